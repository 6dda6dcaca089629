"""The Trainer's checkpoints: what one holds (`save_state`'s schema, with the Trainer's
own values as its extra), writing one, keeping the best, and resuming from the newest
(`restore` and `resume_loader`, as `load_state` does, then the Trainer's extras)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from ddpkit.checkpoint.pt import find_checkpoint, keep_as_best
from ddpkit.checkpoint.state import restore, resume_loader, save_state
from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.parallel.precision import Precision
from ddpkit.parallel.strategy import Strategy
from ddpkit.training.config import TrainConfig
from ddpkit.training.decisions import (
    Stateful,
    callback_states,
    higher_is_better,
    load_callback_states,
)
from ddpkit.training.progress import EpochSums, resume_line


class Run(Protocol):
    """What a checkpoint holds of a `Trainer`, and what a resume sets back (described
    here, as the Trainer imports this module: it cannot be imported back)."""

    @property
    def ctx(self) -> DistContext: ...
    @property
    def config(self) -> TrainConfig: ...
    @property
    def strategy(self) -> Strategy: ...
    @property
    def model(self) -> nn.Module: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def scheduler(self) -> LRScheduler | None: ...
    @property
    def precision(self) -> Precision: ...
    @property
    def train_loader(self) -> DataLoader[Any]: ...
    @property
    def callbacks(self) -> Sequence[Stateful]: ...

    epoch: int
    batch: int
    global_step: int
    samples_seen: int
    should_stop: bool
    best: float | None
    last_checkpoint: Path | None
    _sums: EpochSums
    _judged_step: int
    _saved_step: int
    _resumed_step: int | None
    _resumed_inside: bool

    def save(self) -> Path: ...
    def say(self, text: str) -> None: ...
    def _call(self, hook: str, *args: Any) -> None: ...


def parts(trainer: Run) -> dict[str, Any]:
    """What a checkpoint of this run holds, as `save_state` takes it: the Trainer's
    own values (callbacks, samples seen, an early stop, the config) are its extra."""
    extra = {
        "callbacks": callback_states(trainer.callbacks),
        "samples_seen": trainer.samples_seen,
        "should_stop": trainer.should_stop,
        "best": trainer.best,
        "judged_step": trainer._judged_step,
        "config": trainer.config.to_dict(),
    }
    return {
        "model": trainer.model,
        "optimizer": trainer.optimizer,
        "scheduler": trainer.scheduler,
        "scaler": trainer.precision.scaler,
        "loader": trainer.train_loader,
        "epoch": trainer.epoch,
        "batch": trainer.batch,
        "step": trainer.global_step,
        "extra": extra,
    }


def save(trainer: Run) -> Path:
    """`Trainer.save`: every rank calls it, rank 0 writes."""
    folder = trainer.config.checkpoint_dir
    if folder is None:
        raise ConfigError("save() needs a checkpoint folder: set checkpoint_dir")
    state = parts(trainer)
    if trainer._sums.epoch == trainer.epoch:  # inside the epoch (same on every rank)
        state["extra"]["epoch_sums"] = trainer._sums.gather()
    path = save_state(folder, trainer.ctx, **state, keep_last=trainer.config.keep_last)
    trainer.last_checkpoint, trainer._saved_step = path, trainer.global_step
    trainer._call("on_checkpoint", path)
    return path


def new_best(trainer: Run, metrics: dict[str, float]) -> bool:
    """After an evaluation: whether `config.keep_best`'s metric improved; if so it
    becomes `best` now, before this step's checkpoint is written (which keeps it)."""
    name = trainer.config.keep_best
    if name is None:
        return False
    if name not in metrics:
        raise ConfigError(
            f"keep_best watches {name!r}, which this run does not report (it has: "
            f"{', '.join(sorted(metrics))}): choose one of those"
        )
    value, best = metrics[name], trainer.best
    if best is not None and not (value > best if higher_is_better(name) else value < best):
        return False  # no better (a NaN never is)
    trainer.best = value
    return True


def keep_best(trainer: Run) -> None:
    """Keep this step's checkpoint (written now unless it was already) as best.pt."""
    path = trainer.last_checkpoint if trainer._saved_step == trainer.global_step else None
    best = keep_as_best(path or trainer.save(), trainer.ctx)
    trainer.say(f"{trainer.config.keep_best} {trainer.best:.4f} is the best so far: kept as {best}")


def resume(trainer: Run) -> None:
    """Continue from the newest checkpoint of `config.checkpoint_dir`, if any (every
    rank; rank 0 chooses the file), and say where the run goes on."""
    folder, ctx = trainer.config.checkpoint_dir, trainer.ctx
    assert folder is not None
    found = find_checkpoint(folder, ctx)
    if found is None:
        trainer.say(f"no checkpoint in {folder}: starting from epoch 1")
        return
    trainer.strategy.check_resume(found.path, found.state)
    saved = restore(
        found,
        ctx,
        model=trainer.model,
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        scaler=trainer.precision.scaler,
    )
    unused = load_callback_states(trainer.callbacks, saved.extra.get("callbacks"), saved.path)
    if unused:
        trainer.say(
            f"{saved.path} keeps the state of callbacks this run lacks: {', '.join(unused)}"
        )
    trainer.epoch, trainer.global_step = saved.epoch, saved.step
    trainer._resumed_step, trainer._resumed_inside = saved.step, saved.batch > 0
    # The loader's next pass starts after the batches trained, then restores the RNG.
    trainer.batch = resume_loader(trainer.train_loader, saved, ctx)
    extra = saved.extra
    trainer.samples_seen = int(extra.get("samples_seen", 0))
    trainer._sums.resume(extra.get("epoch_sums"), trainer.epoch, trainer.samples_seen)
    trainer.should_stop = bool(extra.get("should_stop", False))
    trainer.best = extra.get("best")
    trainer._judged_step = int(extra.get("judged_step", -1))
    trainer.last_checkpoint = saved.path
    # Said once, by rank 0, as what happened (the skipped files are already skipped).
    skipped = f"{found.skip_note()}; " if found.skipped else ""
    where = (trainer.epoch, trainer.batch, trainer.global_step, trainer.should_stop)
    trainer.say(skipped + resume_line(trainer.config, saved.path, *where))
