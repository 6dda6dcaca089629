"""Exact resume for a hand-written loop: `save_state` and `load_state`.

What `Trainer` does for its own loop, for yours: a checkpoint holds the bare model, the
optimizer, scheduler and GradScaler, where the loop was (epoch, batch of the epoch,
step), every rank's random streams and anything of yours (`extra`). After a crash,
the same script run again continues at the batch after the save and ends with the
same bits as a run that was never interrupted::

    import ddpkit

    def main(ctx, folder, epochs):
        ddpkit.seed_everything(0)                      # the same model on every rank
        model = Net()
        opt = torch.optim.AdamW(model.parameters())
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        model = ddpkit.prepare_model(model, ctx)
        loader = ddpkit.prepare_loader(train_set, ctx, batch_size=32)
        ddpkit.seed_everything(rank_seed(0, ctx.rank))  # each rank its own stream

        start = ddpkit.load_state(folder, ctx, model=model, optimizer=opt,
                                  scheduler=sched, loader=loader)
        if start is None:                              # nothing saved yet
            start = {"epoch": 0, "batch": 0, "step": 0}
        step = start["step"]
        for epoch in range(start["epoch"], epochs):
            loader.set_epoch(epoch)
            first = start["batch"] if epoch == start["epoch"] else 0
            for batch, (x, y) in enumerate(loader, start=first + 1):  # batches done
                opt.zero_grad()
                loss_fn(model(x.to(ctx.device)), y.to(ctx.device)).backward()
                opt.step()
                sched.step()
                step += 1
                if step % 500 == 0:
                    ddpkit.save_state(folder, ctx, model=model, optimizer=opt,
                                      scheduler=sched, loader=loader,
                                      epoch=epoch, batch=batch, step=step)

Files are `ckpt-<step>.pt`, as `save_checkpoint` writes them (rank 0 writes a temporary
file, fsyncs and renames it), and `load_state` resumes from the newest one that loads
(rank 0 chooses; every rank loads that very file). A file that loads is one that a
weights-only `torch.load` accepts; it is loaded to the CPU, and each state is copied onto
the device of the object it is loaded into.

A model sharded with `prepare_model(..., strategy="fsdp")` is saved as `Trainer` saves
it: a folder `ckpt-<step>.dcp` in which every rank writes its own shards of the model
and optimizer (see `ddpkit.checkpoint.sharded`). It loads on any number of ranks, one process
included, as the shards are redistributed to fit the job that loads them.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit.checkpoint.pt import (
    Found,
    check_same_model,
    find_checkpoint,
    save_checkpoint,
)
from ddpkit.context import DistContext
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.parallel.batches import to_device
from ddpkit.parallel.data import DistributedLoader
from ddpkit.parallel.model import model_class_name, sync_buffers, unwrap
from ddpkit.parallel.strategy import Strategy
from ddpkit.seed import set_rng_state

log = logging.getLogger("ddpkit")

# The bookkeeping keys of what load_state returns; `extra` may not use them.
RESERVED = ("epoch", "batch", "step", "path")


class Stateful(Protocol):
    """Anything with `state_dict()` and `load_state_dict(state)`: an LR scheduler, a
    GradScaler."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None: ...


