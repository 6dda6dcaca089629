"""What `prepare_model` and `prepare_loader` build, shown to a watcher: how `ddpkit
verify` checks a training loop written by hand with them.

ddpkit owns those two calls, so a watcher set for a block (`watching(watcher)`) sees
the model before it is wrapped and the training data before it is batched, and may
replace them: verify records each sample a rank trains on, then replays them in one
process. Nothing is watched outside such a block; the setting is this thread's and
this context's own (a `ContextVar`), not the process's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn
from torch.utils.data import Dataset, Sampler


@dataclass
class TrainingData:
    """A training loader's parts as `prepare_loader` is about to use them."""

    dataset: Dataset[Any]
    sampler: Sampler[Any] | None
    batch_size: int
    num_workers: int


class Watcher(Protocol):
    def model(self, model: nn.Module) -> nn.Module:
        """The bare model given to `prepare_model`, or the one to use instead."""
        ...

    def training_data(self, data: TrainingData) -> TrainingData:
        """A training loader's parts (not an evaluation's), or those to use instead."""
        ...


_WATCHER: ContextVar[Watcher | None] = ContextVar("ddpkit_watcher", default=None)


def watcher() -> Watcher | None:
    """The watcher of the block this runs in, if any."""
    return _WATCHER.get()


@contextlib.contextmanager
def watching(w: Watcher) -> Iterator[None]:
    """Show `w` what `prepare_model` and `prepare_loader` build inside the block."""
    token = _WATCHER.set(w)
    try:
        yield
    finally:
        _WATCHER.reset(token)
