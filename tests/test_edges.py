"""Jobs at the edges, unlike the built-in examples: dropout, random noise drawn in
`__getitem__`, worker processes, IterableDatasets that shard themselves unevenly,
AdamW with a per-step scheduler, accumulation, mid-epoch resume and early stopping.

After each fit, every rank's model, optimizer and scheduler state is gathered and
compared, not rank 0's alone; where one process can say what the ranks should have
computed, a plain loop in float64 is the reference."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddpkit import Callback, DistContext, TrainConfig, Trainer, launch
from ddpkit.checkpoint.digest import model_digest, state_digest
from ddpkit.errors import ConfigError
from ddpkit.parallel.data import prepare_loader
from ddpkit.parallel.model import unwrap
from ddpkit.seed import seed_everything


def _all_ranks(ctx: DistContext, value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (a collective: every rank calls it)."""
    if not ctx.distributed:
        return [value]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


def _state(trainer: Trainer) -> dict[str, Any]:
    return {
        "model": model_digest(trainer.model),
        "optimizer": state_digest(trainer.optimizer.state_dict()),
        "scheduler": state_digest(trainer.scheduler.state_dict()) if trainer.scheduler else None,
        "step": trainer.global_step,
    }


def _regression(n: int, seed: int = 3, dtype: torch.dtype = torch.float32) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=dtype)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))


# -- 1. every rank its own reproducible stream ------------------------------------------
class _Draws(Callback):
    def __init__(self) -> None:
        self.draws: list[list[float]] = []

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        self.draws.append(torch.rand(3).tolist())


def _rank_streams(ctx: DistContext) -> list[Any]:
    seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    draws = _Draws()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        _regression(64),
        ctx,
        TrainConfig(epochs=2, batch_size=8),
        loss_fn=nn.functional.mse_loss,
        callbacks=[draws],
        log_fn=lambda s: None,
    )
    trainer.fit()
    return _all_ranks(ctx, {"draws": draws.draws, **_state(trainer)})


def test_each_rank_draws_its_own_reproducible_stream() -> None:
    ranks = launch(_rank_streams, nprocs=2)
    assert ranks[0]["draws"] != ranks[1]["draws"]  # dropout masks differ between ranks
    assert ranks[0]["model"] == ranks[1]["model"]  # and the ranks still agree
    assert launch(_rank_streams, nprocs=2) == ranks  # reproducibly


# -- 2. uneven shards, accumulation, AdamW with a per-step scheduler --------------------
_SHARDS = {0: range(0, 10), 1: range(10, 33)}  # 10 and 23 samples


class _UnevenStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Shards itself by rank, unevenly, as the README asks of an IterableDataset."""

    def __init__(self, rank: int) -> None:
        self.data, self.indices = _regression(33, dtype=torch.float64), _SHARDS[rank]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.data[i] for i in self.indices)


def _adamw(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _model64() -> nn.Module:
    seed_everything(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def _fit_adamw(ctx: DistContext, data: Any, epochs: int, accumulate: int) -> list[Any]:
    """AdamW with a per-step scheduler on a float64 MLP; every rank's end state."""
    model = _model64()
    opt, sched = _adamw(model)
    trainer = Trainer(
        model,
        opt,
        data,
        ctx,
        TrainConfig(epochs=epochs, batch_size=4, accumulate=accumulate, scheduler_interval="step"),
        loss_fn=nn.functional.mse_loss,
        scheduler=sched,
        log_fn=lambda s: None,
    )
    fit = trainer.fit()
    params = [p.detach().clone() for p in unwrap(trainer.model).parameters()]
    return _all_ranks(ctx, {**_state(trainer), "params": params, "steps": fit.global_step})


def _fit_uneven(ctx: DistContext, accumulate: int) -> list[Any]:
    return _fit_adamw(ctx, _UnevenStream(ctx.rank), 2, accumulate)


def _batches(indices: list[int], batch: int) -> list[list[int]]:
    return [indices[i : i + batch] for i in range(0, len(indices), batch)]


