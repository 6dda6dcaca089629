"""prepare_loader: `DataLoader(..., shuffle=False, sampler=DistributedSampler(...))` with
the parts that the DDP tutorial leaves to the user done: a seed shared by all ranks, seeded workers,
pinned memory on GPUs, and an evaluation mode that counts every sample exactly once."""

from __future__ import annotations

import itertools
import math
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
    default_collate,
)
from torch.utils.data.dataloader import _BaseDataLoaderIter
from torch.utils.data.distributed import DistributedSampler

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.inrank.preemption import ddpkit_job
from ddpkit.parallel.batches import map_tensors
from ddpkit.parallel.watch import TrainingData, watcher
from ddpkit.seed import rank_seed, rng_state, set_rng_state

# Per-epoch reseeding of the loader's generator keeps worker seeds a function of
# (seed, rank, epoch) only, so a resumed run sees the same augmentations.
_EPOCH_STRIDE = 1_000_003
_MASK64 = 2**64 - 1


def _splitmix64(value: int) -> int:
    """splitmix64's step: a bijection of 64-bit numbers that scatters neighbours, so
    that seeds made from (rank key, epoch, position) never coincide by an offset
    (adding them instead gave position p of epoch e+1 the seed of p+1 of epoch e)."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class DistributedLoader(DataLoader[Any]):
    """A DataLoader with `set_epoch`, which both reshuffles the sampler and reseeds the
    workers (without `sampler.set_epoch`, a DistributedSampler repeats its order), and
    `skip`, which starts the next epoch part-way without loading what it skips."""

    base_seed: int = 0
    # Samples of the epoch's global order that the pass under way skipped (see
    # batches_after): where its batches stand in the epoch, for a checkpoint.
    pass_start: int = 0
    # This rank's samples skipped at the pass's start (a resume's `skip`) and in the
    # pass: where its batches stand in the sampler's padded order (gather_for_metrics).
    pass_skipped: int = 0
    pass_length: int | None = None
    epoch: int = 0  # the epoch of the next pass (set_epoch)
    # The last batch the pass under way read past (a resume's), else None: over uneven
    # shards a rank whose data ran out before the save trains with it as a stand-in.
    last_read_past: Any = None
    # (batches to read past, random streams to restore, batches counted done): see resume_at
    _resume_plan: tuple[int, dict[str, Any] | None, int] | None = None

    @property
    def base_sampler(self) -> Any:
        """The sampler that decides which indices this rank takes, in which order."""
        sampler = self.sampler
        return sampler.inner if isinstance(sampler, _Positioned) else sampler

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        set_sampler_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_sampler_epoch):
            set_sampler_epoch(epoch)
        if self.generator is not None:
            self.generator.manual_seed(self.base_seed + epoch * _EPOCH_STRIDE)

    def resume_at(self, batches: int, rng: dict[str, Any] | None = None) -> None:
        """Make the next pass start after its first `batches` batches (a mid-epoch
        resume) and then restore the random streams `rng` (from `ddpkit.seed.rng_state()`).

        The streams are restored only once the pass has started and the batches are
        passed, because both may draw random numbers that the interrupted run drew
        before it saved. Map-style data skips the indices without loading them; an
        IterableDataset reads past its batches, and so do shards that may differ in
        length between ranks (your own sampler): a rank whose shard ran out before the
        save keeps the last batch as its stand-in (`ddpkit.parallel.steps`). Later
        passes are plain.
        """
        uneven = not isinstance(self.base_sampler, DistributedSampler) and _world() > 1
        skipped = not uneven and self.skip(batches)
        self._resume_plan = (0 if skipped else batches, rng, batches)

    def next_pass(self) -> tuple[int, int | None]:
        """(the batches of the epoch that the next pass starts after, the epoch's
        batches in all or None when unknown): where a `resume_at` left it."""
        done = 0 if self._resume_plan is None else self._resume_plan[2]
        read_past = 0 if self._resume_plan is None else self._resume_plan[0]
        try:
            length = len(self)
        except TypeError:  # an IterableDataset without __len__
            return done, None
        return done, length + done - read_past

    def __iter__(self) -> _BaseDataLoaderIter:
        plan, self._resume_plan = self._resume_plan, None
        self.pass_start = getattr(self.sampler, "global_start", 0)
        self.pass_skipped = getattr(self.sampler, "start", 0)
        sampler = self.sampler  # a stream's has no length
        self.pass_length = len(sampler) if isinstance(sampler, _Positioned) else None
        batches = super().__iter__()
        self.last_read_past = None
        if plan is not None:
            read_past, rng, _ = plan
            for self.last_read_past in itertools.islice(batches, read_past):
                pass
            if rng is not None:
                set_rng_state(rng)
        return batches

    def skip(self, batches: int) -> bool:
        """Start the next epoch after its first `batches` batches, without loading them
        (a mid-epoch resume). False for an IterableDataset, whose batches can only be
        skipped by reading them."""
        if not isinstance(self.sampler, _Positioned):
            return False
        if batches:  # 0 leaves a start that batches_after set for your own sampler
            self.sampler.start = batches * cast(int, self.batch_size)
        return True

    def samples_done(self, batches: int, world_size: int) -> int:
        """Where the pass under way stands after this rank's `batches` batches, in samples
        of the epoch's global order (all ranks together): what `batches_after` resumes."""
        if not batches:
            return 0
        return self.pass_start + batches * cast(int, self.batch_size) * world_size

    def batches_after(self, samples: int, world_size: int, saved_world_size: int) -> int:
        """Prepare a mid-epoch resume after the first `samples` samples of the epoch's
        global order (all ranks together), whatever number of ranks and batch size
        trained them, and return the batches of the epoch that this rank counts as done.

        When the samples make whole batches on `world_size` ranks, those are the
        batches to skip (`skip`, `resume_at`): with the ranks and batch size that saved,
        exactly the saved count. Otherwise the next pass starts at that sample: of
        ddpkit's own order, what is left is shared out over the ranks as
        DistributedSampler shares a whole epoch; of your own sampler, on the ranks that
        saved, each rank goes on in its own order after its share of the samples. Every
        sample is trained once; the pass then counts 0 batches done.

        Raises:
            ConfigError: the order is not ddpkit's (your own sampler, a subclass of
                DistributedSampler with its own order, an IterableDataset) and the
                number of ranks changed, or (an IterableDataset) the samples make no
                whole batch: ddpkit cannot share out the rest of that order.
        """
        per_step = cast(int, self.batch_size) * world_size
        sampler = self.sampler
        positioned = sampler if isinstance(sampler, _Positioned) else None
        ours = positioned is not None and _ddpkits_order(positioned.inner)
        if ours or saved_world_size == world_size:
            if samples % per_step == 0:
                return samples // per_step
            if positioned is not None and (ours or samples % world_size == 0):
                positioned.global_start = samples
                if not ours:  # every rank trained samples / W of its own order
                    positioned.start = samples // world_size
                return 0
        order = (
            f"order of your {type(positioned.inner).__name__}"
            if positioned is not None
            else "order of your IterableDataset"
        )
        raise ConfigError(
            f"the resumed epoch had trained {samples} samples on {saved_world_size} rank(s), "
            f"and the {order} cannot be shared out again over {world_size} rank(s) in "
            f"batches of {self.batch_size}: resume with the number of ranks that saved, or "
            f"from a checkpoint saved at an epoch's end"
        )


