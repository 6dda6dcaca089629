"""Where each rank's step time went, and the verdict: why N ranks are not N times faster.

A `Breakdown` is one rank's seconds over some optimizer steps, in five parts that add up
to the steps' wall time (see `ddpkit.inrank.profile`, which measures them): waiting for
the next batch (`data`), the forward and backward (`compute`), waiting for gradient
communication beyond the backward it overlaps (`comm`), `optimizer.step()`
(`optimizer`), and ddpkit's own work (`ddpkit`: checkpoints, logs, the stop vote).

`verdict` turns every rank's breakdown into lines a user acts on. What holds the ranks
back shows as a wait on the others: in DDP a rank that is late to the gradients'
all-reduce makes every other rank wait for it there (their `comm`), so a rank whose own
work (all but `comm`) is well above the others' is named first, with the part of it
that is larger (its loader or its compute). Only with no such rank is communication
itself the cost. A balanced job names no rank.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

# The parts of a step, in the order they are shown.
PARTS = ("data", "compute", "comm", "optimizer", "ddpkit")

# A rank is held back by its own work when that is this much above the others' median.
STRAGGLER_RATIO = 1.25
# Fractions of a step: above this, a wait is worth a line of the verdict.
DATA_WAIT = 0.15
COMM_WAIT = 0.20
OPTIMIZER_SHARE = 0.30
DDPKIT_SHARE = 0.05
# A straggler whose main thread ran on a core less than this share of its compute time
# was kept off it by other processes (CPU ranks only).
RAN_SHARE = 0.75
# Fewer steps than this say little: the verdict waits for more.
MIN_STEPS = 3


@dataclass
class Breakdown:
    """One rank's time (seconds) over `steps` optimizer steps, and its `samples`."""

    steps: int = 0
    samples: int = 0
    data: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    optimizer: float = 0.0
    ddpkit: float = 0.0
    # Of `compute`, the seconds the rank's main thread ran on a CPU (0: not measured,
    # on GPUs): well below `compute`, other processes kept the rank off its core.
    compute_cpu: float = 0.0

    @property
    def total(self) -> float:
        return float(sum(getattr(self, part) for part in PARTS))

    def copy(self) -> Breakdown:
        return replace(self)

    def share(self, part: str) -> float:
        """`part`'s fraction of the steps' time (0 with no time)."""
        total = self.total
        return getattr(self, part) / total if total > 0 else 0.0

    @property
    def own(self) -> float:
        """Seconds per step of this rank's own work: all but the wait for the others."""
        return (self.total - self.comm) / max(self.steps, 1)

    def per_step(self, part: str) -> float:
        return float(getattr(self, part)) / max(self.steps, 1)

    def add(self, other: Breakdown) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def since(self, earlier: Breakdown) -> Breakdown:
        """What was added after `earlier` (an older copy of this one)."""
        return Breakdown(
            **{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)}
        )

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Breakdown:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})  # type: ignore[arg-type]

    def record(self) -> dict[str, float | int]:
        """The run log's values: milliseconds per step of each part, and the steps."""
        values: dict[str, float | int] = {"steps": self.steps, "samples": self.samples}
        for part in PARTS:
            values[f"{part}_ms"] = round(1000 * self.per_step(part), 3)
        return values


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _others(ranks: Mapping[int, Breakdown], rank: int) -> list[Breakdown]:
    return [b for r, b in ranks.items() if r != rank]


def verdict(ranks: Mapping[int, Breakdown]) -> list[str]:
    """Lines that say what holds the job back, from every rank's breakdown over the same
    steps. The first line sums up the step; a balanced job names no rank."""
    measured = {r: b for r, b in ranks.items() if b.steps >= MIN_STEPS and b.total > 0}
    if not measured:
        return ["not enough optimizer steps were measured to say where the time goes"]
    whole = Breakdown()
    for b in measured.values():
        whole.add(b)
    n = len(measured)
    step_ms = 1000 * whole.total / whole.steps
    summary = ", ".join(f"{part} {_pct(whole.share(part))}" for part in PARTS)
    lines = [f"{n} rank{'s' if n > 1 else ''}, {step_ms:.1f} ms a step: {summary}"]
    return lines + (_held_back(measured) or ["balanced: no rank holds the others back"])


