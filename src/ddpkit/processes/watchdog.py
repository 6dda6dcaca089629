"""Worker side of crash and hang diagnosis: each rank reports where it is, and whether
it is working.

A daemon thread samples the main thread about once a second and writes `rank<N>.json`
into a status folder that the supervising process reads: the Python stack and when it
last changed, the collective the rank waits in (and since when), and when the rank last
showed that it works: any of its threads (the watch's own aside) or of its child
processes (`subprocess.run`, a tokenizer, `tar`, DataLoader workers) used the CPU, it or
a child read data (a download), or it is inside `rank_zero_first`. A child process that
merely exists is no such sign: idle DataLoader workers must not keep a hang alive.
Collectives are recorded by wrapping the `torch.distributed` functions a script (or
FSDP) calls, and the `wait()` of the work an `async_op=True` call returns, which gives
gloo on CPU what NCCL's flight recorder gives on GPUs: which collective, in which order,
called from which line. A rank that raises writes `rank<N>.error.json`; a rank that
returns says it has finished.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from ddpkit.collectives import COLLECTIVES, POINT_TO_POINT

# torch's own frames too: a rank blocked in DDP's gradient all-reduce sits in
# torch/autograd/graph.py, but the line to show is the user's `loss.backward()`.
_TORCH_SPEC = importlib.util.find_spec("torch")
_TORCH_DIR = os.path.dirname(_TORCH_SPEC.origin or "") + os.sep if _TORCH_SPEC else "torch/"
# subprocess's too: a rank waiting for its child is shown at its `subprocess.run` line.
_OWN_FILES = (
    __file__,
    _TORCH_DIR,
    "multiprocessing/",
    "threading.py",
    "runpy.py",
    subprocess.__file__,
)
# Frames of the machinery that starts a worker: left out of the stacks we show.
_PLUMBING = (
    __file__,
    "multiprocessing/",
    "runpy",
    "<string>",
    "ddpkit/processes/launcher.py",
    "ddpkit/processes/workers.py",
    "ddpkit/processes/shim.py",
)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically, so the reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _frames(frame: FrameType | None) -> Iterator[FrameType]:
    """`frame` and its callers, innermost first."""
    while frame is not None:
        yield frame
        frame = frame.f_back


def _user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame outside torch.distributed and ddpkit's own plumbing (else `frame`)."""
    outside = (f for f in _frames(frame) if not any(p in f.f_code.co_filename for p in _OWN_FILES))
    return next(outside, frame)


def describe(frame: FrameType | None) -> str:
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def waited_in(exc: BaseException) -> dict[str, str] | None:
    """The torch.distributed call that `exc` came out of, and the user's line that
    made it: {"name": "barrier", "where": "train.py:12 in main"}; None if it came from
    elsewhere. A rank whose peer left raises there (gloo: "Connection closed by
    peer"), and the report must say where it was waiting, not only that it failed."""
    names = COLLECTIVES | POINT_TO_POINT
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        code = frame.f_code
        if code.co_name in names and code.co_filename.startswith(_TORCH_DIR):
            return {"name": code.co_name, "where": describe(_user_frame(frame))}
    return None


def descendants(pid: int, read: Callable[[str], str] | None = None) -> list[int]:
    """Child processes of `pid`, theirs, and so on (Linux: /proc; elsewhere none)."""
    read = read or (lambda path: Path(path).read_text())
    found: list[int] = []
    todo, seen = [pid], {pid}
    while todo:
        parent = todo.pop()
        tasks: list[str] = []
        with contextlib.suppress(OSError):
            tasks = os.listdir(f"/proc/{parent}/task")
        for task in tasks:  # a child belongs to the thread that started it
            with contextlib.suppress(OSError, ValueError):
                for kid in map(int, read(f"/proc/{parent}/task/{task}/children").split()):
                    if kid not in seen:
                        seen.add(kid)
                        found.append(kid)
                        todo.append(kid)
    return found


# A share of the wall-clock time that the rank (its threads and child processes) must
# spend on the CPU to count as working; a loop that polls with sleep() uses far less,
# and so do idle threads (torch's pools, gloo's) and idle DataLoader workers.
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


