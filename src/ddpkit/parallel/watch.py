"""What `prepare_model` and `prepare_loader` build, shown to a watcher: how `ddpkit
verify` checks a training loop written by hand with them.

ddpkit owns those two calls, so a watcher set for a block (`watching(watcher)`) sees
the model before it is wrapped and the training data before it is batched, and may
replace them: verify records each sample a rank trains on, then replays them in one
process. A script's own `DataLoader` over a `DistributedSampler` (the DDP tutorial's
training loader) is shown as a training loader too; of its other own `DataLoader`s,
the watcher learns where they were built. Nothing is watched outside such a block; the
setting is this thread's and this context's own (a `ContextVar`), not the process's.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler


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

    def own_loader(self, data: TrainingData) -> TrainingData | None:
        """The parts of a `DataLoader` over a `DistributedSampler` that the script built
        itself, as it is first iterated: those to use instead, or None to leave it."""
        ...

    def other_loader(self, site: str) -> None:
        """A `DataLoader` the script built itself, not over a `DistributedSampler`:
        where ("train.py:12")."""
        ...


_WATCHER: ContextVar[Watcher | None] = ContextVar("ddpkit_watcher", default=None)


def watcher() -> Watcher | None:
    """The watcher of the block this runs in, if any."""
    return _WATCHER.get()


@contextlib.contextmanager
def watching(w: Watcher) -> Iterator[None]:
    """Show `w` what `prepare_model` and `prepare_loader` build inside the block, and
    the script's own `DataLoader`s."""
    token = _WATCHER.set(w)
    _own_loaders(+1)
    try:
        yield
    finally:
        _own_loaders(-1)
        _WATCHER.reset(token)


# -- a script's own DataLoader ----------------------------------------------------------
_ORIGINAL = DataLoader.__init__, DataLoader.__iter__, DataLoader.__len__
_BLOCKS = [0]  # watching blocks open in this process: the hooks are in while any is
_LOCK = threading.Lock()
_TORCH, _DDPKIT = (os.path.dirname(p) + os.sep for p in (torch.__file__, os.path.dirname(__file__)))


def _own_loaders(change: int) -> None:
    """Put the hooks on `DataLoader` in as the first block opens, out as the last one
    closes. They look at the watcher of the context that builds the loader, so loaders
    built outside a block are left alone."""
    with _LOCK:
        _BLOCKS[0] += change
        hooks = (_seen_init, _seen_iter, _seen_len) if _BLOCKS[0] else _ORIGINAL
        DataLoader.__init__, DataLoader.__iter__, DataLoader.__len__ = hooks  # type: ignore[method-assign]


def _seen_init(self: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
    _ORIGINAL[0](self, *args, **kwargs)
    w = _WATCHER.get()
    site = _site() if w is not None else None
    if w is None or site is None:  # not watched, or ddpkit's own loader
        return
    if isinstance(self.sampler, DistributedSampler) and self.batch_size is not None:
        # Shown as it is first iterated: a loader the script hands to prepare_loader
        # is shown by prepare_loader instead.
        given = inspect.signature(_ORIGINAL[0]).bind(self, *args, **kwargs).arguments
        given.pop("self")
        self.__dict__["_ddpkit_given"] = (w, given)
    else:
        w.other_loader(site)


def _instead(loader: DataLoader[Any]) -> DataLoader[Any]:
    """The loader to iterate for `loader`: itself, or for a script's own training loader
    over a DistributedSampler, one built with the parts its watcher gives."""
    given = loader.__dict__.get("_ddpkit_given")
    if given is None:
        return loader
    if "_ddpkit_instead" not in loader.__dict__:
        w, options = given
        seen = w.own_loader(
            TrainingData(
                loader.dataset,
                cast(Sampler[Any], loader.sampler),  # a DistributedSampler, as _seen_init saw
                loader.batch_size or 1,
                loader.num_workers,
            )
        )
        instead = loader
        if seen is not None:
            options = dict(options, dataset=seen.dataset, sampler=seen.sampler)
            options.update(batch_size=seen.batch_size, num_workers=seen.num_workers)
            if not seen.num_workers:  # options that DataLoader refuses without workers
                options.update(prefetch_factor=None, persistent_workers=False)
            instead = DataLoader.__new__(DataLoader)
            _ORIGINAL[0](instead, **options)
        loader.__dict__["_ddpkit_instead"] = instead
    return cast(DataLoader[Any], loader.__dict__["_ddpkit_instead"])


def _seen_iter(self: DataLoader[Any]) -> Any:
    return _ORIGINAL[1](_instead(self))


def _seen_len(self: DataLoader[Any]) -> int:
    return _ORIGINAL[2](_instead(self))


def _site() -> str | None:
    """ "file:line" of the script's line that builds a DataLoader; None if ddpkit does."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or frame.f_code.co_filename.startswith(_DDPKIT):
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"
