"""Worker side of crash and hang diagnosis: each rank reports where it is, and whether
it is working.

A daemon thread samples the main thread about once a second and writes `rank<N>.json`
into a status folder that the supervising process reads: the Python stack and when it
last changed, the collective the rank waits in (and since when), and when the rank last
showed that it works: its main thread used the CPU, it read data (a download), it has
a live child process (`subprocess.run`, a tokenizer, `tar`), or it is inside
`rank_zero_first`. Collectives are recorded by wrapping the `torch.distributed`
functions a script calls, which gives gloo on CPU what NCCL's flight recorder gives on
GPUs: which collective, in which order, called from which line. A rank that raises
writes `rank<N>.error.json`; a rank that returns says it has finished.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from ddpkit.collectives import COLLECTIVES, POINT_TO_POINT

# torch's own frames too: a rank blocked in DDP's gradient all-reduce sits in
# torch/autograd/graph.py, but the line to show is the user's `loss.backward()`.
_TORCH_SPEC = importlib.util.find_spec("torch")
_TORCH_DIR = os.path.dirname(_TORCH_SPEC.origin or "") + os.sep if _TORCH_SPEC else "torch/"
_OWN_FILES = (__file__, _TORCH_DIR, "multiprocessing/", "threading.py", "runpy.py")
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


# A share of the wall-clock time that the main thread must spend on the CPU to count as
# working; a loop that polls with sleep() uses far less.
_BUSY_SHARE = 0.05
# Bytes read between samples beyond which the rank counts as reading data.
_READ_BYTES = 4096

# What this process is doing on purpose (see `expect`): set by `rank_zero_first`.
_EXPECTED = {"work": 0, "wait": 0}


@contextlib.contextmanager
def expect(what: str) -> Iterator[None]:
    """Mark this process as working on purpose ("work": rank 0 inside rank_zero_first),
    or as waiting on purpose for such work ("wait"), so that no notice is printed."""
    _EXPECTED[what] += 1
    try:
        yield
    finally:
        _EXPECTED[what] -= 1


class CollectiveTracker:
    """Wraps torch.distributed's collectives (and send/recv) to record the one this
    rank waits in, and since when."""

    def __init__(self) -> None:
        self.count = 0
        self.current: dict[str, Any] | None = None

    def install(self) -> None:
        import torch.distributed as dist

        for name in sorted(COLLECTIVES | POINT_TO_POINT):
            original = getattr(dist, name, None)
            if original is not None and not getattr(original, "_ddpkit_tracked", False):
                setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            caller = _user_frame(sys._getframe(1))
            self.current = {
                "name": name,
                "seq": self.count,
                "where": describe(caller),
                "since": time.time(),
                "expected": _EXPECTED["wait"] > 0,
            }
            try:
                return original(*args, **kwargs)
            finally:
                self.current = None

        tracked._ddpkit_tracked = True  # type: ignore[attr-defined]
        return tracked


class _Activity:
    """Evidence that this process works: main-thread CPU time, bytes read, children."""

    def __init__(self, main_ident: int | None, main_native_id: int | None) -> None:
        self._status = f"/proc/self/task/{main_native_id}/status"
        self._clock: int | None = None
        with contextlib.suppress(AttributeError, OSError, TypeError):
            self._clock = time.pthread_getcpuclockid(main_ident)  # type: ignore[arg-type]
        self._own_reads = 0  # bytes this class read itself, not the rank's reading
        self._last = (time.time(), self._cpu(), self._read_bytes())

    def _cpu(self) -> float:
        if self._clock is not None:
            with contextlib.suppress(OSError):
                return time.clock_gettime(self._clock)
        return time.process_time()

    def _read(self, path: str) -> str:
        with open(path) as f:
            text = f.read()
        self._own_reads += len(text.encode())
        return text

    def _read_bytes(self) -> int:
        with contextlib.suppress(OSError, ValueError):
            for line in self._read("/proc/self/io").splitlines():
                if line.startswith("rchar:"):
                    return int(line.split()[1]) - self._own_reads
        return 0

    def wakeups(self) -> int:
        """How often the main thread was scheduled so far: a loop that polls with
        sleep() wakes up again and again; a thread blocked for good never does."""
        total = 0
        with contextlib.suppress(OSError, ValueError):
            for line in self._read(self._status).splitlines():
                if "ctxt_switches:" in line:
                    total += int(line.split()[1])
        return total

    def children(self) -> int:
        """Live (not zombie) child processes of this process."""
        pids: list[str] = []
        with contextlib.suppress(OSError):
            for task in os.listdir("/proc/self/task"):
                with contextlib.suppress(OSError):
                    pids += self._read(f"/proc/self/task/{task}/children").split()
        alive = 0
        for pid in pids:
            with contextlib.suppress(OSError, IndexError):
                alive += self._read(f"/proc/{pid}/stat").rsplit(") ", 1)[1][0] != "Z"
        return alive

    def working(self) -> bool:
        """Whether the rank worked since the last call."""
        now, cpu, read = time.time(), self._cpu(), self._read_bytes()
        then, cpu0, read0 = self._last
        self._last = (now, cpu, read)
        busy = cpu - cpu0 >= _BUSY_SHARE * max(now - then, 1e-3)
        return busy or read - read0 > _READ_BYTES or _EXPECTED["work"] > 0 or self.children() > 0


class Watchdog:
    """Samples this process's main thread and writes its status for the supervisor."""

    def __init__(
        self,
        folder: Path,
        rank: int,
        interval: float = 1.0,
        publish: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.path = folder / f"rank{rank}.json"
        self.publish = publish  # also hands each report elsewhere (a store, for other nodes)
        self.rank = rank
        self.interval = interval
        self.tracker = CollectiveTracker()
        self._main = threading.main_thread().ident
        self._activity = _Activity(self._main, threading.main_thread().native_id)
        self._signature: tuple[tuple[str, int], ...] = ()
        self._wakeups = -1
        self._moved = self._active = time.time()
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> Watchdog:
        self.tracker.install()
        self.sample()
        threading.Thread(target=self._run, name="ddpkit-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def finish(self, state: str = "finished") -> None:
        """Say that this rank has returned: it waits for nothing but the job's end.
        `state` "released": `launch` let it go under an agent, while rank 0 goes on
        alone (it waits for no one, see HangJudge)."""
        self._stop.set()
        with self._lock, contextlib.suppress(Exception):
            now = time.time()
            self._write(
                {
                    "rank": self.rank,
                    "pid": os.getpid(),
                    "state": state,
                    "sampled": now,
                    "moved": now,
                    "active": now,
                    "since": now,
                    "where": "finished",
                    "collective": None,
                    "stack": [],
                },
            )

    def _write(self, report: dict[str, Any]) -> None:
        write_json(self.path, report)
        if self.publish is not None:
            self.publish(report)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # diagnosis must never kill the job
                self.sample()

    def sample(self) -> None:
        with self._lock:
            if self._stop.is_set() and self.path.exists():
                return  # finished: keep that report
            self._sample()

    def _sample(self) -> None:
        frame = sys._current_frames().get(self._main or 0)
        signature = []
        f = frame
        while f is not None:
            signature.append((f.f_code.co_filename, f.f_lineno))
            f = f.f_back
        now = time.time()
        wakeups = self._activity.wakeups()
        if tuple(signature) != self._signature or wakeups != self._wakeups:
            self._signature, self._wakeups = tuple(signature), wakeups
            self._moved = now  # it moves: it may be polling, so it is not parked
        if self._activity.working():
            self._active = now
        self._write(
            {
                "rank": self.rank,
                "pid": os.getpid(),
                "state": "running",
                "sampled": now,
                "moved": self._moved,  # the stack last changed
                "active": self._active,  # the rank last showed that it works
                "expected_work": _EXPECTED["work"] > 0,
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