def _call_at(frame: FrameType, **call: Any) -> dict[str, Any]:
    """`call` (a collective's record), waited in from `frame` from now on."""
    where = describe(_user_frame(frame))
    return {**call, "where": where, "since": time.time(), "expected": _EXPECTED["wait"] > 0}


class CollectiveTracker:
    """Wraps torch.distributed's collectives (and send/recv) to record the one this
    rank waits in, and since when.

    A call with `async_op=True` returns at once and the rank blocks later, in the
    `wait()` of the work it returned (FSDP gathers so): that wait is recorded as the
    collective, from the moment it begins. Works are remembered weakly, so one that is
    never waited on costs nothing once torch drops it."""

    def __init__(self) -> None:
        self.count = 0
        self.current: dict[str, Any] | None = None
        self._work_type: type | None = None
        self._pending: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()

    def install(self) -> None:
        import torch.distributed as dist

        for name in sorted(COLLECTIVES | POINT_TO_POINT):
            # A name that this torch lacks (all_gather_single before 2.13) is skipped.
            original = getattr(dist, name, None)
            if original is not None and not getattr(original, "_ddpkit_tracked", False):
                setattr(dist, name, self._wrap(name, original))
        work = getattr(getattr(dist, "distributed_c10d", None), "Work", None)
        wait = getattr(work, "wait", None)
        if isinstance(work, type) and wait is not None:
            self._work_type = work
            if not getattr(wait, "_ddpkit_tracked", False):
                # On the class: torch's own code (FSDP) calls it on the work it holds.
                setattr(work, "wait", self._wrap_wait(wait))  # noqa: B010

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            call = _call_at(sys._getframe(1), name=name, seq=self.count)
            outer, self.current = self.current, call
            try:
                result = original(*args, **kwargs)
            finally:
                self.current = outer
            self._remember(result, call)
            return result

        tracked._ddpkit_tracked = True  # type: ignore[attr-defined]
        return tracked

    def _remember(self, result: Any, call: dict[str, Any]) -> None:
        """Keep the collective that returned `result` (an async work, or a list of them:
        batch_isend_irecv) for the wait to come."""
        if self._work_type is None or result is None:
            return
        for work in result if isinstance(result, list) else [result]:
            if isinstance(work, self._work_type):
                with contextlib.suppress(TypeError):  # a work that takes no weak reference
                    self._pending[work] = call

    def _wrap_wait(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def tracked_wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                call = self._pending.get(work)
            except TypeError:
                call = None
            if call is None:  # a sync call's own wait (already recorded), or not ours
                return original(work, *args, **kwargs)
            outer, self.current = self.current, _call_at(sys._getframe(1), **call)
            try:
                return original(work, *args, **kwargs)
            finally:
                self.current = outer

        tracked_wait._ddpkit_tracked = True  # type: ignore[attr-defined]
        return tracked_wait


try:  # clock ticks per second, the unit of CPU times in /proc/<pid>/stat
    _TICKS = float(os.sysconf("SC_CLK_TCK"))
except (AttributeError, OSError, ValueError):
    _TICKS = 100.0


class _Activity:
    """Evidence that this process works: CPU time of its threads (the watch's own aside)
    and child processes, bytes they read, rank_zero_first."""

    def __init__(self, main_native_id: int | None) -> None:
        self._status = f"/proc/self/task/{main_native_id}/status"
        # The thread that samples (Watchdog._run): its own CPU time is no work.
        self.watch_thread: int | None = None
        self._own_reads = 0  # bytes this class read itself, not the rank's reading
        self._last = (time.time(), self._cpu(), *self._children(), self._read_bytes())

    def _cpu(self) -> float:
        """CPU seconds of every thread of this process so far, less the sampling's."""
        cpu = time.process_time()
        if threading.get_ident() == self.watch_thread:
            cpu -= time.thread_time()
        return cpu

    def _read(self, path: str) -> str:
        with open(path) as f:
            text = f.read()
        self._own_reads += len(text.encode())
        return text

    def _read_bytes(self, pid: int | str = "self") -> int:
        with contextlib.suppress(OSError, ValueError):
            for line in self._read(f"/proc/{pid}/io").splitlines():
                if line.startswith("rchar:"):
                    return int(line.split()[1]) - (self._own_reads if pid == "self" else 0)
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

    def _children(self) -> tuple[float, int]:
        """(CPU seconds, bytes read) of the child processes so far: the live ones and
        their own ended children, and the ended children this process reaped."""
        times = os.times()
        cpu, read = times.children_user + times.children_system, 0
        for pid in descendants(os.getpid(), self._read):
            with contextlib.suppress(OSError, IndexError, ValueError):
                # utime, stime, cutime, cstime: fields 14 to 17 of /proc/<pid>/stat
                fields = self._read(f"/proc/{pid}/stat").rsplit(") ", 1)[1].split()
                cpu += sum(int(f) for f in fields[11:15]) / _TICKS
                read += self._read_bytes(pid)
        return cpu, read

    def working(self) -> bool:
        """Whether the rank worked since the last call."""
        now, cpu, (kids_cpu, kids_read) = time.time(), self._cpu(), self._children()
        read = self._read_bytes()
        then, cpu0, kids_cpu0, kids_read0, read0 = self._last
        self._last = (now, cpu, kids_cpu, kids_read, read)
        # A child that leaves the tree (its parent ended first) takes its CPU time and
        # reads with it: that drop must not hide the others' work.
        used = cpu - cpu0 + max(kids_cpu - kids_cpu0, 0.0)
        busy = used >= _BUSY_SHARE * max(now - then, 1e-3)
        reads = read - read0 + max(kids_read - kids_read0, 0)
        return busy or reads > _READ_BYTES or _EXPECTED["work"] > 0


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
        self._activity = _Activity(threading.main_thread().native_id)
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

    def finish(self, state: str = "finished") -> None:
        """Say that this rank has returned: it waits for nothing but the job's end.
        `state` "released": `launch` let it go under an agent, while rank 0 goes on
        alone (it waits for no one, see HangJudge)."""
        self._stop.set()
        with self._lock, contextlib.suppress(Exception):
            now = time.time()
            self._write(
                state=state,
                sampled=now,
                moved=now,
                active=now,
                since=now,
                where="finished",
                collective=None,
                stack=[],
            )

    def _write(self, **fields: Any) -> None:
        report = {"rank": self.rank, "pid": os.getpid(), **fields}
        write_json(self.path, report)
        if self.publish is not None:
            self.publish(report)

    def _run(self) -> None:
        self._activity.watch_thread = threading.get_ident()
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
        signature = tuple((f.f_code.co_filename, f.f_lineno) for f in _frames(frame))
        now = time.time()
        wakeups = self._activity.wakeups()
        if signature != self._signature or wakeups != self._wakeups:
            self._signature, self._wakeups = signature, wakeups
            self._moved = now  # it moves: it may be polling, so it is not parked
        # Waiting for a child that uses no CPU (a `sleep`, a download stalled on the
        # network) is not parked either: the child may still end. It is uncertain, as
        # polling is; DataLoader workers idle beside a deadlocked main thread are not.
        child_wait = any(f.f_code.co_filename == subprocess.__file__ for f in _frames(frame))
        if child_wait:
            self._moved = now
        if self._activity.working():
            self._active = now
        self._write(
            state="running",
            sampled=now,
            moved=self._moved,  # the stack last changed
            active=self._active,  # the rank last showed that it works
            expected_work=_EXPECTED["work"] > 0,
            child_wait=child_wait,
            where=describe(_user_frame(frame)),
            collective=self.tracker.current,
            collectives_done=self.tracker.count - (1 if self.tracker.current else 0),
            stack=_format_stack(frame),
        )


def _format_stack(frame: FrameType | None) -> list[str]:
    """The stack of `frame`, outermost first, without the worker start-up machinery."""
    summary = traceback.extract_stack(frame) if frame is not None else []
    kept = [f for f in summary if not any(p in f.filename for p in _PLUMBING)]
    return traceback.format_list(kept)


def format_exception(exc: BaseException) -> str:
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
                "traceback": format_exception(exc),
                "waited_in": waited_in(exc),
            },
        )
