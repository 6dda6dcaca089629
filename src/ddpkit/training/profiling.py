"""The Trainer's side of `TrainConfig(profile=True)` (`ddpkit train --profile`): where
each rank's step time goes, in the run log and in words (see `ddpkit.inrank.profile`
for what is measured, `ddpkit.inrank.breakdown` for the verdict).

Under `ddpkit run --profile` the agent measures and judges any script; a Trainer inside
then only marks its own work and its evaluation, and says nothing itself.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from ddpkit.context import DistContext
from ddpkit.inrank import profile
from ddpkit.inrank.breakdown import Breakdown, verdict
from ddpkit.parallel.ranks import all_gather_object
from ddpkit.records.runlog import RunLog

# Seconds between two verdicts said while a run trains (at the first epoch's end after).
VERDICT_EVERY_S = 300.0
_NOTHING = contextlib.nullcontext()


class StepProfile:
    """Measures this rank's steps when `enabled` (or when `ddpkit run --profile` does),
    writes every rank's breakdown to the run log at each epoch's end and says the
    verdict every few minutes and at the end (rank 0, through `say`)."""

    def __init__(self, ctx: DistContext, enabled: bool, say: Callable[[str], None]) -> None:
        self.ctx, self.enabled, self.say = ctx, enabled, say
        self.measures: profile.Profiler | None = None
        self._logged = Breakdown()  # the totals written to the run log so far
        self._judged = Breakdown()  # ... and judged in the last verdict
        self._said = time.perf_counter()
        self._began = 0.0

    def start(self, model: nn.Module) -> None:
        """As `fit` begins: measure, and the wait for `model`'s gradient all-reduces (a
        DDP model, wrapped before the profiler's hooks were there)."""
        self._began = time.perf_counter()
        if self.enabled:
            self.measures = profile.start(cuda=self.ctx.device.type == "cuda")
        else:
            self.measures = profile.active()
        if self.measures is not None and isinstance(model, nn.parallel.DistributedDataParallel):
            self.measures.watch(model)

    def own(self) -> AbstractContextManager[None]:
        """The Trainer's own work between steps: logs, checkpoints, the stop vote and the
        callbacks."""
        return self.measures.own() if self.measures is not None else _NOTHING

    def outside(self) -> AbstractContextManager[Any]:
        """An evaluation: no part of any step."""
        return self.measures.outside() if self.measures is not None else _NOTHING

    def epoch_end(self, step: int, runlog: RunLog) -> None:
        """Every rank: the breakdown of each rank since the last epoch's end to the run
        log; the verdict on the time since the last one, when it is a few minutes old."""
        if not self.enabled or self.measures is None:
            return
        now = self.measures.snapshot()
        windows = self._gather(now.since(self._logged))
        self._logged = now
        for rank, window in windows.items():
            if window.steps:
                runlog.write("profile", step, {"rank": rank, **window.record()})
        if time.perf_counter() - self._said >= VERDICT_EVERY_S:
            self._say(self._gather(now.since(self._judged)), "the last minutes")
            self._judged = now

    def finish(self) -> None:
        """Every rank, as `fit` returns: the verdict on the whole run (its steps after
        the warm-up), and ddpkit's fixed time before the first step and after the last."""
        if not self.enabled or self.measures is None:
            return
        measures, now = self.measures, time.perf_counter()
        total = measures.finish()
        warm = measures.warm
        first, last = measures.first_step_at, measures.last_step_at
        fixed = (first - self._began, now - last) if first is not None and last else (0, 0)
        found = all_gather_object(
            ((total.since(warm) if warm is not None else total).to_dict(), fixed)
        )
        self._say(
            {rank: Breakdown.from_dict(data) for rank, (data, _) in enumerate(found)}, "the run"
        )
        before, after = (max(times[i] for _, times in found) for i in (0, 1))
        self.say(
            f"  ddpkit's fixed time: {before:.2f} s before the first step (seeding, resuming, "
            f"the run log, starting the loaders), {after:.2f} s after the last (the last "
            f"checkpoint on disk, the ranks' BatchNorm buffers made equal), in a "
            f"{now - self._began:.1f} "
            "s fit"
        )

    def _gather(self, mine: Breakdown) -> dict[int, Breakdown]:
        """Every rank's breakdown (a collective)."""
        found = all_gather_object(mine.to_dict())
        return {rank: Breakdown.from_dict(data) for rank, data in enumerate(found)}

    def _say(self, ranks: dict[int, Breakdown], over: str) -> None:
        self._said = time.perf_counter()
        self.say(f"profile of {over}: " + "\n  ".join(verdict(ranks)))
