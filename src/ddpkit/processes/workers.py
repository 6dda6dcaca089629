"""What each worker that `launch` starts runs: it joins the group, runs `fn`, sends its
result or its error back to the parent, and exits; it never outlives the parent."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import torch

from ddpkit.context import DistContext
from ddpkit.errors import Preempted
from ddpkit.inrank import audit
from ddpkit.inrank.preemption import (
    STOP_SIGNALS,
    install_handlers,
    leave_notices_to_launcher,
    starting_up,
)
from ddpkit.inrank.watchdog import Watchdog, format_exception, waited_in
from ddpkit.processes.config import LOOPBACK
from ddpkit.processes.group import destroy_group, device_for, init_group
from ddpkit.processes.machine import threads_per_rank
from ddpkit.processes.nccl import nccl_watch
from ddpkit.processes.store import TCPStore, loopback_interface
from ddpkit.seed import start_rank_streams
from ddpkit.storage import is_running


@dataclass(frozen=True)
class Spec:
    """What a spawned worker needs to join the job."""

    world_size: int
    backend: str
    store_port: int | None  # TCP store owned by the parent
    init_file: str | None  # or a shared file
    status_dir: str | None  # where ranks report progress, for hang diagnosis
    timeout_s: float
    log_level: int
    parent_pid: int  # the launching process: a worker whose parent is another one exits
    forked: bool = False  # the worker is a copy of the parent, not a new interpreter
    inherited_fd: int | None = None  # the parent's listening socket, in a forked worker
    environ: dict[str, str] | None = None  # the parent's environment, for a forkserver's worker
    stdio: tuple[ParentFd, ParentFd] | None = None  # and its stdout and stderr
    hang_timeout: float = 0.0  # ddpkit's hang timeout (0: off): NCCL's must be shorter
    trace_dir: str | None = None  # where NCCL's flight recorder dumps on a timeout
    audit_dir: str | None = None  # where an audited rank writes what it saw (launch(audit=True))
    rng: dict[str, Any] | None = None  # the RNG streams the script seeded (seeded_by_script)


class ParentFd:
    """A file descriptor of the launcher, handed to a worker that another process
    (the forkserver) starts: the worker's output goes where the launcher's goes now
    (a terminal, a file, pytest's capture), not where the server's went at its start."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        return (ParentFd._received, (DupFd(self.fd),))  # sent while the worker starts

    @staticmethod
    def _received(dup: Any) -> ParentFd:
        return ParentFd(dup.detach())


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to SIGKILL this worker if the parent dies, so no orphan outlives it.

    `parent_pid` is the parent that started this worker: if it died before the request
    took effect, this worker now has another parent (init, or a subreaper such as a
    container's or systemd's) and exits at once."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() != (parent_pid or os.getppid()):  # the parent died before prctl
        os._exit(1)


def worker(
    rank: int, spec: Spec, fn: Callable[..., Any], args: tuple[Any, ...], conn: Connection
) -> None:
    """Rank `rank` of a job that `launch` started: join the group, run `fn`, send its
    result (or its error) to the parent on `conn`, and exit."""
    if spec.forked:
        # The parent's exit hooks are the parent's: run here, the cleanup of its
        # temporary folders would delete them from under it (see exit_now).
        atexit._clear()
        if spec.inherited_fd is not None:
            os.close(spec.inherited_fd)
    if spec.environ is None:
        die_with_parent(spec.parent_pid)
    else:
        os.environ.clear()
        os.environ.update(spec.environ)
        for target, parent in zip((1, 2), spec.stdio or (), strict=False):
            os.dup2(parent.fd, target)
            os.close(parent.fd)
        # Its parent is the server, which ends when the launcher does.
        die_with_parent()
        if not is_running(spec.parent_pid):
            os._exit(1)
    # A process group of its own, as torchrun gives its workers: a terminal's Ctrl-C
    # reaches the launcher alone, which passes it on once, so a SIGINT that reaches a
    # worker is meant for it.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    # SIGTERM, SIGUSR1 or SIGINT: save and stop if a Trainer with a checkpoint folder
    # runs, else stop at once (see preemption). A Ctrl-C comes by the launcher, which
    # says what it does.
    install_handlers((*STOP_SIGNALS, signal.SIGINT))
    leave_notices_to_launcher()
    if not logging.getLogger().handlers:
        logging.basicConfig(level=spec.log_level, format=f"[rank {rank}] %(message)s")
    world = spec.world_size
    watchdog = Watchdog(Path(spec.status_dir), rank).start() if spec.status_dir else None
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(spec.store_port or 0),
    )
    lo = loopback_interface()
    if lo:
        # gloo listens on the address the host name resolves to, and NCCL's bootstrap
        # on every interface; on one machine loopback is enough and keeps them off the
        # network.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_rank(world))
    # NCCL's watchdog names the collective that waits, before ddpkit stops the job.
    traces = Path(spec.trace_dir) if spec.trace_dir else None
    nccl_env, group_timeout = nccl_watch(
        spec.backend, spec.hang_timeout, spec.timeout_s, traces, os.environ
    )
    os.environ.update(nccl_env)
    # The launcher learns of this rank's first optimizer step: until some rank has
    # taken one, a stop signal loses nothing and the job ends as StoppedAtStart.
    recorder = audit.install(rank) if spec.audit_dir else None
    # Forked (by launch or the forkserver), this rank holds a copy of another process's
    # RNGs: every rank would draw the same "random" numbers.
    start_rank_streams(spec.rng or {})
    with starting_up(on_first_step=lambda: _say_trained(conn)):
        code = _run_rank(rank, spec, fn, args, conn, group_timeout, watchdog)
    if recorder is not None and spec.audit_dir:
        audit.finish(recorder, Path(spec.audit_dir), failed=code != 0)
    exit_now(code)


