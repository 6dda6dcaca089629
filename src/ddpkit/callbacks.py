"""Callbacks: small hooks into Trainer.fit, and early stopping as the built-in example.

Every hook runs on every rank with the same (already reduced) numbers, so a decision a
callback takes, such as stopping, is the same everywhere: no rank is left waiting in a
collective. A hook that writes files should check `trainer.ctx.is_main`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.errors import ConfigError

if TYPE_CHECKING:
    from ddpkit.trainer import FitResult, Trainer


class Callback:
    """Override the hooks you need; each default does nothing."""

    def on_fit_start(self, trainer: Trainer) -> None: ...
    def on_fit_end(self, trainer: Trainer, result: FitResult) -> None: ...
    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None: ...
    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None: ...
    def on_step_end(self, trainer: Trainer, step: int) -> None: ...
    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None: ...
    def on_checkpoint(self, trainer: Trainer, path: Path) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """What to keep in checkpoints, so a resumed run continues the same decision."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by `min_delta` for `patience` epochs.

    `monitor` is any epoch metric: `loss`, `eval_loss`, `accuracy`, ... With
    `mode="auto"`, metrics named like accuracy are maximised, the others minimised.
    """

    def __init__(
        self,
        monitor: str = "eval_loss",
        patience: int = 3,
        min_delta: float = 0.0,
        mode: str = "auto",
    ) -> None:
        if patience < 1:
            raise ConfigError(f"patience must be >= 1 (got {patience})")
        if mode not in ("auto", "min", "max"):
            raise ConfigError(f"mode must be 'auto', 'min' or 'max' (got {mode!r})")
        if mode == "auto":
            mode = "max" if any(w in monitor for w in ("acc", "f1", "auc", "precision")) else "min"
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, min_delta, mode
        self.best = math.inf if mode == "min" else -math.inf
        self.bad_epochs = 0
        self.stopped_epoch: int | None = None

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:
            raise ConfigError(
                f"early stopping watches {self.monitor!r}, which this run does not report "
                f"(it has: {', '.join(sorted(metrics))}): choose one of those"
            )
        value = metrics[self.monitor]
        better = (
            value < self.best - self.min_delta
            if self.mode == "min"
            else value > self.best + self.min_delta
        )
        if better:
            self.best, self.bad_epochs = value, 0
            return
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            self.stopped_epoch = epoch
            trainer.should_stop = True
            trainer.say(
                f"early stopping: {self.monitor} has not improved for {self.patience} "
                f"epoch(s) (best {self.best:.4g})"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_epochs = float(state["best"]), int(state["bad_epochs"])
