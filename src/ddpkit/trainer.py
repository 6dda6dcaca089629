"""Trainer: the seed's Trainer made whole. Read `fit` top to bottom: it is the loop."""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from ddpkit.checkpoint import latest_checkpoint, load_model_state, save_checkpoint
from ddpkit.context import DistContext
from ddpkit.data import prepare_loader
from ddpkit.errors import ConfigError
from ddpkit.metrics import reduce_sums
from ddpkit.model import prepare_model, unwrap
from ddpkit.seed import set_rng_state

log = logging.getLogger("ddpkit")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a training run; validated on construction.

    `batch_size` is per rank (the global batch is `batch_size * world_size`).
    `save_every` is in epochs; a checkpoint is also written after the last epoch.
    """

    epochs: int = 10
    batch_size: int = 32
    seed: int = 0
    save_every: int = 1
    checkpoint_dir: str | None = None
    resume: bool = False
    keep_last: int = 3
    num_workers: int = 0
    drop_last: bool = False
    sync_batchnorm: bool = True
    find_unused_parameters: bool = False
    progress: bool | None = None  # None: a progress bar when stdout is a terminal

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, rule: str, fix: str) -> None:
            if not ok:
                value = getattr(self, name)
                raise ConfigError(f"{name} must be {rule} (got {value!r}): {fix}")

        for name in ("epochs", "batch_size", "keep_last"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            need(isinstance(value, int) and value >= 1, name, ">= 1", f"pass {flag} 1 or more")
        need(
            isinstance(self.save_every, int) and self.save_every >= 0,
            "save_every",
            ">= 0",
            "pass --save-every 0 to save after the last epoch only",
        )
        need(
            isinstance(self.num_workers, int) and self.num_workers >= 0,
            "num_workers",
            ">= 0",
            "pass --num-workers 0 to load data in the training process",
        )
        need(isinstance(self.seed, int), "seed", "an integer", "pass --seed 0")
        need(
            not self.resume or self.checkpoint_dir is not None,
            "resume",
            "used with a checkpoint folder",
            "pass --checkpoint-dir DIR with --resume",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class FitResult:
    """What `fit` returns (on every rank; the numbers are global, not per rank)."""

    epochs: int
    global_step: int
    samples_per_s: float
    final_loss: float
    eval: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None


class Trainer:
    """Trains `model` on `train_set` with DDP over all ranks of `ctx`.

    The model is moved, BatchNorm-synchronized and wrapped here (`prepare_model`);
    build the optimizer on the bare model's parameters before, as in a one-GPU script.
    `loss_fn(outputs, targets)` must return the mean over the batch.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_set: Dataset[Any],
        ctx: DistContext,
        config: TrainConfig | None = None,
        *,
        loss_fn: LossFn = nn.functional.cross_entropy,
        eval_set: Dataset[Any] | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        log_fn: Callable[[str], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.config = config = config or TrainConfig()
        self.model = prepare_model(
            model,
            ctx,
            sync_batchnorm=config.sync_batchnorm,
            find_unused_parameters=config.find_unused_parameters,
        )
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.train_loader = prepare_loader(
            train_set,
            ctx,
            config.batch_size,
            seed=config.seed,
            num_workers=config.num_workers,
            drop_last=config.drop_last,
        )
        self.eval_loader = (
            None
            if eval_set is None
            else prepare_loader(
                eval_set,
                ctx,
                config.batch_size,
                evaluation=True,
                num_workers=config.num_workers,
            )
        )
        self.log_fn = log_fn or _print
        self.epoch = 0  # the next epoch to run
        self.global_step = 0
        self.last_checkpoint: Path | None = None

    # -- the loop -------------------------------------------------------------------
    def fit(self) -> FitResult:
        cfg = self.config
        if cfg.resume:
            self._resume()
        samples = 0
        train_time = 0.0
        loss = math.nan
        metrics: dict[str, float] = {}
        for epoch in range(self.epoch, cfg.epochs):
            self.train_loader.set_epoch(epoch)  # a new shuffle each epoch
            loss, n, seconds = self._train_epoch(epoch)
            samples, train_time = samples + n, train_time + seconds
            self.epoch = epoch + 1
            metrics = self.evaluate() if self.eval_loader is not None else {}
            self._log_epoch(epoch, loss, n / max(seconds, 1e-9), seconds, metrics)
            last = self.epoch == cfg.epochs
            if cfg.checkpoint_dir and (
                last or (cfg.save_every and self.epoch % cfg.save_every == 0)
            ):
                self.save()
        return FitResult(
            epochs=self.epoch,
            global_step=self.global_step,
            samples_per_s=samples / train_time if train_time else 0.0,
            final_loss=loss,
            eval=metrics,
            checkpoint=self.last_checkpoint,
        )

    def _train_epoch(self, epoch: int) -> tuple[float, int, float]:
        """One pass over this rank's shard; returns (global mean loss, global samples, s)."""
        model, optimizer, device = self.model, self.optimizer, self.ctx.device
        model.train()
        # Accumulate on the device: calling .item() each step would stall the GPU.
        loss_sum = torch.zeros((), device=device)
        count = 0
        start = time.perf_counter()
        for inputs, targets in self._progress(self.train_loader, epoch):
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(model(inputs), targets)
            loss.backward()  # type: ignore[no-untyped-call]  # DDP averages the gradients across ranks here
            optimizer.step()
            loss_sum.add_(loss.detach(), alpha=len(targets))
            count += len(targets)
            self.global_step += 1
        seconds = time.perf_counter() - start
        if self.scheduler is not None:
            self.scheduler.step()
        # One collective for the epoch's log, run by every rank.
        total, n = reduce_sums([loss_sum, count], self.ctx)
        return total / max(n, 1), int(n), seconds

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact loss (and accuracy for class logits) over the whole eval set.

        Each sample is counted once (no padding); ranks run no collective per batch, so
        shards of unequal length are fine. Call on every rank.
        """
        if self.eval_loader is None:
            raise ConfigError("evaluate() needs an eval_set: pass Trainer(..., eval_set=...)")
        model = unwrap(self.model)  # no DDP forward hooks: nothing to sync in eval
        was_training = model.training
        model.eval()
        device = self.ctx.device
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device, dtype=torch.long)
        count, classify = 0, False
        for inputs, targets in self.eval_loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            outputs = model(inputs)
            loss_sum += self.loss_fn(outputs, targets).float() * len(targets)
            if outputs.ndim == 2 and outputs.shape[1] > 1 and not targets.is_floating_point():
                classify = True
                correct += (outputs.argmax(dim=1) == targets).sum()
            count += len(targets)
        model.train(was_training)
        total_loss, total_correct, total, any_classify = reduce_sums(
            [loss_sum, correct, count, int(classify)], self.ctx
        )
        metrics = {"eval_loss": total_loss / max(total, 1), "eval_samples": total}
        if any_classify:
            metrics["accuracy"] = total_correct / max(total, 1)
        return metrics

    # -- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "scaler": None,  # no mixed precision yet: nothing to scale
            "epoch": self.epoch,
            "global_step": self.global_step,
            "config": self.config.to_dict(),
        }

    def save(self) -> Path:
        """Checkpoint now (call on every rank; rank 0 writes)."""
        assert self.config.checkpoint_dir is not None
        self.last_checkpoint = save_checkpoint(
            self.state_dict(),
            self.config.checkpoint_dir,
            self.ctx,
            step=self.global_step,
            keep_last=self.config.keep_last,
        )
        return self.last_checkpoint

    def _resume(self) -> None:
        assert self.config.checkpoint_dir is not None
        found = latest_checkpoint(self.config.checkpoint_dir, self.ctx)
        if found is None:
            self._say(f"no checkpoint in {self.config.checkpoint_dir}: starting from epoch 1")
            return
        path, state = found
        load_model_state(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        rngs = state.get("rng") or []
        if len(rngs) == self.ctx.world_size:
            set_rng_state(rngs[self.ctx.rank])
        elif self.ctx.is_main:
            log.warning(
                "checkpoint was written by %d rank(s), this job has %d: random state is "
                "not restored, so the run will not repeat the uninterrupted one exactly",
                len(rngs),
                self.ctx.world_size,
            )
        self.last_checkpoint = path
        self._say(f"resumed from {path} at epoch {self.epoch + 1} (step {self.global_step})")

    # -- output (rank 0 only; never wraps a collective) ------------------------------
    def _say(self, text: str) -> None:
        if self.ctx.is_main:
            self.log_fn(text)

    def _log_epoch(
        self, epoch: int, loss: float, rate: float, seconds: float, metrics: dict[str, float]
    ) -> None:
        parts = [
            f"epoch {epoch + 1}/{self.config.epochs}",
            f"loss {loss:.4f}",
            f"{rate:,.0f} samples/s",
            f"{seconds:.2f}s",
        ]
        if "eval_loss" in metrics:
            parts.append(f"eval_loss {metrics['eval_loss']:.4f}")
        if "accuracy" in metrics:
            parts.append(f"accuracy {metrics['accuracy']:.2%}")
        self._say(" | ".join(parts))

    def _progress(self, loader: Iterable[Any], epoch: int) -> Iterable[Any]:
        show = self.config.progress
        if show is None:
            show = sys.stdout.isatty()
        if not (show and self.ctx.is_main):
            return loader
        try:
            from tqdm import tqdm
        except ImportError:  # the bar is a nicety: pip install 'ddpkit[progress]'
            return loader
        bar = tqdm(loader, desc=f"epoch {epoch + 1}", leave=False, dynamic_ncols=True)
        return cast(Iterable[Any], bar)


def _print(text: str) -> None:
    print(text, flush=True)
