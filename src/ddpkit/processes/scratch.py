"""Scratch folders of a running job: removed when the job ends, swept when it was killed.

A job that ends in any normal way (success, error, signal) removes its own folder. One
killed with SIGKILL cannot, so each new folder is made after sweeping the folders
whose owner, a process on this machine, is gone.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from ddpkit.storage import is_running

_OWNER = "owner"


def scratch_dir(kind: str) -> Path:
    """A new empty folder `ddpkit-<kind>-*` in the temp folder (honours $TMPDIR)."""
    root = Path(tempfile.gettempdir())
    for old in root.glob(f"ddpkit-{kind}-*"):
        if _abandoned(old):
            shutil.rmtree(old, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=f"ddpkit-{kind}-"))
    (folder / _OWNER).write_text(f"{socket.gethostname()} {os.getpid()}")
    return folder


def _abandoned(folder: Path) -> bool:
    """True when the folder's owner was a process on this machine that has exited.

    A folder without an owner file (older, or still being made) is never touched, nor
    is one from another machine that shares the temp folder.
    """
    try:
        host, pid = (folder / _OWNER).read_text().split()
        return host == socket.gethostname() and not is_running(int(pid))
    except (OSError, ValueError):
        return False
