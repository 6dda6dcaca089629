"""launch(fn): run a function on every GPU or CPU core, as `mp.spawn` would, done right.

The parent picks the rendezvous (a TCP store it owns on 127.0.0.1 at a port the OS
gives it, or a shared file), spawns one worker per device, watches them, and stops
every worker within seconds when one fails. Under torchrun it spawns nothing and runs
`fn` in place with `env://`; then rank 0 alone goes on past `launch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError, HangError, Preempted, StoppedAtStart, WorkerError
from ddpkit.inrank.preemption import (
    STOP_SIGNALS,
    ddpkit_job,
    install_handlers,
    restore_handlers,
    starting_up,
    stopped_while_starting,
)
from ddpkit.processes.audit import findings as audit_findings
from ddpkit.processes.audit import report as audit_report
from ddpkit.processes.config import LOOPBACK, LaunchConfig
from ddpkit.processes.group import destroy_group, device_for, init_group
from ddpkit.processes.machine import (
    resolve_backend,
    resolve_nprocs,
    threads_per_rank,
    under_torchrun,
)
from ddpkit.processes.nccl import TRACE_PREFIX, nccl_watch
from ddpkit.processes.preemption import SignalForwarder
from ddpkit.processes.report import (
    HangJudge,
    HangWatch,
    blame_key,
    left_early,
    read_reports,
)
from ddpkit.processes.scratch import scratch_dir
from ddpkit.processes.start import (
    StartMethod,
    check_picklable,
    preload_in_forkserver,
    start_method,
    unimportable,
)
from ddpkit.processes.store import HashStore, listening_socket, serve_store
from ddpkit.processes.workers import ParentFd, Spec, worker
from ddpkit.seed import note_streams, seeded_by_script

log = logging.getLogger("ddpkit")
note_streams()  # torch's and NumPy's RNGs, now imported (see seeded_by_script)

T = TypeVar("T")
Backend = Literal["auto", "gloo", "nccl"]
Init = Literal["tcp", "file"]

# Seconds a worker gets to exit after SIGTERM before it is killed.
_GRACE_S = 3.0


def launch(
    fn: Callable[..., T],
    *args: Any,
    config: LaunchConfig | None = None,
    nprocs: int | str | None = None,
    backend: Backend | None = None,
    init: Init | None = None,
    timeout: float | None = None,
    hang_timeout: float | None = None,
    signal_grace: float | None = None,
    start: StartMethod | None = None,
    audit: bool | None = None,
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
        config: the settings below as one `ddpkit.processes.config.LaunchConfig`, which
            says in full what each does and checks it. A keyword given beside it sets a
            field the config leaves at its default; one that contradicts a field the
            config sets raises ConfigError. Its `ddpkit run` fields (`nnodes`, `cpu`,
            `log_dir`, ...) must stay at their defaults.
        nprocs: processes to start (default "auto": one per visible GPU, else per CPU
            core).
        backend: "auto" (the default: nccl on GPUs, gloo on CPU), "gloo" or "nccl".
        init: how ranks meet: "tcp" (the default: a store on 127.0.0.1) or "file".
        timeout: seconds any collective may wait before it fails (default 1800).
        hang_timeout: seconds before ranks that make no progress are stopped (default
            300, or `timeout` if shorter; 0: never).
        signal_grace: seconds the ranks get to save and stop after a stop signal
            (default 60).
        start: how workers start: "auto" (the default), "fork", "forkserver" or "spawn".
        audit: after the job, print on stderr the DDP pitfalls it actually committed
            (ranks that trained different weights, a file saved by every rank, ...).
            Off by default.

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
        StoppedAtStart: a stop signal (SIGTERM, SIGUSR1) came before any rank's first
            optimizer step: nothing was lost, start the job again. Also a SystemExit
            with status 75.
        ConfigError: a bad argument, named with its fix.
    """
    keywords = {
        "nprocs": nprocs,
        "backend": backend,
        "init": init,
        "timeout": timeout,
        "hang_timeout": hang_timeout,
        "signal_grace": signal_grace,
        "start": start,
        "audit": audit,
    }
    cfg = (config or LaunchConfig()).merged({k: v for k, v in keywords.items() if v is not None})
    _check_used(cfg, keywords)
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