class _Positioned(Sampler[Any]):
    """The sampler that shards, able to start an epoch at a position, and (with worker
    processes) pairing each index with a seed of its own.

    Workers take batches in turn, so which worker draws a sample's augmentation, and
    after how many other draws, depends on where the epoch started. A seed per sample,
    made from (seed, rank, epoch, position), makes the draw the same either way, so a
    resumed epoch that skips its first batches is bit-for-bit the uninterrupted one.
    """

    def __init__(self, inner: Sampler[Any], key: int | None) -> None:
        self.inner, self.key = inner, key
        self.epoch = self.start = 0
        self.global_start = 0  # see DistributedLoader.batches_after

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        set_epoch = getattr(self.inner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        start, self.start = self.start, 0  # a skip applies to one epoch only
        global_start, self.global_start = self.global_start, 0
        if global_start and _ddpkits_order(self.inner):
            indices: Iterator[Any] = iter(_rest_of_epoch(self.inner, global_start))
        else:
            indices = itertools.islice(iter(self.inner), start, None)
        if self.key is None:
            return indices
        epoch_key = _splitmix64(_splitmix64(self.key) ^ self.epoch)
        return (
            (_splitmix64(epoch_key ^ position) >> 1, index)  # below 2**63, as torch wants
            for position, index in enumerate(indices, start)
        )

    def __len__(self) -> int:
        if self.global_start and _ddpkits_order(self.inner):
            return len(_rest_of_epoch(self.inner, self.global_start))
        return max(0, len(self.inner) - self.start)  # type: ignore[arg-type]


def _ddpkits_order(sampler: Sampler[Any]) -> bool:
    """Whether ddpkit knows `sampler`'s order for any number of ranks (`global_order`):
    only of these exact classes. A subclass (length buckets, say) may order its epoch
    in its own way, which a permutation rebuilt here would contradict."""
    return type(sampler) in (DistributedSampler, DrawnSampler, ReplacementSampler)


def _rest_of_epoch(sampler: Any, start: int) -> list[int]:
    """This rank's share of `sampler`'s epoch order after its first `start` samples.

    DistributedSampler's order is one permutation of the dataset, the same for any
    number of ranks, of which rank r takes every W-th index from r (after padding the
    order to a multiple of W with its own first indices, or cutting it down to one with
    drop_last). The rest is shared out the same way, so with the same W that trained the
    first `start` samples this is exactly what the rank would have taken next.
    """
    dist_sampler = cast(DistributedSampler[Any], sampler)
    world = dist_sampler.num_replicas
    order = global_order(dist_sampler)
    rest = order[start:]
    if dist_sampler.drop_last:
        rest = rest[: len(rest) - len(rest) % world]
    elif rest and len(rest) % world:
        padding = world - len(rest) % world
        rest += (order * math.ceil(padding / len(order)))[:padding]
    return rest[dist_sampler.rank :: world]


def global_order(sampler: DistributedSampler[Any]) -> list[int]:
    """The epoch's order of a DistributedSampler over all ranks, before padding: a
    permutation of the dataset (or its order, without shuffling); or, for a
    `DrawnSampler`, its draws."""
    size = len(sampler.dataset)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(sampler.seed + sampler.epoch)
    if isinstance(sampler, DrawnSampler):
        if sampler.replacement:
            return torch.randint(size, (sampler.draws,), generator=generator).tolist()
        # As RandomSampler draws without replacement: whole permutations, then part of one.
        full, part = divmod(sampler.draws, size)
        perms = [torch.randperm(size, generator=generator) for _ in range(full)]
        return torch.cat([*perms, torch.randperm(size, generator=generator)[:part]]).tolist()
    if sampler.shuffle:
        return torch.randperm(size, generator=generator).tolist()
    return list(range(size))


def epoch_length(sampler: DistributedSampler[Any]) -> int:
    """Samples in the epoch's order over all ranks, before padding (see global_order)."""
    if isinstance(sampler, DrawnSampler):
        return sampler.draws
    return len(sampler.dataset)  # type: ignore[arg-type]


class DrawnSampler(DistributedSampler[Any]):
    """`RandomSampler(dataset, replacement, num_samples)`, sharded: each epoch draws
    `num_samples` indices (default: as many as the dataset holds) from `seed` and the
    epoch, the same on every rank, with replacement or (as RandomSampler does without)
    whole permutations and then part of one; rank r takes every W-th draw (from r), so
    the ranks share the epoch's draws as DistributedSampler shares a permutation."""

    replacement = False

    def __init__(
        self,
        dataset: Dataset[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        num_samples: int | None = None,
        replacement: bool | None = None,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        if replacement is not None:
            self.replacement = replacement
        self.draws = len(dataset) if num_samples is None else num_samples  # type: ignore[arg-type]
        if self.draws < self.num_replicas:
            raise ConfigError(
                f"the sampler draws {self.draws} sample(s) per epoch but there are "
                f"{self.num_replicas} ranks, so some rank would get none: draw at least "
                f"{self.num_replicas} (num_samples)"
            )
        # DistributedSampler sized the shares from the dataset: size them from the draws.
        if drop_last:
            self.num_samples = self.draws // self.num_replicas
        else:
            self.num_samples = math.ceil(self.draws / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[Any]:
        order = global_order(self)
        if self.drop_last:
            order = order[: self.total_size]
        else:
            order += order[: self.total_size - len(order)]
        return iter(order[self.rank : self.total_size : self.num_replicas])


class ReplacementSampler(DrawnSampler):
    """Training samples drawn with replacement, as nanoGPT draws random windows of its
    token stream, and sharded: each epoch draws one sequence of len(dataset) indices
    (or `num_samples`) from `seed` and the epoch, the same on every rank, and rank r
    takes every W-th of it (from r), so the ranks' shares are as long as
    DistributedSampler's."""

    replacement = True


class _SeededSamples(Dataset[Any]):
    """`dataset`, fetched as `(seed, index)`: every RNG is seeded before each sample.

    Only used in worker processes, whose RNGs serve nothing else."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, item: tuple[int, Any]) -> Any:
        seed, index = item
        random.seed(seed)
        torch.manual_seed(seed)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(seed % 2**32)
        return self.dataset[index]


class ShardSampler(Sampler[int]):
    """Rank r takes samples r, r+W, r+2W, ... in order: no padding, no duplicates.

    DistributedSampler pads the dataset to a multiple of the world size by repeating
    samples, which biases a metric computed over the whole set. This sampler gives
    shards that differ in length by at most one, so evaluation (which runs no
    collective per batch) counts each sample exactly once.
    """

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.length, self.rank, self.world_size = length, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))


class _BatchedTensorDataset(TensorDataset):
    """The same TensorDataset (its tensors, not copies) fetched a batch at a time.

    DataLoader calls `__getitem__` once per sample and stacks the samples
    (`default_collate`); for tensors in memory that costs more than the step of a
    small model (about 75 us of a 300 us step for 32 rows of 20 floats). With
    `__getitems__` it gathers each tensor once per batch instead: the same batches,
    bit for bit, from the same sampler.
    """

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        index = torch.as_tensor(indices)
        return [tensor[index] for tensor in self.tensors]


class _DealtStream(IterableDataset[Any]):
    """A one-process stream dealt out to the ranks a batch at a time: of its batches of
    `batch_size` samples, rank r takes batches r, r + W, r + 2W, ... (W ranks).

    Every rank reads the whole stream (as Accelerate's IterableDatasetShard does). In a
    DataLoader worker the stream is that worker's, batched by it, so dealing each worker's
    batches still gives the ranks together the single-process loader's batches, whole. A
    stream that splits itself between workers (`get_worker_info`) stays split; one that
    does not repeats in every worker, as it did in the script.
    """

    def __init__(
        self, stream: IterableDataset[Any], batch_size: int, rank: int, world_size: int
    ) -> None:
        self.stream, self.batch_size = stream, batch_size
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[Any]:
        turn = self.batch_size * self.world_size
        mine = range(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return (sample for i, sample in enumerate(self.stream) if i % turn in mine)

    def __len__(self) -> int:
        """This rank's samples of a stream with a length (TypeError, as for the stream
        itself, without one)."""
        full, rest = divmod(len(self.stream), self.batch_size)  # type: ignore[arg-type]
        mine = len(range(self.rank, full, self.world_size)) * self.batch_size
        return mine + (rest if full % self.world_size == self.rank else 0)


def _as_is(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    # default_collate would get one ready batch: it is already what it would build.
    return batch


def prepare_loader(
    dataset: Dataset[Any] | DataLoader[Any],
    ctx: DistContext | None = None,
    batch_size: int | None = None,
    *,
    shuffle: bool | None = None,
    evaluation: bool = False,
    replacement: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    sampler: Sampler[Any] | None = None,
    num_workers: int = 0,
    pin_memory: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    worker_init_fn: Callable[[int], None] | None = None,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    timeout: float = 0,
    multiprocessing_context: Any = None,
    in_order: bool = True,
    pin_memory_device: str = "",
) -> DistributedLoader:
    """A DataLoader that gives this rank its share of `dataset`.

    Training (the default) shuffles with a DistributedSampler seeded alike on every
    rank, so the ranks see disjoint shards of one permutation. Call
    `loader.set_epoch(epoch)` before each epoch (Trainer does), or every epoch repeats
    the same order. A `TensorDataset` is fetched a batch at a time (the same batches
    as the per-sample default, with less work).

    `dataset` may also be the DataLoader of a one-GPU script: it is rebuilt to shard its
    dataset with the loader's options and order, as the exactness notes list (a
    DataLoader over an IterableDataset is dealt out a batch at a time); `evaluation`,
    `seed`, and a `batch_size` or `shuffle` that you pass win, the rest is ignored.

    `collate_fn`, `worker_init_fn` (called once torch has seeded the worker's Python,
    NumPy and torch RNGs; ddpkit seeds them again before each sample), `timeout`,
    `in_order`, with workers `persistent_workers`, `prefetch_factor` and
    `multiprocessing_context`, and with pinning `pin_memory_device`, are DataLoader's.

    Args:
        dataset: a map-style dataset, or an IterableDataset that shards itself by rank
            (by itself: in a DataLoader it would be sharded twice).
        ctx: this rank's `DistContext` (default: `DistContext.current()`).
        batch_size: samples per rank; the global batch is `batch_size * world_size`.
        shuffle: shuffle the training order (default: True for training; not allowed
            with `sampler` or `evaluation`).
        evaluation: shard without padding or dropping, so that every sample is counted
            exactly once over all ranks (ranks may get one sample more than others).
        replacement: draw the training samples with replacement (`ReplacementSampler`:
            nanoGPT's random windows), as many each epoch as the dataset holds.
        seed: the seed of the shuffled order, the same on every rank.
        drop_last: drop each rank's last incomplete batch.
        sampler: your own sampler, used instead of ddpkit's; it must shard by itself.
        num_workers: data-loading processes per rank; each is seeded reproducibly.
        pin_memory: pin batches for faster copies to the GPU (default: on GPUs, unless
            the dataset's first sample is already on a GPU). A CPU rank never pins: True
            (yours, or that of the DataLoader you pass) is dropped there, without
            torch's warning from every rank.

    Returns:
        A `DataLoader` with a `set_epoch(epoch)` method.

    Raises:
        ConfigError: for a bad size or a combination that cannot work.
    """
    ddpkit_job()  # under ddpkit run, a stop signal before the first step ends it with 75
    ctx = ctx or DistContext.current()
    if isinstance(dataset, DataLoader):
        return _reshard(dataset, ctx, batch_size, shuffle, evaluation, replacement, seed)
    batch_size = _check_request(
        dataset, ctx, batch_size, num_workers, sampler, shuffle, evaluation, replacement
    )
    if sampler is None and not isinstance(dataset, IterableDataset):
        sampler = _our_sampler(dataset, ctx, evaluation, replacement, shuffle, seed, drop_last)
    dataset, sampler, batch_size, num_workers = _as_verify_sees(
        dataset, sampler, batch_size, num_workers, evaluation
    )
    return _loader(
        dataset,
        ctx,
        sampler,
        evaluation=evaluation,
        seed=seed,
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=drop_last,
        collate_fn=collate_fn,
        worker_init_fn=worker_init_fn,
        persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor,
        timeout=timeout,
        multiprocessing_context=multiprocessing_context,
        in_order=in_order,
        pin_memory_device=pin_memory_device,
    )


def _reshard(
    loader: DataLoader[Any],
    ctx: DistContext,
    batch_size: int | None,
    shuffle: bool | None,
    evaluation: bool,
    replacement: bool,
    seed: int,
) -> DistributedLoader:
    """`prepare_loader` of a one-GPU script's DataLoader: its dataset, sharded, with the
    loader's options (see `_kept_options`). A RandomSampler's draws become a
    `DrawnSampler` (each epoch draws as many, seeded by `seed` and the epoch, and the
    ranks share the draws). A stream is dealt out: every rank reads the whole of it and
    rank r keeps the loader's batches r, r + W, r + 2W, ... of W ranks (with workers,
    of each worker's batches), so batches stay whole and the ranks together get what
    the loader gave one process; shares may differ by a batch."""
    kept = _kept_options(loader, batch_size, shuffle, evaluation)
    inner = loader.dataset
    draws = kept.pop("draws", None)
    if draws is not None:  # the loader's RandomSampler(num_samples, replacement)
        num_samples, drawn_with_replacement = draws
        kept["sampler"] = DrawnSampler(
            inner,
            ctx.world_size,
            ctx.rank,
            seed=seed,
            drop_last=kept["drop_last"],
            num_samples=num_samples,
            replacement=drawn_with_replacement or replacement,
        )
        replacement = False  # the sampler draws
    if (
        isinstance(inner, IterableDataset)
        and not isinstance(inner, _DealtStream)  # a loader of ours: dealt already
        and ctx.world_size > 1
    ):
        # The script's stream knows nothing of ranks: each rank takes its batches.
        inner = _DealtStream(inner, kept["batch_size"], ctx.rank, ctx.world_size)
    return prepare_loader(
        inner, ctx, **kept, evaluation=evaluation, replacement=replacement, seed=seed
    )


def _check_request(
    dataset: Dataset[Any],
    ctx: DistContext,
    batch_size: int | None,
    num_workers: int,
    sampler: Sampler[Any] | None,
    shuffle: bool | None,
    evaluation: bool,
    replacement: bool,
) -> int:
    """Refuse a size or a combination of `prepare_loader`'s arguments that cannot work;
    the batch size, which a dataset needs."""
    if batch_size is None:
        raise ConfigError("prepare_loader needs a batch_size for a dataset: pass batch_size=32")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1 (got {batch_size}): pass --batch-size 32")
    if num_workers < 0:
        raise ConfigError(f"num_workers must be >= 0 (got {num_workers})")
    if sampler is not None and shuffle:
        raise ConfigError(
            "shuffle=True cannot be combined with a sampler (the sampler decides the order): "
            "drop shuffle=True, or drop the sampler and let ddpkit shard and shuffle"
        )
    if evaluation and shuffle:
        raise ConfigError("shuffle=True has no use in evaluation mode: drop it")
    if replacement and (evaluation or sampler is not None or shuffle is False):
        raise ConfigError(
            "replacement=True draws the training order itself: drop it, or drop "
            "evaluation, sampler or shuffle=False"
        )
    if evaluation and ctx.distributed and isinstance(dataset, IterableDataset):
        # ddpkit cannot tell whether the stream shards itself: every rank may evaluate
        # all of it, or each its share, and the counts would be silently wrong.
        raise ConfigError(
            "an IterableDataset cannot be an eval set with several ranks, because ddpkit "
            "cannot make it count each sample exactly once: pass a map-style dataset "
            "(with __len__ and __getitem__), which ddpkit shards without padding"
        )
    return batch_size


def _our_sampler(
    dataset: Dataset[Any],
    ctx: DistContext,
    evaluation: bool,
    replacement: bool,
    shuffle: bool | None,
    seed: int,
    drop_last: bool,
) -> Sampler[Any]:
    """ddpkit's sampler of a map-style dataset: its shard for evaluation (no padding),
    else a shard of one seeded order (drawn with replacement, if asked)."""
    size = len(dataset)  # type: ignore[arg-type]
    if evaluation:
        return ShardSampler(size, ctx.rank, ctx.world_size)
    if size < ctx.world_size:
        raise ConfigError(
            f"the training set has {size} sample(s) but there are {ctx.world_size} "
            f"ranks, so some rank would get none: use a larger dataset or --nproc {size}"
        )
    return (ReplacementSampler if replacement else DistributedSampler)(
        dataset,
        num_replicas=ctx.world_size,
        rank=ctx.rank,
        shuffle=True if shuffle is None else shuffle,
        seed=seed,
        drop_last=drop_last,
    )


def _as_verify_sees(
    dataset: Dataset[Any],
    sampler: Sampler[Any] | None,
    batch_size: int,
    num_workers: int,
    evaluation: bool,
) -> tuple[Dataset[Any], Sampler[Any] | None, int, int]:
    """The training data as `ddpkit verify` has it read, while it checks a hand-written
    loop (it records each sample a rank reads); else as it is."""
    seen_by = watcher()
    if seen_by is None or evaluation:
        return dataset, sampler, batch_size, num_workers
    seen = seen_by.training_data(TrainingData(dataset, sampler, batch_size, num_workers))
    return seen.dataset, seen.sampler, seen.batch_size, seen.num_workers


def _loader(
    dataset: Dataset[Any],
    ctx: DistContext,
    sampler: Sampler[Any] | None,
    *,
    evaluation: bool,
    seed: int,
    batch_size: int,
    num_workers: int,
    pin_memory: bool | None,
    drop_last: bool,
    collate_fn: Callable[[list[Any]], Any] | None,
    worker_init_fn: Callable[[int], None] | None,
    persistent_workers: bool,
    prefetch_factor: int | None,
    timeout: float,
    multiprocessing_context: Any,
    in_order: bool,
    pin_memory_device: str,
) -> DistributedLoader:
    """The loader of this rank's share, as `prepare_loader` decided it: pinned on GPU
    ranks, a plain TensorDataset fetched a batch at a time, each sample of a training
    pass seeded in the workers; DataLoader's own options where they apply."""
    pin = _pins(dataset, ctx, pin_memory)
    # A plain TensorDataset is fetched a batch at a time (subclasses may override
    # __getitem__, and a collate_fn of the caller's expects single samples).
    if collate_fn is None and type(dataset) is TensorDataset:
        dataset, collate_fn = _BatchedTensorDataset(*dataset.tensors), _as_is
    if sampler is not None and not evaluation:
        # Workers draw each sample's randomness from a seed of its own (see _Positioned);
        # a plain TensorDataset draws nothing, and keeps its batched fetch.
        seeded = num_workers > 0 and not isinstance(dataset, _BatchedTensorDataset)
        sampler = _Positioned(sampler, rank_seed(seed, ctx.rank) if seeded else None)
        if seeded:
            dataset = _SeededSamples(dataset)
    loader = DistributedLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin,
        drop_last=drop_last,
        collate_fn=collate_fn,
        worker_init_fn=worker_init_fn,
        generator=torch.Generator().manual_seed(seed + ctx.rank),
        persistent_workers=persistent_workers and num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        timeout=timeout,
        multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
        pin_memory_device=pin_memory_device if pin else "",
        # Passed only when asked: torch's default, and older releases may lack it.
        **cast(dict[str, Any], {} if in_order else {"in_order": False}),
    )
    loader.base_seed = seed + ctx.rank
    return loader


def _pins(dataset: Dataset[Any], ctx: DistContext, pin_memory: bool | None) -> bool:
    """Whether the loader pins its batches: on GPU ranks only (as asked, or by default),
    unless the samples are already on a GPU (torch's pinning thread would stop the first
    epoch with "cannot pin 'torch.cuda.FloatTensor'")."""
    # A CPU rank never pins: pinned memory only speeds up copies to a GPU, and torch
    # warns on every rank that has none ("no accelerator is found"). A one-GPU script's
    # DataLoader(pin_memory=True) thus runs on CPU ranks as it is.
    if pin_memory is False or ctx.device.type != "cuda":
        return False
    elsewhere = sorted({str(d) for d in _first_sample_devices(dataset) if d.type != "cpu"})
    if not elsewhere:
        return True
    if pin_memory:
        raise ConfigError(
            f"pin_memory=True cannot pin the dataset's samples, which are already on "
            f"{elsewhere[0]} (only CPU tensors can be pinned): drop pin_memory=True, or "
            "let the dataset return CPU tensors"
        )
    return False


def _first_sample_devices(dataset: Dataset[Any]) -> set[torch.device]:
    """The devices of the tensors in `dataset[0]`, read with every RNG left as it was, so
    that a random augmentation in `__getitem__` draws in training what it would have
    drawn anyway. Empty for a stream (reading it would use it up), an empty dataset, and
    one that `[0]` does not index (its own errors come when the loader reads it)."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or not len(dataset):
        return set()
    saved = rng_state()
    try:
        sample = dataset[0]
    except Exception:
        return set()
    finally:
        set_rng_state(saved)
    devices: set[torch.device] = set()

    def note(tensor: torch.Tensor) -> torch.Tensor:
        devices.add(tensor.device)
        return tensor

    map_tensors(sample, note)
    return devices


def _kept_options(
    loader: DataLoader[Any], batch_size: int | None, shuffle: bool | None, evaluation: bool
) -> dict[str, Any]:
    """The options of a user's DataLoader that `prepare_loader` keeps when it rebuilds it."""
    if loader.batch_size is None:
        raise ConfigError(
            "cannot shard a DataLoader built with a batch_sampler (or batch_size=None): "
            "pass its dataset and batch_size to prepare_loader, with a sampler that "
            "shards by itself as sampler= if you need one"
        )
    kept: dict[str, Any] = {
        "batch_size": loader.batch_size if batch_size is None else batch_size,
        "drop_last": loader.drop_last,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "collate_fn": None if loader.collate_fn is default_collate else loader.collate_fn,
        "worker_init_fn": loader.worker_init_fn,
        "persistent_workers": loader.persistent_workers,
        "prefetch_factor": loader.prefetch_factor if loader.num_workers > 0 else None,
        "timeout": loader.timeout,
        "multiprocessing_context": loader.multiprocessing_context,
        "in_order": getattr(loader, "in_order", True),
        "pin_memory_device": loader.pin_memory_device,
    }
    order = loader.sampler
    if isinstance(loader.dataset, IterableDataset) or evaluation:
        return kept  # a stream has no sampler (see _DealtStream); evaluation keeps the order
    if isinstance(order, DistributedSampler):
        kept["sampler"] = order  # already a shard of its own
    elif isinstance(order, RandomSampler) and (order.replacement or order._num_samples):
        if shuffle is False:
            raise ConfigError(
                f"shuffle=False contradicts the DataLoader's RandomSampler(replacement="
                f"{order.replacement}, num_samples={order._num_samples}), which draws at "
                "random: drop shuffle=False, or the sampler's options"
            )
        kept["draws"] = (order._num_samples, order.replacement)
    elif isinstance(order, (RandomSampler, SequentialSampler)):
        kept["shuffle"] = isinstance(order, RandomSampler) if shuffle is None else shuffle
    else:
        raise ConfigError(
            f"the DataLoader's {type(order).__name__} cannot be sharded by ddpkit: pass "
            "its dataset to prepare_loader with sampler= a sampler that gives each rank "
            "its own share, or use shuffle=True/False"
        )
    return kept


def _world() -> int:
    """The number of ranks of the process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
