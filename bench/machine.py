"""How busy other processes keep the machine: benchmarks on a shared machine are only as
good as the share of the CPUs that others took meanwhile (`foreign_load`)."""

from __future__ import annotations

import argparse
import os
import resource
import time
from collections.abc import Callable
from typing import Any

from tutorial import threads_for

BUSY_LIMIT = 0.10  # a run is "contended" when other processes used more of the machine


def _machine_busy_s() -> float | None:
    """CPU seconds every process of the machine has used since boot (Linux only)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait
    return (sum(ticks[:3]) + sum(ticks[5:8])) / os.sysconf("SC_CLK_TCK")


def _own_busy_s() -> float:
    """CPU seconds of this process and of its finished (reaped) children."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class LoadMeter:
    """The share of the machine's CPU that *other* processes used since `start()`:
    benchmarks on a shared machine are only as good as this number is small."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self._t, self._busy, self._own = time.perf_counter(), _machine_busy_s(), _own_busy_s()

    def foreign(self) -> float | None:
        busy = _machine_busy_s()
        if busy is None or self._busy is None:
            return None
        seconds = (time.perf_counter() - self._t) * threads_for(1)
        other = (busy - self._busy) - (_own_busy_s() - self._own)
        return max(0.0, other) / seconds if seconds > 0 else None


def settle(max_s: float, say: Callable[[str], None]) -> None:
    """Wait (at most `max_s`) until other processes leave the CPUs nearly idle."""
    deadline = time.monotonic() + max_s
    meter, told = LoadMeter(), False
    while time.monotonic() < deadline:
        meter.start()
        time.sleep(1.0)
        load = meter.foreign()
        if load is None or load < BUSY_LIMIT:
            return
        if not told:
            say(f"  waiting for other processes to leave the CPUs ({load:.0%} busy)...")
            told = True


def warn_if_contended(records: list[dict[str, Any]], say: Callable[[str], None]) -> None:
    """Say how many measurements other processes disturbed, if any."""
    contended = sum((r.get("foreign_load") or 0.0) >= BUSY_LIMIT for r in records)
    if contended:
        say(
            f"warning: during {contended} of {len(records)} measurements other processes "
            f"used more than {BUSY_LIMIT:.0%} of the CPUs (foreign_load in the JSON): the "
            "numbers are noisy; rerun on a quiet machine, or with --settle 60"
        )


Records = list[dict[str, Any]]


def measured(
    launch: Callable[[], Records],
    settle_s: float,
    retries: int,
    say: Callable[[str], None],
    replaced: list[tuple[Records, float | None, int]] | None = None,
) -> tuple[Records, float | None, int]:
    """Run `launch`; returns its records, the foreign load meanwhile and the attempt.

    With `settle_s`, first wait for a quiet machine, and run it again (at most `retries`
    times) when other processes took the CPUs meanwhile; the runs it replaces go to
    `replaced`, if given, as (records, foreign load, attempt).
    """
    meter = LoadMeter()
    attempts = 1 + (retries if settle_s > 0 else 0)
    for attempt in range(attempts):
        if settle_s > 0:
            settle(settle_s, say)
        meter.start()
        records = launch()
        foreign = meter.foreign()
        if (foreign or 0.0) < BUSY_LIMIT or attempt == attempts - 1:
            return records, foreign, attempt
        if replaced is not None:
            replaced.append((records, foreign, attempt))
        say("  (other processes took the CPUs during that launch: running it again)")
    raise AssertionError("unreachable")


def add_settle_args(p: argparse.ArgumentParser) -> None:
    """--settle and --retries: how `measured` treats a machine that others share."""
    p.add_argument(
        "--settle",
        type=float,
        default=0.0,
        metavar="S",
        help="before each launch, wait up to S seconds for other processes to leave the CPUs "
        "(for shared machines; default 0: don't wait)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        metavar="N",
        help="with --settle, run a launch again (at most N times) when other processes took "
        "the CPUs during it (default 2)",
    )
