"""What each worker of `ddpkit run` executes:
`python -m ddpkit.processes.shim (SCRIPT | -m MODULE) ARGS`.

torchrun's agent starts it once per rank. It prepares the diagnosis (a watchdog that
reports progress, a record of the exception if the script raises), then runs the
user's script or module as `__main__`, exactly as `python SCRIPT` would.

Before anything else, its stdout and stderr are connected to the agent's process
(`ddpkit.processes.output`), which shows each line with its rank and writes it to this
rank's log, `rank<N>.log`; the whole traceback, if the script raises, goes to the log
alone: the agent prints the first failing rank's (the user's frames only) and keeps
the logs when the job fails.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import runpy
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.errors import RUN_WORKER
from ddpkit.storage import write_json


def _status_folder() -> Path | None:
    root = os.environ.get(RUN_WORKER)
    if not root:
        return None
    # Each restart of the job by the elastic agent reports into a folder of its own.
    folder = Path(root) / f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _store_publisher(rank: int) -> Callable[[dict[str, Any]], None] | None:
    """With several nodes, reports also go to the rendezvous store (see ddpkit.processes.agent)."""
    address = os.environ.get("DDPKIT_STATUS_STORE")
    if not address:
        return None
    from datetime import timedelta

    from ddpkit.processes.report import status_key
    from ddpkit.processes.store import TCPStore

    host, _, port = address.rpartition(":")
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    key = status_key(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), rank)
    return lambda report: store.set(key, json.dumps(report))


def _note_process_group(folder: Path, rank: int) -> None:
    """Leave `rank<N>.initialised` once the script starts a process group, so that the
    agent can say when no rank did (N copies of a one-process script, each on all the
    data). torch resets its own count when the group is destroyed, hence a wrapper."""
    import torch.distributed as dist

    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        (folder / f"rank{rank}.initialised").touch()
        return original(*args, **kwargs)

    dist.init_process_group = init_process_group


def _refused(folder: Path | None, rank: int, exc: BaseException) -> int:
    """A call that `ddpkit run --cpu` cannot rehearse: the agent says it in one line."""
    from ddpkit.processes.rehearse import REFUSED_EXIT

    if folder is None:
        print(f"ddpkit: {exc}", file=sys.stderr, flush=True)
    else:
        write_json(folder / f"rank{rank}.refused.json", {"message": str(exc)})
    return REFUSED_EXIT


@dataclass
class _Helpers:
    """What a worker of `ddpkit run` prepares around the script (see `_prepare`)."""

    starting: Any = field(default_factory=contextlib.nullcontext)
    watchdog: Any = None
    recorder: Any = None
    profiler: Any = None

    def finish(self, folder: Path, rank: int, code: int, released: bool) -> None:
        """After the script, before the rank exits with `code`."""
        from ddpkit.inrank import audit

        if self.recorder is not None:
            audit.finish(self.recorder, folder, failed=code != 0)
        if self.profiler is not None:
            self.profiler.dump(final=True)
        if code == 0:
            # A rank whose peers then fail in a collective left them waiting: the agent
            # names it (see report.left_early).
            (folder / f"rank{rank}.ended").touch()
            if self.watchdog is not None:
                # It now waits for the others (not hung), or, released by launch, for no one.
                self.watchdog.finish("released" if released else "finished")


def _prepare(folder: Path, rank: int) -> _Helpers:
    """The agent's helpers in this rank: notes, the hang watch, the audit, the profiler."""
    from ddpkit.inrank import audit, preemption, profile
    from ddpkit.inrank.watchdog import Watchdog
    from ddpkit.processes import rehearse

    _note_process_group(folder, rank)
    # The agent learns whether the script runs ddpkit's code and when any rank took
    # its first step: a stop signal before it ends a ddpkit job with 75.
    preemption.notes_to(str(folder / f"rank{rank}"))
    helpers = _Helpers(
        starting=preemption.starting_up(
            on_first_step=lambda: preemption.tell_agent(preemption.TRAINED_NOTE)
        ),
        recorder=audit.install(rank) if os.environ.get(audit.AUDIT_ENV) else None,
        profiler=profile.from_env(rank, folder),
    )
    if float(os.environ.get("DDPKIT_HANG_TIMEOUT", "0")) > 0:
        helpers.watchdog = Watchdog(folder, rank, publish=_store_publisher(rank)).start()
    rehearse.refuse_own_ranks()  # mp.spawn inside a rank would hang
    return helpers