def _reference(
    data: TensorDataset, epochs: list[list[list[list[int]]]], k: int, model: nn.Module
) -> tuple[list[torch.Tensor], int]:
    """One process, float64: step g of an epoch takes micro-batches g*k..g*k+k-1 of every
    rank and descends the mean loss over all their samples."""
    opt, sched = _adamw(model)
    steps = 0
    for ranks in epochs:
        for g in range(max(-(-len(r) // k) for r in ranks)):
            index = [i for r in ranks for b in r[g * k : g * k + k] for i in b]
            x, y = data[index]
            nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()
            sched.step()
            steps += 1
    return [p.detach() for p in model.parameters()], steps


def test_uneven_iterable_shards_with_accumulation_keep_every_rank_identical() -> None:
    ranks = launch(_fit_uneven, 3, nprocs=2, hang_timeout=60)
    # Rank 0 has 3 batches, rank 1 has 6: two optimizer steps per epoch on both ranks.
    assert [r["steps"] for r in ranks] == [4, 4]
    for key in ("model", "optimizer", "scheduler", "step"):
        assert ranks[0][key] == ranks[1][key], key
    shards = [_batches(list(_SHARDS[r]), 4) for r in (0, 1)]
    expected, steps = _reference(_regression(33, dtype=torch.float64), [shards] * 2, 3, _model64())
    assert steps == 4
    for got, want in zip(ranks[0]["params"], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_an_iterable_of_unknown_length_averages_its_short_last_group() -> None:
    # One process, 23 samples in batches of 4 (6 batches), accumulate 4: groups of 4 and 2.
    ranks = launch(_fit_one_stream, nprocs=1)
    expected, steps = _reference(
        _regression(33, dtype=torch.float64), [[_batches(list(_SHARDS[1]), 4)]] * 2, 4, _model64()
    )
    assert ranks[0]["steps"] == steps == 4
    for got, want in zip(ranks[0]["params"], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _fit_one_stream(ctx: DistContext) -> list[Any]:
    # rank 0 of a one-process job reads rank 1's shard of 23 samples
    return _fit_adamw(ctx, _UnevenStream(1), 2, 4)


def _fit_even(ctx: DistContext) -> list[Any]:
    return _fit_adamw(ctx, _regression(96, dtype=torch.float64), 1, 5)


def test_a_short_last_group_is_averaged_over_its_own_size() -> None:
    # 48 samples per rank in micro-batches of 4: 12 micro-batches, groups of 5, 5 and 2.
    ranks = launch(_fit_even, nprocs=2)
    assert ranks[0]["model"] == ranks[1]["model"] and ranks[0]["steps"] == 3
    data = _regression(96, dtype=torch.float64)
    shards = []
    for rank in (0, 1):
        sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=2, rank=rank)
        sampler.set_epoch(0)
        shards.append(_batches(list(sampler), 4))
    expected, _ = _reference(data, [shards], 5, _model64())
    for got, want in zip(ranks[0]["params"], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# -- 4. mid-epoch resume: random noise in __getitem__, dropout, 0 and 2 workers ---------
class _Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Adds fresh noise to every sample it returns, as an augmentation does."""

    fetched = 0  # samples fetched in this process (with 0 workers: the rank's own)

    def __init__(self) -> None:
        self.data = _regression(64)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        type(self).fetched += 1
        x, y = self.data[i]
        return x + 0.1 * torch.randn(8), y


class _Stop(Exception):
    pass


class _SaveAndStop(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if step == self.step:
            trainer.save()
            raise _Stop


def _noisy_fit(ctx: DistContext, folder: str, workers: int, stop_at: int | None) -> list[Any]:
    seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = TrainConfig(
        epochs=2, batch_size=4, num_workers=workers, checkpoint_dir=folder, resume=True
    )
    _Noisy.fetched = 0
    trainer = Trainer(
        model,
        opt,
        _Noisy(),
        ctx,
        config,
        loss_fn=nn.functional.mse_loss,
        callbacks=[] if stop_at is None else [_SaveAndStop(stop_at)],
        log_fn=lambda s: None,
    )
    with contextlib.suppress(_Stop):
        trainer.fit()
    return _all_ranks(ctx, {**_state(trainer), "fetched": _Noisy.fetched})


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_mid_epoch_resume_is_exact_with_random_getitem(tmp_path: Path, workers: int) -> None:
    straight = launch(_noisy_fit, str(tmp_path / "a"), workers, None, nprocs=2)
    # 32 samples per rank: 8 batches per epoch; stop after step 5 of epoch 1.
    launch(_noisy_fit, str(tmp_path / "b"), workers, 5, nprocs=2)
    resumed = launch(_noisy_fit, str(tmp_path / "b"), workers, None, nprocs=2)
    assert straight[0]["model"] == straight[1]["model"]
    for key in ("model", "optimizer", "step"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key
    if workers == 0:  # the 5 trained batches were skipped, not loaded again
        assert [r["fetched"] for r in resumed] == [(8 - 5) * 4 + 8 * 4] * 2


def test_workers_seed_every_sample_the_same_wherever_the_epoch_starts() -> None:
    loader = prepare_loader(_Noisy(), DistContext(), 4, num_workers=2)
    loader.set_epoch(1)
    whole = [x for x, _ in loader]
    assert not torch.equal(whole[0], whole[1])
    loader.set_epoch(1)
    assert loader.skip(3)
    rest = [x for x, _ in loader]
    assert len(whole) == 16 and len(rest) == 13
    assert all(torch.equal(a, b) for a, b in zip(rest, whole[3:], strict=True))


# -- 5. early stopping survives resume; every rank stops together ------------------------
class _StopAfter(Callback):
    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
        if epoch + 1 >= self.epochs:
            trainer.should_stop = True


def _stopping_fit(ctx: DistContext, folder: str) -> list[Any]:
    seed_everything(0)
    model = nn.Linear(8, 1)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        _regression(32),
        ctx,
        TrainConfig(epochs=5, batch_size=8, checkpoint_dir=folder, resume=True),
        loss_fn=nn.functional.mse_loss,
        callbacks=[_StopAfter(2)],
        log_fn=lambda s: None,
    )
    fit = trainer.fit()
    return _all_ranks(ctx, {"epochs": fit.epochs, "stopped": fit.stopped_early, **_state(trainer)})


def test_a_run_that_stopped_early_stays_stopped_after_resume(tmp_path: Path) -> None:
    first = launch(_stopping_fit, str(tmp_path), nprocs=2)
    assert [(r["epochs"], r["stopped"]) for r in first] == [(2, True)] * 2
    again = launch(_stopping_fit, str(tmp_path), nprocs=2)
    assert [(r["epochs"], r["step"], r["model"]) for r in again] == [
        (r["epochs"], r["step"], r["model"]) for r in first
    ]


# -- an IterableDataset as eval set -----------------------------------------------------
def _iterable_eval(ctx: DistContext) -> str:
    try:
        prepare_loader(_UnevenStream(ctx.rank), ctx, 4, evaluation=True)
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def test_an_iterable_eval_set_is_refused_with_several_ranks() -> None:
    message = launch(_iterable_eval, nprocs=2)
    assert "IterableDataset cannot be an eval set" in message and "map-style" in message
    assert launch(_iterable_eval, nprocs=1) == "accepted"


# -- D06: rank_zero_first may take longer than the collective timeout ------------------
def _prepare_longer_than_the_timeout(ctx: DistContext, folder: str) -> list[int]:
    import time

    from ddpkit import rank_zero_first
    from ddpkit.parallel.ranks import all_gather_object

    cache = Path(folder) / "tokens.pt"
    with rank_zero_first():
        if ctx.rank == 0:
            time.sleep(8)  # a download: longer than the 4 s any collective may wait
            torch.save(torch.arange(10), cache)
        tokens = torch.load(cache)  # rank 1 reads rank 0's cache
    return all_gather_object(int(tokens.sum()))  # and the group still works


@pytest.mark.slow
def test_rank_zero_first_longer_than_the_collective_timeout_finishes(tmp_path: Path) -> None:
    # The others' wait has no deadline: "never stopped" holds on gloo as on NCCL, whose
    # timeout is the hang timeout less 30 s.
    sums = launch(
        _prepare_longer_than_the_timeout, str(tmp_path), nprocs=2, timeout=4, hang_timeout=4
    )
    assert sums == [45, 45]
