"""Checkpoints: written by rank 0 only, atomically; read by every rank safely.

A checkpoint is one file `ckpt-<global step>.pt` holding the unwrapped model state,
optimizer/scheduler/scaler state, the next epoch, the global step, the config and
every rank's RNG state. A write goes to a temporary file in the same folder and is
then renamed, so a crash mid-save leaves the previous checkpoint intact. Training goes
on while a thread flushes the new file to disk (fsync); only then are the checkpoints
it outdates deleted, so that even a power cut finds one that is whole (a kill in that
second may leave one more than `keep_last`; the next save removes it). The next save,
the end of `Trainer.fit` and the process's exit wait for that flush.
Loading uses `weights_only=True` (no arbitrary code from a pickle: a file that holds other
Python objects is refused, never unpickled) and maps tensors to the CPU: `load_state_dict`
copies them onto the model's and optimizer's device (an optimizer's `step` stays on the
CPU, where foreach Adam wants it), and no GPU holds the whole file with every rank's RNG
state. On resume, rank 0 alone chooses the checkpoint and every rank loads
exactly that file (checked by its sha256), or every rank stops with the same error.

A checkpoint also records what wrote it: the command, host and pid, and a fingerprint of
the model's tensor names and shapes, so that a job is not resumed from another model's
checkpoint. A `Trainer` holds its folder's lock (see `ddpkit.storage`) while it runs.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.checkpoint import sharded
from ddpkit.context import DistContext
from ddpkit.errors import CheckpointError
from ddpkit.parallel.model import load_model_state as load_model_state  # its home; named here too
from ddpkit.parallel.model import model_class_name, strip_prefixes, unwrap
from ddpkit.parallel.ranks import all_gather_object
from ddpkit.parallel.strategy import Strategy
from ddpkit.seed import rng_state
from ddpkit.storage import (
    PENDING,
    FolderLock,
    delete,
    holds_lock,
    host_token,
    install,
    is_running,
    os_error_in,
    temporary_name,
    this_process,
    write,
    write_failure,
)

log = logging.getLogger("ddpkit")
T = TypeVar("T")

FORMAT = "ddpkit-checkpoint/1"
_NAME = re.compile(r"^ckpt-(\d+)\.(?:pt|dcp)$")  # a file, or a sharded folder
# A temporary file names its writer (`.ckpt-<step>.pt.<pid>@<host>.<random>.tmp`), so that
# clearing the ones of crashed saves never deletes one that another process is writing.
_TEMP = re.compile(r"^\.(?:ckpt-\d+|best)\.(?:pt|dcp)\.(?:(\d+)@([\w-]*)\.)?\w+\.tmp$")


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
    """torch.save to a temporary file beside `path`, then rename it over `path`: a crash
    never leaves a half-written file under the name. Like torch.save, it leaves the
    flush to disk to the system (no fsync): for a file made from a checkpoint, which
    itself is durable (`ddpkit export`).

    Raises:
        CheckpointError: the file could not be written (say the disk is full); the
            temporary file is removed and `path` is left as it was.
    """
    try:
        _write_atomically(obj, path, sync="never")
    except _WriteFailed as exc:
        raise CheckpointError(f"{exc.what}: {exc.fix}") from None


class _WriteFailed(Exception):
    """A checkpoint write that failed: `what` happened and the `fix`."""

    def __init__(self, what: str, fix: str) -> None:
        self.what, self.fix = what, fix
        super().__init__(what)


Sync = Literal["now", "later", "never"]


def _write_atomically(
    obj: Any, path: Path, retire: list[Path] | None = None, *, sync: Sync = "now"
) -> None:
    """Write `obj` to `path` by a temporary file and a rename (`storage.write`).

    `sync` "now": the file is on disk (fsync) before it gets its name, and `retire`
    (older checkpoints) leave their names just before (`storage.install`). "later": it
    gets its name at once, and a thread makes it durable and only then deletes `retire`
    (`storage.PENDING`); a file that replaces one of the same name is synced now, as
    its older bytes are gone with the rename. "never": no fsync (`retire` as "now").
    """
    later = sync == "later" and not path.exists()
    saving = False  # once the file is made: a failure from then on may need its size

    def save(f: BinaryIO) -> None:
        nonlocal saving
        saving = True
        torch.save(obj, f)

    try:
        # "later": its name at once, no fsync; the thread below makes it durable.
        write(path, save, durable=sync != "never" and not later, retire=[] if later else retire)
    except Exception as exc:
        error = os_error_in(exc)
        if error is None:
            raise  # not the disk's doing (say an object torch cannot save): as it was
        room = saving and error.errno in _ROOM_ERRNOS
        what, fix = write_failure(error, path.parent, _serialised_size(obj) if room else None)
        raise _WriteFailed(f"cannot write checkpoint {path}: {what}", fix) from None
    if later:
        PENDING.later(path, retire or [])


_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class _Counter:
    """A file that keeps nothing and counts the bytes written to it."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: bytes) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n

    def flush(self) -> None:
        pass


