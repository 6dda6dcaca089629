"""Handwritten digits (the 1,797 8x8 images scikit-learn ships; no download) with a
small CNN that has BatchNorm, so the SyncBatchNorm path is exercised."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.training.job import Job

DEFAULTS = {"epochs": 10, "batch_size": 32}
TEST_FRACTION = 0.2


def datasets(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """A fixed train/test split (the same on every rank and every run)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError(
            "the digits example needs scikit-learn: pip install 'ddpkit[examples]'"
        ) from None
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def model() -> nn.Module:
    # No bias before BatchNorm: BatchNorm subtracts it again, so its gradient is zero
    # but for rounding noise, which Adam divides by that noise's own size and turns
    # into updates of about lr * 1e-9 that differ with the summation order (enough to
    # fail `ddpkit verify`'s float64 tolerance while every real parameter agrees).
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


def build(ctx: DistContext) -> Job:
    net = model()
    train, test = datasets()
    return Job(
        model=net,
        # A factory: built on the parameters of the prepared model, so that the job
        # also runs sharded (--strategy fsdp).
        optimizer=lambda params: torch.optim.Adam(params, lr=3e-3),
        train_set=train,
        eval_set=test,
        loss_fn=nn.functional.cross_entropy,
    )
