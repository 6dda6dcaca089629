"""Jobs for `ddpkit verify`'s tests: the DDP tutorial's regression, made wrong in one way each
(and, as near misses, made right in the same place)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, SequentialSampler, TensorDataset

import ddpkit
from ddpkit.examples.linear import dataset


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


def _random_data() -> TensorDataset:
    # Drawn from torch's global RNG: the same on every rank only if all are seeded alike.
    return TensorDataset(torch.rand(256, 20), torch.rand(256, 1))


def rank_seeded_dropout(ctx: ddpkit.DistContext) -> ddpkit.Job:
    """Reseeds every rank with its rank before making its random dataset (the DDP
    tutorial's defect): each rank trains on data of its own."""
    model = _dropout_model()
    torch.manual_seed(1000 + ctx.rank)
    job = _job(ctx, model)
    job.train_set = _random_data()
    return job


def dropout(ctx: ddpkit.DistContext) -> ddpkit.Job:
    """The near miss: the same model and random dataset, every rank seeded alike (by
    ddpkit)."""
    job = _job(ctx, _dropout_model())
    job.train_set = _random_data()
    return job


class _Noisy(Dataset[Any]):
    """64 of the regression's samples, each fetched with fresh noise on its inputs (a
    random augmentation); `unseeded` draws the noise from a generator seeded by the OS."""

    def __init__(self, unseeded: bool = False) -> None:
        self.data, self.unseeded = dataset(64), unseeded

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[index]
        generator = None
        if self.unseeded:
            generator = torch.Generator()
            generator.seed()
        return x + 0.1 * torch.randn(x.shape, generator=generator), y


def noisy_dropout(ctx: ddpkit.DistContext) -> ddpkit.Job:
    """Dropout in the model and random noise added to every sample, drawn from each
    rank's own stream (2 steps an epoch at batch 16 on 2 ranks)."""
    job = _job(ctx, _dropout_model())
    job.train_set = _Noisy()
    return job


def unseeded_noise(ctx: ddpkit.DistContext) -> ddpkit.Job:
    """Every sample's noise comes from a generator that nothing seeds."""
    job = _job(ctx, nn.Linear(20, 1))
    job.train_set = _Noisy(unseeded=True)
    return job


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
    assert isinstance(job.optimizer, torch.optim.Optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(job.optimizer, step_size=2, gamma=0.5)
    job.callbacks = [_StepScheduler(scheduler)]
    return job


def one_logit(ctx: ddpkit.DistContext) -> ddpkit.Job:
    """The DDP tutorial's loss: cross entropy over the model's one logit, which is 0
    whatever the model does, so SGD never moves a parameter."""
    job = _job(ctx, nn.Sequential(nn.Linear(20, 8), nn.Tanh(), nn.Linear(8, 1)))
    job.loss_fn = nn.functional.cross_entropy  # targets (batch, 1): probabilities of one class
    return job