def _check_used(cfg: LaunchConfig, used: Mapping[str, Any]) -> None:
    """Refuse a setting that only `ddpkit run` uses (`used`: the ones launch uses)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.init and f.name not in used and value != f.default:
            raise ConfigError(
                f"launch does not use {f.name}={value!r}, a setting of `ddpkit run`: leave "
                "it out of the LaunchConfig, or start the script with ddpkit run"
            )


def _run_single(fn: Callable[..., T], args: tuple[Any, ...], backend: str, timeout_s: float) -> T:
    """One process: no spawn, but a real (size-1) group so collectives in user code work.

    It runs in the caller's process, so what it changes there is put back afterwards:
    the thread count, and sys.excepthook (init_process_group prefixes it with the rank).
    """
    device = device_for(backend, 0)
    threads, hook = torch.get_num_threads(), sys.excepthook
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_rank(1))
    init_group(backend, 0, 1, device, timeout_s, store=HashStore())
    handlers = install_handlers((*STOP_SIGNALS, signal.SIGINT))  # save on a signal
    try:
        with starting_up():
            return fn(DistContext(0, 0, 1, 1, device, backend), *args)
    except SystemExit as exc:
        signum = stopped_while_starting(exc)
        if signum:  # before the first optimizer step: nothing is lost
            raise StoppedAtStart(signum) from None
        raise
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
    ddpkit_job()  # from here, ddpkit run ends a job stopped before its first step with 75
    env = os.environ
    rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    device = device_for(backend, local_rank)
    # ddpkit run passes its hang timeout: NCCL's watchdog must speak before it stops
    # the job (plain torchrun passes none; then the timeout stays).
    hang = _float_or_zero(env.get("DDPKIT_HANG_TIMEOUT"))
    _, group_timeout = nccl_watch(backend, hang, timeout_s, None, env)
    init_group(backend, rank, world, device, group_timeout, init_method="env://")
    # torchrun's agent passes the signal it got (SIGTERM, SIGINT, ...) on to its workers.
    handlers = install_handlers((*STOP_SIGNALS, signal.SIGINT))
    failed = False
    try:
        with starting_up():
            return fn(DistContext(rank, local_rank, world, local_world, device, backend), *args)
    except Preempted:
        raise  # every rank saved the same step: no collective is left waiting
    except SystemExit as exc:
        failed = exc.code not in (0, None)
        signum = stopped_while_starting(exc)
        if signum:  # before this rank's first optimizer step: nothing is lost
            raise StoppedAtStart(signum) from None
        raise
    except BaseException:
        failed = True
        raise
    finally:
        restore_handlers(handlers)
        # The script goes on after us, so we cannot skip its shutdown as spawned
        # workers do (see workers.exit_now); a short pause lets gloo's threads release their
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
    check_picklable(fn)
    method = start_method(
        cast(StartMethod, cfg.start), backend, unimportable=unimportable(fn, args)
    )
    mp: Any = multiprocessing.get_context(method)
    if method == "forkserver":
        preload_in_forkserver(["torch", "ddpkit.processes.workers"])
    # The store's server runs on a thread, and a fork must happen while there is none:
    # the socket is bound and listening now (so its port is known and connections
    # queue), and the store starts serving it once the workers exist.
    listener = listening_socket(LOOPBACK) if cfg.init == "tcp" else None
    store: Any = None
    folders = _JobFolders.make(cfg, backend)
    spec = _spec(n, backend, cfg, method, listener, folders)
    log.debug("starting %d workers with %s", n, method)
    procs: dict[int, BaseProcess] = {}
    conns: dict[int, Connection] = {}
    watch: HangWatch | None = None
    forwarder = SignalForwarder(
        lambda: [p.pid for p in procs.values() if p.pid is not None and p.is_alive()],
        cfg.signal_grace,
    )
    handlers = forwarder.install()
    try:
        # Python 3.12+ warns at every fork while threads run. "auto" forks then only for
        # a function from a notebook or python -c, whose kernel threads a worker never
        # uses (see start_method): the warning would only alarm the user. Asked for by
        # name, fork keeps Python's warning.
        quiet_fork = cfg.start == "auto" and method == "fork"
        _start_workers(mp, spec, fn, args, forwarder, procs, conns, quiet_fork=quiet_fork)
        if listener is not None:
            store, listener = serve_store(world_size=n, listener=listener), None
        if folders.status is not None:
            # Started after the forks, like the store: a fork must happen with no thread.
            judge = HangJudge(cfg.hang_s, n, collective_timeout=cfg.timeout)
            reports = functools.partial(read_reports, folders.status)
            watch = HangWatch(reports, judge, lambda h: None)
            watch.start()
        nccl = folders.traces is not None
        return cast(T, _supervise(procs, conns, watch, forwarder, nccl=nccl))
    finally:
        if watch is not None:
            watch.stop()
        restore_handlers(handlers)
        _stop(procs.values())
        for conn in conns.values():
            conn.close()
        folders.close()
        if listener is not None:
            listener.close()
        del store


@dataclasses.dataclass
class _JobFolders:
    """The job's scratch folder, and in it what the workers write there, where the job
    has it: each rank's progress (the hang watch's reports), the dumps of NCCL's flight
    recorder and the audit's records."""

    root: Path
    status: Path | None
    traces: Path | None
    audit: Path | None

    @classmethod
    def make(cls, cfg: LaunchConfig, backend: str) -> _JobFolders:
        root = scratch_dir("job")
        wanted = {"status": cfg.hang_s > 0, "nccl-trace": backend == "nccl", "audit": cfg.audit}
        made = {name: root / name if on else None for name, on in wanted.items()}
        for folder in made.values():
            if folder is not None:
                folder.mkdir()
        return cls(root, made["status"], made["nccl-trace"], made["audit"])

    def close(self) -> None:
        """Keep NCCL's dumps, print the audit's findings, and remove the rest."""
        if self.traces:
            _keep_traces(self.traces)
        if self.audit:
            print(audit_report(audit_findings(self.audit)), end="", file=sys.stderr, flush=True)
        shutil.rmtree(self.root, ignore_errors=True)