def _serialised_size(obj: Any) -> int | None:
    """The exact size of `obj` saved, without holding it in memory (it is serialised
    again, only after a write ran out of room); None if that fails too."""
    counter = _Counter()
    try:
        torch.save(obj, counter)  # type: ignore[arg-type]  # write() is all it needs
    except Exception:
        return None
    return counter.size


def _clear_temporaries(folder: Path) -> None:
    """Delete the temporary files of saves that crashed mid-write, and only those: one
    whose writer still runs on this host is being written. A temporary file of another
    host, or from before writers were named, is deleted only by the holder of the
    folder's lock, as then no other ddpkit job writes here."""
    me = this_process()
    locked: bool | None = None
    for tmp in [*folder.glob(".ckpt-*.tmp"), *folder.glob(".best.*.tmp")]:
        m = _TEMP.match(tmp.name)
        if m and m.group(1) and m.group(2) == host_token(me.host):
            pid = int(m.group(1))
            crashed = pid != me.pid and not is_running(pid)
        else:
            if locked is None:
                locked = holds_lock(folder)
            crashed = locked
        if crashed:
            delete(tmp)  # already under a hidden name


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
    shards: dict[str, Any] | None = None,
) -> Path:
    """Save a training state as `directory/ckpt-<step, 9 digits>.pt`. Call it on EVERY rank.

    Every rank's RNG state is gathered into the file, so a resumed run draws the same
    random numbers. Rank 0 writes to a temporary file and renames it, so a crash never
    leaves a half-written checkpoint; then all ranks meet at a barrier, so nobody reads
    or deletes a checkpoint that is still being written. The file reaches the disk
    (fsync) on a thread while training goes on; `wait_for_checkpoints()` waits for it,
    as the next save, `Trainer.fit`'s end and the process's exit do.

    What `state` must hold: the model's weights under "model" (its `state_dict()`),
    which is how `latest_checkpoint` and `find_checkpoint` tell a checkpoint from any
    other file; beside it whatever your resume needs, as tensors and plain values
    (numbers, strings, lists and dicts of them), which a weights-only load accepts. A
    state without a "model" entry, or with a module rather than its state dict there,
    could never be resumed from: it is refused before anything is written, on every
    rank. Only rank 0's `state` is written: the other ranks may pass `{}`.

    Args:
        state: what to save, e.g. `{"model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(), "epoch": epoch}`. With `shards`, the
            model is in the shards and "model" may be left out.
        directory: the checkpoint folder (created if missing).
        ctx: this rank's `DistContext`.
        step: the number in the file name (an optimizer step or an epoch).
        keep_last: keep only the newest this many checkpoints, this one included (None:
            keep all); the older ones are deleted once this one is on disk.
        shards: tensors that every rank writes its own part of (a sharded model's and
            optimizer's state, from `Strategy.checkpoint_tensors`): the checkpoint is then the
            folder `ckpt-<step>.dcp` (see `ddpkit.checkpoint.sharded`).

    Returns:
        The path of the checkpoint written.

    Raises:
        CheckpointError: on every rank, `state` (rank 0's) is not a dict with a
            "model" state dict, and nothing was written; or the file could not be
            written (the newest earlier checkpoint is left intact).
    """
    if shards is not None:
        # Every rank passes its own shards, alike: each checks its own, and all of them
        # find the same problem before any rank writes. (Rank 0's state is checked as
        # it is written, beside the shards: see _save_sharded.)
        problem = _shards_problem(shards)
        if problem is not None:
            raise CheckpointError(problem)
        rngs = _gather_to_main(rng_state(), ctx)
        return _save_sharded(state, shards, rngs, Path(directory), ctx, step, keep_last)
    # Only rank 0's state is written (save_state passes {} on the others), so rank 0
    # judges it, and _on_rank0 hands its refusal to every rank, as it would a failed
    # write: no rank is left waiting, and no file or folder has been made.
    problem = _state_problem(state) if ctx.is_main else None
    rngs = _gather_to_main(rng_state(), ctx)
    path = checkpoint_path(directory, step)

    def write() -> None:
        if problem is not None:
            raise CheckpointError(problem)
        _write_checkpoint(state, rngs, ctx.world_size, path, keep_last)

    # The other ranks wait until rank 0 has written (so nobody reads or deletes a
    # checkpoint still being written), and they stop with rank 0's error if it failed.
    _on_rank0(write, ctx, f"rank 0 failed to write checkpoint {path}")
    return path