def _reach_node_0(timeout_s: float) -> None:
    """With several nodes: reach node 0's store at MASTER_ADDR:MASTER_PORT (what node
    0's agent gave the others) before the script does, whose process group would retry
    an address it cannot reach without end; a ConfigError naming the address, what it
    resolved to and the fix, after `timeout_s` at most (--rdzv-timeout)."""
    import socket
    import time

    from ddpkit.errors import ConfigError

    host, port = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "0"))
    if not host or os.environ.get("WORLD_SIZE") == os.environ.get("LOCAL_WORLD_SIZE"):
        return  # one machine: nothing to reach
    fix = (
        "give every node an address of node 0 that it reaches (--master-addr, and "
        "--local-addr on node 0: its IP on their network)"
    )
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(
            f"this node cannot resolve node 0's address {host!r} ({exc.strerror}): {fix}, or "
            f"make {host} resolve on every node"
        ) from None
    resolved = ", ".join(sorted({str(info[4][0]) for info in found}))
    deadline = time.monotonic() + timeout_s
    while True:
        for family, kind, proto, _, where in found:
            try:
                with socket.socket(family, kind, proto) as probe:
                    probe.settimeout(min(5.0, max(deadline - time.monotonic(), 0.1)))
                    probe.connect(where)
                    return
            except OSError:
                continue
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"this node cannot reach node 0 at {host}:{port} (resolved to {resolved}) "
                f"within {timeout_s:.0f} s (--rdzv-timeout): {fix}, or open port {port} "
                "between the nodes"
            )
        time.sleep(1.0)


def main() -> None:
    # First, before the imports that take seconds (torch): torchrun's agent stops every
    # rank as soon as one fails, and what a rank says while it starts is its output too.
    from ddpkit.inrank.output import attach, log_only

    attach()
    from ddpkit.errors import PREEMPTED_EXIT, Preempted, StoppedAtStart
    from ddpkit.inrank import preemption
    from ddpkit.inrank.watchdog import record_error
    from ddpkit.processes import rehearse
    from ddpkit.processes.launcher import ReleasedByLaunch
    from ddpkit.processes.workers import die_with_parent, exit_now

    # Never outlive the agent, even if it is killed with SIGKILL.
    parent = os.environ.get("DDPKIT_PARENT_PID")
    die_with_parent(int(parent) if parent else None)
    args = sys.argv[1:]
    as_module = bool(args) and args[0] == "-m"
    if as_module:
        args = args[1:]
    target, rest = args[0], args[1:]
    rank = int(os.environ.get("RANK", "0"))
    folder = _status_folder()
    helpers = _Helpers() if folder is None else _prepare(folder, rank)
    if rehearse.rehearsing():  # --cpu: after the audit's hooks, which it wraps
        rehearse.install()
    sys.argv = [target, *rest]
    code, released, stopped = 0, False, 0
    try:
        _reach_node_0(float(os.environ.get("DDPKIT_RDZV_TIMEOUT", "300")))
        with helpers.starting:
            if as_module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.path[0] = str(Path(target).resolve().parent)  # as `python SCRIPT` does
                runpy.run_path(target, run_name="__main__")
    except Preempted as exc:  # saved after a stop signal: the agent tells the user
        code = PREEMPTED_EXIT
        if folder is not None:
            write_json(folder / f"rank{rank}.preempted.json", {"message": str(exc)})
    except rehearse.NotRehearsable as exc:  # --cpu met a call it cannot run
        code = _refused(folder, rank, exc)
    except SystemExit as exc:
        released = isinstance(exc, ReleasedByLaunch)
        # Stopped by ddpkit's handler before this rank's first step (launch's
        # StoppedAtStart, ddpkit train while it starts): the rank ends by the signal, as
        # one with no handler does, and the agent, which knows who sent it and whether
        # any rank has trained, says what it means for the job (agent._stop_before_training).
        if isinstance(exc, StoppedAtStart):
            stopped = exc.signum
        else:
            stopped = preemption.stopped_while_starting(exc)
        if stopped:
            preemption.ddpkit_job()
            code = 128 + stopped
        elif exc.code not in (0, None):
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
            code = exc.code if isinstance(exc.code, int) else 1
            if folder is not None:
                record_error(folder, rank, exc)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the agent says it once
        code = 130
    except BaseException as exc:
        refused = rehearse.refusal(exc) if rehearse.rehearsing() else None
        if refused is not None:  # --cpu: a CUDA call that it does not map
            code = _refused(folder, rank, refused)
        else:
            code = 1
            # The agent shows the first failing rank's; every rank's is in its log.
            if not log_only(traceback.format_exc()):
                traceback.print_exc()
            if folder is not None:
                record_error(folder, rank, exc)
    if folder is not None:
        helpers.finish(folder, rank, code, released)
    # Like a spawned worker of `launch`: no interpreter shutdown, which gloo's threads
    # can turn into an abort (SIGABRT) even after a clean run.
    exit_now(code, signum=stopped)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C while the worker starts: the agent says it once
        os._exit(130)
