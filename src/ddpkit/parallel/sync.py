"""Gradient synchronisation in a hand-written loop: skip DDP's all-reduce for a backward,
and gradient accumulation that all-reduces once per optimizer step.

Both work on the model `prepare_model` returns: a DDP wrapper with several processes,
the bare module with one (where there is nothing to skip).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.parallel.fsdp import as_sharded
from ddpkit.parallel.model import find_ddp


@contextlib.contextmanager
def no_backward_sync(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Skip DDP's gradient all-reduce for the forward and backward run inside.

    DDP's `no_sync()` (FSDP's `set_requires_gradient_sync(False)` on a sharded model),
    also on a model that has no DDP wrapper (one process, where it does nothing) and
    under `torch.compile`. Each rank's gradients then add up locally;
    the next backward outside it all-reduces the sum. Put the forward inside too: DDP
    decides in the forward whether the backward all-reduces. `enabled=False` makes it
    a no-op, for code that decides at run time::

        with no_backward_sync(model, enabled=not last_micro_batch):
            loss_fn(model(x), y).backward()
    """
    if not enabled:
        yield
        return
    sharded = as_sharded(model)
    if sharded is not None:  # strategy "fsdp": its own switch
        sharded.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            sharded.set_requires_gradient_sync(True)
        return
    ddp = find_ddp(model)
    if ddp is None:
        yield
        return
    with ddp.no_sync():
        yield


class Accumulation:
    """Gradient accumulation over groups of `k` micro-batches; see `accumulate`."""

    def __init__(self, model: nn.Module, k: int, length: int | None = None) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"accumulate needs k >= 1 micro-batches per step (got {k!r})")
        if length is not None and (not isinstance(length, int) or length < 0):
            raise ConfigError(f"length must be the number of micro-batches, >= 0 (got {length!r})")
        self.model, self.k, self.length = model, k, length

    def _check(self, i: int) -> None:
        if i < 0:
            raise ConfigError(f"micro-batch index must be >= 0 (got {i})")

    def should_step(self, i: int) -> bool:
        """True when micro-batch `i` (0-based) ends a group: step the optimizer after it.

        That is every k-th micro-batch, and the last one when `length` is known."""
        self._check(i)
        return (i + 1) % self.k == 0 or (self.length is not None and i + 1 == self.length)

    def group_size(self, i: int) -> int:
        """How many micro-batches the group of micro-batch `i` has: `k`, or fewer in a
        short last group (when `length` is known). Divide the loss by it, so that the
        group's gradient is the mean over its micro-batches."""
        self._check(i)
        start = i - i % self.k
        if self.length is None:
            return self.k
        return max(1, min(self.k, self.length - start))

    def step(self, i: int) -> contextlib.AbstractContextManager[Any]:
        """The context for micro-batch `i`'s forward and backward: DDP's all-reduce is
        skipped unless the micro-batch ends a group (`should_step(i)`)."""
        return no_backward_sync(self.model, enabled=not self.should_step(i))


def accumulate(model: nn.Module, k: int, length: int | None = None) -> Accumulation:
    """Gradient accumulation: one optimizer step per `k` micro-batches, one all-reduce.

    Micro-batches are counted by their index `i` in the pass (0, 1, 2, ...), so the
    helper keeps no count of its own and a loop that resumes mid-pass stays right. Run
    each micro-batch's forward and backward inside `acc.step(i)`: all but the last of
    each group skip DDP's all-reduce, so their gradients add up on each rank and the
    group's last backward all-reduces the sum. Give `length` (the micro-batches in a
    pass, `len(loader)`) and a short last group steps too, and `group_size(i)` tells its
    size. With one process it accumulates the same way (there is nothing to skip)::

        acc = ddpkit.accumulate(model, k=4, length=len(loader))
        for i, (x, y) in enumerate(loader):
            with acc.step(i):  # forward and backward inside
                loss = loss_fn(model(x), y) / acc.group_size(i)
                loss.backward()
            if acc.should_step(i):
                optimizer.step()
                optimizer.zero_grad()

    Args:
        model: what `prepare_model` returned (a DDP wrapper or the bare module).
        k: micro-batches per optimizer step (1: step after every batch).
        length: micro-batches per pass, if known.
    """
    return Accumulation(model, k, length)
