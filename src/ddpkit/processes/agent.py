"""`ddpkit run`'s engine: torchrun's elastic agent in this process, plus ddpkit's
rendezvous on loopback, fair threads per worker, hang watching and crash reports.

The agent runs in this process (`torch.distributed.run`), so its restarts, signal
handling and multi-node rendezvous are torchrun's own. ddpkit adds: a rendezvous served
on loopback at a free port for one machine, a fair thread count per worker, a shim in
each worker that reports progress and exceptions, and the reports read back here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# torch's C++ store client prints a warning with a C++ stack for every call that fails
# once node 0 is gone; ddpkit says what happened in one line instead. The level is read
# when torch loads, so it is set before; the workers get the user's setting back.
_QUIET_CPP_LOG = "TORCH_CPP_LOG_LEVEL" not in os.environ
if _QUIET_CPP_LOG:
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"

from torch.distributed.elastic.rendezvous.api import (  # noqa: E402
    RendezvousError,
    RendezvousTimeoutError,
)

from ddpkit.errors import PREEMPTED_EXIT, RUN_WORKER, ConfigError, StoppedAtStart  # noqa: E402
from ddpkit.findings import Finding  # noqa: E402
from ddpkit.inrank.audit import AUDIT_ENV  # noqa: E402
from ddpkit.inrank.preemption import (  # noqa: E402
    DDPKIT_JOB_NOTE,
    STOP_SIGNALS,
    TRAINED_NOTE,
)
from ddpkit.inrank.profile import DUMP_EVERY_S, PROFILE_ENV  # noqa: E402
from ddpkit.inrank.watchdog import descendants  # noqa: E402
from ddpkit.processes.audit import findings as audit_findings  # noqa: E402
from ddpkit.processes.config import LOOPBACK, LaunchConfig  # noqa: E402
from ddpkit.processes.machine import (  # noqa: E402
    advertised_address,
    interface_of,
    threads_per_rank,
)
from ddpkit.processes.output import RankOutput  # noqa: E402
from ddpkit.processes.profile import (  # noqa: E402
    VERDICT_EVERY_S,
    ProfileWatch,
    RankProfile,
    read_profiles,
)
from ddpkit.processes.rehearse import REFUSED_EXIT, REHEARSE_ENV  # noqa: E402
from ddpkit.processes.report import (  # noqa: E402
    HANG_EXIT,
    Hang,
    HangJudge,
    HangWatch,
    blame_key,
    left_early,
    read_reports,
    status_key,
)
from ddpkit.processes.scratch import scratch_dir  # noqa: E402
from ddpkit.processes.store import serve_store  # noqa: E402


def run_script(
    command: list[str],
    opts: LaunchConfig,
    on_audit: Callable[[list[Finding]], None] | None = None,
    on_profile: Callable[[dict[int, RankProfile]], None] | None = None,
    profile_every: float = VERDICT_EVERY_S,
) -> int:
    """Run `command` (SCRIPT ARGS..., or -m MODULE ARGS...) on every worker through
    torchrun's agent, `opts.nprocs` (resolved to a number) on this machine; the exit
    status. With `on_audit`, the workers are audited (see `audit.py`) and it is given
    what they did wrong, once the job has ended (well or not). With `on_profile`, the
    workers measure where their step time goes (see `ddpkit.inrank.profile`): the
    verdict is said every `profile_every` seconds, and `on_profile` is given every
    rank's measurements once the job has ended.

    0 when every worker succeeded; 1 after a crash, with the first failing rank's
    traceback on stderr; 124 for a hang, with every rank's stack; 128 + N when the job
    was stopped by signal N.
    """
    single, host, local = opts.nnodes == 1, opts.store_host, opts.local
    nproc = int(opts.nprocs)
    store, port = _rendezvous(opts)
    _patch_agent_store(loopback=local)
    _note_agent_stops()
    _patch_restarts()
    status = scratch_dir("run")
    world = nproc if single else opts.nnodes * nproc
    # What the ranks print, line by line, to the console and to each rank's log. The
    # global ranks of one machine are known in advance only when it is the only one.
    output = RankOutput(
        Path(opts.log_dir).absolute() if opts.log_dir is not None else status / "logs",
        prefix=world > 1 if opts.rank_prefix is None else opts.rank_prefix,
        shown=opts.local_ranks_filter,
        ranks=range(nproc) if single else (),
    ).start()
    env = {
        **output.env(),
        RUN_WORKER: str(status),
        "DDPKIT_HANG_TIMEOUT": str(opts.hang_s),
        "DDPKIT_RDZV_TIMEOUT": str(opts.rdzv_timeout),
        "DDPKIT_PARENT_PID": str(os.getpid()),  # the workers' parent: this agent
    }
    advertised = _advertised(opts, port)
    env.update(_network_env(opts, port, advertised))
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads_per_rank(nproc))
    if on_audit is not None:
        env[AUDIT_ENV] = "1"
    if on_profile is not None:
        # Each rank writes its measurements often enough for every verdict to be fresh.
        env[PROFILE_ENV] = str(min(DUMP_EVERY_S, profile_every / 2))
    if opts.cpu:
        env[REHEARSE_ENV] = "1"
    os.environ.update(env)
    if _QUIET_CPP_LOG:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
    torchrun_args = _torchrun_args(command, opts, port, status, advertised)
    watch = None
    if on_profile is not None:
        watch = ProfileWatch(functools.partial(_latest_attempt, status), profile_every).start()
    try:
        reports: Callable[[], dict[int, dict[str, Any]]] = functools.partial(_file_reports, status)
        if not single:
            reports = _StoreReports(host, port, world)
            reports.tell_address(opts.node_rank, advertised)
        logs = _Logs(output, in_log_dir=opts.log_dir is not None, this_node_only=not single)
        return _supervise(torchrun_args, status, reports, opts.hang_s, world, logs)
    except RendezvousTimeoutError:
        raise ConfigError(
            f"the other nodes did not join within {opts.rdzv_timeout:.0f} s: start all "
            f"{opts.nnodes} nodes with --master-addr {host} --master-port {port}, "
            "or raise --rdzv-timeout"
        ) from None
    except RendezvousError as exc:
        print(
            f"ddpkit: the job failed: lost the rendezvous on node 0 ({host}:{port}, "
            f"{type(exc).__name__}): node 0 stopped or the network failed; this node's "
            "workers were stopped",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        output.close()
        if on_audit is not None:
            on_audit(audit_findings(_latest_attempt(status)))
        if watch is not None:
            watch.stop()
        if on_profile is not None:
            on_profile(read_profiles(_latest_attempt(status)))
        shutil.rmtree(status, ignore_errors=True)
        del store


def _rendezvous(opts: LaunchConfig) -> tuple[Any, int]:
    """The store this node serves (node 0; else None) and the rendezvous port, once
    node 0 accepts connections."""
    host = opts.store_host
    if opts.node_rank != 0:
        _wait_for_master(host, opts.master_port, opts.rdzv_timeout)
        return None, opts.master_port
    # Node 0 serves the rendezvous itself, bound to the one address it was given.
    try:
        store = serve_store(host, 0 if opts.nnodes == 1 else opts.master_port)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve the rendezvous on {host}:{opts.master_port} ({exc.strerror}): "
            "on node 0, --master-addr must be an address of this machine and "
            "--master-port a free port"
        ) from None
    return store, store.port


def _network_env(opts: LaunchConfig, port: int, advertised: str | None) -> dict[str, str]:
    """The variables that put the workers' sockets where the other nodes reach them."""
    env = {}
    if opts.nnodes > 1:
        # Every node's watch judges every rank, so the ranks report to the store too.
        env["DDPKIT_STATUS_STORE"] = f"{opts.store_host}:{port}"
    if opts.local and sys.platform == "linux":
        # gloo's and NCCL's sockets stay off the network when every node is this machine.
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in os.environ:
                env[name] = "lo"
    elif advertised and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo binds where this machine's host name resolves, else to loopback, which no
        # other node reaches: the interface of the address the other nodes are given.
        interface = interface_of(advertised)
        if interface is not None:
            env["GLOO_SOCKET_IFNAME"] = interface
    return env