def _spec(
    n: int,
    backend: str,
    cfg: LaunchConfig,
    method: str,
    listener: Any,
    folders: _JobFolders,
) -> Spec:
    """What every worker is told: how to meet the others, and what to watch and write."""
    return Spec(
        world_size=n,
        backend=backend,
        store_port=listener.getsockname()[1] if listener else None,
        init_file=None if listener else str(folders.root / "rendezvous"),
        status_dir=str(folders.status) if folders.status else None,
        timeout_s=cfg.timeout,
        log_level=logging.getLogger("ddpkit").getEffectiveLevel(),
        parent_pid=os.getpid(),
        forked=method == "fork",
        # A forked worker holds a copy of the listening socket: it closes it.
        inherited_fd=listener.fileno() if listener and method == "fork" else None,
        # The server's workers are copies of the server: of its environment too, as it
        # was when the first launch started it.
        environ=dict(os.environ) if method == "forkserver" else None,
        stdio=(ParentFd(1), ParentFd(2)) if method == "forkserver" else None,
        hang_timeout=cfg.hang_s,
        trace_dir=str(folders.traces) if folders.traces else None,
        audit_dir=str(folders.audit) if folders.audit else None,
        # Each rank starts from the streams the script seeded, the others fresh: as if it
        # ran the script itself (ddpkit run), not as a copy of this process's draws.
        rng=seeded_by_script(),
    )