_STATE_FIX = 'pass {"model": unwrap(model).state_dict(), "optimizer": ..., "epoch": ...}'


def _state_problem(state: Any, *, sharded: bool = False) -> str | None:
    """Why a checkpoint of `state` could not be resumed from, in one line that ends
    with the fix; None when it can. `latest_checkpoint` and `find_checkpoint` know a
    ddpkit checkpoint by its "model" entry (a `sharded` one's model is in its shards),
    and a weights-only load refuses a module."""
    if not isinstance(state, dict):
        return f"save_checkpoint's state is a {_kind(state)}, not a dict: {_STATE_FIX}"
    if sharded:
        return None
    if "model" not in state:
        names = ", ".join(repr(k) for k in list(state)[:6]) + (", ..." if len(state) > 6 else "")
        has = f"it has {names}" if state else "it is empty"
        return (
            f"save_checkpoint's state has no 'model' entry ({has}), so latest_checkpoint "
            f"and find_checkpoint could not resume from it: {_STATE_FIX}"
        )
    if not isinstance(state["model"], dict):
        return (
            f"save_checkpoint's state['model'] is a {_kind(state['model'])}, not a state "
            "dict, and a weights-only load would refuse it: pass "
            "state['model'] = unwrap(model).state_dict()"
        )
    return None


def _shards_problem(shards: Any) -> str | None:
    """Why a sharded checkpoint of `shards` could not be resumed from; None if it can."""
    if isinstance(shards, dict) and "model" in shards:
        return None
    return (
        "save_checkpoint's shards have no 'model' entry, so the checkpoint could not be "
        "resumed from: pass the shards of Strategy.of(model, ctx).checkpoint_tensors"
    )


def _kind(value: Any) -> str:
    """The type of `value` as a reader knows it: `list`, `torch.nn.modules.linear.Linear`."""
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def keep_as_best(path: Path, ctx: DistContext) -> Path:
    """Keep checkpoint `path` also as `best.pt` (`best.dcp` for a sharded one) in its
    folder, where `keep_last` never deletes it: a hard link to the file (no copy) where
    the filesystem has them, else a copy. Call on every rank; rank 0 does it."""
    best = path.with_name(f"best{path.suffix}")

    def keep() -> None:
        tmp = temporary_name(best)
        try:
            if path.is_dir():
                shutil.copytree(path, tmp)
            else:
                try:
                    os.link(path, tmp)
                except OSError:  # a filesystem without hard links
                    shutil.copy2(path, tmp)
            install(tmp, best, [])
        except BaseException:
            delete(tmp)
            raise

    _on_rank0(keep, ctx, f"rank 0 failed to keep {path} as {best}")
    return best