def _advertised(opts: LaunchConfig, port: int) -> str | None:
    """What the other nodes are told to reach this one at (node 0: its workers' store);
    None: torch's default, this machine's host name, which they may not resolve."""
    if opts.local:
        return LOOPBACK
    return opts.local_addr or advertised_address(opts.store_host, port)


def _torchrun_args(
    command: list[str], opts: LaunchConfig, port: int, status: Path, local: str | None
) -> list[str]:
    """torchrun's command line: its agent runs `command` in ddpkit's shim on each
    worker; `local`: the address this node gives the others (see `_advertised`)."""
    single, host = opts.nnodes == 1, opts.store_host
    run_id = f"ddpkit-{uuid.uuid4().hex[:8]}" if single else f"ddpkit-{host}-{port}"
    return [
        *("--nnodes", str(opts.nnodes), "--nproc-per-node", str(int(opts.nprocs))),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", run_id),
        *("--rdzv-conf", f"is_host=false,join_timeout={int(opts.rdzv_timeout)}"),
        *("--max-restarts", str(opts.max_restarts), "--monitor-interval", "0.1"),
        *("--log-dir", str(status / "torchelastic")),  # else torch leaves one in $TMPDIR
        *(["--local-addr", local] if local else []),
        # "--": what follows is the workers' command, never torchrun's options (argparse
        # would take an abbreviation such as --nproc in it for one of its own).
        *("--module", "--", "ddpkit.processes.shim", *command),
    ]


