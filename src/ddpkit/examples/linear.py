"""`ddpkit train --example linear`: a small linear regression, the PyTorch DDP
tutorial's job with its defects fixed.

2,048 random (20 -> 1) pairs made from a fixed seed, so every rank holds the same
dataset (the tutorial builds an unseeded one per rank); `Linear(20, 1)` trained with
MSE (the tutorial's cross-entropy on a single logit is always 0 and never learns).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit.context import DistContext
from ddpkit.training.job import Job

DEFAULTS = {"epochs": 10, "batch_size": 32}


def dataset(size: int = 2048, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(size, 20, generator=g), torch.rand(size, 1, generator=g))


def build(ctx: DistContext) -> Job:
    model = nn.Linear(20, 1)
    return Job(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
        train_set=dataset(),
        loss_fn=nn.functional.mse_loss,
    )