def wait_for_checkpoints() -> None:
    """Return once every checkpoint this process saved is on disk.

    `save_checkpoint` returns as soon as the file is whole under its name (a crash of
    the process can no longer lose it) and flushes it to disk (fsync) on a thread, so
    the loop does not wait for the disk. The next save, `Trainer.fit`'s end and the
    process's exit wait for that flush; call this before you copy the folder elsewhere
    or power the machine off.

    Raises:
        CheckpointError: a checkpoint could not be flushed to disk (the older ones it
            would have replaced were kept).
    """
    PENDING.wait()


def _save_sharded(
    state: dict[str, Any],
    shards: dict[str, Any],
    rngs: list[Any],
    directory: Path,
    ctx: DistContext,
    step: int,
    keep_last: int | None,
) -> Path:
    path = checkpoint_path(directory, step).with_suffix(sharded.SUFFIX)
    if ctx.is_main:
        PENDING.wait()
        directory.mkdir(parents=True, exist_ok=True)
        _clear_temporaries(directory)
    tmp = sharded.write_shards(shards, path, ctx)  # every rank its part

    def finish() -> None:
        try:
            problem = _state_problem(state, sharded=True)
            if problem is not None:  # no checkpoint: the shards' folder goes below
                raise CheckpointError(problem)
            _write_checkpoint({**state, "sharded": True}, rngs, ctx.world_size, tmp / sharded.META)
            sharded.publish(tmp, path, _outdated(directory, path, keep_last))
        except BaseException:
            delete(tmp)
            raise

    _on_rank0(finish, ctx, f"rank 0 failed to write checkpoint {path}")
    return path


def _write_checkpoint(
    state: dict[str, Any],
    rngs: list[Any],
    world_size: int,
    path: Path,
    keep_last: int | None = None,
) -> None:
    PENDING.wait()  # the previous checkpoint on disk, or its failure told (to every rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Inside a sharded checkpoint's temporary folder, the file must be on disk before
    # the folder is published; a checkpoint file of its own is made durable meanwhile.
    inside = path.parent.name.endswith(".tmp")
    if not inside:
        _clear_temporaries(path.parent)
    payload = {**state, "rng": rngs, "world_size": world_size, "format": FORMAT}
    model = state.get("model")
    if isinstance(model, dict):
        payload["model_fingerprint"] = model_fingerprint(model)
    me = this_process()
    payload["writer"] = {"command": me.command, "host": me.host, "pid": me.pid, "time": me.since}
    try:
        _write_atomically(
            payload,
            path,
            _outdated(path.parent, path, keep_last),
            sync="now" if inside else "later",
        )
    except _WriteFailed as exc:
        # A failed write touches no checkpoint (not even one of the same name).
        before = list_checkpoints(path.parent)
        kept = (
            f"{before[-1].name}, the newest checkpoint, is intact"
            if before
            else "the folder holds no checkpoint yet"
        )
        raise CheckpointError(
            f"{exc.what}; {kept} and no partial file was left: {exc.fix}, or pass "
            "--checkpoint-dir on another disk"
        ) from None


def _outdated(folder: Path, new: Path, keep_last: int | None) -> list[Path]:
    """The checkpoints in `folder` that `new` outdates, to be removed as it is published
    (`storage.install`): all but the newest `keep_last - 1` of the others (None or 0:
    none). The one just written is always kept, also when the folder holds newer steps
    (say a damaged one that its resume skipped)."""
    if keep_last is None or keep_last < 1:
        return []
    others = [p for p in list_checkpoints(folder) if p != new]
    return others[: max(len(others) - (keep_last - 1), 0)]