def _wait_for_master(host: str, port: int, timeout_s: float) -> None:
    """A bounded wait until node 0 accepts connections, then a clear error."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5.0, timeout_s)).close()
            return
        except socket.gaierror:
            raise ConfigError(f"--master-addr {host!r} is not a known host name") from None
        except OSError:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"cannot reach the master at {host}:{port} within {timeout_s:.0f} s: start "
                    "node 0 first, or check --master-addr/--master-port and the firewall"
                ) from None
            time.sleep(0.5)


def _patched(owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
    """Replace `owner.name` (a method of torch's) by `wrap(original)`, once a process."""
    flag = f"_ddpkit_patched_{name}"
    if not getattr(owner, flag, False):
        setattr(owner, name, wrap(getattr(owner, name)))
        setattr(owner, flag, True)


def _patch_agent_store(loopback: bool) -> None:
    """Two fixes to the store that torchrun's agent serves for the workers.

    - torch keeps one such store for every rendezvous round, so after a restart the new
      workers find the previous attempt's keys and gloo dials ranks that are dead
      ("connectFullMesh failed"). A fresh store per round, as the comment in torch's
      rendezvous.py says it should be, makes `--max-restarts` work.
    - TCPStore listens on every interface; when all nodes live on this machine it is
      served on 127.0.0.1 only.
    """
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler as Handler,
        )
    except ImportError:  # pragma: no cover - another torch layout: keep its behaviour
        return

    def fresh_store(original_next: Any) -> Any:
        def next_rendezvous(self: Any) -> Any:
            for attr in ("_shared_tcp_store_server", "_bootstrap_store_info"):
                if hasattr(self, attr):
                    setattr(self, attr, None)
            return original_next(self)

        return next_rendezvous

    def on_loopback(original: Any) -> Any:
        def create(self: Any, master_addr: str, master_port: int) -> Any:
            return serve_store(LOOPBACK, master_port, multi_tenant=True)

        return create

    _patched(Handler, "next_rendezvous", fresh_store)
    if loopback and hasattr(Handler, "_create_tcp_store_server"):
        _patched(Handler, "_create_tcp_store_server", on_loopback)


