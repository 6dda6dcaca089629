"""Job: what a training job is made of, as returned by a `build(ctx)` function (or
`build(ctx, config)`, which also sees the run's `TrainConfig`: epochs, batch size, ...).

The built-in examples are jobs; so is a user's own job (`ddpkit train --job mod:build`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
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
    """The parts of a training job: the arguments of `Trainer` but `ctx`, `config` and
    `log_fn`, which the run supplies when it builds the Trainer. `Trainer` describes
    each; build the optimizer on the bare model's parameters, as for a Trainer."""

    # The same names, order and defaults as Trainer's parameters (a test holds them so).
    model: nn.Module
    optimizer: torch.optim.Optimizer | OptimizerFactory
    train_set: Dataset[Any]
    loss_fn: LossFn = nn.functional.cross_entropy
    eval_set: Dataset[Any] | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | SchedulerFactory | None = None
    train_sampler: Sampler[Any] | None = None
    callbacks: list[Callback] = field(default_factory=list)
    collate_fn: Callable[[list[Any]], Any] | None = None
    training_step: StepFn | None = None
    metrics_fn: MetricsFn | None = None

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
        parts = {f.name: getattr(self, f.name) for f in fields(self)}
        parts["callbacks"] = [*self.callbacks, *callbacks]
        if train_sampler is not None:
            parts["train_sampler"] = train_sampler
        if not evaluate:
            parts["eval_set"] = None
        return Trainer(ctx=ctx, config=config, log_fn=log_fn, **parts)


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
