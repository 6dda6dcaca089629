"""Job: what a training job is made of, as returned by a `build(ctx)` function (or
`build(ctx, config)`, which also sees the run's `TrainConfig`: epochs, batch size, ...).

The built-in examples are jobs; so is a user's own job (`ddpkit train --job mod:build`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset, Sampler

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.parallel.batches import LossFn, MetricsFn, StepFn
from ddpkit.seed import seed_everything
from ddpkit.training.config import TrainConfig
from ddpkit.training.jobspec import EXAMPLES, BuildFn, build_arity, example_module, load_job
from ddpkit.training.trainer import Callback, OptimizerFactory, SchedulerFactory, Trainer


@dataclass
class Job:
    """The parts of a training job. Build the optimizer on the bare model's parameters.

    How a batch becomes a loss (`loss_fn`, a model that returns its own loss, or
    `training_step`) is described in `Trainer`.
    """

    model: nn.Module
    # An optimizer on the bare model's parameters, or a factory `params -> optimizer`
    # (needed with strategy "fsdp", which replaces the parameters).
    optimizer: torch.optim.Optimizer | OptimizerFactory
    train_set: Dataset[Any]
    # For (inputs, targets) batches; dict batches use the model's own loss.
    loss_fn: LossFn = nn.functional.cross_entropy
    eval_set: Dataset[Any] | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | SchedulerFactory | None = None
    # A sampler that shards by itself (ranks may get unequal numbers of batches).
    train_sampler: Sampler[Any] | None = None
    callbacks: list[Callback] = field(default_factory=list)
    # How samples become a batch, for training and evaluation (DataLoader's default if None).
    collate_fn: Callable[[list[Any]], Any] | None = None
    training_step: StepFn | None = None  # training_step(model, batch) -> mean loss
    metrics_fn: MetricsFn | None = None  # metrics_fn(model, batch) -> {name: batch mean}

    def trainer(
        self,
        ctx: DistContext,
        config: TrainConfig,
        *,
        callbacks: Sequence[Callback] = (),
        train_sampler: Sampler[Any] | None = None,
        evaluate: bool = True,
        log_fn: Callable[[str], None] | None = None,
    ) -> Trainer:
        """A Trainer for this job. `callbacks` run after the job's own; `train_sampler`
        replaces the job's; `evaluate=False` leaves the eval set out."""
        return Trainer(
            self.model,
            self.optimizer,
            self.train_set,
            ctx,
            config,
            loss_fn=self.loss_fn,
            collate_fn=self.collate_fn,
            training_step=self.training_step,
            metrics_fn=self.metrics_fn,
            eval_set=self.eval_set if evaluate else None,
            scheduler=self.scheduler,
            train_sampler=train_sampler if train_sampler is not None else self.train_sampler,
            callbacks=[*self.callbacks, *callbacks],
            log_fn=log_fn,
        )


JobRef = BuildFn | str  # a build function, a built-in example's name, or MODULE:FUNCTION


def resolve_build(job: JobRef) -> BuildFn:
    if callable(job):
        return job
    if job in EXAMPLES:
        return cast(BuildFn, example_module(job).build)
    return load_job(job)[0]


def build_job(ctx: DistContext, job: JobRef, config: TrainConfig) -> Job:
    """Seed every rank alike (so parameters and random ops start equal), then build,
    passing `config` to a `build(ctx, config)`."""
    seed_everything(config.seed)
    fn = resolve_build(job)
    built = fn(ctx, config) if build_arity(fn) == 2 else fn(ctx)
    if not isinstance(built, Job):
        raise ConfigError(f"the job's build function returned {type(built).__name__}, not a Job")
    return built
