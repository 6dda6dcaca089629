"""Each rank's side of `--profile`: where its time goes, per optimizer step.

`start` installs a few hooks, once per process, on calls every training loop makes, so
that any script is measured as written (`ddpkit run --profile`), and the Trainer too
(`TrainConfig(profile=True)`):

- data: the time inside a DataLoader iterator's `__next__` (the wait for a batch);
- optimizer: the time inside any torch optimizer's `step()` (its pre and post hooks);
  its post hook also ends the step;
- comm, under DDP: from the moment the backward has computed the last gradient of a
  DDP model's parameters (a hook on the parameter whose gradient comes last) to the end
  of `backward()`: the wait for the all-reduces beyond the backward they overlap, as
  DDP waits for them there;
- comm, under FSDP2: the time in its all-gathers (`unshard`, `wait_for_unshard`), its
  reduce-scatters (`foreach_reduce`) and the wait for them at the end of the backward;
- ddpkit: the regions the Trainer marks as its own (`own`: checkpoints, logs, the stop
  vote);
- compute: the rest of the step (the forward and the backward, a loop's own code).

Regions never count twice: one inside another counts as the outer one. The Trainer's
evaluation is left out of the step (`outside`).

On GPUs the marks are CUDA events on the current stream, read once they have completed
(a step or two later, by `query()`): no synchronisation per step. A part then measures
what the GPU's stream spent there: a data wait that the GPU's queued work hid counts
as none. On CPUs the marks are `time.perf_counter()` and the main thread's CPU time,
which tells a rank that computes slowly from one that other processes keep off its
core (`compute_cpu`).

Off (never started) this costs nothing; on, a few microseconds per batch and step.
Under `ddpkit run` each rank writes what it measured to `rank<N>.profile.json` every
few seconds (`dump`), for the agent's verdict (`ddpkit.processes.profile`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ddpkit.inrank.breakdown import Breakdown
from ddpkit.storage import write_json

# Set by `ddpkit run --profile` for its workers: the seconds between two writes of a
# rank's measurements.
PROFILE_ENV = "DDPKIT_PROFILE"
_FILE = "rank{rank}.profile.json"
# Seconds between two writes of a rank's file, and so between two snapshots of its
# totals (the breakdown over time), at most; the most snapshots kept (then every other
# one goes).
DUMP_EVERY_S = 5.0
_MOST_SNAPSHOTS = 512
# The first steps pay for warming up (allocations, autotuning): the totals after them
# (`warm`) give the throughput that a one-rank baseline is compared with.
WARMUP_STEPS = 5
# `ddpkit run --profile --baseline`: the one-rank run stops after this many steps.
STOP_AFTER_ENV = "DDPKIT_PROFILE_STOP_AFTER"

Mark = Any  # (wall seconds, CPU seconds or None) on CPUs, a torch.cuda.Event on GPUs


class Profiler:
    """The measurements of this process (one per process: see `start`)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._thread = threading.get_ident()  # the loop's: the thread that started it
        self.total = Breakdown()
        # (seconds since the start, the totals then): the breakdown over time.
        self.snapshots: list[tuple[float, Breakdown]] = []
        self._born = time.perf_counter()
        self._depth = 0  # inside a timed region: nested ones count as it
        self._parts: list[tuple[str, Mark, Mark]] = []  # this step's timed regions
        self._left_out: list[tuple[Mark, Mark]] = []  # this step's regions outside it
        self._samples = 0
        # The first step starts with its first measured region (a batch fetched, say),
        # not with the set-up before it.
        self._step_start: Mark = None
        self._unread: deque[tuple[Mark, Mark, list[Any], list[Any], int]] = deque()
        self._optimizer_start: Mark = None
        self._last_gradient: Mark = None
        self._watched: weakref.WeakSet[Any] = weakref.WeakSet()
        self._gradients: list[_LastGradient] = []
        self._dumped = self._born  # the first write after DUMP_EVERY_S
        self._file: Path | None = None
        self._ended = 0  # steps ended (read or not)
        self.warm: Breakdown | None = None  # the totals after WARMUP_STEPS steps
        self.stop_after = 0  # end the process after this many steps (0: never)
        self.dump_every = DUMP_EVERY_S
        # When (time.perf_counter(), on the host) the first step began and the last ended.
        self.first_step_at: float | None = None
        self.last_step_at: float | None = None

    # -- marks ----------------------------------------------------------------------
    def mark(self) -> Mark:
        """Now: (wall seconds, this thread's CPU seconds) on CPUs, else a CUDA event."""
        if not self.cuda:
            return time.perf_counter(), time.thread_time()
        import torch

        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def _wall_mark(self) -> Mark:
        """`mark` without the CPU time (half a microsecond) where the thread waits: the
        CPU it uses there counts as compute's."""
        return (time.perf_counter(), None) if not self.cuda else self.mark()

    def _seconds(self, start: Mark, end: Mark) -> float:
        if not self.cuda:
            return float(end[0] - start[0])
        return float(start.elapsed_time(end)) / 1000.0

    def _cpu(self, start: Mark, end: Mark) -> float:
        """The seconds this thread ran between two marks (0 where not measured: on GPUs,
        and where a mark has no CPU time)."""
        if self.cuda or start[1] is None or end[1] is None:
            return 0.0
        return float(end[1] - start[1])

    def _ready(self, end: Mark) -> bool:
        return True if not self.cuda else bool(end.query())

    # -- regions --------------------------------------------------------------------
    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Time the region as `part` of this step (unless inside another region)."""
        if self._depth:
            yield
            return
        start = self._begin()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self._parts.append((part, start, self.mark()))

    def _begin(self) -> Mark:
        """A mark now, which starts the first step if none has started."""
        mark = self.mark()
        if self._step_start is None:
            self._step_start = mark
            if self.first_step_at is None:
                self.first_step_at = time.perf_counter()
        return mark

    def own(self) -> contextlib.AbstractContextManager[None]:
        """A region of ddpkit's own work (the Trainer's checkpoints, logs, stop vote)."""
        return self.timed("ddpkit")

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """A region that is no part of any step (the Trainer's evaluation)."""
        start = self.mark()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self._left_out.append((start, self.mark()))

    def fetch_started(self) -> Mark:
        """A DataLoader's `__next__` begins: its mark (None: not measured, inside another
        region or outside the main thread, whose loop this is)."""
        if self._depth or threading.get_ident() != self._thread:
            return None
        return self._begin()

    def fetch_ended(self, start: Mark, batch: Any) -> None:
        """... and returned `batch` (None when it raised: the end of the epoch)."""
        if start is not None:
            self._parts.append(("data", start, self.mark()))
            self._samples += _count(batch)

    # -- hooks ----------------------------------------------------------------------
    def optimizer_started(self) -> None:
        main = threading.get_ident() == self._thread
        self._optimizer_start = self._begin() if main and not self._depth else None

    def optimizer_ended(self) -> None:
        if threading.get_ident() != self._thread:
            return  # an optimizer of another thread's: no step of this loop
        end = self.mark()  # the optimizer's end is the step's
        if self._optimizer_start is not None:
            self._parts.append(("optimizer", self._optimizer_start, end))
            self._optimizer_start = None
        self.end_step(end)

    def gradients_ready(self) -> None:
        self._last_gradient = self._wall_mark()
        if self._step_start is None:  # a loop without a DataLoader: its first step
            self._begin()

    def backward_ended(self) -> None:
        if self._last_gradient is not None and not self._depth:
            self._parts.append(("comm", self._last_gradient, self._wall_mark()))
        self._last_gradient = None

    def watch(self, model: Any) -> None:
        """Measure the wait for `model`'s gradient all-reduces (a DDP model): from its
        last gradient to the end of the backward."""
        if model in self._watched:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        if params:
            self._watched.add(model)
            self._gradients.append(_LastGradient(self, params))

    # -- steps ----------------------------------------------------------------------
    def end_step(self, end: Mark = None) -> None:
        """The optimizer stepped (at `end`, else now): the step's regions are read once
        its marks completed."""
        end = self.mark() if end is None else end
        start = end if self._step_start is None else self._step_start
        self._unread.append((start, end, self._parts, self._left_out, self._samples))
        self._step_start, self._parts, self._left_out, self._samples = end, [], [], 0
        self._ended += 1
        self.last_step_at = now = time.perf_counter()
        self._read(wait=self._ended == WARMUP_STEPS)  # once: a GPU waits here alone
        if self._ended == WARMUP_STEPS:
            self.warm = self.total.copy()
            for watch in self._gradients:
                watch.keep_the_last()
        if self.stop_after and self._ended >= self.stop_after:
            self.dump(final=True)
            raise SystemExit(0)  # a baseline's steps are done: `finally` blocks run
        if self._file is not None and now - self._dumped >= self.dump_every:
            self.dump()

    def _read(self, wait: bool) -> None:
        # Added up in place, field by field: this runs every step.
        total, seconds, used = self.total, self._seconds, self._cpu
        while self._unread:
            start, end, parts, left_out, samples = self._unread[0]
            if not wait and not self._ready(end):
                return  # the GPU is still on it: read it at a later step
            if wait and self.cuda:
                end.synchronize()
            self._unread.popleft()
            wall, cpu, timed = seconds(start, end), used(start, end), 0.0
            for a, b in left_out:
                wall -= seconds(a, b)
                cpu -= used(a, b)
            for part, a, b in parts:
                took = max(seconds(a, b), 0.0)
                setattr(total, part, getattr(total, part) + took)
                timed += took
                cpu -= used(a, b)
            compute = max(wall - timed, 0.0)
            total.compute += compute
            total.compute_cpu += min(max(cpu, 0.0), compute)
            total.steps += 1
            total.samples += samples

    def snapshot(self) -> Breakdown:
        """The totals so far (every completed step), also kept for the breakdown over time."""
        self._read(wait=False)
        now = self.total.copy()
        self.snapshots.append((round(time.perf_counter() - self._born, 3), now))
        if len(self.snapshots) > _MOST_SNAPSHOTS:
            self.snapshots = self.snapshots[::2]
        return now

    def finish(self) -> Breakdown:
        """Every step read (waiting for the GPU's last ones): the totals."""
        self._read(wait=True)
        return self.snapshot()

    def dump(self, final: bool = False) -> None:
        """Write what this rank measured to its file (under `ddpkit run`)."""
        if self._file is None:
            return
        total = self.finish() if final else self.snapshot()
        self._dumped = time.perf_counter()
        data = {
            "total": total.to_dict(),
            "warm": None if self.warm is None else self.warm.to_dict(),
            "snapshots": [[t, b.to_dict()] for t, b in self.snapshots],
        }
        with contextlib.suppress(OSError):  # a full disk costs the profile, never the job
            write_json(self._file, data)


class _LastGradient:
    """When a model's last gradient of a backward is ready: a hook on each parameter
    while the order in which they are computed is learnt (the warm-up), then on the
    last one alone (a hook is a Python call per backward: a few microseconds)."""

    def __init__(self, profiler: Profiler, params: list[Any]) -> None:
        self.profiler = profiler
        self.last = -1  # the index of the parameter whose gradient came last
        self.handles = {
            i: p.register_post_accumulate_grad_hook(functools.partial(self._ready, i))
            for i, p in enumerate(params)
        }

    def _ready(self, index: int, param: Any) -> None:
        self.last = index
        self.profiler.gradients_ready()

    def keep_the_last(self) -> None:
        if self.last < 0:
            return  # no backward yet: keep learning
        for index, handle in self.handles.items():
            if index != self.last:
                handle.remove()
        self.handles = {self.last: self.handles[self.last]}


_PROFILER: Profiler | None = None


def active() -> Profiler | None:
    """This process's profiler, if `start` was called."""
    return _PROFILER


def start(cuda: bool | None = None, folder: Path | None = None, rank: int = 0) -> Profiler:
    """Start measuring this process (again: the same profiler). `folder`: write the
    measurements to `rank<N>.profile.json` there, every few seconds and at `dump`."""
    global _PROFILER
    if _PROFILER is None:
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        _PROFILER = Profiler(cuda)
        _install(_PROFILER)
    if folder is not None:
        _PROFILER._file = folder / _FILE.format(rank=rank)
    return _PROFILER


def read_file(folder: Path, rank: int) -> dict[str, Any] | None:
    import json

    try:
        data: dict[str, Any] = json.loads((folder / _FILE.format(rank=rank)).read_text())
    except (OSError, ValueError):
        return None
    return data


def _count(batch: Any, depth: int = 0) -> int:
    """The samples in a batch: the length of its first tensor (in a tuple, list or dict)."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    if depth < 3:
        if isinstance(batch, dict) and batch:
            return _count(next(iter(batch.values())), depth + 1)
        if isinstance(batch, (list, tuple)) and batch:
            return _count(batch[0], depth + 1)
    return 0


def _wrap(owner: Any, name: str, wrapper: Callable[[Any], Any]) -> None:
    original = getattr(owner, name, None)
    if original is not None:
        setattr(owner, name, functools.wraps(original)(wrapper(original)))


def _install(prof: Profiler) -> None:
    """The hooks: once per process, for every loader, optimizer and model."""
    import torch
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    from torch.utils.data import dataloader

    def next_batch(original: Any) -> Any:
        def __next__(self: Any) -> Any:
            start, batch = prof.fetch_started(), None
            try:
                batch = original(self)
            finally:
                prof.fetch_ended(start, batch)
            return batch

        return __next__

    _wrap(dataloader._BaseDataLoaderIter, "__next__", next_batch)
    register_optimizer_step_pre_hook(lambda *_: prof.optimizer_started())
    register_optimizer_step_post_hook(lambda *_: prof.optimizer_ended())

    def backward(original: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                prof.backward_ended()

        return run

    _wrap(torch.autograd, "backward", backward)

    from torch.nn.parallel import DistributedDataParallel

    def ddp_init(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            prof.watch(self)

        return __init__

    _wrap(DistributedDataParallel, "__init__", ddp_init)
    _install_fsdp(prof)


def _install_fsdp(prof: Profiler) -> None:
    """FSDP2's collectives and its waits for them count as communication. Private names
    of torch's: where a version lacks one, that time counts as compute."""
    try:
        from torch.distributed.fsdp._fully_shard import (
            _fsdp_param_group,
            _fsdp_state,
        )
    except ImportError:  # pragma: no cover - another torch layout
        return

    def communicating(original: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with prof.timed("comm"):
                return original(*args, **kwargs)

        return run

    group = getattr(_fsdp_param_group, "FSDPParamGroup", None)
    for name in ("unshard", "wait_for_unshard"):
        _wrap(group, name, communicating)
    _wrap(_fsdp_param_group, "foreach_reduce", communicating)
    _wrap(
        getattr(_fsdp_state, "FSDPState", None), "_root_post_backward_final_callback", communicating
    )


def from_env(rank: int, folder: Path) -> Profiler | None:
    """In a worker of `ddpkit run --profile`: start, writing to `folder`."""
    if not os.environ.get(PROFILE_ENV):
        return None
    prof = start(folder=folder, rank=rank)
    prof.stop_after = int(os.environ.get(STOP_AFTER_ENV, "0"))
    prof.dump_every = float(os.environ[PROFILE_ENV])
    return prof
