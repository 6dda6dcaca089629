"""Job: what a training job is made of, as returned by a `build(ctx)` function.

The built-in examples are jobs; so is a user's own job (`ddpkit train --job mod:build`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset, Sampler

from ddpkit.callbacks import Callback
from ddpkit.config import TrainConfig
from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.seed import seed_everything
from ddpkit.trainer import LossFn, Trainer

EXAMPLES = ("digits", "seed")


@dataclass
class Job:
    """The parts of a training job. Build the optimizer on the bare model's parameters."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    train_set: Dataset[Any]
    loss_fn: LossFn
    eval_set: Dataset[Any] | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    # A sampler that shards by itself (ranks may get unequal numbers of batches).
    train_sampler: Sampler[Any] | None = None
    callbacks: list[Callback] = field(default_factory=list)

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
            eval_set=self.eval_set if evaluate else None,
            scheduler=self.scheduler,
            train_sampler=train_sampler if train_sampler is not None else self.train_sampler,
            callbacks=[*self.callbacks, *callbacks],
            log_fn=log_fn,
        )


BuildFn = Callable[[DistContext], Job]
JobRef = BuildFn | str  # a build function, a built-in example's name, or MODULE:FUNCTION


def resolve_build(job: JobRef) -> BuildFn:
    if callable(job):
        return job
    if job in EXAMPLES:
        return cast(BuildFn, example_module(job).build)
    from ddpkit.jobspec import load_job  # imports user code: only when asked

    return load_job(job)[0]


def build_job(ctx: DistContext, job: JobRef, seed: int) -> Job:
    """Seed every rank alike (so parameters and random ops start equal), then build."""
    seed_everything(seed)
    built = resolve_build(job)(ctx)
    if not isinstance(built, Job):
        raise ConfigError(f"the job's build function returned {type(built).__name__}, not a Job")
    return built


def example_module(name: str) -> ModuleType:
    """The module of a built-in example; it has `build(ctx) -> Job` and `DEFAULTS`."""
    if name not in EXAMPLES:
        raise ConfigError(f"unknown example {name!r}: choose one of {', '.join(EXAMPLES)}")
    return importlib.import_module(f"ddpkit.examples.{name}")