def save_state(
    directory: str | os.PathLike[str],
    ctx: DistContext | None = None,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
    loader: DataLoader[Any] | None = None,
    epoch: int,
    batch: int = 0,
    step: int,
    extra: Mapping[str, Any] | None = None,
    keep_last: int | None = 3,
) -> Path:
    """Save where your loop is, so that `load_state` continues it exactly. Call it on
    EVERY rank, at the same point of the loop (it is a collective); rank 0 writes
    (of a sharded model, every rank writes its own shards as well).

    Args:
        directory: the checkpoint folder (created if missing).
        ctx: this rank's `DistContext` (default: `DistContext.current()`).
        model: the model, bare or as `prepare_model` wrapped it; the bare model's
            state is saved, so it loads into either. Every rank gets rank 0's buffers
            first (BatchNorm's running statistics), so all ranks go on with what the
            file holds.
        optimizer: its optimizer.
        scheduler: its LR scheduler, if any.
        scaler: the `torch.amp.GradScaler` of fp16 training, if any.
        loader: the training loader (from `prepare_loader`), so that its shuffle of
            this epoch is resumed too.
        epoch: the epoch in progress, counted from 0. Saving after an epoch's last
            batch and whatever your loop does at the end of the epoch, pass the next
            one (`epoch + 1`, with `batch=0`).
        batch: batches of `epoch` done (0: at its start). A resumed loop starts with
            the batch after it.
        step: your global step counter: the number in the file name, so the newest
            state is the one with the highest step.
        extra: your own values to get back from `load_state`: numbers, strings,
            tensors, and lists and dicts of them (rank 0's is saved; names may not be
            epoch, batch, step or path).
        keep_last: keep only the newest this many files (None: keep all).

    Returns:
        The path of the file written (`directory/ckpt-<step>.pt`); of a model sharded
        with strategy "fsdp", the folder `directory/ckpt-<step>.dcp`.

    Raises:
        ConfigError: a negative position, or an `extra` that a weights-only load
            would refuse.
        CheckpointError: the file could not be written (the newest earlier one is
            left intact).
    """
    ctx = ctx or DistContext.current()
    for name, value in (("epoch", epoch), ("batch", batch), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"save_state needs {name} as an int >= 0 (got {value!r})")
    extra = dict(extra or {})
    clash = [k for k in RESERVED if k in extra]
    if clash:
        raise ConfigError(
            f"extra may not use the name {clash[0]!r}: load_state returns it as its own "
            "bookkeeping; rename that entry"
        )
    for key, value in extra.items():
        _check_loadable(value, f"extra[{key!r}]")
    sync_buffers(model, ctx)  # the file holds rank 0's buffers; so does every rank now
    # The strategy says where the model and optimizer go: into rank 0's file, or (sharded)
    # every rank writes its own part and the rest of the state goes beside them.
    tensors, shards = Strategy.of(model, ctx).checkpoint_tensors(model, optimizer)
    state: dict[str, Any] = {}
    if ctx.is_main:  # only rank 0's state is written; the others need not build theirs
        state = checkpoint_state(
            model,
            optimizer,
            ctx,
            scheduler=scheduler,
            scaler=scaler,
            loader=loader,
            epoch=epoch,
            batch=batch,
            step=step,
            extra=extra,
            tensors=False,
        )
        state.update(tensors)
    # save_checkpoint gathers every rank's RNG streams into the file.
    return save_checkpoint(state, directory, ctx, step=step, keep_last=keep_last, shards=shards)


def checkpoint_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: DistContext,
    *,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
    loader: DataLoader[Any] | None = None,
    epoch: int,
    batch: int,
    step: int,
    extra: Mapping[str, Any],
    tensors: bool = True,
) -> dict[str, Any]:
    """The one schema of ddpkit's checkpoints, `save_state`'s and the Trainer's: the bare
    model's and the optimizer's states (unless `tensors` is False: a sharded checkpoint
    keeps them in its shards), the scheduler's and scaler's, where the loop was, and
    `extra`. `save_checkpoint` adds every rank's random streams."""
    state: dict[str, Any] = {
        "model_class": model_class_name(model),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "epoch": epoch,
        "batch": batch,
        "global_step": step,
        "loader": None if loader is None else _loader_position(loader, epoch, batch, ctx),
        "extra": dict(extra),
    }
    if tensors:
        state["model"] = unwrap(model).state_dict()
        state["optimizer"] = optimizer.state_dict()
    return state


