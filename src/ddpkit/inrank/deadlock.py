"""A DataLoader worker that can never run again, seen from the rank that waits for it.

A DataLoader's main thread waits for a batch by polling its workers (it wakes every few
seconds to see that they are alive), so a rank whose worker is stuck looks like a rank
that polls: it may still get its batch. One case is certain: a worker with a single
thread that sleeps on a lock of its own process with no timeout. Only another thread
of that process could release the lock, and there is none. It happens when a worker
is forked while another thread of the rank holds a lock that the child then needs:
in CPython itself before 3.11.10, 3.10.15 and 3.9.20 (gh-112275, the lock of the list
of thread states, which torch's and gloo's threads take), or in the user's code.

Linux only: a process's current system call and its arguments are read from
/proc/<pid>/syscall. Elsewhere, or when that file cannot be read, nothing is said.
"""

from __future__ import annotations

import contextlib
import platform
import sys
from types import FrameType
from typing import Any

# futex(2): its system call number, by machine; the wait operations; the flag of a
# lock private to one process.
_FUTEX = {"x86_64": 202, "aarch64": 98}
_FUTEX_WAITS = (0, 9)  # FUTEX_WAIT, FUTEX_WAIT_BITSET
_FUTEX_PRIVATE = 128
_FUTEX_CMD = 127

_DATALOADER = ("torch", "utils", "data", "dataloader.py")

# The CPython releases whose forked children can deadlock on the thread-state lock.
_FIXED = {(3, 9): 20, (3, 10): 15, (3, 11): 10}


def waited_worker(frame: FrameType | None) -> list[int]:
    """The pids of the DataLoader workers that the thread at `frame` waits for a batch
    from (empty when it does not wait in a DataLoader with workers)."""
    while frame is not None:
        parts = frame.f_code.co_filename.replace("\\", "/").split("/")
        if tuple(parts[-4:]) == _DATALOADER and frame.f_code.co_name in (
            "_try_get_data",
            "_get_data",
        ):
            loader_iter = frame.f_locals.get("self")
            workers: list[Any] = getattr(loader_iter, "_workers", None) or []
            return [w.pid for w in workers if getattr(w, "pid", None)]
        frame = frame.f_back
    return []


def stuck_for_good(pid: int) -> bool:
    """True when process `pid` has one thread, asleep on a lock of its own with no
    timeout: nothing can ever wake it."""
    number = _FUTEX.get(platform.machine())
    if number is None:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            threads = [line for line in f if line.startswith("Threads:")]
        with open(f"/proc/{pid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return False
    if not threads or threads[0].split()[1] != "1" or len(fields) < 5:
        return False
    with contextlib.suppress(ValueError):
        op, timeout = int(fields[2], 16), int(fields[4], 16)
        return (
            int(fields[0]) == number
            and op & _FUTEX_PRIVATE != 0
            and op & _FUTEX_CMD in _FUTEX_WAITS
            and timeout == 0
        )
    return False


def fork_deadlock_hint() -> str | None:
    """What to do when this Python's own fork can deadlock a child (gh-112275); None
    on a Python that has the fix."""
    version = sys.version_info
    fixed = _FIXED.get((version.major, version.minor))
    if version >= (3, 12) or (fixed is not None and version.micro >= fixed):
        return None
    return (
        f"Python {platform.python_version()} can deadlock a process forked while another "
        "thread holds its thread-state lock (CPython gh-112275, fixed in 3.11.10, 3.10.15, "
        "3.9.20 and 3.12): upgrade Python, or start the workers without fork: "
        'DataLoader(..., multiprocessing_context="forkserver")'
    )
