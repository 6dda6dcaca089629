"""Checkpoints: written by rank 0 only, atomically; read by every rank safely.

A checkpoint is one file `ckpt-<global step>.pt` holding the unwrapped model state,
optimizer/scheduler/scaler state, the next epoch, the global step, the config and
every rank's RNG state. A write goes to a temporary file in the same folder, is
flushed to disk and then renamed, so a crash mid-save leaves the previous checkpoint
intact. Loading uses `weights_only=True` (no arbitrary code from a pickle) and maps
tensors onto the loading rank's own device.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.context import DistContext
from ddpkit.errors import CheckpointError
from ddpkit.model import strip_prefixes, unwrap
from ddpkit.seed import rng_state

log = logging.getLogger("ddpkit")

FORMAT = "ddpkit-checkpoint/1"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"ckpt-{step:09d}.pt"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Checkpoint files in `directory`, oldest (lowest step) first."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def check_writable(directory: str | os.PathLike[str]) -> Path:
    """Create `directory` if needed and prove a file can be written there."""
    folder = Path(directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ddpkit-probe-"):
            pass
    except OSError as exc:
        raise CheckpointError(
            f"cannot write checkpoints to {folder} ({exc.strerror or exc}): "
            "pass --checkpoint-dir with a writable folder"
        ) from None
    return folder


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file beside `path`, fsync, then rename over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file private (0600); give it the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # Make the rename itself durable (the directory entry), not only the file data.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _gather_to_main(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's `obj`, on rank 0 (a collective: every rank calls it)."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def save_checkpoint(
    state: dict[str, Any],
    directory: str | os.PathLike[str],
    ctx: DistContext,
    *,
    step: int,
    keep_last: int | None = 3,
) -> Path:
    """Save a training state as `directory/ckpt-<step, 9 digits>.pt`. Call it on EVERY rank.

    Every rank's RNG state is gathered into the file, so a resumed run draws the same
    random numbers. Rank 0 writes to a temporary file and renames it, so a crash never
    leaves a half-written checkpoint; then all ranks meet at a barrier, so nobody reads
    or deletes a checkpoint that is still being written.

    Args:
        state: what to save, e.g. `{"model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict()}` (tensors and plain Python values).
        directory: the checkpoint folder (created if missing).
        ctx: this rank's `DistContext`.
        step: the number in the file name (an optimizer step or an epoch).
        keep_last: keep only the newest this many checkpoints (None: keep all).

    Returns:
        The path of the checkpoint written.
    """
    rngs = _gather_to_main(rng_state(), ctx)
    path = checkpoint_path(directory, step)
    if ctx.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(".ckpt-*.tmp"):  # left by a crash mid-save
            stale.unlink(missing_ok=True)
        payload = {**state, "rng": rngs, "world_size": ctx.world_size, "format": FORMAT}
        atomic_save(payload, path)
        if keep_last is not None:
            for old in list_checkpoints(path.parent)[:-keep_last]:
                old.unlink(missing_ok=True)
    if ctx.distributed:
        dist.barrier()
    return path


def load_checkpoint(path: str | os.PathLike[str], ctx: DistContext) -> dict[str, Any]:
    """Load one checkpoint written by `save_checkpoint`, onto this rank's device.

    The file is read with `weights_only=True`, so it cannot run code.

    Args:
        path: the checkpoint file.
        ctx: this rank's `DistContext`.

    Returns:
        The saved state, with `rng` (every rank's RNG state) and `world_size` added.

    Raises:
        CheckpointError: the file is missing, unreadable or not a ddpkit checkpoint.
    """
    try:
        state = torch.load(path, map_location=ctx.device, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupt ({type(exc).__name__}): delete it "
            "to resume from the one before"
        ) from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a ddpkit checkpoint (no 'model' entry)")
    return state


def latest_checkpoint(
    directory: str | os.PathLike[str], ctx: DistContext
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in `directory` that loads, skipping (and reporting) broken ones.

    Args:
        directory: the checkpoint folder.
        ctx: this rank's `DistContext`.

    Returns:
        `(path, state)` of the newest readable checkpoint, or None when the folder holds
        no checkpoint.

    Raises:
        CheckpointError: the folder holds checkpoints but none of them loads.
    """
    candidates = list_checkpoints(directory)
    broken: list[str] = []
    for path in reversed(candidates):
        try:
            state = load_checkpoint(path, ctx)
        except CheckpointError as exc:
            broken.append(str(exc))
            continue
        if broken and ctx.is_main:
            log.warning("skipped %d unreadable checkpoint(s): %s", len(broken), "; ".join(broken))
        return path, state
    if candidates:
        raise CheckpointError(
            f"no checkpoint in {directory} could be read ({'; '.join(broken)}): delete "
            "them, or drop --resume to start from scratch"
        )
    return None


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a model state dict, with or without DDP's `module.` prefixes, into `model`."""
    unwrap(model).load_state_dict(strip_prefixes(state))