def load_state(
    path: str | os.PathLike[str],
    ctx: DistContext | None = None,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
    loader: DataLoader[Any] | None = None,
) -> dict[str, Any] | None:
    """Continue from the newest state `save_state` wrote. Call it on EVERY rank (a
    collective), after building the model, optimizer, scheduler and loader and
    before the loop.

    The model, optimizer, scheduler and scaler get their saved states; a sharded state
    (`ckpt-<step>.dcp`) loads on any number of ranks, so a job may resume on fewer or
    more processes than saved it (its random streams then start afresh). Each rank gets
    its own random streams back, and the loader is set to the saved epoch and starts
    after the batches already done: your loop's next `for ... in loader` yields the
    batch after the save, without loading the ones before (an IterableDataset reads
    past them), and only then are the random streams restored, so that its
    augmentations and dropout draw what the uninterrupted run drew (a state saved
    at an epoch's start restores them at once). Without a `loader`, the streams are
    restored at once and your loop skips the `batch` batches itself.

    Args:
        path: the checkpoint folder (its newest file that loads is used, a `.pt` file
            or a sharded `.dcp` folder: rank 0 chooses, skipping broken ones, and every
            rank loads exactly that one), or one checkpoint (an existing file, a path
            ending in `.pt`, or a sharded checkpoint's `.dcp` folder).
        ctx: this rank's `DistContext` (default: `DistContext.current()`).
        model: the model, bare or wrapped.
        optimizer: as given to `save_state`.
        scheduler: as given to `save_state`.
        scaler: as given to `save_state`.
        loader: the training loader, as given to `save_state`.

    Returns:
        None when the folder holds no saved state (a first run); else your `extra`
        (its tensors on this rank's device) with `epoch` (to run), `batch` (of it
        done), `step` and `path` (the file) added, the same on every rank.

    Raises:
        CheckpointError: a named file that is missing or does not load; a folder whose
            files all fail to load; a file of another model; a `.pt` file for a sharded
            model; or a rank that could not load the file rank 0 chose.
    """
    ctx = ctx or DistContext.current()
    found = find_checkpoint(path, ctx)
    if found is None:
        return None
    if found.skipped and ctx.is_main:
        log.warning("%s; resuming from %s", found.skip_note(), found.path.name)
    saved = restore(
        found, ctx, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler
    )
    batch = resume_loader(loader, saved, ctx)
    if ctx.is_main:
        after = f" after batch {batch}" if batch else ""
        log.info(
            "resumed from %s at epoch %d%s (step %d)",
            saved.path,
            saved.epoch + 1,
            after,
            saved.step,
        )
    return {
        # The file is loaded to the CPU; your own tensors come back on this rank's device.
        **to_device(saved.extra, ctx.device),
        "epoch": saved.epoch,
        "batch": batch,
        "step": saved.step,
        "path": saved.path,
    }


@dataclass
class Saved:
    """Where the loop that saved a checkpoint was (what `restore` read)."""

    path: Path
    epoch: int
    """The epoch to run next, or the one in progress."""
    batch: int
    """Batches of `epoch` that were done (by the ranks that saved)."""
    step: int
    loader: dict[str, Any]
    """The loader's position (`_loader_position`); empty when no loader was saved."""
    rng: dict[str, Any] | None
    """This rank's random streams; None when another number of ranks saved them."""
    extra: dict[str, Any]


def restore(
    found: Found,
    ctx: DistContext,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
) -> Saved:
    """Load the checkpoint that `find_checkpoint` found into the model, optimizer,
    scheduler and scaler, and say where its loop was. Call it on every rank."""
    where, state = found.path, found.state
    if "global_step" not in state or "epoch" not in state:
        raise CheckpointError(_NOT_OURS.format(path=where))
    _restore_parts(where, state, model, optimizer, scheduler, scaler, ctx)
    rngs = state.get("rng") or []
    mine: dict[str, Any] | None = None
    if len(rngs) == ctx.world_size:
        mine = rngs[ctx.rank]
    elif ctx.is_main:
        log.warning(
            "%s was written by %d rank(s), this job has %d: random streams are not "
            "restored, so the run will not repeat the uninterrupted one exactly",
            where,
            len(rngs),
            ctx.world_size,
        )
    return Saved(
        path=where,
        epoch=int(state["epoch"]),
        batch=int(state.get("batch", 0)),
        step=int(state["global_step"]),
        loader=dict(state.get("loader") or {}),
        rng=mine,
        extra=dict(state.get("extra") or {}),
    )


# -- loading ---------------------------------------------------------------------------
def _restore_parts(
    path: Path,
    state: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Stateful | None,
    scaler: Stateful | None,
    ctx: DistContext,
) -> None:
    """Load the states into their objects. Every rank loads the same file into the
    same objects, so a mismatch raises on every rank alike."""
    Strategy.of(model, ctx).load_checkpoint_tensors(path, state, model, optimizer, _check_whole)
    for name, part in (("scheduler", scheduler), ("scaler", scaler)):
        if part is None:
            continue
        if state.get(name) is None:
            if ctx.is_main:
                log.warning("%s holds no %s state: the %s starts afresh", path, name, name)
            continue
        part.load_state_dict(state[name])


