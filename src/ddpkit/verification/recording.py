"""The samples each rank trained on: recorded in the N-rank run, replayed in one process.

Random augmentation (noise, flips, crops drawn in `__getitem__`) draws from each rank's
own random stream, or from each sample's own seed in worker processes, so the same
dataset called again in one process would give other samples. Instead, the N-rank run
saves every sample it fetches to a file, and the one-process run trains on those files,
in the union of the ranks' orders: it sees exactly what each rank saw, whatever drew it.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from ddpkit.training.trainer import Callback, Trainer

# (epoch, rank, index, occurrence): occurrence counts the earlier fetches of the same
# index by the same rank in the same epoch (a sampler may repeat an index).
SampleKey = tuple[int, int, int, int]


def sample_file(folder: Path, key: SampleKey) -> Path:
    epoch, rank, index, occurrence = key
    return folder / f"e{epoch}-r{rank}-i{index}-o{occurrence}.pt"


class OrderOfPasses(Sampler[tuple[int, int]]):
    """A rank's sampler that keeps the order of indices it gives at each pass, and gives
    each index with the number of its pass, for a `Recorder(by_pass=True)`: a pass may
    end before its last batch (a loop that peeks at one batch for its size), so which
    pass fetched a sample cannot be counted from the orders."""

    def __init__(self, inner: Sampler[Any]) -> None:
        self.inner = inner
        self.orders: list[list[int]] = []

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.inner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        number = len(self.orders)
        self.orders.append([int(i) for i in self.inner])
        return ((number, i) for i in self.orders[-1])

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


class Recorder(Dataset[Any]):
    """The N-rank run's training set: the job's, saving each sample it returns.

    Works in worker processes: each takes a copy of this dataset as an epoch starts, with
    the epoch that `epoch_callback()` set, and claims an occurrence by creating its file.
    `by_pass`: it is fetched as (pass, index) from an `OrderOfPasses`, and records each
    pass as an epoch of its own.
    """

    def __init__(
        self, data: Dataset[Any], folder: Path, rank: int, *, by_pass: bool = False
    ) -> None:
        self.data, self.folder, self.rank, self.by_pass = data, folder, rank, by_pass
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, item: Any) -> Any:
        if self.by_pass:
            self.epoch, index = item
        else:
            index = item
        sample = self.data[index]
        occurrence = 0
        while True:
            path = sample_file(self.folder, (self.epoch, self.rank, int(index), occurrence))
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                occurrence += 1
                continue
            with os.fdopen(fd, "wb") as file:
                torch.save(sample, file)
            return sample

    def epoch_callback(self) -> Callback:
        """A callback that tells this dataset which epoch starts."""
        return _EpochOf(self)


class _EpochOf(Callback):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        self.recorder.epoch = epoch


def replay_keys(orders: list[list[list[int]]], batch: int) -> list[list[SampleKey]]:
    """Per epoch (or pass of a hand-written loop), the one-process order of the recorded
    samples: its batch i is rank 0's batch i, then rank 1's, ... (`orders[rank][epoch]`
    is a rank's order of indices)."""
    union = []
    for epoch, ranks in enumerate(zip(*orders, strict=False)):
        seen: Counter[tuple[int, int]] = Counter()
        keys: list[SampleKey] = []
        for start in range(0, len(ranks[0]), batch):
            for rank, order in enumerate(ranks):
                for index in order[start : start + batch]:
                    keys.append((epoch, rank, index, seen[rank, index]))
                    seen[rank, index] += 1
        union.append(keys)
    return union


class Replay(Dataset[Any]):
    """The one-process run's training set: the recorded samples, fetched by their
    position in `keys` (all epochs one after another), as `ReplaySampler` yields it."""

    def __init__(self, folder: Path, keys: list[list[SampleKey]]) -> None:
        self.folder = folder
        self.keys = [key for epoch in keys for key in epoch]

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, position: int) -> Any:
        path = sample_file(self.folder, self.keys[position])
        if not path.exists():
            epoch, rank, index, _ = self.keys[position]
            raise FileNotFoundError(
                f"verify recorded no sample {index} of rank {rank} in epoch {epoch + 1}: "
                "the training loop fetched other samples than its sampler gave"
            )
        # Our own file, written by the N-rank run: any picklable sample may come back.
        return torch.load(path, weights_only=False)


class ReplaySampler(Sampler[int]):
    """Yields the positions in `Replay` of one epoch's recorded samples, in order: the
    epoch that `set_epoch` set, or with `by_pass`, the next one at each pass (a loop
    written by hand need not call set_epoch)."""

    def __init__(self, keys: list[list[SampleKey]], *, by_pass: bool = False) -> None:
        self.epochs: list[range] = []
        start = 0
        for epoch in keys:
            self.epochs.append(range(start, start + len(epoch)))
            start += len(epoch)
        self.epoch = 0
        self.by_pass, self.passes = by_pass, 0

    def set_epoch(self, epoch: int) -> None:
        if not self.by_pass:
            self.epoch = min(epoch, len(self.epochs) - 1)

    def __iter__(self) -> Iterator[int]:
        if self.by_pass:
            if self.passes >= len(self.epochs):
                raise RuntimeError(
                    "the one-process run passed over its data more often than the N ranks "
                    "did: does the loop's number of epochs depend on the number of ranks?"
                )
            self.epoch, self.passes = self.passes, self.passes + 1
        return iter(self.epochs[self.epoch])

    def __len__(self) -> int:
        return len(self.epochs[self.epoch])
