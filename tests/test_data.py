"""prepare_loader: shards, shuffling per epoch, exact evaluation, seeded workers, errors."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    get_worker_info,
)

from ddpkit import DistContext, launch
from ddpkit.errors import ConfigError
from ddpkit.parallel.data import ShardSampler, prepare_loader


def _indices(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _epoch_orders(ctx: DistContext, n: int) -> list[Any]:
    loader = prepare_loader(_indices(n), ctx, batch_size=4, seed=7)
    mine = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        mine.append([int(i) for (batch,) in loader for i in batch])
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def test_ranks_see_disjoint_shards_and_set_epoch_reshuffles() -> None:
    n = 64
    per_rank = launch(_epoch_orders, n, nprocs=2)
    r0, r1 = per_rank
    for epoch in range(3):
        assert len(r0[epoch]) == len(r1[epoch]) == n // 2
        assert set(r0[epoch]).isdisjoint(r1[epoch])
        assert sorted(r0[epoch] + r1[epoch]) == list(range(n))
    # a new order every epoch, on every rank
    assert r0[0] != r0[1] != r0[2] and r1[0] != r1[1]
    # same seed -> same permutation as one process would see (rank r takes r::2)
    single = torch.randperm(n, generator=torch.Generator().manual_seed(7 + 1)).tolist()
    assert r0[1] == single[0::2] and r1[1] == single[1::2]


def _eval_shards(ctx: DistContext, n: int) -> list[Any]:
    loader = prepare_loader(_indices(n), ctx, batch_size=2, evaluation=True)
    mine = [int(i) for (batch,) in loader for i in batch]
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def test_evaluation_counts_every_sample_exactly_once_on_uneven_sizes() -> None:
    r0, r1 = launch(_eval_shards, 7, nprocs=2)
    assert sorted(r0 + r1) == list(range(7))  # no padding duplicates, nothing lost
    assert (len(r0), len(r1)) == (4, 3)


def test_shard_sampler_lengths() -> None:
    assert [len(ShardSampler(5, r, 3)) for r in range(3)] == [2, 2, 1]
    assert [list(ShardSampler(2, r, 3)) for r in range(3)] == [[0], [1], []]


def test_training_set_smaller_than_world_is_an_error() -> None:
    ctx = DistContext(rank=0, world_size=4)
    with pytest.raises(ConfigError, match=r"3 sample.*4 ranks"):
        prepare_loader(_indices(3), ctx, batch_size=1)


def test_sampler_with_shuffle_is_an_error() -> None:
    data = _indices(8)
    with pytest.raises(ConfigError, match="shuffle=True cannot be combined with a sampler"):
        prepare_loader(data, DistContext(), 2, shuffle=True, sampler=SequentialSampler(data))
    # a user sampler alone is fine and is used as given
    loader = prepare_loader(data, DistContext(), 2, sampler=SequentialSampler(data))
    assert [int(i) for (b,) in loader for i in b] == list(range(8))


def test_bad_batch_size_is_an_error() -> None:
    with pytest.raises(ConfigError, match="batch_size must be >= 1"):
        prepare_loader(_indices(8), DistContext(), 0)


class _RandomDraws(Dataset[float]):
    """Each item is a draw from Python's RNG, as an augmentation would make."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> float:
        return random.random()


def _draws(seed: int, epoch: int) -> list[float]:
    loader = prepare_loader(
        _RandomDraws(), DistContext(), 2, seed=seed, num_workers=2, shuffle=False
    )
    loader.set_epoch(epoch)
    return [float(x) for batch in loader for x in batch]


def test_workers_are_seeded_per_worker_and_repeatably() -> None:
    a = _draws(seed=3, epoch=0)
    assert a == _draws(seed=3, epoch=0)  # repeatable, so a resumed run matches
    # batches 0 and 1 come from different workers: their draws must differ
    assert a[0:2] != a[2:4]
    # A new epoch draws anew: no draw of epoch 1 is one of epoch 0's (before the seeds
    # were mixed, epoch 1 drew epoch 0's draws shifted by one position). The same on
    # 2 real ranks: tests/test_worker_seeds.py.
    assert not set(a) & set(_draws(seed=3, epoch=1))


