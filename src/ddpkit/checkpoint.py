"""Checkpoints: written by rank 0 only, atomically; read by every rank safely.

A checkpoint is one file `ckpt-<global step>.pt` holding the unwrapped model state,
optimizer/scheduler/scaler state, the next epoch, the global step, the config and
every rank's RNG state. A write goes to a temporary file in the same folder, is
flushed to disk and then renamed, so a crash mid-save leaves the previous checkpoint
intact. Loading uses `weights_only=True` (no arbitrary code from a pickle: a file that
holds other Python objects is refused, never unpickled) and maps tensors onto the loading
rank's own device. On resume, rank 0 alone chooses the checkpoint and every rank loads
exactly that file (checked by its sha256), or every rank stops with the same error.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
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


class _Unreadable(Exception):
    """Why one checkpoint file could not be loaded: `reason` (what is wrong with the file)
    and `fix` (what to do about it when this file was asked for by name)."""

    def __init__(self, reason: str, fix: str) -> None:
        self.reason = reason
        self.fix = fix
        super().__init__(f"{reason}: {fix}")


# Phrases of torch's weights-only unpickler that mean "this pickle names a Python object
# that is not allowed" (a refusal), as opposed to a stream that is merely damaged.
_REFUSAL = re.compile(
    r"(?:unsupported GLOBAL|Unsupported global: GLOBAL) (\S+)|unrecognized function|"
    r"Can only create new object|Can only build"
)
_DELETE_IT = "delete it (or move it out of the folder) to resume from the one before"


def _read_bytes(path: Path) -> bytes:
    """The bytes of one checkpoint file. One function, so a test can make one rank's
    read of one file fail or differ (as on a node with a different filesystem)."""
    return path.read_bytes()


def _decode(data: bytes, path: Path, ctx: DistContext) -> dict[str, Any]:
    """Unpickle a checkpoint's bytes with `weights_only=True` onto this rank's device."""
    try:
        state = torch.load(io.BytesIO(data), map_location=ctx.device, weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        refusal = _REFUSAL.search(text) if "Weights only load failed" in text else None
        if refusal is None:
            raise _Unreadable(
                f"checkpoint {path} is truncated or corrupt (UnpicklingError)", _DELETE_IT
            ) from None
        what = f"GLOBAL {refusal.group(1).rstrip('.')}" if refusal.group(1) else refusal.group(0)
        raise _Unreadable(
            f"checkpoint {path} was refused: it holds Python objects that a weights-only "
            f"load does not allow (it could run code), so it was not unpickled ({what})",
            "save_checkpoint writes only tensors and plain values, so this file was written "
            f"by something else or altered; {_DELETE_IT}",
        ) from None
    except Exception as exc:
        raise _Unreadable(
            f"checkpoint {path} is truncated or corrupt ({type(exc).__name__})", _DELETE_IT
        ) from None
    if not isinstance(state, dict) or "model" not in state:
        raise _Unreadable(
            f"{path} is not a ddpkit checkpoint (no 'model' entry)",
            f"pass a file written by save_checkpoint, or {_DELETE_IT}",
        )
    return state


def _load(path: Path, ctx: DistContext) -> tuple[dict[str, Any], str]:
    """The state in `path` and the sha256 of the bytes it was decoded from (read once)."""
    try:
        data = _read_bytes(path)
    except FileNotFoundError:
        raise _Unreadable(
            f"checkpoint {path} does not exist", "pass the path of an existing ckpt-*.pt file"
        ) from None
    except OSError as exc:
        raise _Unreadable(
            f"checkpoint {path} cannot be read ({exc.strerror or exc})",
            "check that the file and its folder are readable by this user",
        ) from None
    return _decode(data, path, ctx), hashlib.sha256(data).hexdigest()


def load_checkpoint(path: str | os.PathLike[str], ctx: DistContext) -> dict[str, Any]:
    """Load one checkpoint written by `save_checkpoint`, onto this rank's device.

    Only the calling rank reads the file; no collective is involved. The file is read
    with `weights_only=True`, so it cannot run code: a file holding other Python objects
    is refused without being unpickled.

    Args:
        path: the checkpoint file.
        ctx: this rank's `DistContext`.

    Returns:
        The saved state, with `rng` (every rank's RNG state) and `world_size` added.

    Raises:
        CheckpointError: the file is missing, unreadable, refused (it holds Python objects
            a weights-only load does not allow) or not a ddpkit checkpoint.
    """
    try:
        return _load(Path(path), ctx)[0]
    except _Unreadable as exc:
        raise CheckpointError(str(exc)) from None


def _newest_readable(
    directory: str | os.PathLike[str], ctx: DistContext
) -> tuple[Path, dict[str, Any], str] | None:
    """This process's pick: `(path, state, sha256)` of the newest checkpoint that loads,
    None when there is none. Skipped files are logged; all of them broken raises."""
    candidates = list_checkpoints(directory)
    broken: list[str] = []
    for path in reversed(candidates):
        try:
            state, digest = _load(path, ctx)
        except _Unreadable as exc:
            broken.append(exc.reason)
            continue
        if broken:
            log.warning(
                "resuming from the older checkpoint %s because %d newer one(s) could not be "
                "loaded: %s (delete or move the unreadable file(s) to silence this warning)",
                path.name,
                len(broken),
                "; ".join(broken),
            )
        return path, state, digest
    if candidates:
        raise CheckpointError(
            f"no checkpoint in {directory} could be read ({'; '.join(broken)}): delete "
            "them, or drop --resume to start from scratch"
        )
    return None


def _step_of(path: Path) -> int:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else -1


def _check_same_file(
    path: Path, digest: str, ctx: DistContext
) -> tuple[dict[str, Any], str | None]:
    """Load rank 0's choice on this (non-zero) rank: `(state, None)`, or `({}, reason)`."""
    try:
        data = _read_bytes(path)
    except FileNotFoundError:
        return {}, (
            "the file does not exist there (nodes must share the checkpoint folder: put "
            "checkpoint_dir on a filesystem every node mounts at the same path)"
        )
    except Exception as exc:
        return {}, f"the file cannot be read ({type(exc).__name__}: {exc})"
    got = hashlib.sha256(data).hexdigest()
    if got != digest:
        return {}, (
            f"its bytes differ from rank 0's (sha256 {got[:12]} != {digest[:12]}): nodes must "
            "share one checkpoint folder, and nothing may rewrite it during a resume"
        )
    try:
        return _decode(data, path, ctx), None
    except _Unreadable as exc:
        return {}, exc.reason
    except Exception as exc:  # never leave the other ranks waiting in the collective
        return {}, f"loading it failed ({type(exc).__name__}: {exc})"


def latest_checkpoint(
    directory: str | os.PathLike[str], ctx: DistContext
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in `directory` that loads, skipping (and reporting) broken ones.

    With a process group this is a collective: call it on EVERY rank. Rank 0 alone picks
    the checkpoint and broadcasts its name, step and sha256; every other rank loads
    exactly that file and checks its digest, so all ranks resume from the same state or
    all of them raise the same error. Rank 0 logs any skipped files.

    Args:
        directory: the checkpoint folder.
        ctx: this rank's `DistContext`.

    Returns:
        `(path, state)` of the newest readable checkpoint, or None when the folder holds
        no checkpoint.

    Raises:
        CheckpointError: the folder holds checkpoints but none of them loads; or, in a
            distributed job, some rank could not load the file rank 0 chose (the message
            names the ranks, the file and why).
    """
    if not ctx.distributed:
        found = _newest_readable(directory, ctx)
        return None if found is None else (found[0], found[1])

    # Rank 0 chooses. Whatever happens there is broadcast, so no rank waits forever.
    choice: list[Any] = [None]
    found = None
    failure: BaseException | None = None
    if ctx.is_main:
        try:
            found = _newest_readable(directory, ctx)
        except Exception as exc:
            failure = exc
            choice = [("error", str(exc) if isinstance(exc, CheckpointError) else None)]
        else:
            if found is not None:
                choice = [("ok", str(found[0]), _step_of(found[0]), found[2])]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    if choice[0][0] == "error":
        if failure is not None:
            raise failure
        raise CheckpointError(
            choice[0][1]
            or f"rank 0 failed while choosing a checkpoint in {directory}: see rank 0's error"
        )

    _, chosen, step, digest = choice[0]  # rank 0's path names the file in errors
    path = Path(directory) / Path(chosen).name  # the same path when nodes share the folder
    problem: str | None = None
    if found is not None:
        state = found[1]
    else:
        state, problem = _check_same_file(path, digest, ctx)

    # Everyone agrees on the outcome, so one rank's failure stops every rank.
    problems: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(problems, problem)
    failed = [r for r, p in enumerate(problems) if p is not None]
    if failed:
        reasons = "; ".join(f"rank {r}: {problems[r]}" for r in failed)
        raise CheckpointError(
            f"rank(s) {', '.join(map(str, failed))} could not load checkpoint {chosen} "
            f"(step {step}) that rank 0 chose to resume from ({reasons}): every rank must "
            "load the same file, so fix that and resume again"
        )
    return path, state


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a model state dict, with or without DDP's `module.` prefixes, into `model`."""
    unwrap(model).load_state_dict(strip_prefixes(state))
