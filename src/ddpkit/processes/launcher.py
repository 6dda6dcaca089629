"""launch(fn): run a function on every GPU or CPU core, as `mp.spawn` would, done right.

The parent picks the rendezvous (a TCP store it owns on 127.0.0.1 at a port the OS
gives it, or a shared file), spawns one worker per device, watches them, and stops
every worker within seconds when one fails. Under torchrun it spawns nothing and runs
`fn` in place with `env://`; then rank 0 alone goes on past `launch`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar, cast

import torch
import torch.distributed as dist

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError, HangError, Preempted, WorkerError
from ddpkit.processes.config import LOOPBACK, LaunchConfig
from ddpkit.processes.group import destroy_group
from ddpkit.processes.nccl import TRACE_PREFIX, nccl_watch
from ddpkit.processes.preemption import (
    DEFAULT_SIGNAL_GRACE,
    STOP_SIGNALS,
    SignalForwarder,
    install_handlers,
    restore_handlers,
)
from ddpkit.processes.report import (
    HangJudge,
    HangWatch,
    blame_key,
    left_early,
    read_reports,
)
from ddpkit.processes.scratch import scratch_dir
from ddpkit.processes.watchdog import Watchdog, waited_in
from ddpkit.versions import release

log = logging.getLogger("ddpkit")

# Public in torch.distributed, but not re-exported in its type stubs.
TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]
HashStore: Any = dist.HashStore  # type: ignore[attr-defined]

T = TypeVar("T")
Backend = Literal["auto", "gloo", "nccl"]
Init = Literal["tcp", "file"]
StartMethod = Literal["auto", "fork", "forkserver", "spawn"]

# torch 2.4 to 2.7 serve the store with libuv, which refuses a socket handed to it
# (asking first and retrying is not safe: the failed attempt may close the socket).
_LIBUV_REFUSES_SOCKETS = (2, 4) <= release(torch.__version__) < (2, 8)

# Seconds a worker gets to exit after SIGTERM before it is killed.
_GRACE_S = 3.0


def under_torchrun() -> bool:
    """True when torchrun (or another elastic agent) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def cpu_count() -> int:
    """CPU cores this process may run on (respects taskset and cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def visible_gpus(value: str) -> int:
    """GPUs that CUDA_VISIBLE_DEVICES=`value` lets a process use, counted as CUDA does:
    indices or GPU-/MIG- UUIDs, up to the first entry that is neither (so "-1" hides all)."""
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        count += 1
    return count


# Set once GPUs had to be counted through the CUDA driver: a forked worker could not
# use CUDA then.
_CUDA_DRIVER_USED = False


def gpu_count() -> int:
    """GPUs this process may use, counted without initialising CUDA here.

    `torch.cuda.device_count()` and `is_available()` initialise the CUDA driver when
    NVML cannot answer, and a parent that did cannot fork GPU workers; the workers
    also need no context of the parent's on GPU 0. So: NVML, as torch reads it (it
    honours CUDA_VISIBLE_DEVICES), else CUDA_VISIBLE_DEVICES when set, else
    `nvidia-smi -L`; the driver only as a last resort (noted, so that no worker is
    forked after it).
    """
    global _CUDA_DRIVER_USED
    if not torch.backends.cuda.is_built() or torch.version.hip:  # type: ignore[no-untyped-call]
        return torch.cuda.device_count()  # 0 on a CPU build; ROCm counts its own way
    nvml = getattr(torch.cuda, "_device_count_nvml", None)
    try:
        count = nvml() if nvml is not None else -1
    except Exception:  # a private helper of torch's: any failure means "NVML cannot say"
        count = -1
    if count >= 0:
        return int(count)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return visible_gpus(visible)
    count = _nvidia_smi_gpus()
    if count > 0:
        return count
    count = torch.cuda.device_count()
    # A driver that found no GPU (or none installed) leaves nothing a fork would copy.
    _CUDA_DRIVER_USED = _CUDA_DRIVER_USED or count > 0
    return count


def _nvidia_smi_gpus() -> int:
    """GPUs that `nvidia-smi -L` lists; 0 without it or when it fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def resolve_backend(backend: str) -> str:
    """`auto` is nccl when a GPU is visible, gloo otherwise; an impossible choice raises."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"backend must be 'auto', 'gloo' or 'nccl' (got {backend!r})")
    if backend == "auto":
        return "nccl" if gpu_count() > 0 else "gloo"
    if backend == "nccl" and gpu_count() == 0:
        raise ConfigError(
            "backend 'nccl' needs a CUDA GPU and none is visible: pass backend='gloo'"
        )
    return backend


def resolve_nprocs(nprocs: int | str, backend: str) -> int:
    """torchrun's `auto`: one process per visible GPU, else one per CPU core."""
    if nprocs == "auto":
        return gpu_count() if backend == "nccl" else cpu_count()
    if isinstance(nprocs, str) and nprocs.isdigit():
        nprocs = int(nprocs)
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ConfigError(
            f"nprocs must be 'auto' or an integer >= 1 (got {nprocs!r}): pass --nproc 2"
        )
    if backend == "nccl" and nprocs > (gpus := gpu_count()):
        raise ConfigError(
            f"nprocs={nprocs} but only {gpus} GPU(s) are visible: "
            "pass --nproc auto (one process per GPU)"
        )
    return nprocs


