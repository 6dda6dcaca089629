"""Job: what a training job is made of, as returned by a `build(ctx)` function.

The built-in examples are jobs; so is a user's own job (`ddpkit train --job mod:build`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, Sampler

from ddpkit.callbacks import Callback
from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.trainer import LossFn

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


BuildFn = Callable[[DistContext], Job]


def example_module(name: str) -> ModuleType:
    """The module of a built-in example; it has `build(ctx) -> Job` and `DEFAULTS`."""
    if name not in EXAMPLES:
        raise ConfigError(f"unknown example {name!r}: choose one of {', '.join(EXAMPLES)}")
    return importlib.import_module(f"ddpkit.examples.{name}")
