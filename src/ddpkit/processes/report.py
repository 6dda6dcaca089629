"""Supervisor side of crash and hang diagnosis: read what the ranks reported, decide
whether the job is hung, and say which rank failed or where each one is stuck."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Exit status of a job that ddpkit stopped because it was hung (as timeout(1) does).
HANG_EXIT = 124
# Seconds without progress before a job counts as hung (0 turns the check off).
DEFAULT_HANG_TIMEOUT = 300.0
# How long before the collective timeout an uncertain wait is stopped and reported.
_EARLY_S = 3.0
# Seconds without a new report from a live rank (its watch samples every second)
# after which its main thread must be holding Python's lock.
_SILENT_S = 5.0

# How to raise the hang timeout, for users of the command line and of `launch` alike.
_RAISE_HANG_TIMEOUT = "raise the hang timeout (--hang-timeout, or hang_timeout= in Python)"

# Words of errors a rank raises because a peer died, not because it failed itself.
_PEER_LOST = ("closed by peer", "reset by peer", "remote worker", "Broken pipe", "aborted")


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def blame_key(
    exitcode: int | None,
    message: str,
    when: float,
    *,
    stopped_by_supervisor: bool | None = None,
) -> tuple[int, float]:
    """Sort key over failures: the one most likely to be the cause comes first.

    A rank killed by a signal that its supervisor did not send (the OOM killer's
    SIGKILL, a SIGSEGV, a SIGTERM from someone else) is a cause. Then a rank's own
    error, then an error that says a peer went away (a consequence). Last, a rank
    killed by its supervisor's signal without an error of its own: that is how the
    other ranks are stopped. Within each kind, the earliest wins.

    `stopped_by_supervisor`: whether the supervisor had signalled this rank (`ddpkit
    run`'s agent knows whom it stopped); None when it cannot tell, and then SIGTERM,
    SIGINT and SIGHUP count as its signals, the others not.
    """
    if exitcode is not None and exitcode < 0:
        ours = stopped_by_supervisor
        if ours is None:
            ours = -exitcode in _STOP_SIGNALS
        if not ours:
            return (0, 0.0)
        if not message:
            return (3, when)
    return (2 if is_peer_lost(message) else 1, when)


def left_early(
    ended: list[int], failed: dict[int, tuple[str, dict[str, str] | None]]
) -> str | None:
    """The summary of a hang that ended in errors: ranks in `ended` returned (or exited
    with code 0) while the others waited in a collective for them, and the wait failed
    only because their sockets closed (gloo: "Connection closed by peer"). None when a
    failure is of its own (the rank that failed is then the cause).

    `failed`: rank -> (the error's message, `waited_in` of it: the call and the line;
    None for a collective that torch makes itself, out of C++: DDP's gradient
    all-reduce inside `backward()`, its start-up checks in `DDP(...)`).
    """
    if not ended or not failed:
        return None
    if any(not is_peer_lost(msg) for msg, _ in failed.values()):
        return None
    lines = [
        f"ddpkit: the job is hung: {_ranks(ended)} ended while {_ranks(list(failed))} waited "
        "in a collective. Where each rank is:"
    ]
    for rank in sorted([*ended, *failed]):
        where = failed[rank][1] if rank in failed else None
        if where is not None:
            lines.append(f"  rank {rank}: in {where['name']} at {where['where']}")
        elif rank in failed:
            lines.append(
                f"  rank {rank}: in a collective that torch makes itself (DDP's gradient "
                "all-reduce in backward(), or its checks in DDP(...)): its traceback below "
                "shows the line"
            )
        else:
            lines.append(f"  rank {rank}: ended (returned, or exited with code 0)")
    lines.append(
        "  every rank must call the same collectives in the same order: look for a "
        "return, `break` or `sys.exit()` under a rank check (e.g. `if rank == 1: return`)"
    )
    return "\n".join(lines)


def is_peer_lost(message: str) -> bool:
    """Whether an error says that a peer went away (a consequence, not a cause)."""
    return any(word in message for word in _PEER_LOST)


def status_key(attempt: int, rank: int) -> str:
    """The store key of a rank's report (jobs on several machines report through it)."""
    return f"ddpkit/status/{attempt}/{rank}"


def read_reports(folder: Path, suffix: str = ".json") -> dict[int, dict[str, Any]]:
    """rank -> report, for files `rank<N><suffix>` in `folder` (unreadable ones skipped)."""
    reports: dict[int, dict[str, Any]] = {}
    for path in folder.glob(f"rank*{suffix}"):
        stem = path.name[4 : -len(suffix)]
        if not stem.isdigit():
            continue
        try:
            reports[int(stem)] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return reports


@dataclass
class Hang:
    """Evidence that the job cannot go on: why, every rank's last report, what each
    rank was doing (`HangJudge._kind`), and what the user can do about it."""

    statuses: dict[int, dict[str, Any]]
    why: str
    now: float
    kinds: dict[int, str] = field(default_factory=dict)
    advice: list[str] = field(default_factory=list)

    def summary(self, world_size: int | None = None) -> str:
        """A few lines: where each rank is, who is missing from which collective, and
        what to look for."""
        ranks = sorted(self.statuses)
        lines = [f"ddpkit: the job is hung: {self.why}. Where each rank is:"]
        described = {
            rank: _describe(self.statuses[rank], self.now, self.kinds.get(rank)) for rank in ranks
        }
        lines += [f"  {who}: {text}" for who, text in _grouped(described)]
        lines += self._missing(ranks if world_size is None else list(range(world_size)))
        lines += [f"  {line}" for line in self.advice]
        return "\n".join(lines)

    def _missing(self, everyone: list[int]) -> list[str]:
        waits: dict[tuple[int, str], list[int]] = {}
        for rank, status in self.statuses.items():
            coll = status.get("collective")
            if coll:
                waits.setdefault((coll["seq"], coll["name"]), []).append(rank)
        lines = []
        for (seq, name), inside in sorted(waits.items()):
            missing = [r for r in everyone if r not in inside]
            if missing:
                lines.append(
                    f"  {_ranks(inside)} wait{'s' if len(inside) == 1 else ''} in {name} "
                    f"#{seq}; {_ranks(missing)} never reached it"
                )
        if len(waits) > 1:
            lines.append(
                "  every rank must call the same collectives in the same order: look for a "
                "collective under a rank check (e.g. `if rank == 0: dist.barrier()`)"
            )
        return lines

    def stacks(self) -> str:
        """Every rank's Python stack; above a few ranks, each distinct stack once."""
        stacks = {}
        for rank in sorted(self.statuses):
            stack = "".join(self.statuses[rank].get("stack", []))
            if self.statuses[rank].get("state") in ("finished", "released"):
                stack = "(it has finished: no stack to show)\n"
            stacks[rank] = stack
        parts = [
            f"--- Python stack of {who} (most recent call last) ---\n{stack}"
            for who, stack in _grouped(stacks)
        ]
        return "\n".join(parts).rstrip()


def _describe(status: dict[str, Any], now: float, kind: str | None = None) -> str:
    """Where a rank is, and what it does there, in words: "in barrier (collective #4)
    at train.py:12 in main", "not in a collective: idle (...) at train.py:30 in main"."""
    coll = status.get("collective")
    if status.get("state") == "finished":
        return f"finished {now - float(status['since']):.0f} s ago: it calls no more collectives"
    if status.get("state") == "released":
        return "done: `launch` let it go, and rank 0 goes on alone"
    if coll:
        return f"in {coll['name']} (collective #{coll['seq']}) at {coll['where']}"
    where = status.get("where", "?")
    if kind is None:
        return f"not in a collective: at {where}"
    return f"not in a collective: {_doing(status, kind)} at {where}"


class HangJudge:
    """Decides, from the ranks' reports, whether the job is certainly stuck.

    A rank waits when it is in a collective (or send/recv) or has finished. Once some
    rank has waited `hang_timeout` seconds, the others decide:
    - every other rank waits too, or is parked (the same line, no CPU in any thread or
      child process, no reading, for `hang_timeout` s): nothing can move any more: a
      hang;
    - some rank works (CPU in any thread or child process, reading data,
      rank_zero_first): a notice every `hang_timeout` s, never a stop;
    - some rank polls (its stack moves, but it uses no CPU), or waits in `subprocess`
      for a child that uses no CPU (it may still end): uncertain: notices, and a stop
      once the waiting has lasted `collective_timeout` s (the collectives would fail
      then anyway).
    A rank whose report is missing (a node not seen yet) stops any decision. A rank
    that `launch` released under an agent (its part is done; rank 0 goes on with the
    script alone) waits for no one and is left out.
    """

    def __init__(
        self, hang_timeout: float, world_size: int, collective_timeout: float | None = None
    ) -> None:
        self.timeout, self.world_size = hang_timeout, world_size
        self.collective_timeout = collective_timeout
        self._noticed = 0.0

    def judge(
        self, statuses: dict[int, dict[str, Any]], now: float | None = None
    ) -> tuple[Hang | None, str | None]:
        """(a Hang to stop the job for, or None; a notice to print, or None)."""
        now = time.time() if now is None else now
        if self.timeout <= 0 or any(r not in statuses for r in range(self.world_size)):
            return None, None
        kinds = {rank: self._kind(s, now) for rank, s in statuses.items()}
        # Ranks that `launch` let go under an agent wait for no one: the script goes on
        # in rank 0 alone, as long as it likes (see launcher._run_under_agent).
        kinds = {rank: k for rank, k in kinds.items() if k != "released"}
        waiters = [r for r, k in kinds.items() if k in ("waiting", "finished")]
        others = [r for r, k in kinds.items() if k not in ("waiting", "finished")]
        if not waiters or all(k == "finished" for k in kinds.values()):
            return None, None
        waited = now - min(float(_since(statuses[r])) for r in waiters)
        if waited < self.timeout:
            return None, None
        hang = Hang(statuses, "", now, kinds)
        # When every rank waits, the job is stuck only since the last one began to: a
        # report sampled a moment before its collective ended (or before the rank
        # returned) must not read as a long mismatch.
        settled = now - max(float(_since(statuses[r])) for r in waiters)
        if not others and settled < self.timeout:
            return None, None
        if all(kinds[r] == "parked" for r in others):
            hang.why, hang.advice = self._why(statuses, kinds, waiters, others, waited)
            return hang, None
        # Just before the collectives would fail on their own, so that the report says why.
        limit = None if self.collective_timeout is None else self.collective_timeout - _EARLY_S
        if limit is not None and waited >= limit and all(kinds[r] != "working" for r in others):
            how = " or ".join(sorted({_doing(statuses[r], kinds[r]) for r in others}))
            hang.why = (
                f"{_ranks(waiters)} waited {waited:.0f} s for {_ranks(others)}, which stayed "
                f"{how}; stopped at the collective timeout ({self.collective_timeout:g} s), "
                "where the waits would fail anyway"
            )
            hang.advice = [
                f"{_stacks_below(others)} what {_ranks(others)} waited for instead of the "
                "collective (a file, a service, a child process?)"
            ]
            return hang, None
        expected = all(statuses[r].get("expected_work") for r in others) and all(
            (statuses[r].get("collective") or {}).get("expected") for r in waiters
        )
        if expected or now - self._noticed < self.timeout:
            return None, None
        self._noticed = now
        return None, self._notice(statuses, kinds, waiters, others, waited, now)

    def _kind(self, status: dict[str, Any], now: float) -> str:
        if status.get("state") in ("finished", "released"):
            return str(status["state"])
        if status.get("collective"):
            return "waiting"
        if now - float(status.get("sampled", now)) > _SILENT_S:
            # Its watch could not run: the main thread holds Python's lock in one long
            # C call (`sum(range(10**10))`, a regex), working or not: uncertain.
            return "silent"
        if now - float(status.get("active", now)) < self.timeout:
            return "working"
        if now - float(status.get("moved", now)) < self.timeout:
            return "polling"
        return "parked"

    @staticmethod
    def _why(
        statuses: dict[int, dict[str, Any]],
        kinds: dict[int, str],
        waiters: list[int],
        others: list[int],
        waited: float,
    ) -> tuple[str, list[str]]:
        """Why the job is hung, and what to look for (lines of advice)."""
        stuck = [r for r in others if statuses[r].get("stuck_worker")]
        if stuck:
            worker = statuses[stuck[0]]["stuck_worker"]
            return (
                f"{_ranks(waiters)} waited {waited:.0f} s while "
                + "; ".join(f"rank {r} is {_doing(statuses[r], kinds[r])}" for r in stuck)
            ), [
                worker.get("hint")
                or "a worker forked while another thread of its rank held a lock (one of "
                "yours, or a library's) never gets it: take the lock in the worker itself, or "
                "start the workers without fork: "
                'DataLoader(..., multiprocessing_context="forkserver")'
            ]
        if others:
            return (
                f"{_ranks(waiters)} waited {waited:.0f} s while {_ranks(others)} stayed at one "
                "line without using the CPU (in any thread or child process) or reading data"
            ), [
                f"{_ranks(others)} {_is(others)} blocked in a call (a deadlocked lock, a queue "
                f"that stays empty, a long sleep): {_stacks_below(others)} which; if that call "
                f"would have returned, {_RAISE_HANG_TIMEOUT} above its wait"
            ]
        names = {
            (s["collective"]["seq"], s["collective"]["name"])
            for s in statuses.values()
            if s.get("collective")
        }
        if any(k == "finished" for k in kinds.values()):
            stuck = [r for r in waiters if kinds[r] == "waiting"]
            done = [r for r in waiters if kinds[r] == "finished"]
            return (
                f"{_ranks(stuck)} waited {waited:.0f} s in a collective that {_ranks(done)} "
                f"will never call: {'it has' if len(done) == 1 else 'they have'} finished"
            ), [
                "every rank must call the same collectives: look for a `return` or `break` "
                "under a rank check, or a loop that runs more steps on some ranks than on "
                "others (data split unevenly)"
            ]
        if len(names) > 1:  # _missing says which rank waits where, and what to look for
            return f"the ranks have waited {waited:.0f} s in different collectives", []
        return f"every rank has waited {waited:.0f} s in the same collective", [
            "every rank called it, yet it does not complete: the connection between the "
            "ranks may be stuck (with NCCL, NCCL_DEBUG=INFO says more); if the collective "
            f"is only slow, {_RAISE_HANG_TIMEOUT}"
        ]

    def _notice(
        self,
        statuses: dict[int, dict[str, Any]],
        kinds: dict[int, str],
        waiters: list[int],
        others: list[int],
        waited: float,
        now: float,
    ) -> str:
        """Who has waited how long for whom, what those ranks do, and what comes of it."""
        doing = "; ".join(
            f"rank {r} is {_doing(statuses[r], kinds[r])} at {statuses[r].get('where', '?')}"
            for r in others
        )
        described = {r: _describe(statuses[r], now) for r in waiters}
        waits = "; ".join(f"{who}: {text}" for who, text in _grouped(described))
        head = (
            f"ddpkit: notice: {_ranks(waiters)} {'has' if len(waiters) == 1 else 'have'} "
            f"waited {waited:.0f} s for {_ranks(others)}: {doing}; waiting: {waits}."
        )
        unsure = [r for r in others if kinds[r] != "working"]
        if unsure:
            when = (
                ""
                if self.collective_timeout is None
                else f", in {max(self.collective_timeout - _EARLY_S - waited, 0):.0f} s"
            )
            return (
                f"{head} If {_ranks(unsure)} {_is(unsure)} waiting for something that never "
                f"comes, the job is stopped at the collective timeout{when}"
            )
        tail = " Nothing is stopped while a rank works"
        if 0 in others:
            tail += (
                "; work that rank 0 must do before the others (a download, a data cache) "
                "belongs in `ddpkit.rank_zero_first()`, where the wait is expected and no "
                "notice is printed"
            )
        return head + tail


class HangWatch(threading.Thread):
    """The one hang watch of `launch` and `ddpkit run`: once a second, it has `judge`
    read `reports()`, prints its notices, and on a hang keeps it in `hang`, calls
    `on_hang(hang)` once and stops. `stop()` ends the watch for good (the job ends for
    another reason: a rank failed, or a signal came)."""

    def __init__(
        self,
        reports: Callable[[], dict[int, dict[str, Any]]],
        judge: HangJudge,
        on_hang: Callable[[Hang], None],
    ) -> None:
        super().__init__(name="ddpkit-hang-watch", daemon=True)
        self.reports, self.judge, self.on_hang = reports, judge, on_hang
        self.hang: Hang | None = None
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(1.0):
            verdict: tuple[Hang | None, str | None] = (None, None)
            with contextlib.suppress(Exception):  # an unreadable report is no verdict
                verdict = self.judge.judge(self.reports())
            hang, notice = verdict
            if self._done.is_set():
                return
            if notice:
                print(notice, file=sys.stderr, flush=True)
            if hang is not None:
                self.hang = hang
                self.on_hang(hang)
                return

    def stop(self) -> None:
        self._done.set()


def _doing(status: dict[str, Any], kind: str) -> str:
    """What a rank that does not wait does, in words that read after "rank 1 is"."""
    if kind == "polling" and status.get("child_wait"):
        return "waiting for a child process that uses no CPU"
    if status.get("stuck_worker"):
        return (
            f"waiting for its DataLoader worker (pid {status['stuck_worker']['pid']}), which can "
            "never run again: it has one thread, asleep on a lock of its own with no timeout"
        )
    return {
        "working": "busy (using the CPU or reading data)",
        "polling": "polling (it wakes up, but uses no CPU)",
        "silent": "in one long call that holds Python's lock (ddpkit cannot tell whether it works)",
        "parked": "idle (no CPU, no data read)",
    }.get(kind, kind)


def _since(status: dict[str, Any]) -> float:
    coll = status.get("collective")
    return float(coll["since"] if coll else status.get("since", status.get("sampled", 0.0)))


def _ranks(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0, 2`, or with runs of three or more `ranks 0-6, 8-31`."""
    ordered = sorted(ranks)
    runs: list[list[int]] = []
    for rank in ordered:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts = [f"{run[0]}-{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run)) for run in runs]
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(parts)


# Above this many ranks, ranks in the same place are said once, together: a report of
# hundreds of ranks stays a few lines.
_GROUP_ABOVE = 4


def _grouped(lines: dict[int, str]) -> list[tuple[str, str]]:
    """(`rank R` or `ranks A-B, ...`, text) for each text of `lines` (rank -> text):
    one per rank in a small job, one per distinct text above _GROUP_ABOVE ranks."""
    if len(lines) <= _GROUP_ABOVE:
        return [(f"rank {rank}", text) for rank, text in sorted(lines.items())]
    by_text: dict[str, list[int]] = {}
    for rank, text in sorted(lines.items()):
        by_text.setdefault(text, []).append(rank)
    return [(_ranks(ranks), text) for text, ranks in by_text.items()]


def _is(ranks: list[int]) -> str:
    return "is" if len(ranks) == 1 else "are"


def _stacks_below(ranks: list[int]) -> str:
    return "its stack below shows" if len(ranks) == 1 else "their stacks below show"