def _threads() -> int:
    """Threads of this process, native ones included (a store's server, OpenMP's pool)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1  # unknown


# Threads the libraries started on import (numpy's OpenBLAS server, which is safe to
# fork: it stops itself around a fork). Counted when ddpkit's launcher is imported,
# which imports torch first.
_IMPORT_THREADS = _threads()


def start_method(
    requested: StartMethod = "auto", backend: str = "gloo", *, unimportable: str | None = None
) -> str:
    """How `launch` starts workers: "fork" where that is safe, else "forkserver".

    A forked worker starts in milliseconds with torch already imported; a spawned one
    is a new interpreter that imports torch again (about 1.5 s, all ranks at once
    competing for the cores). Fork is safe only while this process has started no
    thread since torch was imported: fork copies the calling thread alone, and a
    lock another thread held stays locked in the child (an OpenMP pool after a
    parallel op, a store's server, a logger's thread). Linux only, and CPU jobs only:
    a forked child cannot use CUDA once the parent has initialised it. `launch` counts
    the GPUs without CUDA (see `gpu_count`), so its parent stays fit to fork, but GPU
    jobs keep the forkserver until forked NCCL workers have run on GPUs. Elsewhere (GPU
    jobs, a parent with threads) the workers are forked from a server process that
    this process starts once, a new single-threaded interpreter that has imported
    torch and touched no GPU (multiprocessing's "forkserver", with torch preloaded):
    the first launch pays one import of torch, later ones none. "spawn" starts each
    worker as a new interpreter, as `mp.spawn` does.

    `unimportable` names the function (or what its arguments hold) when it was defined
    in a notebook, `python -c` or a script read from stdin: a spawned worker cannot
    import it, so a CPU job on Linux forks even while threads run, as Accelerate's
    `notebook_launcher` and Lightning's "ddp_notebook" do (a Jupyter kernel always
    runs threads of its own; they only move messages, and a worker never uses them).
    Where no start can work, ConfigError says what to do instead.
    """
    if unimportable is not None:
        return _start_for_unimportable(requested, backend, unimportable)
    if requested != "auto":
        return requested
    unsafe_fork = (
        sys.platform != "linux"
        or backend == "nccl"
        or _CUDA_DRIVER_USED
        or torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        or threading.active_count() > 1
        or not 0 < _threads() <= _IMPORT_THREADS
    )
    if not unsafe_fork:
        return "fork"
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _start_for_unimportable(requested: StartMethod, backend: str, name: str) -> str:
    if requested in ("spawn", "forkserver"):
        raise ConfigError(
            f"{'spawned' if requested == 'spawn' else 'forkserver'} workers cannot run "
            f"{name!r} from a notebook, python -c or stdin: "
            "they cannot import what is defined there: pass start='auto' to fork them "
            f"(Linux, CPU jobs), or move {name!r} into a .py file and import it"
        )
    if requested == "fork":
        return "fork"
    if backend == "nccl":
        raise ConfigError(
            f"cannot start GPU workers for {name!r} from a notebook, python -c or stdin: "
            "spawned workers cannot import it and forked ones cannot use CUDA: move "
            f"{name!r} into a .py file and import it (or pass backend='gloo' to run on CPU)"
        )
    if sys.platform != "linux":
        raise ConfigError(
            f"cannot start workers for {name!r} from a notebook, python -c or stdin on "
            f"{sys.platform}: spawned workers cannot import it and ddpkit forks only on "
            f"Linux: move {name!r} into a .py file and import it"
        )
    if _CUDA_DRIVER_USED or torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise ConfigError(
            "cannot start workers from a notebook after CUDA was initialised in it: restart "
            f"the kernel and call launch before any CUDA use (or move {name!r} into a .py file)"
        )
    return "fork"


def threads_per_rank(local_world_size: int) -> int:
    """A fair share of the cores, so ranks on one machine don't oversubscribe it."""
    return max(1, cpu_count() // max(1, local_world_size))


@dataclass(frozen=True)
class _Spec:
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
    stdio: tuple[_ParentFd, _ParentFd] | None = None  # and its stdout and stderr
    hang_timeout: float = 0.0  # ddpkit's hang timeout (0: off): NCCL's must be shorter
    trace_dir: str | None = None  # where NCCL's flight recorder dumps on a timeout


class _ParentFd:
    """A file descriptor of the launcher, handed to a worker that another process
    (the forkserver) starts: the worker's output goes where the launcher's goes now
    (a terminal, a file, pytest's capture), not where the server's went at its start."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        return (_ParentFd._received, (DupFd(self.fd),))  # sent while the worker starts

    @staticmethod
    def _received(dup: Any) -> _ParentFd:
        return _ParentFd(dup.detach())


def launch(
    fn: Callable[..., T],
    *args: Any,
    nprocs: int | str = "auto",
    backend: Backend = "auto",
    init: Init = "tcp",
    timeout: float = 1800.0,
    hang_timeout: float | None = None,
    signal_grace: float = DEFAULT_SIGNAL_GRACE,
    start: StartMethod = "auto",
) -> T:
    """Run `fn(ctx, *args)` on every GPU (or CPU core) and return rank 0's result.

    Each process joins one process group and gets its `DistContext` (rank, world size,
    device) as `ctx`.

    Under `ddpkit run` (or torchrun), which already started one process per rank,
    nothing is spawned: `fn` runs in place on every rank with the group the agent set
    up. Then, so that the code after `launch` runs once as under `python script.py`,
    rank 0 goes on with its result and every other rank ends its process quietly
    (exit code 0; its `finally` blocks and exit hooks run). A script therefore calls
    `launch` once under an agent: a second call raises ConfigError. If the script set
    up the process group itself, `fn` just runs, and every rank gets its own result.

    Args:
        fn: a function defined at the top level of a module, script or notebook cell
            (spawned workers import it by name). One defined in a notebook, `python -c`
            or a script read from stdin cannot be imported by a new interpreter, so
            its workers are forked (see `start`).
        *args: passed to `fn` after `ctx`; they must pickle.
        nprocs: processes to start ("auto": one per visible GPU, else per CPU core).
        backend: "auto" (nccl on GPUs, gloo on CPU), "gloo" or "nccl".
        init: how ranks meet: "tcp" (a store on 127.0.0.1) or "file".
        timeout: seconds any collective may wait before it fails.
        hang_timeout: seconds before ranks that make no progress are stopped (0: never).
        signal_grace: seconds the ranks get to save and stop after a stop signal.
        start: how workers start: "auto", "fork", "forkserver" or "spawn". Each of
            these settings is a field of `ddpkit.processes.config.LaunchConfig`, which
            says in full what it does and checks it.

    Returns:
        What `fn` returned on rank 0 (under an agent, only rank 0 returns). From spawned
        workers, its tensors come back on the CPU, wherever they were: inside dicts,
        lists and tuples, nested as deep as they go (a `state_dict()` too), so that this
        process creates no CUDA context on their GPU. Tensors inside other objects (a
        model, a dataclass) keep their device: return `model.state_dict()`, or call
        `.cpu()` on them in `fn`.

    Raises:
        WorkerError: a rank raised or died; it names the rank and carries its traceback.
            The other ranks are stopped.
        HangError: the ranks stopped making progress; it says where each one is stuck.
        Preempted: a stop signal came, and every rank saved the same step (resume it).
            A SystemExit too: a script that does not catch it exits with status 75.
        ConfigError: a bad argument, named with its fix.
    """
    cfg = LaunchConfig(
        nprocs=nprocs,
        backend=backend,
        init=init,
        timeout=timeout,
        hang_timeout=hang_timeout,
        signal_grace=signal_grace,
        start=start,
    )
    if dist.is_available() and dist.is_initialized():
        # The caller set up the group itself (or we are nested): just run.
        return fn(DistContext.current(), *args)
    if under_torchrun():
        return _run_under_agent(fn, args, resolve_backend(cfg.backend), cfg.timeout)
    backend_ = resolve_backend(cfg.backend)
    n = resolve_nprocs(cfg.nprocs, backend_)
    if n == 1 and cfg.start == "auto":
        return _run_single(fn, args, backend_, cfg.timeout)
    return _spawn(fn, args, n, backend_, cfg)


def _device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        # Before init, so that nccl and every later `.cuda()` use this rank's GPU
        # instead of all landing on GPU 0.
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _init_group(
    backend: str, rank: int, world: int, device: torch.device, timeout_s: float, **how: Any
) -> None:
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s), **how}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)


def _run_single(fn: Callable[..., T], args: tuple[Any, ...], backend: str, timeout_s: float) -> T:
    """One process: no spawn, but a real (size-1) group so collectives in user code work.

    It runs in the caller's process, so what it changes there is put back afterwards:
    the thread count, and sys.excepthook (init_process_group prefixes it with the rank).
    """
    device = _device_for(backend, 0)
    threads, hook = torch.get_num_threads(), sys.excepthook
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_rank(1))
    _init_group(backend, 0, 1, device, timeout_s, store=HashStore())
    handlers = install_handlers((*STOP_SIGNALS, signal.SIGINT))  # save on a signal
    try:
        return fn(DistContext(0, 0, 1, 1, device, backend), *args)
    finally:
        restore_handlers(handlers)
        destroy_group()
        torch.set_num_threads(threads)
        sys.excepthook = hook


# Set on rank 0 under an agent once a launch has returned and the other ranks ended.
_OTHER_RANKS_ENDED = False


class ReleasedByLaunch(SystemExit):
    """How a rank other than 0 ends once `launch` has run `fn` under an agent: exit
    status 0, and `ddpkit run`'s hang watch knows it waits for no one."""


def _run_under_agent(
    fn: Callable[..., T], args: tuple[Any, ...], backend: str, timeout_s: float
) -> T:
    """Run `fn` on this rank; then rank 0 alone goes on past `launch`, as under
    `python script.py`, where the code after `launch` runs once, in the parent."""
    global _OTHER_RANKS_ENDED
    if _OTHER_RANKS_ENDED:
        # Its process group could never form: rank 0 would wait for ranks that are gone.
        raise ConfigError(
            "under ddpkit run or torchrun the ranks other than 0 end when launch returns, "
            "so a second launch cannot start: launch once, with all the distributed work "
            "in fn (or run the script with python, where each launch starts its workers)"
        )
    several = int(os.environ["WORLD_SIZE"]) > 1
    rank0 = int(os.environ["RANK"]) == 0
    try:
        result = _run_in_place(fn, args, backend, timeout_s)
    finally:
        # Even if fn raised here: the ranks whose fn returned have ended.
        _OTHER_RANKS_ENDED = several and rank0
    if several and not rank0:
        # The group is destroyed. SystemExit, not os._exit: the script's `finally`
        # blocks and exit hooks still run, and ddpkit run's shim counts exit code 0
        # as a rank that finished.
        raise ReleasedByLaunch(0)
    return result


def _run_in_place(fn: Callable[..., T], args: tuple[Any, ...], backend: str, timeout_s: float) -> T:
    env = os.environ
    rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    device = _device_for(backend, local_rank)
    # ddpkit run passes its hang timeout: NCCL's watchdog must speak before it stops
    # the job (plain torchrun passes none; then the timeout stays).
    hang = _float_or_zero(env.get("DDPKIT_HANG_TIMEOUT"))
    _, group_timeout = nccl_watch(backend, hang, timeout_s, None, env)
    _init_group(backend, rank, world, device, group_timeout, init_method="env://")
    # torchrun's agent passes the signal it got (SIGTERM, SIGINT, ...) on to its workers.
    handlers = install_handlers((*STOP_SIGNALS, signal.SIGINT))
    failed = False
    try:
        return fn(DistContext(rank, local_rank, world, local_world, device, backend), *args)
    except Preempted:
        raise  # every rank saved the same step: no collective is left waiting
    except SystemExit as exc:
        failed = exc.code not in (0, None)
        raise
    except BaseException:
        failed = True
        raise
    finally:
        restore_handlers(handlers)
        # The script goes on after us, so we cannot skip its shutdown as spawned
        # workers do (see _exit_now); a short pause lets gloo's threads release their
        # last work first, which avoids the rare abort at exit.
        time.sleep(0.05)
        # After an error an NCCL collective may still wait for a peer: destroying the
        # group would wait for it (until the collective timeout); aborting does not.
        destroy_group(failed=failed)


def _float_or_zero(value: str | None) -> float:
    try:
        return float(value or 0)
    except ValueError:
        return 0.0


def _spawn(
    fn: Callable[..., T],
    args: tuple[Any, ...],
    n: int,
    backend: str,
    cfg: LaunchConfig,
) -> T:
    timeout_s, hang_timeout = cfg.timeout, cfg.hang_s
    _check_picklable(fn)
    unimportable = _unimportable(fn, args)
    method = start_method(cast(StartMethod, cfg.start), backend, unimportable=unimportable)
    mp: Any = multiprocessing.get_context(method)
    if method == "forkserver":
        _preload_in_forkserver(["torch", "ddpkit.processes.launcher"])
    # The store's server runs on a thread, and a fork must happen while there is none:
    # the socket is bound and listening now (so its port is known and connections
    # queue), and the store starts serving it once the workers exist.
    listener = listening_socket(LOOPBACK) if cfg.init == "tcp" else None
    store: Any = None
    tmpdir = scratch_dir("job")
    status = tmpdir / "status" if hang_timeout > 0 else None
    if status:
        status.mkdir()
    traces = tmpdir / "nccl-trace" if backend == "nccl" else None
    if traces:
        traces.mkdir()
    spec = _Spec(
        world_size=n,
        backend=backend,
        store_port=listener.getsockname()[1] if listener else None,
        init_file=None if listener else str(tmpdir / "rendezvous"),
        status_dir=str(status) if status else None,
        timeout_s=timeout_s,
        log_level=logging.getLogger("ddpkit").getEffectiveLevel(),
        parent_pid=os.getpid(),
        forked=method == "fork",
        # A forked worker holds a copy of the listening socket: it closes it.
        inherited_fd=listener.fileno() if listener and method == "fork" else None,
        # The server's workers are copies of the server: of its environment too, as it
        # was when the first launch started it.
        environ=dict(os.environ) if method == "forkserver" else None,
        stdio=(_ParentFd(1), _ParentFd(2)) if method == "forkserver" else None,
        hang_timeout=hang_timeout,
        trace_dir=str(traces) if traces else None,
    )
    log.debug("starting %d workers with %s", n, method)
    # Python 3.12+ warns at every fork while threads run. "auto" forks then only for a
    # function from a notebook or python -c, whose kernel threads a worker never uses
    # (see start_method): the warning would only alarm the user. Asked for by name,
    # fork keeps Python's warning.
    quiet_fork = cfg.start == "auto" and method == "fork"
    procs: dict[int, BaseProcess] = {}
    conns: dict[int, Connection] = {}
    watch: HangWatch | None = None
    forwarder = SignalForwarder(
        lambda: [p.pid for p in procs.values() if p.pid is not None and p.is_alive()],
        cfg.signal_grace,
    )
    handlers = forwarder.install()
    try:
        for rank in range(n):
            recv, send = mp.Pipe(duplex=False)
            proc = mp.Process(
                target=_worker, args=(rank, spec, fn, args, send), name=f"ddpkit-rank{rank}"
            )
            try:
                with warnings.catch_warnings():
                    if quiet_fork:
                        warnings.filterwarnings(
                            "ignore", "This process .* is multi-threaded", DeprecationWarning
                        )
                    proc.start()
            except (AttributeError, TypeError, ValueError) as exc:  # pickling fn or args
                raise ConfigError(
                    f"cannot send {getattr(fn, '__name__', fn)!r} or its arguments to the "
                    f"workers ({exc}): define the function at module level and pass "
                    "picklable arguments"
                ) from exc
            finally:
                send.close()
            procs[rank], conns[rank] = proc, recv
        if listener is not None:
            store, listener = serve_store(world_size=n, listener=listener), None
        if status is not None:
            # Started after the forks, like the store: a fork must happen with no thread.
            judge = HangJudge(hang_timeout, n, collective_timeout=timeout_s)
            watch = HangWatch(functools.partial(read_reports, status), judge, lambda h: None)
            watch.start()
        return cast(T, _supervise(procs, conns, watch, forwarder, nccl=bool(traces)))
    finally:
        if watch is not None:
            watch.stop()
        restore_handlers(handlers)
        _stop(procs.values())
        for conn in conns.values():
            conn.close()
        if traces:
            _keep_traces(traces)
        shutil.rmtree(tmpdir, ignore_errors=True)
        if listener is not None:
            listener.close()
        del store


def _keep_traces(traces: Path) -> None:
    """Move the dumps of NCCL's flight recorder out of the job's folder, which is about
    to be removed, and say where they are."""
    if not any(traces.glob(f"{TRACE_PREFIX}*")):
        return
    kept = Path(tempfile.mkdtemp(prefix="ddpkit-nccl-trace-"))  # never swept: no owner
    for dump in traces.iterdir():
        shutil.move(str(dump), kept / dump.name)
    print(
        "ddpkit: NCCL's flight recorder wrote the last collectives of each rank to "
        f"{kept}: read them with `torchfrtrace {kept} -p {TRACE_PREFIX}`",
        file=sys.stderr,
        flush=True,
    )


def _preload_in_forkserver(modules: list[str]) -> None:
    """Have multiprocessing's forkserver import `modules` when it starts (the first
    forkserver launch of this process), so that its workers begin with torch and ddpkit
    imported. No GPU is touched there.

    `set_forkserver_preload` replaces the whole list, and the server is one per process:
    the modules the program asked for itself are kept. Its `__main__` is not: the
    server would run the script's top level, which may touch a GPU.
    """
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    asked = [m for m in getattr(server, "_preload_modules", []) if m != "__main__"]
    multiprocessing.set_forkserver_preload(asked + [m for m in modules if m not in asked])


def _check_picklable(fn: Callable[..., Any]) -> None:
    """A forked worker needs no pickled `fn`, a spawned one does: refuse what cannot
    pickle either way, so a job that runs here also runs where workers are spawned.

    A function from a notebook or `python -c` pickles (by name) but a spawned worker
    cannot find it, so it is always forked (see start_method); it is held to the same
    rule all the same, so that once moved into a .py file it runs there unchanged."""
    try:
        pickle.dumps(fn)
    except (AttributeError, TypeError, ValueError, pickle.PicklingError) as exc:
        raise ConfigError(
            f"cannot send {getattr(fn, '__name__', fn)!r} to the workers ({exc}): define "
            "the function at module level"
        ) from exc


def _main_kind() -> Literal["importable", "interactive", "unreadable"]:
    """How a spawned worker fares with this process's `__main__`. multiprocessing imports
    it again by module name (`python -m`) or from its file (`python script.py`); it skips
    one without a file (Jupyter, `python -c`), whose functions are then missing; and it
    fails on a file that is not one (`python -` reads stdin and names it "<stdin>")."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return "importable"
    path = getattr(main, "__file__", None)
    if path is None:
        return "interactive"
    return "importable" if os.path.isfile(path) else "unreadable"


class _NullWriter:
    def write(self, data: bytes) -> int:
        return len(data)


class _MainFinder(pickle.Pickler):
    """Pickles to nowhere, noting the first function or class from `__main__` it meets."""

    def __init__(self) -> None:
        super().__init__(cast(io.BufferedWriter, _NullWriter()), pickle.HIGHEST_PROTOCOL)
        self.found: str | None = None

    def persistent_id(self, obj: Any) -> None:
        if (
            self.found is None
            and isinstance(obj, (type, types.FunctionType))
            and obj.__module__ == "__main__"
        ):
            self.found = obj.__qualname__
        # None: pickle `obj` as usual.

    def reducer_override(self, obj: Any) -> Any:
        # A tensor holds data, never a function: skip copying it (a dataset may be large).
        if isinstance(obj, torch.Tensor):
            return (tuple, ())
        return NotImplemented


def _unimportable(fn: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
    """The name of a function or class, in `fn` or in its arguments, that a spawned worker
    cannot import: one defined in a notebook, `python -c` or a script read from stdin
    (from stdin no spawned worker starts at all: then `fn`'s name). None when there is
    none, at once when `__main__` is a file (the usual case)."""
    kind = _main_kind()
    if kind == "importable":
        return None
    if kind == "unreadable":
        return str(getattr(fn, "__qualname__", fn))
    finder = _MainFinder()
    for obj in (fn, args):
        # What cannot pickle at all is refused elsewhere (or needs no pickling: a fork).
        with contextlib.suppress(Exception):
            finder.dump(obj)
        if finder.found is not None:
            return finder.found
    return None


# After every rank has returned its result, how long a worker may take to exit.
_EXIT_GRACE_S = 10.0
# After the first failure, how long to keep listening so that the true cause (say a
# rank killed by a signal, seen only when it is reaped) can arrive before we blame one.
_SETTLE_S = 1.0


def _blame_key(failure: tuple[float, WorkerError]) -> tuple[int, float]:
    when, err = failure
    return blame_key(err.exitcode, Exception.__str__(err), when)


def _supervise(
    procs: dict[int, BaseProcess],
    conns: dict[int, Connection],
    watch: HangWatch | None,
    forwarder: SignalForwarder,
    *,
    nccl: bool = False,
) -> Any:
    """Wait for every worker; soon after the first failure, raise the likely cause;
    raise HangError when the ranks certainly cannot go on (see HangJudge), and print
    its notices about ranks that keep the others waiting. After a stop signal, raise
    `Preempted` when the ranks saved, else leave as the signal would have."""
    results: dict[int, Any] = {}
    preempted: dict[int, Preempted] = {}
    failures: list[tuple[float, WorkerError]] = []
    waits: dict[int, dict[str, str] | None] = {}  # rank -> the collective its error came from
    running = dict(procs)
    open_conns = dict(conns)
    settle_until: float | None = None

    def drain(rank: int) -> None:
        conn = open_conns.get(rank)
        while conn is not None and conn.poll():
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                open_conns.pop(rank).close()
                return
            if msg[0] == "ok":
                results[rank] = msg[1]
            elif msg[0] == "preempted":
                preempted[rank] = msg[1]
            else:
                _, when, exc_type, text, tb, waits[rank] = msg
                message = f"rank {rank} raised {exc_type}: {text}"
                failures.append((when, WorkerError(rank, message, exc_type=exc_type, traceback=tb)))

    all_done_at: float | None = None
    while running:
        now = time.monotonic()
        if settle_until is not None and now >= settle_until:
            break
        if forwarder.expired():
            print(
                f"ddpkit: the ranks did not save and stop within {forwarder.grace:g} s of "
                "the signal: stopping them; the newest checkpoint on disk is complete",
                file=sys.stderr,
                flush=True,
            )
            _stop(running.values())
            break
        if all_done_at is not None and now - all_done_at > _EXIT_GRACE_S:
            # Every rank returned its result; one still tearing down its process group
            # (gloo can hang there on some torch releases) must not hold the job.
            _stop(running.values())
            break
        handles: list[Any] = [p.sentinel for p in running.values()]
        handles += list(open_conns.values())
        wait(handles, timeout=1.0 if settle_until is None else settle_until - now)
        for rank in list(open_conns):
            drain(rank)
        for rank, proc in list(running.items()):
            if proc.exitcode is None:
                continue
            drain(rank)  # a message sent just before exit is still in the pipe
            del running[rank]
            code = proc.exitcode
            reported = [f for _, f in failures if f.rank == rank]
            for err in reported:
                err.exitcode = code
            if code != 0 and not reported:
                err = WorkerError(rank, _describe_exit(rank, code, nccl=nccl), exitcode=code)
                failures.append((time.time(), err))
        if failures and settle_until is None:
            settle_until = time.monotonic() + _SETTLE_S
        if all_done_at is None and len(results) == len(procs):
            all_done_at = time.monotonic()
        if watch is not None and (failures or forwarder.signum):
            watch.stop()  # the job ends for another reason: no hang to find
        elif watch is not None and watch.hang is not None:
            raise HangError(watch.hang.summary(len(procs)), watch.hang.stacks())
    if preempted:
        raise preempted[min(preempted)]
    if forwarder.signum and len(results) < len(procs):
        forwarder.stop_now()  # stopped by the signal before anything was saved
    if failures:
        errors = [err for _, err in failures]
        summary = left_early(
            sorted(results), {e.rank: (Exception.__str__(e), waits.get(e.rank)) for e in errors}
        )
        if summary is not None:
            stacks = "\n\n".join(
                f"--- traceback of rank {e.rank} ---\n{e.traceback.rstrip()}" for e in errors
            )
            raise HangError(summary, stacks)
        raise min(failures, key=_blame_key)[1]
    if 0 not in results:
        raise WorkerError(0, "rank 0 exited without returning a result", exitcode=0)
    return results[0]


def _describe_exit(rank: int, code: int, *, nccl: bool = False) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (the kernel's OOM killer sends SIGKILL: check memory)" if name == "SIGKILL" else ""
        if name == "SIGABRT" and nccl:
            # How NCCL's watchdog ends a rank: its own message says which collective.
            hint = (
                " (NCCL's watchdog ends a rank so when a collective times out: its "
                "'collective operation timeout' message above names the collective)"
            )
        return f"rank {rank} was killed by {name}{hint}"
    return f"rank {rank} exited with code {code}"


def _stop(procs: Any) -> None:
    """SIGTERM every live worker, SIGKILL what is left after a grace period, reap all."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()
    for p in procs:
        p.join()


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to `host` only (port 0: one the OS picks), already listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(
    host: str = LOOPBACK,
    port: int = 0,
    world_size: int | None = None,
    *,
    listener: socket.socket | None = None,
    **kwargs: Any,
) -> Any:
    """A TCP store served on `host` only (default 127.0.0.1, at a port the OS picks), or
    on `listener`, a socket from `listening_socket`.

    TCPStore listens on every interface when it opens its own socket, so it is handed
    a socket already bound to `host`: a single-machine job is not reachable from the
    network. Holding the port for the whole job also means a second job can never get
    the same one.
    """
    sock = listener if listener is not None else listening_socket(host, port)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store closes the socket when it is destroyed
    options = {"is_master": True, "wait_for_workers": False, "master_listen_fd": fd, **kwargs}
    if _LIBUV_REFUSES_SOCKETS:
        options["use_libuv"] = False
    try:
        return TCPStore(host, port, world_size, **options)
    except BaseException:
        os.close(fd)
        raise


def _loopback_interface() -> str | None:
    """The name of the loopback interface (Linux: lo), if there is one."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _worker(
    rank: int, spec: _Spec, fn: Callable[..., Any], args: tuple[Any, ...], conn: Connection
) -> None:
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
        if not _alive(spec.parent_pid):
            os._exit(1)
    # A process group of its own, as torchrun gives its workers: a terminal's Ctrl-C
    # reaches the launcher alone, which passes it on once, so a SIGINT that reaches a
    # worker is meant for it.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    # SIGTERM, SIGUSR1 or SIGINT: save and stop if a Trainer with a checkpoint folder
    # runs, else stop at once (see preemption).
    install_handlers((*STOP_SIGNALS, signal.SIGINT))
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
    lo = _loopback_interface()
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
    initialised = False
    failed = False
    code = 0
    try:
        device = _device_for(spec.backend, rank)
        if spec.store_port is not None:
            store = TCPStore(
                LOOPBACK,
                spec.store_port,
                world,
                is_master=False,
                timeout=timedelta(seconds=spec.timeout_s),
            )
            _init_group(spec.backend, rank, world, device, group_timeout, store=store)
        else:
            _init_group(
                spec.backend,
                rank,
                world,
                device,
                group_timeout,
                init_method=f"file://{spec.init_file}",
            )
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
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's shutdown, after atexit hooks and flushing output.

    gloo's background threads may still be releasing finished work when Python
    finalizes; if one needs the GIL then, the process aborts ("terminate called without
    an active exception") although the job succeeded. Skipping finalization avoids it.
    """
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
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


def _report(conn: Connection, exc: BaseException) -> None:
    # If the parent is gone or the pipe broke, the exit code still tells.
    with contextlib.suppress(Exception):
        tb = traceback.format_exc()
        _send(conn, ("error", time.time(), type(exc).__name__, str(exc), tb, waited_in(exc)))