def test_a_tensor_dataset_is_fetched_a_batch_at_a_time_with_the_same_batches() -> None:
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(50, 3, 4, generator=g), torch.randint(0, 5, (50,), generator=g)
    )
    for rank in (0, 1):
        ctx = DistContext(rank=rank, world_size=2)
        ours = prepare_loader(data, ctx, batch_size=8, seed=3)
        plain = DataLoader(
            data, batch_size=8, sampler=DistributedSampler(data, 2, rank, shuffle=True, seed=3)
        )
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            plain.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            got, want = list(ours), list(plain)
            assert len(got) == len(want) == 4  # 25 per rank: 8, 8, 8, 1
            for (x, y), (wx, wy) in zip(got, want, strict=True):
                assert torch.equal(x, wx) and torch.equal(y, wy)
                assert x.shape == wx.shape and y.dtype == wy.dtype
    assert isinstance(ours.dataset, TensorDataset)  # still one, over the same tensors
    assert ours.dataset.tensors[0] is data.tensors[0]


class _Stream(IterableDataset[int]):
    """Samples 0, 1, ..., n - 1, as a one-GPU script streams them: with no thought of
    ranks; split between DataLoader workers (get_worker_info) if `by_worker`, else read
    whole by each worker (the user's loader then yields every sample once per worker)."""

    def __init__(self, n: int, by_worker: bool = False) -> None:
        self.n, self.by_worker = n, by_worker

    def __iter__(self) -> Iterator[int]:
        worker = get_worker_info()
        if self.by_worker and worker is not None:
            return iter(range(worker.id, self.n, worker.num_workers))
        return iter(range(self.n))


class _SizedStream(_Stream):
    def __len__(self) -> int:
        return self.n


# (samples, batch size, workers, split by worker)
_STREAMS = [(11, 3, 0, False), (16, 2, 2, True), (12, 2, 2, False)]


def _stream_batches(ctx: DistContext) -> list[Any]:
    out: list[dict[str, Any]] = []
    for n, size, workers, by_worker in _STREAMS:
        script = DataLoader(_Stream(n, by_worker), batch_size=size, num_workers=workers)
        mine = [b.tolist() for b in prepare_loader(script, ctx)]
        out.append({"single": [b.tolist() for b in script], "mine": mine})
    sized = prepare_loader(DataLoader(_SizedStream(11), batch_size=3), ctx)
    out.append({"len": len(sized), "batches": len(list(sized))})
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, out)
    return everyone


@pytest.mark.slow  # 3 loaders with workers: each rank starts them anew (3-5 s each)
def test_a_dataloader_over_a_stream_is_dealt_out_to_the_ranks_by_batch() -> None:
    ranks = launch(_stream_batches, nprocs=2)
    for case, (n, _, workers, by_worker) in enumerate(_STREAMS):
        single = ranks[0][case]["single"]  # the script's own loader, in one process
        shares = [rank[case]["mine"] for rank in ranks]
        assert all(shares), case  # every rank gets batches
        # Together the ranks get exactly the script's batches, whole, each on one rank.
        assert sorted(shares[0] + shares[1]) == sorted(single), case
        if by_worker or workers == 0:
            samples = [i for share in shares for batch in share for i in batch]
            assert sorted(samples) == list(range(n)), case  # disjoint and complete
        if workers == 0:  # rank r takes the stream's batches r, r + 2, ...
            assert shares == [single[0::2], single[1::2]], case
    # A stream with a length: each rank's own number of batches (3 + 3 + 3 + 2 samples).
    assert [rank[-1] for rank in ranks] == [{"len": 2, "batches": 2}, {"len": 2, "batches": 2}]