def _run_rank(
    rank: int,
    spec: Spec,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Connection,
    group_timeout: float,
    watchdog: Watchdog | None,
) -> int:
    """Join the group, run `fn`, send its result or its error on `conn`, leave the
    group; the exit status this worker ends with."""
    world = spec.world_size
    initialised = False
    failed = False
    code = 0
    try:
        device = device_for(spec.backend, rank)
        how: dict[str, Any] = {"init_method": f"file://{spec.init_file}"}
        if spec.store_port is not None:
            timeout = timedelta(seconds=spec.timeout_s)
            store = TCPStore(LOOPBACK, spec.store_port, world, is_master=False, timeout=timeout)
            how = {"store": store}
        init_group(spec.backend, rank, world, device, group_timeout, **how)
        initialised = True
        result = fn(DistContext(rank, rank, world, world, device, spec.backend), *args)
        if watchdog is not None:
            watchdog.finish()  # from now on it waits for the others: no longer hung
        _send(conn, ("ok", result if rank == 0 else None))
    except Preempted as exc:
        _send(conn, ("preempted", exc))
    except SystemExit as exc:
        if exc.code in (0, None):
            _send(conn, ("ok", None))
        else:
            _report(conn, exc)
            code = exc.code if isinstance(exc.code, int) else 1
            failed = True
    except BaseException as exc:
        _report(conn, exc)
        code, failed = 1, True
    finally:
        if initialised:
            # After an error an NCCL collective may still wait for a peer: abort it.
            destroy_group(failed=failed)
        conn.close()
    return code


def exit_now(code: int, *, signum: int = 0) -> NoReturn:
    """Exit without the interpreter's shutdown, after atexit hooks and flushing output;
    with `signum`, end by that signal (its default action) instead of with `code`.

    gloo's background threads may still be releasing finished work when Python
    finalizes; if one needs the GIL then, the process aborts ("terminate called without
    an active exception") although the job succeeded. Skipping finalization avoids it.
    """
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if signum:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(code)


def _send(conn: Connection, message: tuple[Any, ...]) -> None:
    # Plain pickle copies tensor data into the message. multiprocessing's own pickler
    # would pass tensors as shared-memory handles that the parent can only open while
    # this worker is still alive, and workers exit right after sending. A GPU tensor
    # would be unpickled onto its GPU: a CUDA context in the parent, on that GPU.
    conn.send_bytes(pickle.dumps(result_on_cpu(message)))


def result_on_cpu(obj: Any) -> Any:
    """`obj` with every tensor on a GPU (or any other device with data) copied to the
    CPU, inside dicts (OrderedDict too, such as a state_dict), lists and tuples (named
    ones too), nested as deep as they go. Anything else is left as it is, tensors
    inside it included: a model, a dataclass, an object of your own."""
    if isinstance(obj, torch.Tensor):
        return _tensor_on_cpu(obj)
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, result_on_cpu(v)) for k, v in obj.items())
    if type(obj) is list:
        return [result_on_cpu(v) for v in obj]
    if type(obj) is tuple:
        return tuple(result_on_cpu(v) for v in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(result_on_cpu(v) for v in obj))
    return obj


def _tensor_on_cpu(t: torch.Tensor) -> torch.Tensor:
    if t.device.type in ("cpu", "meta"):  # a meta tensor has no data to copy
        return t
    moved = t.detach().to("cpu")
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(moved, requires_grad=t.requires_grad)
    # A copy that kept the autograd history would not pickle; requires_grad is kept.
    return moved.requires_grad_(t.requires_grad) if t.is_floating_point() else moved


def _say_trained(conn: Connection) -> None:
    """Tell the launcher that this rank took its first optimizer step."""
    # Called inside optimizer.step(): a launcher that is gone (this worker is about to
    # be killed with it) must not turn into an error of the step.
    with contextlib.suppress(OSError):
        _send(conn, ("trained", None))


def _report(conn: Connection, exc: BaseException) -> None:
    # If the parent is gone or the pipe broke, the exit code still tells.
    with contextlib.suppress(Exception):
        tb = format_exception(exc)
        _send(conn, ("error", time.time(), type(exc).__name__, str(exc), tb, waited_in(exc)))
