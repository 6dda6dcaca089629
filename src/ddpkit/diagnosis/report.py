"""Supervisor side of crash and hang diagnosis: read what the ranks reported, decide
whether the job is hung, and say which rank failed or where each one is stuck."""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Exit status of a job that ddpkit stopped because it was hung (as timeout(1) does).
HANG_EXIT = 124
# Seconds without progress before a job counts as hung (0 turns the check off).
DEFAULT_HANG_TIMEOUT = 300.0

# Words of errors a rank raises because a peer died, not because it failed itself.
_PEER_LOST = ("closed by peer", "reset by peer", "remote worker", "Broken pipe", "aborted")


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def blame_key(exitcode: int | None, message: str, when: float) -> tuple[int, float]:
    """Sort key over failures: the one most likely to be the cause comes first.

    A rank killed by a signal such as SIGKILL (the OOM killer) or SIGSEGV is a cause;
    SIGTERM and SIGINT are how supervisors stop the other ranks, so they are not. An
    error that says a peer went away is a consequence. Otherwise, the earliest wins.
    """
    if exitcode is not None and exitcode < 0 and -exitcode not in _STOP_SIGNALS:
        return (0, 0.0)
    return (2 if any(word in message for word in _PEER_LOST) else 1, when)


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
    """Evidence that no rank has made progress for `stalled_s` seconds."""

    statuses: dict[int, dict[str, Any]]
    stalled_s: float

    def summary(self, world_size: int | None = None) -> str:
        """A few lines: where each rank is, and who is missing from which collective."""
        ranks = sorted(self.statuses)
        lines = [
            f"ddpkit: the job is hung: no rank has made progress for {self.stalled_s:.0f} s. "
            "Where each rank is:"
        ]
        for rank in ranks:
            status = self.statuses[rank]
            coll = status.get("collective")
            if coll:
                lines.append(
                    f"  rank {rank}: in {coll['name']} (collective #{coll['seq']}) "
                    f"at {coll['where']}"
                )
            else:
                lines.append(f"  rank {rank}: not in a collective, at {status.get('where', '?')}")
        lines += self._missing(ranks if world_size is None else list(range(world_size)))
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
        parts = []
        for rank in sorted(self.statuses):
            stack = "".join(self.statuses[rank].get("stack", []))
            parts.append(f"--- Python stack of rank {rank} (most recent call last) ---\n{stack}")
        return "\n".join(parts).rstrip()


def find_hang(
    folder: Path, timeout_s: float, expected: int, now: float | None = None
) -> Hang | None:
    """A Hang when all `expected` ranks report and none progressed for `timeout_s`."""
    statuses = read_reports(folder)
    if timeout_s <= 0 or len(statuses) < expected:
        return None
    now = time.time() if now is None else now
    stalled = min(now - float(s.get("progress", now)) for s in statuses.values())
    return Hang(statuses, stalled) if stalled >= timeout_s else None


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))