def model_fingerprint(state: dict[str, Any]) -> str:
    """sha256 of a model state dict's tensor names and shapes (not its values): what a
    checkpoint must match to load into a model."""
    text = "\n".join(f"{name} {list(shape)}" for name, shape in sorted(_shapes(state).items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {
        name: tuple(value.shape) if isinstance(value, torch.Tensor) else ()
        for name, value in strip_prefixes(state).items()
    }


def check_same_model(model: nn.Module, state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Raise CheckpointError, naming both models, when checkpoint `state` (as loaded)
    holds other tensors than `model` has; checkpoints that predate the recorded model
    class and fingerprint are compared by their tensors alone.

    Call it on every rank: they load the same file into the same model, so all of them
    raise, or none."""
    bare = unwrap(model)
    ours, theirs = _shapes(bare.state_dict()), _shapes(state["model"])
    if ours == theirs:
        return
    missing = [n for n in ours if n not in theirs]
    extra = [n for n in theirs if n not in ours]
    resized = [n for n in ours if n in theirs and ours[n] != theirs[n]]
    differences = []
    if missing:
        differences.append(f"it lacks {len(missing)} of this model's tensors, e.g. {missing[0]!r}")
    if extra:
        differences.append(f"it has {len(extra)} that this model lacks, e.g. {extra[0]!r}")
    if resized:
        name = resized[0]
        differences.append(
            f"{len(resized)} differ in shape, e.g. {name!r}: {list(theirs[name])} in it, "
            f"{list(ours[name])} in this model"
        )
    written = state.get("model_class") or "a model whose class was not recorded"
    if state.get("model_fingerprint"):
        written += f" (fingerprint {str(state['model_fingerprint'])[:12]})"
    command = (state.get("writer") or {}).get("command")
    if command:
        written += f" by `{command}`"
    raise CheckpointError(
        f"checkpoint {path} holds another model ({'; '.join(differences)}): it was written "
        f"for {written}; this job's model is {model_class_name(bare)} (fingerprint "
        f"{model_fingerprint(bare.state_dict())[:12]}): give each job its own "
        "--checkpoint-dir, or drop --resume to start from scratch"
    )


def lock_folder(directory: str | os.PathLike[str], ctx: DistContext) -> FolderLock | None:
    """Take `directory`'s lock for this job: rank 0 takes it, the other ranks get None.

    A collective: call it on EVERY rank. When the lock is held by another job that
    still runs, every rank raises the same CheckpointError naming that job.
    """
    lock = FolderLock(directory)  # only made: rank 0 takes it
    _on_rank0(lock.acquire, ctx, f"rank 0 failed to lock {directory}")
    return lock if ctx.is_main else None


def _on_rank0(action: Callable[[], T], ctx: DistContext, failed: str) -> T | None:
    """Run `action` on rank 0 alone; then every rank returns what it returned (sent to
    the others: it must pickle), or raises rank 0's CheckpointError (rank 0 raises its
    own error, whatever it is; for an error of another kind, the others raise
    "`failed`: see rank 0's error"). A collective: the other ranks wait until rank 0 is
    done, and none is left waiting when it fails."""
    outcome: list[tuple[T | None, str | None]] = [(None, None)]  # (result, error)
    failure: Exception | None = None
    if ctx.is_main:
        try:
            outcome = [(action(), None)]
        except Exception as exc:
            failure = exc
            told = str(exc) if isinstance(exc, CheckpointError) else f"{failed}: see rank 0's error"
            outcome = [(None, told)]
    if ctx.distributed:
        dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    result, error = outcome[0]
    if error is not None:
        raise CheckpointError(error)
    return result


class _Unreadable(Exception):
    """Why one checkpoint file could not be loaded: `reason` (what is wrong with the file)
    and `fix` (what to do about it when this file was asked for by name); `kind` and
    `detail` say it short, for the line that reports a skipped file."""

    def __init__(self, reason: str, fix: str, kind: str, detail: str) -> None:
        self.reason = reason
        self.fix = fix
        self.kind = kind
        self.detail = detail
        super().__init__(f"{reason}: {fix}")


# Phrases of torch's weights-only unpickler that mean "this pickle names a Python object
# that is not allowed" (a refusal), as opposed to a stream that is merely damaged.
_REFUSAL = re.compile(
    r"(?:unsupported GLOBAL|Unsupported global: GLOBAL) (\S+)|unrecognized function|"
    r"Can only create new object|Can only build"
)
_DELETE_IT = "delete it (or move it out of the folder) to resume from the one before"


def _file_of(path: Path) -> Path:
    """The file that holds checkpoint `path`'s pickle (of a sharded one: its `meta.pt`)."""
    return path / sharded.META if path.is_dir() else path


def _read_bytes(path: Path) -> bytes:
    """The bytes of one checkpoint file (of a sharded checkpoint: its `meta.pt`), for a
    digest of exactly what is decoded. One function, so a test can make one rank's read
    of one file fail or differ (as on a node with a different filesystem)."""
    return _file_of(path).read_bytes()


def _decode(data: bytes | BinaryIO, path: Path) -> dict[str, Any]:
    """Unpickle a checkpoint's bytes (or its open file) with `weights_only=True`, its
    tensors on the CPU."""
    try:
        source = io.BytesIO(data) if isinstance(data, bytes) else data
        # The CPU, not the rank's GPU: load_state_dict places each tensor where its
        # object wants it (Adam's `step` on the CPU: on a GPU, foreach Adam reads it back
        # with two host syncs per parameter per step), and the GPU never holds the whole
        # file, every rank's RNG states included.
        state = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        refusal = _REFUSAL.search(text) if "Weights only load failed" in text else None
        if refusal is None:
            raise _corrupt(path, "UnpicklingError") from None
        what = f"GLOBAL {refusal.group(1).rstrip('.')}" if refusal.group(1) else refusal.group(0)
        detail = (
            "it holds Python objects that a weights-only load does not allow (it could run "
            f"code), so it was not unpickled ({what})"
        )
        raise _Unreadable(
            f"checkpoint {path} was refused: {detail}",
            "save_checkpoint writes only tensors and plain values, so this file was written "
            f"by something else or altered; {_DELETE_IT}",
            "refused",
            detail,
        ) from None
    except Exception as exc:
        raise _corrupt(path, type(exc).__name__) from None
    if not isinstance(state, dict) or not Strategy.holds_model(state):
        raise _Unreadable(
            f"{path} is not a ddpkit checkpoint (no 'model' entry)",
            f"pass a file written by save_checkpoint, or {_DELETE_IT}",
            "foreign",
            "not a ddpkit checkpoint (no 'model' entry)",
        )
    return state


def _corrupt(path: Path, error: str) -> _Unreadable:
    detail = f"truncated or corrupt ({error})"
    return _Unreadable(f"checkpoint {path} is {detail}", _DELETE_IT, "corrupt", detail)


def _load(path: Path, *, digest: bool) -> tuple[dict[str, Any], str | None]:
    """The state in `path` and, with `digest`, the sha256 of the bytes it was decoded
    from (read once, so that the digest is of exactly what was decoded); without it,
    None, and the file is decoded as it is read: no copy of its bytes in memory and no
    hash (with both, a one-process load took 3x a plain torch.load: bench/scaling.py).
    A sharded checkpoint is first checked against its `.metadata`, so that a damaged one
    is skipped as a corrupt file is, not found out by DCP in the middle of a load."""
    problem = sharded.damage(path) if path.is_dir() else None
    if problem is not None:
        raise _corrupt(path, problem)
    if not digest:
        try:
            with _file_of(path).open("rb") as f:
                return _decode(f, path), None
        except (OSError, _Unreadable):
            pass  # a file that does not load is told by its bytes below, as ever
    try:
        data = _read_bytes(path)
    except FileNotFoundError:
        raise _Unreadable(
            f"checkpoint {path} does not exist",
            "pass the path of an existing ckpt-*.pt file or ckpt-*.dcp folder",
            "vanished",
            "it no longer exists",
        ) from None
    except OSError as exc:
        detail = f"cannot be read ({exc.strerror or exc})"
        raise _Unreadable(
            f"checkpoint {path} {detail}",
            "check that the file and its folder are readable by this user",
            "unreadable",
            detail,
        ) from None
    return _decode(data, path), hashlib.sha256(data).hexdigest() if digest else None


def load_checkpoint(path: str | os.PathLike[str], ctx: DistContext) -> dict[str, Any]:
    """Load one checkpoint written by `save_checkpoint`, its tensors on the CPU.

    Only the calling rank reads the file; no collective is involved. The file is read
    with `weights_only=True`, so it cannot run code: a file holding other Python objects
    is refused without being unpickled.

    Args:
        path: the checkpoint file.
        ctx: this rank's `DistContext`.

    Returns:
        The saved state, with `rng` (every rank's RNG state) and `world_size` added;
        its tensors are on the CPU (`load_state_dict` copies them onto the device).

    Raises:
        CheckpointError: the file is missing, unreadable, refused (it holds Python objects
            a weights-only load does not allow) or not a ddpkit checkpoint.
    """
    try:
        return _load(Path(path), digest=False)[0]
    except _Unreadable as exc:
        raise CheckpointError(str(exc)) from None


def model_weights(
    path: str | os.PathLike[str], ctx: DistContext, *, scratch: Path | None = None, fix: str
) -> dict[str, Any]:
    """The whole model of one checkpoint, its tensors on the CPU, read by this process
    alone (no collective): a one-file checkpoint's "model"; a sharded one's shards
    joined (`sharded.joined_model`, through a temporary file in `scratch`).

    Raises:
        CheckpointError: the checkpoint is damaged or cannot be read (for a sharded one,
            the line ends with `fix`), as `load_checkpoint` says.
    """
    path = Path(path)
    if not path.is_dir():
        return dict(load_checkpoint(path, ctx)["model"])
    problem = sharded.damage(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is damaged ({problem}): {fix}")
    return sharded.joined_model(path, scratch, fix)


@dataclass
class Found:
    """The checkpoint to resume from: its `path`, its `state` as loaded, and the newer
    files that were `skipped` ("corrupt ckpt-000000064.pt: truncated or corrupt (...)")."""

    path: Path
    state: dict[str, Any]
    skipped: list[str] = field(default_factory=list)

    def skip_note(self) -> str:
        """The skipped files as one clause ("skipped corrupt ckpt-...: ..."); "" if none."""
        return "; ".join(f"skipped {s}" for s in self.skipped)


def names_one(where: str | os.PathLike[str]) -> bool:
    """Whether `where` names one checkpoint (a file, a path ending in `.pt`, or a
    sharded checkpoint's `.dcp` folder) rather than a folder of them."""
    path = Path(where)
    return (
        path.suffix in (".pt", sharded.SUFFIX) or path.is_file() or (path / sharded.META).is_file()
    )


def _newest_readable(
    where: str | os.PathLike[str], named: bool, ctx: DistContext
) -> tuple[Found, str | None] | None:
    """This process's pick: the newest checkpoint that loads and its sha256 (which the
    other ranks check; None in a one-process job), None when there is none. All of them
    broken raises, and so does a `named` checkpoint that does not load."""
    if named:
        try:
            state, digest = _load(Path(where), digest=ctx.distributed)
        except _Unreadable as exc:
            raise CheckpointError(str(exc)) from None
        return Found(Path(where), state), digest
    candidates = list_checkpoints(where)
    broken: list[str] = []
    skipped: list[str] = []
    for path in reversed(candidates):
        try:
            state, digest = _load(path, digest=ctx.distributed)
        except _Unreadable as exc:
            broken.append(exc.reason)
            skipped.append(f"{exc.kind} {path.name}: {exc.detail}")
            continue
        return Found(path, state, skipped), digest
    if candidates:
        raise CheckpointError(
            f"no checkpoint in {where} could be read ({'; '.join(broken)}): delete "
            "them, or drop --resume to start from scratch"
        )
    return None


def _step_of(path: Path) -> int:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else -1


def _check_same_file(path: Path, digest: str) -> tuple[dict[str, Any], str | None]:
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
        return _decode(data, path), None
    except _Unreadable as exc:
        return {}, exc.reason
    except Exception as exc:  # never leave the other ranks waiting in the collective
        return {}, f"loading it failed ({type(exc).__name__}: {exc})"


def latest_checkpoint(
    directory: str | os.PathLike[str], ctx: DistContext
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in `directory` that loads, skipping (and reporting) broken ones.

    As `find_checkpoint` (call it on EVERY rank), and rank 0 logs a warning for the
    files it skipped ("skipped corrupt ckpt-...: ...; resuming from ckpt-...").

    Returns:
        `(path, state)` of the newest readable checkpoint, or None when the folder holds
        no checkpoint.

    Raises:
        CheckpointError: as `find_checkpoint`.
    """
    found = find_checkpoint(directory, ctx)
    if found is None:
        return None
    if found.skipped and ctx.is_main:
        log.warning("%s; resuming from %s", found.skip_note(), found.path.name)
    return found.path, found.state


def find_checkpoint(where: str | os.PathLike[str], ctx: DistContext) -> Found | None:
    """The checkpoint to resume from: in a folder, the newest that loads, with the newer
    ones it skipped because they do not load (each with the reason); or the one
    checkpoint `where` names. Nothing is logged.

    The one way every rank reads a checkpoint. With a process group this is a
    collective: call it on EVERY rank. Rank 0 alone picks the checkpoint and broadcasts
    its name, step and sha256; every other rank loads exactly that file and checks its
    digest, so all ranks resume from the same state or all of them raise the same error.

    Args:
        where: the checkpoint folder, or one checkpoint in it (a `ckpt-*.pt` file or a
            sharded `ckpt-*.dcp` folder).
        ctx: this rank's `DistContext`.

    Returns:
        The checkpoint found (the same on every rank), or None when the folder holds no
        checkpoint.

    Raises:
        CheckpointError: the folder holds checkpoints but none of them loads, or the
            named checkpoint does not load; or, in a distributed job, some rank could
            not load the file rank 0 chose (the message names the ranks, the file and
            why).
    """
    found: Found | None = None

    def choose() -> tuple[Any, ...] | None:  # path, named, step, sha256, skipped
        nonlocal found
        named = names_one(where)  # rank 0 decides, so that every rank does the same
        mine = _newest_readable(where, named, ctx)
        if mine is None:
            return None
        found, digest = mine
        return str(found.path), named, _step_of(found.path), digest, found.skipped

    # Rank 0 chooses. Whatever happens there is broadcast, so no rank waits forever.
    choice = _on_rank0(choose, ctx, f"rank 0 failed while choosing a checkpoint in {where}")
    if choice is None or not ctx.distributed:
        return found

    chosen, named, step, digest, skipped = choice  # rank 0's path names it in errors
    # A name in the folder: the same file when nodes share it, wherever they mount it.
    path = Path(chosen) if named else Path(where) / Path(chosen).name
    problem: str | None = None
    if found is None:
        state, problem = _check_same_file(path, digest)
        found = Found(path, state, skipped)

    # Everyone agrees on the outcome, so one rank's failure stops every rank.
    problems = all_gather_object(problem)
    failed = [r for r, p in enumerate(problems) if p is not None]
    if failed:
        reasons = "; ".join(f"rank {r}: {problems[r]}" for r in failed)
        raise CheckpointError(
            f"rank(s) {', '.join(map(str, failed))} could not load checkpoint {chosen} "
            f"(step {step}) that rank 0 chose to resume from ({reasons}): every rank must "
            "load the same file, so fix that and resume again"
        )
    found.path = path
    return found