# The workers that torchrun's agent stopped (pids): those still running when it began to
# stop the group (after a failure, for a restart, on a signal to ddpkit run). A rank
# killed by a signal is the cause of a failure unless its pid is here (see _first_failure).
_STOPPED_BY_AGENT: set[int] = set()


def _note_agent_stops() -> None:
    """Record in _STOPPED_BY_AGENT which workers torchrun's agent stops, as it stops them."""
    try:
        from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    except ImportError:  # pragma: no cover - another torch layout: keep its behaviour
        return

    def noting(original: Any) -> Any:
        def close(self: Any, death_sig: Any, timeout: int = 30) -> None:
            # Before its signal: a worker that ended already (on a signal of someone
            # else's too) is not among them.
            _STOPPED_BY_AGENT.update(
                h.proc.pid for h in self.subprocess_handlers.values() if h.proc.poll() is None
            )
            original(self, death_sig, timeout)

        return close

    _patched(SubprocessContext, "_close", noting)


def _patch_restarts() -> None:
    """Two changes to what torchrun's agent does after a failed worker group.

    - It restarts the group while `--max-restarts` allows. A rank that exits 75 did not
      fail: the ranks saved on a stop signal (or were stopped before their first step)
      so that the scheduler requeues the job. A restart would train on and end with 0,
      and the requeue would never come: no restart then, and `ddpkit run` ends with 75
      (see _supervise). Nor after a call that `--cpu` cannot rehearse: every attempt
      would meet it again.
    - Before a restart, it says which rank failed and how, with its traceback (your
      frames only): the job may then succeed, and its logs, without `--log-dir`, are
      deleted with it. A preempted job, which is not restarted, says nothing here.
    """
    try:
        from torch.distributed.elastic.agent.server.api import WorkerState
        from torch.distributed.elastic.agent.server.local_elastic_agent import (
            LocalElasticAgent as Agent,
        )
    except ImportError:  # pragma: no cover - another torch layout: keep its behaviour
        return

    def deciding(original: Any) -> Any:
        def monitor(self: Any, worker_group: Any) -> Any:
            result = original(self, worker_group)
            if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                return result
            status = Path(os.environ[RUN_WORKER])
            attempt = _latest_attempt(status)
            if (
                any(failure.exitcode == PREEMPTED_EXIT for failure in result.failures.values())
                or _stop_before_training(result.failures, attempt)
                or read_reports(attempt, ".refused.json")  # --cpu would only meet it again
            ):
                self._remaining_restarts = 0
            elif self._remaining_restarts > 0:
                most = worker_group.spec.max_restarts
                done = most - self._remaining_restarts  # it reported to attempt<done>
                report = _restart_report(result.failures, status / f"attempt{done}", done + 1, most)
                print(report, file=sys.stderr, flush=True)
            return result

        return monitor

    _patched(Agent, "_monitor_workers", deciding)


def _restart_report(failures: dict[int, Any], folder: Path, restart: int, most: int) -> str:
    """`ddpkit: attempt N failed: rank R raised E: message (restart N of K)`, then that
    rank's traceback (none for a rank killed by a signal)."""
    rank, failure, err = _first_failure(failures, folder)
    what = f"raised {err['exc_type']}: {err['message']}" if err else _how(failure.exitcode)
    line = f"ddpkit: attempt {restart} failed: rank {rank} {what} (restart {restart} of {most})"
    return f"{line}\n{err['traceback'].rstrip()}" if err else line


def _latest_attempt(status: Path) -> Path:
    attempts = sorted(status.glob("attempt*"), key=lambda p: int(p.name[7:] or 0))
    return attempts[-1] if attempts else status / "attempt0"


_NODE_KEY = "ddpkit/node-at/"