def _held_back(ranks: Mapping[int, Breakdown]) -> list[str]:
    """What holds the ranks back, most important first; [] for a balanced job."""
    lines: list[str] = []
    slow = _straggler(ranks)
    if slow is not None:
        lines.append(_straggler_line(ranks, slow))
    else:
        everyone = Breakdown()
        for b in ranks.values():
            everyone.add(b)
        data = min(b.share("data") for b in ranks.values())
        if data >= DATA_WAIT:
            lines.append(
                f"every rank waits for data {_pct(everyone.share('data'))} of each step: the "
                "loaders are the bottleneck; more DataLoader workers (num_workers), "
                "pin_memory, or less work per item in the dataset"
            )
        comm = min(b.share("comm") for b in ranks.values())
        if len(ranks) > 1 and comm >= COMM_WAIT:
            lines.append(
                f"gradient communication is {_pct(everyone.share('comm'))} of a step and is "
                "not hidden behind the backward: larger batches per rank, accumulate "
                "gradients over steps (fewer synchronisations), or a larger bucket_cap_mb "
                "(DDP); under FSDP, reshard_after_forward=False gathers less"
            )
        if min(b.share("optimizer") for b in ranks.values()) >= OPTIMIZER_SHARE:
            lines.append(
                f"the optimizer step is {_pct(everyone.share('optimizer'))} of a step: a "
                "fused or foreach optimizer (foreach=True, fused=True) steps faster"
            )
    own = max(b.share("ddpkit") for b in ranks.values())
    if own >= DDPKIT_SHARE:
        lines.append(
            f"ddpkit's own work (checkpoints, logs, the stop vote) is up to {_pct(own)} of a "
            "step: save less often (save_every, save_every_steps) or log less (log_every)"
        )
    return lines


def _straggler(ranks: Mapping[int, Breakdown]) -> int | None:
    """The rank whose own work per step is well above every other's median, if any."""
    if len(ranks) < 2:
        return None
    rank = max(ranks, key=lambda r: ranks[r].own)
    rest = statistics.median(b.own for b in _others(ranks, rank))
    return rank if ranks[rank].own > STRAGGLER_RATIO * rest else None


def _straggler_line(ranks: Mapping[int, Breakdown], rank: int) -> str:
    """`rank` holds the others back: by its loader or by its compute, whichever grew."""
    slow, others = ranks[rank], _others(ranks, rank)
    names = _ranks_named([r for r in ranks if r != rank])
    waited = statistics.median(b.share("comm") for b in others)
    wait = f"{names} {'waits' if len(others) == 1 else 'wait'} {_pct(waited)} of each step for it"
    data_more = slow.per_step("data") - statistics.median(b.per_step("data") for b in others)
    compute_more = slow.per_step("compute") - statistics.median(
        b.per_step("compute") for b in others
    )
    if data_more >= compute_more:
        return (
            f"rank {rank} waits for data {_pct(slow.share('data'))} of each step ({names} "
            f"{_pct(statistics.median(b.share('data') for b in others))}): its loader is the "
            "bottleneck; more DataLoader workers (num_workers), or less work per item in "
            f"its dataset; {wait}"
        )
    times = slow.per_step("compute") / max(
        statistics.median(b.per_step("compute") for b in others), 1e-9
    )
    ran = slow.compute_cpu / slow.compute if slow.compute_cpu and slow.compute else 1.0
    if ran < RAN_SHARE:
        return (
            f"rank {rank} computes {times:.1f}x longer than {names}, but ran on a core only "
            f"{_pct(ran)} of that time: other processes on its machine take its CPU; {wait} "
            "(fewer ranks or threads per machine, or free its cores)"
        )
    return (
        f"rank {rank} computes {times:.1f}x longer than {names}; {wait} (a straggler): work "
        "that only this rank does (logging, evaluation, a larger share of the data), or a "
        "slower device"
    )


def _ranks_named(ranks: list[int]) -> str:
    """`rank 0`, `ranks 0, 2`, or `the 7 other ranks` when there are many."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) <= 4:
        return "ranks " + ", ".join(map(str, ranks))
    return f"the {len(ranks)} other ranks"
