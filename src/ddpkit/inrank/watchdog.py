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
called from which line. The collectives that torch waits on from C++ (DDP's gradient
all-reduce inside `backward()`, DTensor's) are known by where the main thread sits
while the rank uses no CPU (`native_wait`). A rank that raises writes
`rank<N>.error.json`; a rank that returns says it has finished.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
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
from typing import Any, NamedTuple

from ddpkit.collectives import COLLECTIVES, POINT_TO_POINT
from ddpkit.inrank.deadlock import fork_deadlock_hint, stuck_for_good, waited_worker
from ddpkit.storage import write_json

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
# Frames of the machinery that starts a worker, and of ddpkit's wrappers between the
# user's call and torch (this file's collective tracker, the audit's hooks, --cpu's
# mappings): left out of the stacks we show, which promise the user's frames only.
_PLUMBING = (
    __file__,
    "multiprocessing/",
    "runpy",
    "<string>",
    "ddpkit/processes/launcher.py",
    "ddpkit/processes/workers.py",
    "ddpkit/processes/shim.py",
    "ddpkit/inrank/audit.py",
    "ddpkit/processes/rehearse.py",
)


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
# Bytes read or written between samples beyond which the rank counts as moving data.
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


# DDP's all-reduce of the gradients: torch launches it, and waits on it, from C++ inside
# `backward()`, where no wrapper of a Python function sees it.
GRADIENT_ALL_REDUCE = "DDP's gradient all-reduce in backward()"
# Where torch waits from C++ on a collective that no Python call of torch.distributed
# made: the innermost Python frame of the blocked main thread (a file of torch's, the
# function) -> the collective, in the words of the report.
_NATIVE_WAITS = {
    (os.path.join("autograd", "graph.py"), "_engine_run_backward"): GRADIENT_ALL_REDUCE,
    (os.path.join("distributed", "utils.py"), "_verify_param_shape_across_processes"): (
        "DDP's check of the parameters' shapes in DDP(...)"
    ),
    (os.path.join("distributed", "utils.py"), "_sync_params_and_buffers"): (
        "the broadcast of rank 0's parameters and buffers in DDP(...)"
    ),
    (os.path.join("nn", "parallel", "distributed.py"), "_distributed_broadcast_coalesced"): (
        "DDP's broadcast of the buffers in forward()"
    ),
    # Once, on the second step: the buckets rebuilt in the order gradients came.
    (os.path.join("nn", "parallel", "distributed.py"), "_pre_forward"): (
        "DDP's broadcast of its rebuilt gradient buckets in forward()"
    ),
    # DTensor's collectives (FSDP's gradient clipping, full_tensor()): launched at once,
    # waited on when the result is used.
    (os.path.join("distributed", "_functional_collectives.py"), "wait_tensor"): (
        "a DTensor collective (functional collectives: FSDP's gradient clipping, full_tensor())"
    ),
}
# The dispatch of a torch op (`torch.ops...`): between a function above and C++.
_OPS_FILE = _TORCH_DIR + "_ops.py"
# Work.wait of an async call whose launch no wrapper saw: isend and irecv (see
# ddpkit.collectives.POINT_TO_POINT), or a process group's own methods.
ASYNC_WAIT = "wait() of an isend/irecv"


def native_wait(frame: FrameType | None) -> str | None:
    """The collective that a main thread stopped at `frame` waits on from C++ (see
    _NATIVE_WAITS), if it is blocked at all: None when its innermost frame is none of
    those places."""
    inner = next((f for f in _frames(frame) if f.f_code.co_filename != _OPS_FILE), None)
    if inner is None or not inner.f_code.co_filename.startswith(_TORCH_DIR):
        return None
    path = inner.f_code.co_filename[len(_TORCH_DIR) :]
    return _NATIVE_WAITS.get((path, inner.f_code.co_name))


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
        # The DDP models of this process (see _note_ddp_models), held weakly.
        self.ddp_models: weakref.WeakSet[Any] = weakref.WeakSet()
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
        self._note_ddp_models()

    def _note_ddp_models(self) -> None:
        """Keep each DDP model that this process builds (ddpkit's wrap, or a script's
        own `DistributedDataParallel`): a backward idle in C++ waits in its gradient
        all-reduce unless none syncs (`no_sync()`). Only the constructor is wrapped: the
        training step (and torch.compile, which leaves DDP's forward alone) is not."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        original: Callable[..., None] = DDP.__init__
        if getattr(original, "_ddpkit_tracked", False):
            return

        @functools.wraps(original)
        def init(module: Any, *args: Any, **kwargs: Any) -> None:
            original(module, *args, **kwargs)
            self.ddp_models.add(module)

        init._ddpkit_tracked = True  # type: ignore[attr-defined]
        setattr(DDP, "__init__", init)  # noqa: B010

    def syncs_gradients(self) -> bool:
        """Whether a DDP model of this process all-reduces its gradients in the next
        backward (one not inside `no_sync()`)."""
        return any(model.require_backward_grad_sync for model in list(self.ddp_models))

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
            if call is None and self.current is None:
                # No wrapper saw it start: an isend or irecv (left unwrapped, see
                # ddpkit.collectives), or a process group's own method.
                call = {"name": ASYNC_WAIT, "seq": self.count + 1}
            elif call is None:  # a sync call's own wait, already recorded
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


class _Io(NamedTuple):
    """What a process (its threads) or its children did so far, from /proc."""

    cpu: float = 0.0  # CPU seconds
    read: int = 0  # bytes read (rchar: files, pipes, sockets)
    written: int = 0  # bytes written (wchar): a checkpoint, a log, a cache
    blkio: int = 0  # ticks spent waiting for block I/O (delay accounting; 0 where off)
    in_io_wait: bool = False  # some thread is in uninterruptible sleep now (state D)


def _stat_fields(text: str) -> list[str]:
    """The fields of a /proc/<pid>/stat line after the command name, which may hold
    spaces and parentheses: field 3 (the state) is [0], field 42 (blkio ticks) [39]."""
    return text.rsplit(") ", 1)[1].split()


class _Activity:
    """Evidence that this process works: CPU time of its threads (the watch's own aside)
    and child processes, bytes they read or write, time they spend waiting for the disk
    (a checkpoint's fsync to a slow disk uses no CPU and, once written, moves no more
    bytes: its thread sleeps uninterruptibly, state D), rank_zero_first."""

    def __init__(self, main_native_id: int | None) -> None:
        self._status = f"/proc/self/task/{main_native_id}/status"
        # The thread that samples (Watchdog._run): its own CPU time, and the reports it
        # writes, are no work.
        self.watch_thread: int | None = None
        self._watch_native: int | None = None
        self._own_reads = 0  # bytes this class read itself, not the rank's reading
        self._last = (time.time(), self._own(), self._children())

    def _cpu(self) -> float:
        """CPU seconds of every thread of this process so far, less the sampling's."""
        cpu = time.process_time()
        if threading.get_ident() == self.watch_thread:
            cpu -= time.thread_time()
            self._watch_native = threading.get_native_id()
        return cpu

    def _read(self, path: str) -> str:
        with open(path) as f:
            text = f.read()
        self._own_reads += len(text.encode())
        return text

    def _io(self, pid: int | str) -> tuple[int, int]:
        """(rchar, wchar) of /proc/<pid>/io, or of /proc/<pid>/task/<tid>/io."""
        counts = {"rchar": 0, "wchar": 0}
        with contextlib.suppress(OSError, ValueError):
            for line in self._read(f"/proc/{pid}/io").splitlines():
                key, _, value = line.partition(":")
                if key in counts:
                    counts[key] = int(value)
        return counts["rchar"], counts["wchar"]

    def _threads(self, pid: int | str) -> tuple[int, bool]:
        """(blkio ticks summed over the threads of `pid`, whether one of them is in
        uninterruptible sleep now), the watch's own thread aside."""
        ticks, waiting = 0, False
        tasks: list[str] = []
        with contextlib.suppress(OSError):
            tasks = os.listdir(f"/proc/{pid}/task")
        for task in tasks:
            if pid == "self" and task == str(self._watch_native):
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = _stat_fields(self._read(f"/proc/{pid}/task/{task}/stat"))
                waiting = waiting or fields[0] == "D"
                ticks += int(fields[39]) if len(fields) > 39 else 0
        return ticks, waiting

    def _own(self) -> _Io:
        """This process so far: its CPU time, reads and writes, less the watch's own."""
        cpu = self._cpu()
        read, written = self._io("self")
        read -= self._own_reads  # before this class reads more below
        if self._watch_native is not None:
            written -= self._io(f"self/task/{self._watch_native}")[1]
        blkio, waiting = self._threads("self")
        return _Io(cpu, read, written, blkio, waiting)

    def wakeups(self) -> int:
        """How often the main thread was scheduled so far: a loop that polls with
        sleep() wakes up again and again; a thread blocked for good never does."""
        total = 0
        with contextlib.suppress(OSError, ValueError):
            for line in self._read(self._status).splitlines():
                if "ctxt_switches:" in line:
                    total += int(line.split()[1])
        return total

    def _children(self) -> _Io:
        """The child processes so far: the live ones and their own ended children, and
        the ended children this process reaped (their CPU time only)."""
        times = os.times()
        cpu, read, written, blkio = times.children_user + times.children_system, 0, 0, 0
        waiting = False
        for pid in descendants(os.getpid(), self._read):
            with contextlib.suppress(OSError, IndexError, ValueError):
                # utime, stime, cutime, cstime: fields 14 to 17 of /proc/<pid>/stat
                fields = _stat_fields(self._read(f"/proc/{pid}/stat"))
                cpu += sum(int(f) for f in fields[11:15]) / _TICKS
                kid_read, kid_written = self._io(pid)
                kid_blkio, kid_waiting = self._threads(pid)
                read, written = read + kid_read, written + kid_written
                blkio, waiting = blkio + kid_blkio, waiting or kid_waiting
        return _Io(cpu, read, written, blkio, waiting)

    def working(self) -> bool:
        """Whether the rank worked since the last call."""
        now, own, kids = time.time(), self._own(), self._children()
        then, own0, kids0 = self._last
        self._last = (now, own, kids)
        # A child that leaves the tree (its parent ended first), or a thread that ends,
        # takes its counts with it: that drop must not hide the others' work.
        used = own.cpu - own0.cpu + max(kids.cpu - kids0.cpu, 0.0)
        busy = used >= _BUSY_SHARE * max(now - then, 1e-3)
        moved = own.read - own0.read + max(kids.read - kids0.read, 0)
        moved += own.written - own0.written + max(kids.written - kids0.written, 0)
        disk = own.in_io_wait or kids.in_io_wait
        disk = disk or own.blkio > own0.blkio or kids.blkio > kids0.blkio
        return busy or moved > _READ_BYTES or disk or _EXPECTED["work"] > 0


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
        # The collective this rank waits on from C++ (see native_wait), while it does.
        self._native: dict[str, Any] | None = None
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
        # A DataLoader polls its workers: when the one it waits for can never run again,
        # the rank is parked however often it wakes.
        stuck = next((pid for pid in waited_worker(frame) if stuck_for_good(pid)), None)
        if stuck is None and (signature != self._signature or wakeups != self._wakeups):
            self._moved = now  # it moves: it may be polling, so it is not parked
        self._signature, self._wakeups = signature, wakeups
        # Waiting for a child that uses no CPU (a `sleep`, a download stalled on the
        # network) is not parked either: the child may still end. It is uncertain, as
        # polling is; DataLoader workers idle beside a deadlocked main thread are not.
        child_wait = any(f.f_code.co_filename == subprocess.__file__ for f in _frames(frame))
        if child_wait:
            self._moved = now
        working = self._activity.working()
        if working:
            self._active = now
        collective = self.tracker.current or self._native_wait(frame, working, now)
        self._write(
            state="running",
            sampled=now,
            moved=self._moved,  # the stack last changed
            active=self._active,  # the rank last showed that it works
            expected_work=_EXPECTED["work"] > 0,
            child_wait=child_wait,
            stuck_worker=None if stuck is None else {"pid": stuck, "hint": fork_deadlock_hint()},
            where=describe(_user_frame(frame)),
            collective=collective,
            collectives_done=self.tracker.count
            - (1 if collective and collective["seq"] <= self.tracker.count else 0),
            stack=_format_stack(frame),
        )

    def _native_wait(
        self, frame: FrameType | None, working: bool, now: float
    ) -> dict[str, Any] | None:
        """The record of a collective that torch waits on from C++ (DDP's gradient
        all-reduce inside `backward()`, ...), when the main thread sits where it does
        (native_wait) and the rank used no CPU since the last sample: a long backward
        that computes is work, never a wait. None otherwise."""
        name = native_wait(frame) if not working else None
        if name == GRADIENT_ALL_REDUCE and not self.tracker.syncs_gradients():
            name = None  # a backward with nothing to all-reduce (no DDP, or no_sync())
        if name is not None and frame is not None and not self._native_is(name, now):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                # The next collective's number: the same on every rank at this step.
                record = _call_at(frame, name=name, seq=self.tracker.count + 1)
                # Idle at this line since it last worked or moved.
                record["since"] = max(self._active, self._moved)
                self._native = record
            else:
                name = None
        if name is None:
            self._native = None
        return self._native

    def _native_is(self, name: str, now: float) -> bool:
        """Whether the wait recorded is still this one: the same place, and the rank
        did not move since (a wait in the next step's backward is another)."""
        return self._native is not None and self._native["name"] == name and self._moved < now


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
