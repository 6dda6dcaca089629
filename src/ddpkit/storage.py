"""Folders that jobs write to: one job at a time per checkpoint folder, and a write that
fails (a full disk) said in words.

A checkpoint folder holds a lock file, `ddpkit.lock`, naming the job that uses it (its
pid, host, start time and command). A second job that finds the lock held stops with
an error naming the first; a lock left by a job that died on this host is taken over.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ddpkit.errors import CheckpointError

log = logging.getLogger("ddpkit")

LOCK_FILE = "ddpkit.lock"


# -- who a process is ---------------------------------------------------------------
@dataclass(frozen=True)
class Owner:
    """A process that holds a lock or writes a file: enough to name it to a person and to
    tell, on its own host, whether it still runs."""

    pid: int
    host: str
    since: str  # local time, for people
    command: str
    # Start time of the process in clock ticks since boot (Linux), so that a pid the
    # system has reused for another process is not taken for the job itself.
    ticks: int | None = None

    def is_process(self, other: Owner) -> bool:
        return (self.pid, self.host, self.ticks) == (other.pid, other.host, other.ticks)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {self.since}: `{self.command}`"


def this_process() -> Owner:
    """The calling process as an `Owner`, `since` now."""
    return Owner(
        pid=os.getpid(),
        host=socket.gethostname(),
        since=time.strftime("%Y-%m-%d %H:%M:%S"),
        command=command_line(),
        ticks=_proc_stat(os.getpid())[1],
    )


def command_line() -> str:
    """The command that started this job, as a person would type it (a spawned worker
    has its parent's sys.argv)."""
    if not sys.argv or not sys.argv[0]:
        return "python"
    head = Path(sys.argv[0])
    # `python -m ddpkit train ...` shows sys.argv[0] as the path of ddpkit/__main__.py.
    start = f"python -m {head.parent.name}" if head.name == "__main__.py" else head.name
    text = " ".join([start, shlex.join(sys.argv[1:])]).strip()
    return text if len(text) <= 300 else text[:297] + "..."


def _proc_stat(pid: int) -> tuple[str | None, int | None]:
    """(state letter, start time in ticks) of `pid` from /proc; (None, None) without it."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None, None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces
    return fields[0], int(fields[19])


def is_running(pid: int, ticks: int | None = None) -> bool:
    """Whether process `pid` of this host still runs (a zombie does not). With `ticks`,
    also that it is the same process, not a later one that got the same pid. Unsure
    (no /proc) counts as running, so no live job's files are ever taken."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    state, started = _proc_stat(pid)
    if state is None:
        return True
    return state not in "ZX" and (ticks is None or started == ticks)


def host_token(host: str) -> str:
    """`host` as it can appear in a file name."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", host)


# -- the lock -----------------------------------------------------------------------
class FolderLock:
    """The lock of one folder: `acquire()` or raise CheckpointError, `release()` when done.

    Creating the lock file is the lock (O_EXCL: of two jobs, one creates it), so it also
    works between hosts on a shared filesystem. The file names its owner; a lock whose
    owner no longer runs on this host is stale and taken over. A lock from another host
    cannot be checked, so it is never taken over: the error says how to remove it.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.held = False

    def acquire(self) -> None:
        me = this_process()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for _ in range(5):  # each pass either takes the lock, or removes a stale one
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    holder = self._holder(wait_s=2.0)
                    if holder is None:  # released meanwhile: try again
                        continue
                    if holder.is_process(me):  # this process holds it already
                        self.held = True
                        return
                    if holder.host == me.host and not is_running(holder.pid, holder.ticks):
                        self._take_over(holder)
                        continue
                    raise self._in_use(holder, me) from None
                try:
                    with os.fdopen(fd, "w") as f:
                        f.write(json.dumps(asdict(me)) + "\n")
                        f.flush()
                        os.fsync(f.fileno())
                except OSError:
                    self.path.unlink(missing_ok=True)  # an empty lock would stop every job
                    raise
                self.held = True
                return
        except OSError as exc:
            what, fix = write_failure(exc, self.folder)
            raise CheckpointError(
                f"cannot create the lock file {self.path}: {what}: {fix}, or pass another "
                "--checkpoint-dir"
            ) from None
        raise CheckpointError(
            f"cannot take the lock {self.path}: other jobs keep taking it; give this job "
            "its own --checkpoint-dir"
        )

    def release(self) -> None:
        """Remove the lock file if this process holds it. Never raises: it runs while a
        job ends, perhaps on an error that must not be hidden."""
        if not self.held:
            return
        self.held = False
        try:
            holder = self._holder(wait_s=0.0)
            if holder is not None and holder.is_process(this_process()):
                self.path.unlink()
        except (OSError, CheckpointError) as exc:
            log.warning("could not remove the lock file %s (%s): delete it", self.path, exc)

    def _holder(self, wait_s: float) -> Owner | None:
        """The owner the lock file names (None: there is no lock file). A file just
        created is empty until its owner writes it, so an unreadable one is read again
        for up to `wait_s` seconds."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                data = json.loads(self.path.read_text())
                return Owner(
                    pid=int(data["pid"]),
                    host=str(data["host"]),
                    since=str(data.get("since", "?")),
                    command=str(data.get("command", "?")),
                    ticks=None if data.get("ticks") is None else int(data["ticks"]),
                )
            except FileNotFoundError:
                return None
            except (ValueError, KeyError, TypeError) as exc:
                if time.monotonic() >= deadline:
                    raise CheckpointError(
                        f"the lock file {self.path} cannot be read ({type(exc).__name__}): "
                        "if no other job uses this folder, delete it"
                    ) from None
                time.sleep(0.05)

    def _take_over(self, stale: Owner) -> None:
        """Remove the lock of a job that no longer runs. Two jobs may find the same stale
        lock: the folder's flock lets one of them remove it, and only while it is still
        that stale lock (not one the other job has just created)."""
        with _flocked(self.folder):
            try:
                current = self._holder(wait_s=0.0)
            except (OSError, CheckpointError):
                return  # gone, or being rewritten: the next pass sees
            if current == stale:
                self.path.unlink(missing_ok=True)
                log.warning(
                    "took over the lock %s of pid %d on %s (%s), which is no longer running",
                    self.path,
                    stale.pid,
                    stale.host,
                    stale.command,
                )

    def _in_use(self, holder: Owner, me: Owner) -> CheckpointError:
        fix = "pass another --checkpoint-dir, or wait until that job ends"
        if holder.host != me.host:  # its pid cannot be checked from here
            fix += f"; if that job is gone, delete {self.path}"
        return CheckpointError(
            f"checkpoint folder {self.folder} is in use by another job ({holder.describe()}),"
            f" which holds {self.path}: {fix}"
        )


def fsync_folder(folder: Path) -> None:
    """Make the renames in `folder` durable (its entries), not only the files' data."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- replacing and removing whole files and folders -----------------------------------
# A name is the unit a kill cannot split: one rename either happened or did not. So a
# file or folder leaves its name by one rename, to a hidden temporary name of this
# process (`.<name>.<pid>@<host>.<random>.tmp`, the form of a write in progress, so that
# the next job clears a leftover one), and only then is deleted; deleting a folder in
# place would leave it damaged under its name, file by file, until the last one is gone.


def temporary_name(path: Path) -> Path:
    """A new hidden name beside `path` for its bytes in the making or on their way out,
    `.<name>.<pid>@<host>.<random>.tmp`, which the next job clears if this one dies."""
    token = f"{os.getpid()}@{host_token(socket.gethostname())}.{secrets.token_hex(4)}"
    return path.with_name(f".{path.name}.{token}.tmp")


def set_aside(path: Path) -> Path:
    """Rename `path` (a file or a folder) to a new hidden temporary name beside it, and
    return that name."""
    aside = temporary_name(path)
    os.rename(path, aside)
    return aside


def delete(path: Path) -> None:
    """Delete a file or a folder that has no name anyone reads (never raises)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def install(tmp: Path, path: Path, retire: list[Path], *, durable: bool = True) -> None:
    """Give the finished `tmp` the name `path` (in the same folder) and remove `retire`,
    so that at no moment more names are visible than at the end: each of `retire`, and an
    older folder at `path`, is first renamed aside, then `tmp` is renamed in, then the
    ones set aside are deleted. A kill at any moment leaves every name whole (at worst
    `path` and `retire` are all gone, their bytes under hidden names the next job
    clears). When the rename of `tmp` fails, the ones set aside get their names back. A
    file `tmp` never replaces a folder at `path` (IsADirectoryError, nothing changed)."""
    # A folder cannot be renamed over another one that is not empty, and deleting it
    # first would damage it under its name: it is set aside as the retired ones are.
    replaced = [path] if path.is_dir() and not path.is_symlink() else []
    if replaced and not tmp.is_dir():  # a file never takes a folder's place (os.replace's error)
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    aside: list[tuple[Path, Path]] = []
    try:
        for old in [*retire, *replaced]:
            try:
                aside.append((old, set_aside(old)))
            except FileNotFoundError:
                continue
        os.replace(tmp, path)  # a file at `path` is replaced by this one rename
    except BaseException:
        for old, moved in reversed(aside):
            with contextlib.suppress(OSError):
                os.rename(moved, old)
        raise
    if durable:
        fsync_folder(path.parent)
    for _, moved in aside:
        delete(moved)


def rename(path: Path, new: Path) -> None:
    """Give the file or folder `path` the name `new` (in the same folder): one rename,
    so a kill leaves it under one of the two names, whole."""
    os.rename(path, new)


# -- writing a file whole -------------------------------------------------------------
# Every file ddpkit writes for others to read while it runs, or after it died (a
# checkpoint, config.json, metrics.jsonl rewritten on resume, a csv logger's file given
# new columns, the hang watch's and the audit's reports), is written under a temporary
# name beside its own and renamed over it: a reader, or a job after a kill or a full
# disk, finds the old file or the new one, never half of one.

# What a file holds: bytes, text (written as UTF-8), or a function that writes it to
# the open binary file (`torch.save`, which streams: no copy in memory).
Content = bytes | str | Callable[[BinaryIO], object]


def stage(path: Path, content: Content, *, durable: bool = True) -> Path:
    """Write `content` to a new temporary file beside `path` (`temporary_name`), for
    `install` to give it the name `path`; with `durable`, on disk (fsync) before this
    returns. The temporary file; or the error, with no file left behind."""
    tmp = temporary_name(path)
    # O_EXCL: a new file of this process's own; mode 0o666 less the umask, as open() gives.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(content, str):
                f.write(content.encode("utf-8"))
            elif isinstance(content, bytes):
                f.write(content)
            else:
                content(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        delete(tmp)
        raise
    return tmp


def write(
    path: Path, content: Content, *, durable: bool = True, retire: list[Path] | None = None
) -> None:
    """Put `content` under the name `path` whole (`stage`, then `install` with `retire`).
    `durable`: the file and its name are on disk (fsync) before this returns; without
    it, a power cut (not a kill of the process) may lose the new file. On an error (a
    full disk), `path` and `retire` are as they were and no temporary file is left."""
    tmp = stage(path, content, durable=durable)
    try:
        install(tmp, path, retire or [], durable=durable)
    except BaseException:
        delete(tmp)  # nothing when the rename was done and only the folder's fsync failed
        raise


def write_json(
    path: Path,
    data: Any,
    *,
    durable: bool = False,
    indent: int | None = None,
    default: Callable[[Any], Any] | None = None,
) -> None:
    """Write `data` as JSON (one line, or indented by `indent`) to `path` whole (`write`);
    `default` as json.dumps takes it."""
    write(path, json.dumps(data, indent=indent, default=default) + "\n", durable=durable)


@contextlib.contextmanager
def _flocked(folder: Path) -> Iterator[None]:
    """An exclusive flock on the folder itself, where the filesystem has one (else
    nothing: the rare race it guards against is then not guarded)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # also releases the flock


def holds_lock(folder: str | os.PathLike[str]) -> bool:
    """Whether the calling process holds `folder`'s lock."""
    try:
        holder = FolderLock(folder)._holder(wait_s=0.0)
    except (OSError, CheckpointError):
        return False
    return holder is not None and holder.is_process(this_process())


# -- making a write durable off the caller's path -------------------------------------
class Durability:
    """Files already under their names whose bytes may still be in memory only.

    `torch.save` returns once the kernel holds the bytes; making them survive a power
    cut (an fsync) takes as long again on a fast disk, and longer on a network one. The
    training loop need not wait for that: a checkpoint renamed into place is whole to
    every reader at once, even if the process is killed, so a thread makes it durable
    (the file, then its folder) while training goes on, and only then deletes the
    checkpoints it outdates, so that a power cut before then still finds the older ones.

    One thread at a time: `later` first waits for the previous file. `wait` returns when
    every file handed over is on disk, and raises a failure once. A process holds one
    (`PENDING`), waited for at its exit (atexit, which `launch`'s workers run too).
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._thread: threading.Thread | None = None
        self._failure: str | None = None
        self._pid = os.getpid()
        self._waits_at_exit = False

    def later(self, path: Path, retire: list[Path]) -> None:
        """fsync `path` and its folder on a thread, then delete `retire` (their names
        first, by one rename each, so that a kill leaves no damaged one visible)."""
        self.wait()
        if not self._waits_at_exit:
            atexit.register(self.wait, quiet=True)
            self._waits_at_exit = True
        self._thread = threading.Thread(
            target=self._finish, args=(path, retire), name="ddpkit-durability"
        )
        self._thread.start()

    def _finish(self, path: Path, retire: list[Path]) -> None:
        try:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            fsync_folder(path.parent)
        except OSError as exc:
            what, fix = write_failure(exc, path.parent)
            kept = ", ".join(p.name for p in retire) or "the older checkpoints"
            self._failure = f"checkpoint {path} may not be on disk ({what}); {kept} kept: {fix}"
            return
        for old in retire:
            with contextlib.suppress(OSError):
                delete(set_aside(old))

    def wait(self, *, quiet: bool = False) -> None:
        """Return when every file handed over is on disk.

        Raises:
            CheckpointError: one could not be made durable (said once; with `quiet`,
                on stderr instead, for an exit path that already has an error).
        """
        if self._pid != os.getpid():  # a forked child: the thread is the parent's
            self._reset()
            return
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failure, self._failure = self._failure, None
        if failure is None:
            return
        if not quiet:
            raise CheckpointError(failure)
        print(f"ddpkit: {failure}", file=sys.stderr, flush=True)


PENDING = Durability()


# -- a write that failed ------------------------------------------------------------
# The errors of a write that ran out of room. torch.save reports them as a RuntimeError
# ("unexpected pos ...") raised while the OSError is being handled, so it is found in
# the exception's chain.
_OUT_OF_ROOM = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "the file size limit was hit (ulimit -f or setrlimit RLIMIT_FSIZE)",
}


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError that `exc` is or was raised while handling, if any."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None or isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def free_bytes(folder: Path) -> int | None:
    """Bytes that this user may still write in `folder`'s filesystem (None: unknown)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def size_text(n: int | None) -> str:
    if n is None:
        return "an unknown number of bytes"
    if n < 1 << 20:
        return f"{n:,} bytes"
    if n < 1 << 30:
        return f"{n / (1 << 20):.1f} MiB ({n:,} bytes)"
    return f"{n / (1 << 30):,.1f} GiB ({n:,} bytes)"


def write_failure(error: OSError, folder: Path, needed: int | None = None) -> tuple[str, str]:
    """`(what happened, what to do)` for an OSError from writing a file in `folder`:
    for a full disk, a quota or a size limit, how much room there is (and was needed)."""
    room = _OUT_OF_ROOM.get(error.errno or 0)
    if room is None:
        return error.strerror or str(error), "check the folder and its disk"
    needs = "" if needed is None else f"needs {size_text(needed)}, "
    what = f"{room} ({needs}{size_text(free_bytes(folder))} free in {folder})"
    if error.errno == errno.EFBIG:
        return what, "raise the limit (ulimit -f unlimited)"
    return what, "free some space there"