def _pinning_on_cpu(ctx: DistContext, how: str) -> tuple[bool, list[str]]:
    """The loader's pin_memory, and the warnings that building it and reading an epoch
    raised, on this CPU rank (pinning asked for by a one-GPU script's DataLoader, or by
    prepare_loader's own argument)."""
    import warnings

    data = TensorDataset(torch.randn(16, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "loader":
            loader = prepare_loader(DataLoader(data, batch_size=4, pin_memory=True), ctx)
        else:
            loader = prepare_loader(data, ctx, batch_size=4, pin_memory=True)
        for _ in loader:
            pass
    return loader.pin_memory, [str(w.message) for w in caught]


@pytest.mark.parametrize("how", ["loader", "argument"])
def test_cpu_ranks_do_not_pin_and_do_not_warn(how: str) -> None:
    pinned, warned = launch(_pinning_on_cpu, how, nprocs=2, backend="gloo")
    assert not [w for w in warned if "pin_memory" in w], warned
    assert pinned is False


# -- a one-GPU script's RandomSampler(num_samples, replacement) and its other options --------
_DRAWN = [(True, 40), (False, 24), (False, 6), (True, None)]  # (replacement, num_samples)


def _drawn_epochs(ctx: DistContext) -> list[Any]:
    """Each rank's indices over 2 epochs of a 10-sample set, for each of _DRAWN."""
    out = []
    for replacement, num_samples in _DRAWN:
        data = _indices(10)
        script = DataLoader(
            data, batch_size=3,
            sampler=RandomSampler(data, replacement=replacement, num_samples=num_samples),
        )  # fmt: skip
        loader = prepare_loader(script, ctx, seed=5)
        epochs = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            epochs.append([int(i) for (batch,) in loader for i in batch])
        out.append({"epochs": epochs, "len": len(loader)})
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, out)
    return everyone


def test_a_random_sampler_keeps_its_draws_and_replacement_sharded() -> None:
    ranks = launch(_drawn_epochs, nprocs=2)
    for case, (replacement, num_samples) in enumerate(_DRAWN):
        draws = 10 if num_samples is None else num_samples
        (r0, r1) = (rank[case]["epochs"] for rank in ranks)
        assert [rank[case]["len"] for rank in ranks] == [-(-draws // 2 // 3)] * 2, case
        for epoch in range(2):
            both = r0[epoch] + r1[epoch]
            assert len(r0[epoch]) == len(r1[epoch]) == draws // 2, (case, epoch)  # shares
            counts = sorted(both.count(i) for i in range(10))
            if replacement:  # one sequence of draws, seeded by the epoch, shared out
                g = torch.Generator().manual_seed(5 + epoch)
                order = torch.randint(10, (draws,), generator=g).tolist()
                assert (r0[epoch], r1[epoch]) == (order[0::2], order[1::2]), (case, epoch)
                if draws > 10:
                    assert counts[-1] > 1, case  # repeats: drawn with replacement
            else:  # as RandomSampler: whole permutations, then part of one
                full, part = divmod(draws, 10)
                assert counts == [full] * (10 - part) + [full + 1] * part, (case, epoch)
        assert r0[0] != r0[1], case  # drawn anew each epoch


def test_a_dataloaders_other_options_are_kept() -> None:
    script = DataLoader(
        _indices(12), batch_size=4, num_workers=1, multiprocessing_context="fork",
        timeout=30.0, in_order=False, pin_memory=True, pin_memory_device="cuda",
    )  # fmt: skip
    loader = prepare_loader(script, DistContext.single("cpu"))
    assert loader.timeout == 30.0
    assert loader.multiprocessing_context.get_start_method() == "fork"
    assert loader.in_order is False
    assert sorted(int(i) for (batch,) in loader for i in batch) == list(range(12))
    assert (loader.pin_memory, loader.pin_memory_device) == (False, "")  # a CPU rank: no pinning
    on_gpu = prepare_loader(script, DistContext.single("cuda"))  # built, not read
    assert (on_gpu.pin_memory, on_gpu.pin_memory_device) == (True, "cuda")
    plain = prepare_loader(DataLoader(_indices(4), batch_size=2), DistContext.single("cpu"))
    assert (plain.timeout, plain.multiprocessing_context, plain.in_order) == (0, None, True)
