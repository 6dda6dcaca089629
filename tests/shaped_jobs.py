"""Jobs whose batches are not `(inputs, targets)`, for `ddpkit train --job`:

- `build_dict`: dict samples with random augmentation, a model with dropout that returns
  its own loss (as HuggingFace models do), AdamW with a OneCycleLR sized from the config;
- `build_step`: dataclass batches made by a `collate_fn`, a `training_step`, and a
  `metrics_fn`.

Each rank writes digests of its parameters, optimizer and scheduler state when the fit
ends (into $SHAPED_JOBS_OUT), so that a test can compare every rank.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit.checkpoint.digest import model_digest, state_digest

DEFAULTS = {"epochs": 3, "batch_size": 8, "scheduler_interval": "step", "num_workers": 2}


class DictSamples(Dataset[dict[str, torch.Tensor]]):
    """{"x": features with random noise added per fetch, "labels": class}."""

    def __init__(self, n: int = 200) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 6, generator=g)
        self.labels = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        noise = 0.05 * torch.randn(6)  # augmentation: drawn from the worker's stream
        return {"x": self.x[i] + noise, "labels": self.labels[i]}


class OwnLoss(nn.Module):
    """Returns {"loss", "logits"}, like a HuggingFace model given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Digests(ddpkit.Callback):
    """Writes this rank's digests when the fit ends."""

    def on_fit_end(self, trainer: ddpkit.Trainer, result: object) -> None:
        folder = os.environ.get("SHAPED_JOBS_OUT")
        if not folder:
            return
        states = {
            "model": model_digest(trainer.model),
            "optimizer": state_digest(trainer.optimizer.state_dict()),
            "scheduler": state_digest(trainer.scheduler.state_dict() if trainer.scheduler else {}),
            "global_step": trainer.global_step,
        }
        Path(folder, f"rank{trainer.ctx.rank}.json").write_text(json.dumps(states))


def build_dict(ctx: ddpkit.DistContext, config: ddpkit.TrainConfig) -> ddpkit.Job:
    train = DictSamples()
    model = OwnLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    # OneCycleLR raises if stepped more than total_steps: the count must be exact.
    total = config.total_steps(len(train), ctx.world_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=total)
    return ddpkit.Job(
        model=model,
        optimizer=opt,
        train_set=train,
        eval_set=DictSamples(50),
        scheduler=sched,
        callbacks=[Digests()],
    )


@dataclass
class Pair:
    features: torch.Tensor
    target: torch.Tensor


class PairSamples(Dataset[Pair]):
    def __init__(self, n: int = 120) -> None:
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Pair:
        return Pair(self.x[i], self.y[i])


def collate_pairs(items: list[Pair]) -> Pair:
    return Pair(torch.stack([p.features for p in items]), torch.stack([p.target for p in items]))


def mse_step(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch.features), batch.target)


def abs_error(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    return {"mae": (model(batch.features) - batch.target).abs().mean()}


def build_step(ctx: ddpkit.DistContext) -> ddpkit.Job:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return ddpkit.Job(
        model=model,
        optimizer=opt,
        train_set=PairSamples(),
        eval_set=PairSamples(30),
        collate_fn=collate_pairs,
        training_step=mse_step,
        metrics_fn=abs_error,
        callbacks=[Digests()],
    )