_NOT_OURS = (
    "{path} was not written by save_state (no optimizer state or position): "
    "pass a file that save_state or Trainer wrote"
)


def _check_whole(model: nn.Module, state: dict[str, Any], path: Path) -> None:
    """Raise CheckpointError unless the whole (not sharded) checkpoint `path` holds an
    optimizer state and the tensors of `model` (a sharded one keeps both in its shards,
    which its load checks)."""
    if "optimizer" not in state:
        raise CheckpointError(_NOT_OURS.format(path=path))
    check_same_model(model, state, path)  # one line naming both models


# -- the loader's position ---------------------------------------------------------------
def _loader_position(
    loader: DataLoader[Any], epoch: int, batch: int, ctx: DistContext
) -> dict[str, Any]:
    """The epoch the loader's sampler is at (what shuffles this epoch's order), and
    where the epoch stands in samples of that order, which another number of ranks or
    another batch size can resume (a batch count means nothing there)."""
    sampler_epoch = getattr(loader.sampler, "epoch", None)
    return {
        "epoch": sampler_epoch if isinstance(sampler_epoch, int) else epoch,
        "batch_size": loader.batch_size,
        "world_size": ctx.world_size,
        "epoch_samples": loader.samples_done(batch, ctx.world_size)
        if isinstance(loader, DistributedLoader)
        else batch * (loader.batch_size or 1) * ctx.world_size,
    }


def resume_loader(loader: DataLoader[Any] | None, saved: Saved, ctx: DistContext) -> int:
    """Set `loader` where the saved loop was, `load_state`'s and the Trainer's one way:
    mid-epoch, its next pass starts after the samples that the saved batches held, in
    the epoch's global order (whatever ranks and batch size trained them), and the
    random streams are restored once that pass has started (see
    `DistributedLoader.resume_at`); at an epoch's start, or without a loader, they are
    restored now. Returns the batches of the epoch that this job counts as done."""
    if loader is None or not saved.batch:
        if loader is not None:
            _set_epoch(loader, int(saved.loader.get("epoch", saved.epoch)))
        if saved.rng is not None:
            set_rng_state(saved.rng)
        return saved.batch
    if not isinstance(loader, DistributedLoader):
        raise ConfigError(
            f"load_state cannot resume a {type(loader).__name__} mid-epoch: pass the loader "
            "that ddpkit.prepare_loader returns (it also takes your DataLoader: "
            "loader = ddpkit.prepare_loader(loader, ctx))"
        )
    # Older states hold no epoch_samples: their batches were of the saved batch size,
    # on as many ranks as they saved random streams for (this job's when unknown).
    position = saved.loader
    saved_world = int(position.get("world_size", ctx.world_size))
    samples = position.get("epoch_samples")
    if samples is None:
        size = int(position.get("batch_size") or loader.batch_size or 1)
        samples = saved.batch * size * saved_world
    loader.set_epoch(int(position.get("epoch", saved.epoch)))
    batch = loader.batches_after(int(samples), ctx.world_size, saved_world)
    loader.resume_at(batch, saved.rng)
    return batch


def _set_epoch(loader: DataLoader[Any], epoch: int) -> None:
    set_epoch = getattr(loader, "set_epoch", None) or getattr(loader.sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


# -- what a weights-only load accepts ---------------------------------------------------
# Exact types: a subclass (numpy.float64 is a float) is refused by the load.
_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)


def _check_loadable(value: Any, where: str) -> None:
    """Raise ConfigError when `value` holds something a weights-only load refuses, now
    rather than at the resume, when the file could no longer be used."""
    if type(value) in _LEAVES or isinstance(value, torch.Tensor):
        return
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            _check_loadable(key, f"a key of {where}")
            _check_loadable(item, f"{where}[{key!r}]")
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            _check_loadable(item, f"{where}[{i}]")
        return
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    raise ConfigError(
        f"{where} is a {kind}, which a weights-only load refuses (it could run code), so "
        "the state could not be resumed: store numbers, strings, tensors, and lists and "
        "dicts of them (say float(x) or x.tolist())"
    )
