"""Worker side of crash and hang diagnosis: each rank reports where it is.

A daemon thread samples the main thread's Python stack about once a second and writes
`rank<N>.json` into a status folder that the supervising process reads: the time the
stack last changed (progress), the stack itself, and the collective the rank is in.
Collectives are recorded by wrapping the `torch.distributed` functions a script calls,
which gives gloo on CPU what NCCL's flight recorder gives on GPUs: which collective,
in which order, called from which line. A rank that raises writes `rank<N>.error.json`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from ddpkit.collectives import COLLECTIVES

_OWN_FILES = (__file__, "torch/distributed/", "multiprocessing/", "threading.py", "runpy.py")
# Frames of the machinery that starts a worker: left out of the stacks we show.
_PLUMBING = (
    __file__,
    "multiprocessing/",
    "runpy",
    "<string>",
    "ddpkit/launcher.py",
    "ddpkit/diagnosis/shim.py",
)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically, so the reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame outside torch.distributed and ddpkit's own plumbing."""
    found = None
    while frame is not None:
        if not any(part in frame.f_code.co_filename for part in _OWN_FILES):
            return frame
        found = found or frame
        frame = frame.f_back
    return found


def describe(frame: FrameType | None) -> str:
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


class CollectiveTracker:
    """Wraps torch.distributed's collectives to record the one this rank is in."""

    def __init__(self) -> None:
        self.count = 0
        self.current: dict[str, Any] | None = None

    def install(self) -> None:
        import torch.distributed as dist

        for name in sorted(COLLECTIVES):
            original = getattr(dist, name, None)
            if original is not None and not getattr(original, "_ddpkit_tracked", False):
                setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            caller = _user_frame(sys._getframe(1))
            self.current = {"name": name, "seq": self.count, "where": describe(caller)}
            try:
                return original(*args, **kwargs)
            finally:
                self.current = None

        tracked._ddpkit_tracked = True  # type: ignore[attr-defined]
        return tracked


class Watchdog:
    """Samples this process's main thread and writes its status for the supervisor."""

    def __init__(self, folder: Path, rank: int, interval: float = 1.0) -> None:
        self.path = folder / f"rank{rank}.json"
        self.rank = rank
        self.interval = interval
        self.tracker = CollectiveTracker()
        self._main = threading.main_thread().ident
        self._signature: tuple[tuple[str, int], ...] = ()
        self._progress = time.time()
        self._stop = threading.Event()

    def start(self) -> Watchdog:
        self.tracker.install()
        self.sample()
        threading.Thread(target=self._run, name="ddpkit-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # diagnosis must never kill the job
                self.sample()

    def sample(self) -> None:
        frame = sys._current_frames().get(self._main or 0)
        signature = []
        f = frame
        while f is not None:
            signature.append((f.f_code.co_filename, f.f_lineno))
            f = f.f_back
        now = time.time()
        if tuple(signature) != self._signature:
            self._signature = tuple(signature)
            self._progress = now
        write_json(
            self.path,
            {
                "rank": self.rank,
                "pid": os.getpid(),
                "progress": self._progress,
                "sampled": now,
                "where": describe(_user_frame(frame)),
                "collective": self.tracker.current,
                "collectives_done": self.tracker.count - (1 if self.tracker.current else 0),
                "stack": _format_stack(frame),
            },
        )


def _format_stack(frame: FrameType | None) -> list[str]:
    """The stack of `frame`, outermost first, without the worker start-up machinery."""
    summary = traceback.extract_stack(frame) if frame is not None else []
    kept = [f for f in summary if not any(p in f.filename for p in _PLUMBING)]
    return traceback.format_list(kept)


def _format_exception(exc: BaseException) -> str:
    """Like traceback.format_exception, without the frames of ddpkit's machinery."""
    te = traceback.TracebackException.from_exception(exc)
    te.stack = traceback.StackSummary.from_list(
        [f for f in te.stack if not any(p in f.filename for p in _PLUMBING)]
    )
    return "".join(te.format())


def record_error(folder: Path, rank: int, exc: BaseException) -> None:
    """Leave this rank's exception for the supervisor's crash report."""
    with contextlib.suppress(OSError):
        write_json(
            folder / f"rank{rank}.error.json",
            {
                "rank": rank,
                "time": time.time(),
                "exc_type": type(exc).__name__,
                "message": str(exc),
                "traceback": _format_exception(exc),
            },
        )
