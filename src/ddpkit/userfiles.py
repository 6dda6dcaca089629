"""Reading a file that a user named (a config file, a script to check): a regular file
only, and a bounded read, so that a FIFO is never waited on and a device (/dev/zero) is
never read without end. It imports nothing of torch: the checker uses it too."""

from __future__ import annotations

import os
import stat

# What a path that is not a regular file is, in words.
_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a device",
    stat.S_IFBLK: "a device",
    stat.S_IFSOCK: "a socket",
}


def kind_of(mode: int) -> str:
    """What a file of `st_mode` `mode` is, in words: "a folder", "a FIFO", "a device"..."""
    return (
        "a regular file" if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "a special file")
    )


class NotRegularFile(OSError):
    """The path names a folder, a FIFO, a device or a socket; `kind` says which."""

    def __init__(self, path: str | os.PathLike[str], kind: str) -> None:
        super().__init__(f"{os.fspath(path)} is {kind}, not a regular file")
        self.kind = kind


def read_regular(path: str | os.PathLike[str], limit: int) -> tuple[bytes, int]:
    """(the bytes of `path`, its size), reading at most `limit + 1` bytes and none at all
    from a file whose size is over `limit`: compare the size with the limit.

    The kind is checked before the file is opened (opening a FIFO waits for a writer,
    and opening some devices does something), and again on the open file, which is
    opened without blocking, in case another file took its name meanwhile.

    Raises:
        NotRegularFile: a folder, FIFO, device or socket.
        OSError: the file is missing or cannot be read.
    """
    _check(os.stat(path).st_mode, path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    with os.fdopen(os.open(path, flags), "rb") as f:
        info = os.fstat(f.fileno())
        _check(info.st_mode, path)
        data = f.read(limit + 1) if info.st_size <= limit else b""  # it may grow meanwhile
    return data, max(info.st_size, len(data))


def _check(mode: int, path: str | os.PathLike[str]) -> None:
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, kind_of(mode))
