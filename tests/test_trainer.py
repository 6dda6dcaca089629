"""Trainer and prepare_model on 2 real gloo ranks."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from ddpkit import DistContext, launch
from ddpkit.checkpoint.digest import model_digest
from ddpkit.errors import ConfigError
from ddpkit.parallel.model import unwrap
from ddpkit.parallel.strategy import prepare_model
from ddpkit.parallel.syncbn import SyncBatchNorm
from ddpkit.seed import seed_everything
from ddpkit.training.config import TrainConfig
from ddpkit.training.job import Job
from ddpkit.training.trainer import Trainer


def _bn_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    )


def _layer_types(ctx: DistContext, sync: bool) -> list[str]:
    model = prepare_model(_bn_net(), ctx, sync_batchnorm=sync)
    assert isinstance(model, DDP)
    return [type(m).__name__ for m in unwrap(model).modules()]


def test_prepare_model_synchronizes_batchnorm_unless_told_not_to() -> None:
    assert SyncBatchNorm.__name__ in launch(_layer_types, True, nprocs=2)
    kinds = launch(_layer_types, False, nprocs=2)
    assert "BatchNorm2d" in kinds and SyncBatchNorm.__name__ not in kinds


def test_a_job_holds_exactly_the_trainers_parts() -> None:
    """Job is a Trainer not yet built: its fields are Trainer's parameters (the run
    supplies ctx, config and log_fn), in the same order, with the same defaults."""
    params = [
        p
        for name, p in inspect.signature(Trainer).parameters.items()
        if name not in ("ctx", "config", "log_fn")
    ]
    fields = dataclasses.fields(Job)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields, strict=True):
        if f.default_factory is not dataclasses.MISSING:  # callbacks: () there, [] here
            assert list(p.default) == f.default_factory(), p.name
        elif f.default is dataclasses.MISSING:
            assert p.default is inspect.Parameter.empty, p.name
        else:
            assert p.default is f.default, p.name


def test_one_process_is_not_wrapped() -> None:
    net = _bn_net()
    assert prepare_model(net, DistContext()) is net


def test_config_errors_name_the_field_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"batch_size must be >= 1 \(got 0\): pass --batch-size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ConfigError, match="epochs must be >= 1"):
        TrainConfig(epochs=-1)
    with pytest.raises(ConfigError, match="save_every must be >= 0"):
        TrainConfig(save_every=-2)
    with pytest.raises(ConfigError, match="--checkpoint-dir"):
        TrainConfig(resume=True)
    with pytest.raises(ConfigError, match="keep_last"):
        TrainConfig(keep_last=0)


def _classification_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    return TensorDataset(x, (x.mean(dim=(1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long())


def _dropout_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )


def _train(ctx: DistContext, config: TrainConfig) -> dict[str, Any]:
    seed_everything(config.seed)
    model = _dropout_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    trainer = Trainer(
        model,
        opt,
        _classification_data(90, 1),
        ctx,
        config,
        eval_set=_classification_data(7, 2),
        scheduler=sched,
        log_fn=lambda s: None,
    )
    fit = trainer.fit()
    return {
        "digest": model_digest(trainer.model),
        "step": fit.global_step,
        "eval": fit.eval,
        "epochs": fit.epochs,
        "lr": opt.param_groups[0]["lr"],
    }


def test_resume_is_bit_exact_and_eval_counts_each_sample_once(tmp_path: Path) -> None:
    straight = launch(
        _train, TrainConfig(epochs=4, batch_size=8, checkpoint_dir=str(tmp_path / "a")), nprocs=2
    )
    half = TrainConfig(epochs=2, batch_size=8, checkpoint_dir=str(tmp_path / "b"))
    first = launch(_train, half, nprocs=2)
    resumed = launch(
        _train,
        TrainConfig(epochs=4, batch_size=8, resume=True, checkpoint_dir=str(tmp_path / "b")),
        nprocs=2,
    )
    assert first["digest"] != straight["digest"]
    assert resumed["digest"] == straight["digest"]  # parameters, buffers: bit for bit
    assert resumed["step"] == straight["step"] == 4 * 6  # 90 samples / (8 x 2 ranks) -> 6 steps
    assert resumed["lr"] == straight["lr"]  # the scheduler was restored too
    # 7 eval samples over 2 ranks: counted once each, no padding
    assert straight["eval"]["eval_samples"] == 7
    assert resumed["eval"] == straight["eval"]
