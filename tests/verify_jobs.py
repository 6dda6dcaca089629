"""Jobs for `ddpkit verify`'s tests: the DDP tutorial's regression, made wrong in one way each
(and, as near misses, made right in the same place)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import SequentialSampler

import ddpkit
from ddpkit.examples.seed import dataset


def _job(ctx: ddpkit.DistContext, model: nn.Module, lr: float = 1e-2) -> ddpkit.Job:
    return ddpkit.Job(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        train_set=dataset(256),
        loss_fn=nn.functional.mse_loss,
    )


def batchnorm(ctx: ddpkit.DistContext) -> ddpkit.Job:
    """Fine as it is; wrong when verified with sync_batchnorm=False."""
    return _job(
        ctx, nn.Sequential(nn.Linear(20, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    )


def _summed_mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, targets, reduction="sum")


def summed_loss(ctx: ddpkit.DistContext) -> ddpkit.Job:
    """The loss is summed over the batch instead of averaged."""
    job = _job(ctx, nn.Linear(20, 1), lr=1e-3)
    job.loss_fn = _summed_mse
    return job


def _dropout_model() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))


def rank_seeded_dropout(ctx: ddpkit.DistContext) -> ddpkit.Job:
    """Reseeds every rank with its rank: each rank's dropout masks depend on it."""
    model = _dropout_model()
    torch.manual_seed(1000 + ctx.rank)
    return _job(ctx, model)


def dropout(ctx: ddpkit.DistContext) -> ddpkit.Job:
    """The near miss: the same model, every rank seeded alike (by ddpkit)."""
    return _job(ctx, _dropout_model())


def unsharded(ctx: ddpkit.DistContext) -> ddpkit.Job:
    """Every rank reads the whole dataset."""
    data = dataset(256)
    job = _job(ctx, nn.Linear(20, 1))
    job.train_set, job.train_sampler = data, SequentialSampler(data)
    return job


class _StepScheduler(ddpkit.Callback):
    """Steps an LR scheduler that ddpkit does not know about, so it is not checkpointed."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def on_step_end(self, trainer: ddpkit.Trainer, step: int) -> None:
        self.scheduler.step()


def hidden_scheduler(ctx: ddpkit.DistContext) -> ddpkit.Job:
    job = _job(ctx, nn.Linear(20, 1))
    scheduler = torch.optim.lr_scheduler.StepLR(job.optimizer, step_size=2, gamma=0.5)
    job.callbacks = [_StepScheduler(scheduler)]
    return job
