"""Trainer for real jobs, on 2 real gloo ranks: accumulation, mixed precision, clipping,
schedulers, uneven shards, early stopping, compile, run logs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset, Sampler, TensorDataset

from ddpkit import DistContext, launch
from ddpkit.callbacks import Callback
from ddpkit.checkpoint import latest_checkpoint
from ddpkit.config import TrainConfig
from ddpkit.digest import model_digest, state_digest
from ddpkit.seed import seed_everything
from ddpkit.trainer import Trainer


def _data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


class _Record(Callback):
    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
        self.epochs.append(dict(metrics))


def _fit(ctx: DistContext, config: TrainConfig, opts: dict[str, Any]) -> dict[str, Any]:
    seed_everything(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=opts.get("lr", 0.05), momentum=0.9)
    sched = None
    if opts.get("scheduler"):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    record = _Record()
    trainer = Trainer(
        model,
        opt,
        _data(opts.get("n", 96)),
        ctx,
        config,
        loss_fn=nn.functional.mse_loss,
        scheduler=sched,
        callbacks=[record],
        train_sampler=opts.get("sampler"),
        log_fn=lambda s: None,
    )
    fit = trainer.fit()
    # Every rank's view, so that tests compare all ranks, not rank 0 alone.
    mine = (model_digest(trainer.model), state_digest(opt.state_dict()), fit.global_step)
    ranks: list[Any] = [mine]
    if ctx.distributed:
        ranks = [None] * ctx.world_size
        dist.all_gather_object(ranks, (*mine, fit.epochs, fit.stopped_early))
    return {
        "ranks": ranks,
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "digest": model_digest(trainer.model),
        "step": fit.global_step,
        "epochs": fit.epochs,
        "lr": opt.param_groups[0]["lr"],
        "metrics": record.epochs,
        "scaler": trainer.scaler.state_dict() if trainer.scaler else None,
        "stopped_early": fit.stopped_early,
    }


def test_k_micro_batches_equal_one_batch_of_k_times_b() -> None:
    micro = launch(_fit, TrainConfig(epochs=2, batch_size=4, accumulate=3), {}, nprocs=2)
    whole = launch(_fit, TrainConfig(epochs=2, batch_size=12), {}, nprocs=2)
    assert micro["step"] == whole["step"] == 2 * 4  # 96 / (12 x 2 ranks) per epoch
    for a, b in zip(micro["params"], whole["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_resumes_exactly_with_its_scaler(
    tmp_path: Path, precision: Literal["fp16", "bf16"]
) -> None:
    def cfg(epochs: int, folder: str) -> TrainConfig:
        return TrainConfig(
            epochs=epochs,
            batch_size=8,
            precision=precision,
            resume=True,
            checkpoint_dir=str(tmp_path / folder),
            clip_grad_norm=1.0,
        )

    straight = launch(_fit, cfg(4, "a"), {"scheduler": True}, nprocs=2)
    launch(_fit, cfg(2, "b"), {"scheduler": True}, nprocs=2)
    resumed = launch(_fit, cfg(4, "b"), {"scheduler": True}, nprocs=2)
    assert resumed["digest"] == straight["digest"]
    assert resumed["lr"] == straight["lr"] == 0.05 * 0.5**2  # the scheduler came back
    found = latest_checkpoint(tmp_path / "b", DistContext())
    assert found is not None
    if precision == "fp16":
        assert found[1]["scaler"] is not None and resumed["scaler"] == straight["scaler"]
    else:
        assert found[1]["scaler"] is None


def test_a_per_step_scheduler_survives_resume(tmp_path: Path) -> None:
    def cfg(epochs: int) -> TrainConfig:
        return TrainConfig(
            epochs=epochs,
            batch_size=8,
            scheduler_interval="step",
            checkpoint_dir=str(tmp_path),
            resume=True,
        )

    launch(_fit, cfg(1), {"scheduler": True}, nprocs=2)
    resumed = launch(_fit, cfg(2), {"scheduler": True}, nprocs=2)
    assert resumed["step"] == 12 and resumed["lr"] == 0.05 * 0.5**6  # stepped per step


class _Unequal(Sampler[int]):
    """Rank 0 gets 10 samples, rank 1 gets 25: unequal numbers of batches."""

    def __init__(self, rank: int) -> None:
        self.indices = list(range(10)) if rank == 0 else list(range(10, 35))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _fit_unequal(ctx: DistContext) -> dict[str, Any]:
    return _fit(ctx, TrainConfig(epochs=2, batch_size=4), {"sampler": _Unequal(ctx.rank)})


def test_uneven_shards_finish_without_hanging_or_dropping_work() -> None:
    out = launch(_fit_unequal, nprocs=2, hang_timeout=60)
    # every sample of both shards was trained on, in every epoch
    assert [m["samples"] for m in out["metrics"]] == [35, 35]
    assert out["epochs"] == 2
    # and both ranks end with the same model, optimizer state and step count
    assert out["ranks"][0] == out["ranks"][1]


def test_early_stopping_stops_every_rank_together() -> None:
    config = TrainConfig(
        epochs=10, batch_size=8, early_stopping_patience=2, early_stopping_metric="loss"
    )
    out = launch(_fit, config, {"lr": 0.0}, nprocs=2)  # lr 0: the loss never improves
    # every rank, not rank 0 alone: (digests, step, epochs, stopped early)
    assert [r[3:] for r in out["ranks"]] == [(3, True), (3, True)]
    assert out["ranks"][0] == out["ranks"][1]


def test_run_dir_gets_config_and_step_and_epoch_metrics(tmp_path: Path) -> None:
    config = TrainConfig(
        epochs=2, batch_size=4, run_dir=str(tmp_path), log_every=5, clip_grad_norm=5.0
    )
    launch(_fit, config, {}, nprocs=2)
    assert json.loads((tmp_path / "config.json").read_text())["log_every"] == 5
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x["kind"] == "step"]
    epochs = [x for x in lines if x["kind"] == "epoch"]
    assert [x["step"] for x in steps] == [5, 10, 15, 20]  # 12 steps per epoch, 24 in all
    assert all(x["grad_norm"] > 0 and x["loss"] > 0 and x["lr"] == 0.05 for x in steps)
    assert [x["epoch"] for x in epochs] == [1, 2] and all(x["samples"] == 96 for x in epochs)
    assert not (tmp_path / "tb").exists()  # TensorBoard only when loggers names it


@pytest.mark.slow
def test_compile_wraps_after_ddp_and_checkpoints_have_plain_keys(tmp_path: Path) -> None:
    config = TrainConfig(epochs=1, batch_size=16, compile=True, checkpoint_dir=str(tmp_path))
    out = launch(_fit, config, {}, nprocs=2)
    assert out["step"] == 3
    found = latest_checkpoint(tmp_path, DistContext())
    assert found is not None
    assert sorted(found[1]["model"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]


class _Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """A stream that shards itself: rank 0 yields 10 samples, rank 1 yields 22."""

    def __init__(self, rank: int) -> None:
        self.data = _data(32)
        self.indices = range(10) if rank == 0 else range(10, 32)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.data[i] for i in self.indices)


def _fit_stream(ctx: DistContext) -> list[dict[str, float]]:
    seed_everything(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    record = _Record()
    config = TrainConfig(epochs=2, batch_size=4, accumulate=2)
    Trainer(
        model,
        opt,
        _Stream(ctx.rank),
        ctx,
        config,
        loss_fn=nn.functional.mse_loss,
        callbacks=[record],
        log_fn=lambda s: None,
    ).fit()
    return record.epochs


def test_an_iterable_dataset_of_unequal_shards_trains_everything() -> None:
    epochs = launch(_fit_stream, nprocs=2, hang_timeout=60)
    assert [m["samples"] for m in epochs] == [32, 32]