@contextlib.contextmanager
def _frozen_heap(forking: bool) -> Iterator[None]:
    """While workers are forked: this process's objects frozen (`gc.freeze`). A forked
    worker inherits them all, and each worker's first large import (torch._dynamo, which
    building an optimizer loads) ran the garbage collector over every one of them:
    0.2 s of CPU per rank, and their memory pages copied (measured, bench/peers.py
    --short). Frozen, the collector passes over them."""
    if not forking:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _start_workers(
    mp: Any,
    spec: Spec,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    forwarder: SignalForwarder,
    procs: dict[int, BaseProcess],
    conns: dict[int, Connection],
    *,
    quiet_fork: bool,
) -> None:
    """Start one worker per rank into `procs`, with the end of its pipe into `conns`;
    raise StoppedAtStart if a stop signal comes before every one has started."""
    with _frozen_heap(spec.forked):
        for rank in range(spec.world_size):
            if forwarder.signum:
                break  # stopped while starting: start no more workers
            recv, send = mp.Pipe(duplex=False)
            proc = mp.Process(
                target=worker, args=(rank, spec, fn, args, send), name=f"ddpkit-rank{rank}"
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
    # A signal that came while a worker was being started has not reached it.
    forwarder.catch_up()
    if forwarder.signum and len(procs) < spec.world_size:
        # Some ranks never started, so none can have trained: nothing is lost.
        _stop(procs.values())
        if forwarder.signum == signal.SIGINT:
            forwarder.stop_now()  # Ctrl-C: KeyboardInterrupt, as at any time
        raise StoppedAtStart(forwarder.signum)


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


# After every rank has returned its result, how long a worker may take to exit.
_EXIT_GRACE_S = 10.0
# After the first failure, how long to keep listening so that the true cause (say a
# rank killed by a signal, seen only when it is reaped) can arrive before we blame one.
_SETTLE_S = 1.0


def _blame_key(failure: tuple[float, WorkerError]) -> tuple[int, float]:
    when, err = failure
    return blame_key(err.exitcode, Exception.__str__(err), when)


@dataclasses.dataclass
class _Heard:
    """What the workers said through their pipes, and how they ended."""

    open_conns: dict[int, Connection]
    results: dict[int, Any] = dataclasses.field(default_factory=dict)
    preempted: dict[int, Preempted] = dataclasses.field(default_factory=dict)
    trained: bool = False  # some rank took an optimizer step (see preemption.starting_up)
    failures: list[tuple[float, WorkerError]] = dataclasses.field(default_factory=list)
    # rank -> the collective its error came from
    waits: dict[int, dict[str, str] | None] = dataclasses.field(default_factory=dict)

    def drain(self, rank: int) -> None:
        """Read what `rank` has sent and not yet been read."""
        conn = self.open_conns.get(rank)
        while conn is not None and conn.poll():
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self.open_conns.pop(rank).close()
                return
            if msg[0] == "ok":
                self.results[rank] = msg[1]
            elif msg[0] == "preempted":
                self.preempted[rank] = msg[1]
            elif msg[0] == "trained":
                self.trained = True
            else:
                _, when, exc_type, text, tb, self.waits[rank] = msg
                message = f"rank {rank} raised {exc_type}: {text}"
                err = WorkerError(rank, message, exc_type=exc_type, traceback=tb)
                self.failures.append((when, err))

    def ended(self, rank: int, code: int, *, nccl: bool) -> None:
        """`rank`'s process exited with `code`: a failure, if it said none itself."""
        self.drain(rank)  # a message sent just before exit is still in the pipe
        reported = [f for _, f in self.failures if f.rank == rank]
        for err in reported:
            err.exitcode = code
        if code != 0 and not reported:
            err = WorkerError(rank, _describe_exit(rank, code, nccl=nccl), exitcode=code)
            self.failures.append((time.time(), err))


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
    `Preempted` when the ranks saved, `StoppedAtStart` when no rank had trained yet
    (nothing is lost), else leave as the signal would have."""
    heard = _Heard(dict(conns))
    running = dict(procs)
    settle_until: float | None = None
    all_done_at: float | None = None
    while running:
        now = time.monotonic()
        if settle_until is not None and now >= settle_until:
            break
        if forwarder.expired():
            if heard.trained:  # else nothing was to be saved: StoppedAtStart says it below
                print(
                    f"ddpkit: the ranks did not save and stop within {forwarder.grace:g} s "
                    "of the signal: stopping them; the newest checkpoint on disk is complete",
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
        handles += list(heard.open_conns.values())
        wait(handles, timeout=1.0 if settle_until is None else settle_until - now)
        for rank in list(heard.open_conns):
            heard.drain(rank)
        for rank, proc in list(running.items()):
            if proc.exitcode is not None:
                del running[rank]
                heard.ended(rank, proc.exitcode, nccl=nccl)
        if heard.failures and settle_until is None:
            settle_until = time.monotonic() + _SETTLE_S
        if all_done_at is None and len(heard.results) == len(procs):
            all_done_at = time.monotonic()
        if watch is not None and (heard.failures or forwarder.signum):
            watch.stop()  # the job ends for another reason: no hang to find
        elif watch is not None and watch.hang is not None:
            raise HangError(watch.hang.summary(len(procs)), watch.hang.stacks())
    return _outcome(heard, len(procs), forwarder)


def _outcome(heard: _Heard, nprocs: int, forwarder: SignalForwarder) -> Any:
    """Once the workers are gone: rank 0's result, or what stopped the job, raised."""
    results, failures = heard.results, heard.failures
    if heard.preempted:
        saved = heard.preempted[min(heard.preempted)]
        if forwarder.signum and forwarder.signum != saved.signum:
            # The ranks agree on the largest signal number any of them got (SIGTERM
            # over a Ctrl-C that came after it, say); the stop line names the signal
            # that reached this process, which is the one the job was stopped with.
            saved = Preempted(saved.checkpoint, saved.step, forwarder.signum)
        raise saved
    stop = forwarder.signum or _stop_signal_of([err for _, err in failures])
    if stop in STOP_SIGNALS and not heard.trained and not results:
        # Before any rank's first optimizer step, however the ranks ended (the signal's
        # exit, a collective that lost its peer, killed before their handlers): a
        # requeue starts the job again with nothing lost.
        raise StoppedAtStart(stop)
    if forwarder.signum and len(results) < nprocs:
        forwarder.stop_now()  # stopped by the signal before anything was saved
    if failures:
        errors = [err for _, err in failures]
        summary = left_early(
            sorted(results),
            {e.rank: (Exception.__str__(e), heard.waits.get(e.rank)) for e in errors},
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


def _stop_signal_of(errors: list[WorkerError]) -> int:
    """The stop signal (SIGTERM, SIGUSR1) that ended one of the ranks that failed, by
    its SystemExit(128 + n) or by the signal itself; 0 if none did."""
    for err in errors:
        for signum in STOP_SIGNALS:
            raised = err.exc_type == "SystemExit" and Exception.__str__(err).endswith(
                f": {128 + signum}"
            )
            if raised or err.exitcode == -signum:
                return int(signum)
    return 0


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
