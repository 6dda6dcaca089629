"""The step plan: which micro-batches make each optimizer step, and with what weight.

The Trainer trains from it, and so can a hand-written loop, with the same guarantee:
over shards of equal length, groups of `accumulate` micro-batches and no collective;
over shards whose lengths differ between ranks or are unknown (your own sampler, an
IterableDataset), the ranks agree on every step, so that every rank steps together,
the gradient is the mean over exactly the step's samples, no sample is dropped, and
the ranks' models and optimizers stay bit-identical (see `StepPlan`).

A mid-epoch resume is positioned by the loader (`load_state` calls its `resume_at`):
the plan starts where the loader's pass starts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.parallel.batches import count_samples
from ddpkit.parallel.data import DistributedLoader
from ddpkit.parallel.fsdp import as_sharded
from ddpkit.parallel.sync import Accumulation


class _Agreement:
    """Counts of one step summed over all ranks: an all-reduce started at once, in CPU
    memory (no device sync on a GPU), and waited for when a sum is first read. On one
    process (`group` False) the counts are the sums: there may be no process group."""

    def __init__(self, counts: list[int], group: Any, epoch: int) -> None:
        self._epoch = epoch
        self._sums = torch.tensor(counts, dtype=torch.int64)
        self._work: Any = None
        if group is not False:
            self._work = dist.all_reduce(self._sums, group=group, async_op=True)

    def _read(self) -> list[int]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return [int(x) for x in self._sums.tolist()]

    def total(self) -> float:
        """The step's samples over all ranks; 0 when every rank's data has run out."""
        step_total, any_stranded, *_ = self._read()
        if step_total and any_stranded:
            raise ConfigError(
                f"a rank got no batch at all in epoch {self._epoch + 1} while others did: "
                "each rank's share of the data (an IterableDataset or train_sampler "
                "that shards itself) must hold at least one batch"
            )
        return float(step_total)

    def longest(self, own: int) -> int:
        """The most micro-batches any rank has for this step (FSDP's one-hot counts)."""
        _, _, *have = self._read()
        return max((m for m, c in enumerate(have, 1) if c), default=max(own, 1))


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of the plan.

    Attributes:
        batch: what the loader gave (not moved to the device).
        ends_step: step the optimizer after this micro-batch's backward (and let DDP
            all-reduce in it: skip the sync for the others).
        position: the epoch's batches done once this step ends (what a checkpoint
            written after it resumes from).
        stand_in: this rank's data has run out while others still train: it runs the
            forward and backward of an earlier batch, weighted 0, so that the ranks'
            collectives pair up. Count nothing of it (and, as the Trainer does, run it
            in `model.eval()`, so that BatchNorm keeps its statistics).
    """

    batch: Any
    ends_step: bool
    position: int
    stand_in: bool
    _share: float  # the mean loss is multiplied by this ...
    _of: float | _Agreement  # ... and divided by this (uneven: the step's agreed samples)

    @property
    def weight(self) -> float:
        """What this micro-batch's mean loss is multiplied by before its backward: the
        step's gradient is then the mean over the step's samples (over its group's
        micro-batches with equal shards). Over uneven shards, reading it waits for the
        ranks' agreement on the step."""
        return self._share / self._denominator()

    def weighted(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times `weight` (1: `loss` itself); call `.backward()` on it."""
        scaled = loss * self._share if self._share != 1 else loss
        den = self._denominator()
        return scaled / den if den != 1 else scaled

    @property
    def step_samples(self) -> int | None:
        """The step's samples over all ranks, agreed on uneven shards; None on equal
        shards (there: this rank's samples times the number of ranks)."""
        return None if isinstance(self._of, float) else int(self._of.total())

    def _denominator(self) -> float:
        return self._of if isinstance(self._of, float) else self._of.total()


class StepPlan:
    """The micro-batches of each optimizer step over `loader`: iterate it once per
    epoch, after `loader.set_epoch(epoch)`. A loop over shards of unequal length::

        plan = StepPlan(loader, model, accumulate=4)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for micro in plan:
                x, y = to_device(micro.batch, ctx.device)
                model.train(not micro.stand_in)  # a stand-in keeps BatchNorm's statistics
                with no_backward_sync(model, not micro.ends_step):
                    micro.weighted(loss_fn(model(x), y)).backward()
                if micro.ends_step:
                    optimizer.step()
                    optimizer.zero_grad()
                    scheduler.step()

    Every rank ends with the same parameters, buffers and optimizer state, and every
    sample of every shard is trained once per epoch.

    Build it on every rank (over uneven shards of an nccl job it makes a gloo group,
    a collective) and keep it for the whole run.

    Args:
        loader: what `prepare_loader` returned.
        model: what `prepare_model` returned (under FSDP with `accumulate` > 1 the
            ranks also agree on how many forwards each step runs: each gathers).
        accumulate: micro-batches per optimizer step.
        ctx: this rank's context (`DistContext.current()` if None).
    """

    def __init__(
        self,
        loader: DistributedLoader,
        model: nn.Module,
        accumulate: int = 1,
        ctx: DistContext | None = None,
    ) -> None:
        if not isinstance(loader, DistributedLoader):
            raise ConfigError(
                f"StepPlan needs the loader that ddpkit.prepare_loader returns, not a "
                f"{type(loader).__name__}: loader = ddpkit.prepare_loader(loader, ctx)"
            )
        Accumulation(model, accumulate)  # checks `accumulate`
        self.loader, self.k = loader, accumulate
        self.ctx = ctx = ctx or DistContext.current()
        self.sharded = as_sharded(model) is not None
        # Shards of unequal length are possible only with a sampler or dataset that is
        # not ddpkit's; then the ranks agree on every step.
        self.uneven = ctx.distributed and not isinstance(loader.base_sampler, DistributedSampler)
        # Counts in CPU memory, over gloo: counts on a GPU would make the step wait for
        # the device to finish all it has queued. A gloo group of its own beside nccl.
        self._group: Any = None if ctx.distributed else False  # False: nothing to reduce
        agrees = self.uneven or loader.next_pass()[1] is None  # None: of unknown length
        if agrees and ctx.distributed and ctx.backend != "gloo":
            self._group = dist.new_group(backend="gloo")
        # Stands in when this rank's data has run out (kept from epoch to epoch).
        self._last_batch: Any = None

    def __iter__(self) -> Iterator[MicroBatch]:
        return self.micro_batches()

    def micro_batches(
        self, wrap: Callable[[Iterator[Any]], Iterable[Any]] | None = None
    ) -> Iterator[MicroBatch]:
        """One pass over the loader, as the plan's micro-batches (what iterating the
        plan gives). `wrap` wraps the loader's batches (a progress bar, say)."""
        loader = self.loader
        done, total = loader.next_pass()
        batches: Iterator[Any] = iter(loader)
        if wrap is not None:
            batches = iter(wrap(batches))
        if loader.last_read_past is not None:
            self._last_batch = loader.last_read_past
        if self.uneven or total is None:
            return self._agreed(batches, done)
        return _fixed(batches, self.k, total, done)

    def _agreed(self, batches: Iterator[Any], done: int) -> Iterator[MicroBatch]:
        """Micro-batches of shards whose lengths differ between ranks, or are unknown.

        Before each optimizer step the ranks agree (one small all-reduce) on how many
        samples the step has over all ranks. A rank whose data has run out while others
        still train takes part with its last batch, weighted 0; the epoch ends for every
        rank when no rank has data left.

        The all-reduce starts as soon as a group is drawn, and a rank with data waits
        for it only at the step's first backward, which needs the total: its forward
        runs (on a GPU, is queued) meanwhile. A rank with no data left waits at once,
        and so does every rank under FSDP with accumulation, where the number of
        forwards (one gather each) must be known before the first.
        """
        k, world = self.k, self.ctx.world_size
        # Under FSDP every forward gathers parameters: the ranks must run as many
        # micro-batches as each other, so each also says how many it has (one-hot).
        lengths = k if self.sharded and k > 1 else 0
        epoch = self.loader.epoch
        position = done  # in micro-batches of whole groups, the same on every rank
        while True:
            group = list(itertools.islice(batches, k))
            position += k
            counts = [count_samples(b) for b in group]
            stranded = not group and self._last_batch is None
            have = [int(len(group) == m) for m in range(1, lengths + 1)]
            agreed = _Agreement([sum(counts), int(stranded), *have], self._group, epoch)
            if (not sum(counts) or lengths) and agreed.total() == 0:
                return  # no rank has data left
            runs = agreed.longest(len(group)) if lengths else max(len(group), 1)
            if group:
                self._last_batch = group[-1]
            for m, (batch, n) in enumerate(zip(group, counts, strict=True)):
                # DDP averages over the ranks; this rank's part of the step's mean.
                yield MicroBatch(batch, m == runs - 1, position, False, float(world * n), agreed)
            # No data left here (or less than another rank's): take part, change nothing
            # (weight 0; the step's agreement, read already, says its samples).
            for m in range(len(group), runs):
                yield MicroBatch(self._last_batch, m == runs - 1, position, True, 0.0, agreed)


def _fixed(batches: Iterator[Any], k: int, total: int, done: int) -> Iterator[MicroBatch]:
    """Micro-batches of equal shards of known length (`total` in the epoch, the first
    `done` done): every rank steps after the same batches, with no collective. A short
    last group is averaged over its own size.

    Groups of `k` are counted from where the pass starts: a resume with another batch
    size may start in the middle of a group of the saved run's count, and its first
    group is then a whole one, not the rest of that group at a fraction of its weight
    (with the batch size that saved, the pass starts after a whole group anyway)."""
    acc = Accumulation(nn.Identity(), k, total - done)  # only counts: nothing to skip
    for i, batch in enumerate(batches):
        ends = acc.should_step(i)
        yield MicroBatch(batch, ends, done + i + 1, False, 1.0, float(acc.group_size(i)))
