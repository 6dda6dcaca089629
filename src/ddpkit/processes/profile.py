"""The supervisor's side of `ddpkit run --profile`: every rank's measurements (see
`ddpkit.inrank.profile`), read from their files, and the verdict on them, at the end
and every few minutes while the job runs."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit.inrank.breakdown import Breakdown, verdict
from ddpkit.inrank.profile import read_file

# Seconds between two verdicts while a job runs.
VERDICT_EVERY_S = 300.0


@dataclass
class RankProfile:
    """One rank's measurements: its totals, after its warm-up, and over time."""

    total: Breakdown
    warm: Breakdown | None = None
    snapshots: list[tuple[float, Breakdown]] = field(default_factory=list)

    @property
    def steady(self) -> Breakdown:
        """The totals of the steps after the warm-up (all of them if it never ended)."""
        return self.total.since(self.warm) if self.warm is not None else self.total

    def windows(self) -> list[tuple[float, int, Breakdown]]:
        """(seconds since the start, steps so far, the breakdown since the snapshot
        before) for each snapshot that added steps: the breakdown over time."""
        found, before = [], Breakdown()
        for at, snapshot in self.snapshots:
            if snapshot.steps > before.steps:
                found.append((at, snapshot.steps, snapshot.since(before)))
                before = snapshot
        return found


def read_profiles(folder: Path) -> dict[int, RankProfile]:
    """Every rank's measurements that `folder` (an attempt's) holds, by rank."""
    found: dict[int, RankProfile] = {}
    for file in sorted(folder.glob("rank*.profile.json")):
        rank = int(file.name[4:].split(".", 1)[0])
        data = read_file(folder, rank)
        if data is None:  # a rank killed while it wrote: the others still count
            continue
        warm = data.get("warm")
        found[rank] = RankProfile(
            Breakdown.from_dict(data["total"]),
            None if warm is None else Breakdown.from_dict(warm),
            [(float(t), Breakdown.from_dict(b)) for t, b in data.get("snapshots", [])],
        )
    return found


def rate(profiles: dict[int, RankProfile]) -> float | None:
    """Samples per second of the ranks together, after their warm-up."""
    steady = [p.steady for p in profiles.values()]
    seconds = max((b.total for b in steady), default=0.0)
    samples = sum(b.samples for b in steady)
    return samples / seconds if seconds > 0 and samples else None


def report(
    profiles: dict[int, RankProfile], baseline: float | None = None, ranks: int | None = None
) -> str:
    """The block printed after a profiled job; `baseline`: samples/s of one rank alone
    (`--baseline`), for the scaling efficiency; `ranks`: the job's ranks on this
    machine, of which those that wrote nothing (stopped before their first write, as
    when another rank crashed) are named."""
    lines = verdict({r: p.steady for r, p in profiles.items()})
    silent = [r for r in range(ranks or 0) if r not in profiles]
    if silent:
        names = ", ".join(map(str, silent))
        lines.append(
            f"rank{'s' if len(silent) > 1 else ''} {names} stopped before writing what "
            f"{'they' if len(silent) > 1 else 'it'} measured: not in the verdict"
        )
    now = rate(profiles)
    if baseline and now is not None:
        n = len(profiles)
        lines.append(
            f"scaling efficiency {100 * now / (n * baseline):.0f}%: {now:.0f} samples/s on "
            f"{n} ranks against {n} x {baseline:.0f} of one rank alone"
        )
    return "ddpkit profile: " + "\n  ".join(lines) + "\n"


class ProfileWatch:
    """Says the verdict on the last `every` seconds while the job runs (to stderr)."""

    def __init__(self, folder: Callable[[], Path], every: float = VERDICT_EVERY_S) -> None:
        self.folder, self.every = folder, every
        self._stop = threading.Event()
        self._seen: dict[int, Breakdown] = {}
        self._thread = threading.Thread(target=self._run, name="ddpkit-profile", daemon=True)

    def start(self) -> ProfileWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            totals = {r: p.total for r, p in read_profiles(self.folder()).items()}
            recent = {r: b.since(self._seen.get(r, Breakdown())) for r, b in totals.items()}
            if not any(b.steps for b in recent.values()):
                continue  # nothing new measured (the job starting, say): nothing to say
            self._seen = totals
            print(
                f"ddpkit profile, the last {_duration(self.every)}: "
                + "\n  ".join(verdict(recent)),
                file=sys.stderr,
                flush=True,
            )


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