class _StoreReports:
    """Every rank's report, read from the rendezvous store (jobs on several machines:
    each node's watch sees the ranks of every node, not just its own)."""

    def __init__(self, host: str, port: int, world_size: int) -> None:
        from datetime import timedelta

        from ddpkit.processes.store import TCPStore

        self.store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        self.world_size, self.attempt = world_size, 0

    def tell_address(self, node_rank: int, address: str | None) -> None:
        """Say which node this is at `address`, for the others' reports (`nodes`)."""
        if address:
            self.store.set(f"{_NODE_KEY}{address}", str(node_rank))

    def nodes(self, addresses: list[str]) -> dict[str, int]:
        """The node each of `addresses` is, where that node said (see `tell_address`)."""
        keys = {a: f"{_NODE_KEY}{a}" for a in addresses}
        return {a: int(self.store.get(k)) for a, k in keys.items() if self.store.check([k])}

    def __call__(self) -> dict[int, dict[str, Any]]:
        # A restarted job reports under the next attempt's keys.
        while self.store.check([status_key(self.attempt + 1, 0)]):
            self.attempt += 1
        reports = {}
        for rank in range(self.world_size):
            key = status_key(self.attempt, rank)
            if self.store.check([key]):
                reports[rank] = json.loads(self.store.get(key))
        return reports


_HANG_STOPPED = (
    f"ddpkit: stopped the hung job (exit status {HANG_EXIT}); the summary is above the stacks"
)
# Seconds between telling the agent to stop (it then restarts no worker) and killing
# the workers of a hung job.
_HANG_KILL_DELAY_S = 1.0


def _stop_hung_job(hang: Hang, world: int) -> None:
    """Say where each rank is, stop the agent and kill the workers of this node."""
    # Said now: the stop below may take a moment, and the reports go with it.
    print(f"{hang.summary(world)}\n\n{hang.stacks()}\n", file=sys.stderr, flush=True)
    # The agent turns SIGTERM into SignalException in its main thread and stops every
    # worker on its way out, with SIGTERM and 30 s of grace. A rank blocked in a
    # collective runs no Python handler until the call returns (a script that saves on
    # SIGTERM would hold the job those 30 s), and a hung job cannot save: its workers
    # (on this node) and their children are killed.
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(_HANG_KILL_DELAY_S)
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _file_reports(status: Path) -> dict[int, dict[str, Any]]:
    return read_reports(_latest_attempt(status))


