"""The Trainer's checkpoints: what one holds (`save_state`'s schema, with the Trainer's
own values as its extra), writing one, keeping the best, and resuming from the newest
(`restore` and `resume_loader`, as `load_state` does, then the Trainer's extras)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ddpkit.checkpoint.pt import find_checkpoint, keep_as_best
from ddpkit.checkpoint.state import checkpoint_state, restore, resume_loader, save_state
from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.parallel.data import DistributedLoader
from ddpkit.parallel.precision import Precision
from ddpkit.parallel.strategy import Strategy
from ddpkit.training.config import TrainConfig
from ddpkit.training.decisions import (
    Stateful,
    better,
    callback_states,
    higher_is_better,
    load_callback_states,
    reported,
)
from ddpkit.training.progress import EpochSums, resume_line


class Checkpoints:
    """The Trainer's base class: its checkpoints, of the values below, which the
    Trainer sets (a base class, as the Trainer imports this module and cannot be
    imported back)."""

    ctx: DistContext
    config: TrainConfig
    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler | None
    precision: Precision
    train_loader: DistributedLoader
    callbacks: Sequence[Stateful]
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

    def say(self, text: str) -> None: ...  # the Trainer's
    def _call(self, hook: str, *args: Any) -> None: ...  # the Trainer's

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds (`ddpkit.checkpoint.state.checkpoint_state`, the
        schema `save_state` writes too); with strategy "fsdp" the model and optimizer
        are written as shards instead (see `save`). Not the running epoch's sums of
        every rank, which `save` gathers (a collective)."""
        return checkpoint_state(ctx=self.ctx, **self._parts())

    def _parts(self) -> dict[str, Any]:
        """What a checkpoint of this run holds, as `save_state` takes it: the Trainer's
        own values (callbacks, samples seen, an early stop, the config) are its extra."""
        extra = {
            "callbacks": callback_states(self.callbacks),
            "samples_seen": self.samples_seen,
            "should_stop": self.should_stop,
            "best": self.best,
            "judged_step": self._judged_step,
            "config": self.config.to_dict(),
        }
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.precision.scaler,
            "loader": self.train_loader,
            "epoch": self.epoch,
            "batch": self.batch,
            "step": self.global_step,
            "extra": extra,
        }

    def save(self) -> Path:
        """Checkpoint now (call on every rank; rank 0 writes). Also mid-epoch, e.g. from
        a callback's `on_step_end`: a resumed run then continues with the next batch."""
        folder = self.config.checkpoint_dir
        if folder is None:
            raise ConfigError("save() needs a checkpoint folder: set checkpoint_dir")
        state = self._parts()
        if self._sums.epoch == self.epoch:  # inside the epoch (same on every rank)
            state["extra"]["epoch_sums"] = self._sums.gather()
        path = save_state(folder, self.ctx, **state, keep_last=self.config.keep_last)
        self.last_checkpoint, self._saved_step = path, self.global_step
        self._call("on_checkpoint", path)
        return path

    def _new_best(self, metrics: dict[str, float]) -> bool:
        """After an evaluation: whether `config.keep_best`'s metric improved; if so it
        becomes `best` now, before this step's checkpoint is written (which keeps it)."""
        name = self.config.keep_best
        if name is None:
            return False
        value = reported(metrics, name, "keep_best watches")
        if self.best is not None and not better(value, self.best, higher_is_better(name)):
            return False
        self.best = value
        return True

    def _checkpoint_now(self) -> Path:
        """This step's checkpoint: written now unless it was already."""
        if self.last_checkpoint is not None and self._saved_step == self.global_step:
            return self.last_checkpoint
        return self.save()

    def _keep_best(self) -> None:
        """Keep this step's checkpoint (written now unless it was already) as best.pt."""
        best = keep_as_best(self._checkpoint_now(), self.ctx)
        self.say(f"{self.config.keep_best} {self.best:.4f} is the best so far: kept as {best}")

    def _resume(self) -> None:
        """Continue from the newest checkpoint of `config.checkpoint_dir`, if any (every
        rank; rank 0 chooses the file), and say where the run goes on."""
        folder, ctx = self.config.checkpoint_dir, self.ctx
        assert folder is not None
        found = find_checkpoint(folder, ctx)
        if found is None:
            self.say(f"no checkpoint in {folder}: starting from epoch 1")
            return
        self.strategy.check_resume(found.path, found.state)
        saved = restore(
            found,
            ctx,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            scaler=self.precision.scaler,
        )
        unused = load_callback_states(self.callbacks, saved.extra.get("callbacks"), saved.path)
        if unused:
            self.say(
                f"{saved.path} keeps the state of callbacks this run lacks: {', '.join(unused)}"
            )
        self.epoch, self.global_step = saved.epoch, saved.step
        self._resumed_step, self._resumed_inside = saved.step, saved.batch > 0
        # The loader's next pass starts after the batches trained, then restores the RNG.
        self.batch = resume_loader(self.train_loader, saved, ctx)
        extra = saved.extra
        self.samples_seen = int(extra.get("samples_seen", 0))
        self._sums.resume(extra.get("epoch_sums"), self.epoch, self.samples_seen)
        self.should_stop = bool(extra.get("should_stop", False))
        self.best = extra.get("best")
        self._judged_step = int(extra.get("judged_step", -1))
        self.last_checkpoint = saved.path
        # Said once, by rank 0, as what happened (the skipped files are already skipped).
        skipped = f"{found.skip_note()}; " if found.skipped else ""
        where = (self.epoch, self.batch, self.global_step, self.should_stop)
        self.say(skipped + resume_line(self.config, saved.path, *where))