def _supervise(
    torchrun_args: list[str],
    status: Path,
    reports: Callable[[], dict[int, dict[str, Any]]],
    hang_timeout: float,
    world_size: int,
    logs: _Logs,
) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    parsed = parse_args(torchrun_args)  # type: ignore[no-untyped-call]
    watch = None
    if hang_timeout > 0:
        on_hang = functools.partial(_stop_hung_job, world=world_size)
        watch = HangWatch(reports, HangJudge(hang_timeout, world_size), on_hang)
        watch.start()

    # torchrun's agent passes SIGTERM, SIGINT and SIGHUP on to its workers; SIGUSR1
    # (SLURM's --signal=USR1@90) would kill it outright. Handled as torchrun handles
    # those, the workers get SIGUSR1 and save (a Trainer with a checkpoint folder)
    # within torchrun's 30 s.
    def on_usr1(signum: int, frame: Any) -> None:
        raise SignalException(f"got {signal.Signals(signum).name}", sigval=signal.Signals(signum))

    previous = signal.signal(signal.SIGUSR1, on_usr1)
    try:
        try:
            with _quiet_torchelastic():
                torchrun(parsed)  # type: ignore[no-untyped-call]
        finally:
            logs.output.close()  # the ranks' last lines, before ddpkit says how it went
        if not any(status.glob("attempt*/rank*.initialised")):
            print(_NO_GROUP.format(world=world_size), file=sys.stderr, flush=True)
        return 0
    except ChildFailedError as exc:
        if _said(status, ".preempted.json"):  # a worker got the signal itself
            return PREEMPTED_EXIT
        if _said(status, ".refused.json"):  # --cpu met a call it cannot rehearse
            return REFUSED_EXIT
        if watch is not None and watch.hang is not None:  # its workers were killed
            print(_HANG_STOPPED, file=sys.stderr, flush=True)
            return HANG_EXIT
        stop = _stop_before_training(exc.failures, _latest_attempt(status))
        if stop:  # a worker got the signal before the job's first step
            print(f"ddpkit: {StoppedAtStart(stop)}", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT
        hung = _left_early(exc, _latest_attempt(status))
        if hung is not None:
            print(f"{hung}\n{_HANG_STOPPED}", file=sys.stderr, flush=True)
            return HANG_EXIT
        report = _crash_report(exc, _latest_attempt(status))
        lost = _lost_node(report, reports)
        print(f"{report}\n{lost}{logs.keep()}", file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        if _said(status, ".preempted.json"):
            return PREEMPTED_EXIT
        if watch is not None and watch.hang is not None:  # said when it was found
            print(_HANG_STOPPED, file=sys.stderr, flush=True)
            return HANG_EXIT
        if exc.sigval in STOP_SIGNALS and _starting_ddpkit_job(_latest_attempt(status)):
            print(f"ddpkit: {StoppedAtStart(exc.sigval)}", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT
        how = (
            "interrupted (Ctrl-C)"
            if exc.sigval == signal.SIGINT
            else f"stopped by {exc.sigval.name}"
        )
        print(f"ddpkit: {how}; every worker was stopped", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        if watch:
            watch.stop()


# Said after a clean run in which no rank started a process group.
_NO_GROUP = (
    "ddpkit: warning: no rank called torch.distributed.init_process_group (or "
    "ddpkit.launch): the script ran as {world} independent copies, each on all of the "
    "data; call ddpkit.launch(fn) or init_process_group in it to train together"
)


@contextlib.contextmanager
def _quiet_torchelastic() -> Iterator[None]:
    """Hide the agent's own log lines ("Sending process 123 closing signal SIGTERM",
    "failed (exitcode: 1) local_rank: 1"): ddpkit says what happened, once."""
    quiet = [
        logger
        for name, logger in logging.root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
        and name.startswith(("torch.distributed.elastic", "torch.distributed.run"))
    ]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)


@dataclass(frozen=True)
class _Logs:
    """Where the ranks' logs are: the user's `--log-dir` (`in_log_dir`), or the status
    folder, deleted at the end unless the job fails. `this_node_only`: one node of
    several, whose logs hold this node's ranks."""

    output: RankOutput
    in_log_dir: bool
    this_node_only: bool

    def keep(self) -> str:
        """After a failure: the line that names the logs, moved first out of the status
        folder into a folder of their own, kept for the user."""
        logs = sorted(self.output.logs.glob("rank*.log"))
        if not logs:
            return "ddpkit: no rank left a log"
        folder = self.output.logs
        if not self.in_log_dir:
            folder = Path(tempfile.mkdtemp(prefix="ddpkit-failed-run-"))
            for log in logs:
                shutil.move(str(log), folder / log.name)
        whose = (
            "the output of this node's ranks, with their whole tracebacks"
            if self.this_node_only
            else "every rank's output, with its whole traceback"
        )
        return f"ddpkit: {whose}: {folder}{os.sep}rank<N>.log"


def _said(status: Path, suffix: str) -> bool:
    """Whether a rank left a note `rank<N><suffix>`: `.preempted.json`, the ranks saved
    and stopped on a signal; `.refused.json`, a rank of `--cpu` met a call it cannot
    rehearse. If so, say the first rank's line (every rank has the same, most often)."""
    said = read_reports(_latest_attempt(status), suffix)
    if not said:
        return False
    print(f"ddpkit: {said[min(said)]['message']}", file=sys.stderr, flush=True)
    return True


def _starting_ddpkit_job(folder: Path) -> bool:
    """Whether the ranks run ddpkit's code (`launch`, `DistContext.current()`) and none
    has taken its first optimizer step yet (see preemption.tell_agent)."""
    notes = {p.name.rpartition(".")[2] for p in folder.glob("rank*.*")}
    return DDPKIT_JOB_NOTE in notes and TRAINED_NOTE not in notes


def _stop_before_training(failures: dict[int, Any], folder: Path) -> int:
    """The stop signal (SIGTERM, SIGUSR1) that killed a rank of a ddpkit job before any
    rank's first optimizer step, sent by someone other than this agent (a rank stopped
    by ddpkit's handler then ends by the signal too, see the shim); 0 if none. Nothing
    was lost: the job ends with 75, as under `launch`. A script without ddpkit code
    ends as under torchrun, with 1 naming the rank: ddpkit cannot tell whether it had
    trained (it may train without a torch optimizer) or what it saved."""
    if not _starting_ddpkit_job(folder):
        return 0
    for _, failure in sorted(failures.items()):
        signum = -failure.exitcode if failure.exitcode < 0 else 0
        if signum in STOP_SIGNALS and failure.pid not in _STOPPED_BY_AGENT:
            return signum
    return 0


def _left_early(exc: Any, folder: Path) -> str | None:
    """The hang summary (with the waiting ranks' tracebacks) when ranks ended while the
    others waited for them in a collective (see report.left_early); else None."""
    errors = read_reports(folder, ".error.json")
    failed = {
        rank: (str(errors.get(rank, {}).get("message", "")), errors.get(rank, {}).get("waited_in"))
        for rank in exc.failures
    }
    ended = sorted(int(p.name[4:-6]) for p in folder.glob("rank*.ended") if p.name[4:-6].isdigit())
    summary = left_early(ended, failed)
    if summary is None:
        return None
    stacks = "\n\n".join(
        f"--- traceback of rank {rank} ---\n{errors[rank]['traceback'].rstrip()}"
        for rank in sorted(failed)
    )
    return f"{summary}\n\n{stacks}\n"


def _first_failure(failures: dict[int, Any], folder: Path) -> tuple[int, Any, dict[str, Any]]:
    """Of torchrun's failures (rank -> ProcessFailure), the one most likely the cause
    (report.blame_key): its rank, the failure, and the error it recorded in `folder`
    ({} when it recorded none, e.g. killed by a signal)."""
    errors = read_reports(folder, ".error.json")
    candidates = []
    for rank, failure in failures.items():
        err = errors.get(rank, {})
        message = f"{err.get('exc_type', '')}: {err.get('message', '')}" if err else ""
        when = float(err.get("time", failure.timestamp))
        ours = failure.pid in _STOPPED_BY_AGENT
        key = blame_key(failure.exitcode, message, when, stopped_by_supervisor=ours)
        candidates.append((key, rank, failure, err))
    _, rank, failure, err = min(candidates, key=lambda c: c[0])
    return rank, failure, err


def _how(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


# How gloo says that the other end of a connection went away, with its address.
_PEER_GONE = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+: Connection (?:reset|closed) by peer")


def _lost_node(report: str, reports: Callable[..., Any]) -> str:
    """A line naming the node whose ranks went away under a rank that failed on that
    (a node killed, or cut off the network), ending with a newline; "" otherwise."""
    addresses = _PEER_GONE.findall(report)
    if not addresses or not isinstance(reports, _StoreReports):
        return ""
    with contextlib.suppress(Exception):  # node 0's store may be what went away
        for address, node in reports.nodes(addresses).items():
            return (
                f"ddpkit: node {node} ({address}) went away in the middle of a collective "
                f"(stopped, killed or cut off the network): its own output says why\n"
            )
    return ""


def _crash_report(exc: Any, folder: Path) -> str:
    """The first failing rank, its exit code and its traceback, as the last lines."""
    rank, failure, err = _first_failure(exc.failures, folder)
    how = _how(failure.exitcode)
    if err:
        return (
            f"ddpkit: rank {rank} failed first: {err['exc_type']}: {err['message']}\n"
            f"{err['traceback'].rstrip()}\n"
            f"ddpkit: the job failed: rank {rank} raised {err['exc_type']} and {how}; "
            "the other ranks were stopped"
        )
    return f"ddpkit: the job failed: rank {rank} {how}; the other ranks were stopped"
