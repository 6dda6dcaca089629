"""Stop to be resumed: a stop signal (SIGTERM, SIGUSR1, or Ctrl-C) makes every rank
agree on one optimizer step after which they checkpoint together and exit.

Clusters stop jobs with a signal and a grace period before SIGKILL (SLURM's
`--signal=USR1@90`, Kubernetes' SIGTERM). A rank records the signal instead of dying,
provided a loop that can save is running (`saving_on_signal`); otherwise, and on a
second Ctrl-C, it stops at once as before. The ranks learn about a signal that reached
any of them through `StopVote`, one small all-reduce per step that is waited for one
step later, so it costs no wait of its own.

A job is starting (`starting_up`) until its first optimizer step: a stop signal that no
saving loop records then stops it at once, and as nothing was lost, the job ends as
`StoppedAtStart` (exit status 75, as a preempted job's), not as if it had been killed.
Under `ddpkit run` each rank decides alone, so it leaves notes (`tell_agent`) from which
the agent judges the whole job: whether it runs ddpkit's code at all, and whether any
rank has taken a step.

This is each rank's side; the launcher's, which passes a signal on to its workers and
gives them time to save, is `ddpkit.processes.preemption`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI reads the constants here without loading torch
    import torch

    from ddpkit.context import DistContext

# The signals that ask a job to save and stop.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass
class _Flag:
    """What this process's signal handler recorded (signals are per process)."""

    signum: int = 0  # the first stop signal received, 0 if none
    listeners: int = 0  # loops running that save on a signal
    interrupts: int = 0  # the Ctrl-Cs (SIGINT) among the signals received meanwhile
    starting: bool = False  # inside `starting_up`, before this process's first step
    launcher_says: bool = False  # a worker of `launch`, whose launcher says what Ctrl-C does
    notes: str = ""  # under `ddpkit run`: the path prefix of this rank's notes to its agent
    ddpkit_job: bool = False  # the note that this rank runs ddpkit's code is left


_FLAG = _Flag()

# Set on the SystemExit of a stop signal that came while the job was starting.
_STARTING_ATTR = "_ddpkit_stopped_starting"


def requested() -> int:
    """The stop signal this process received while a saving loop ran (0: none)."""
    return _FLAG.signum


# Notes a worker of `ddpkit run` leaves for its agent (`rank<N>.<note>`, see tell_agent).
DDPKIT_JOB_NOTE = "ddpkit"  # the rank runs ddpkit's code: launch, DistContext.current()
TRAINED_NOTE = "trained"  # the rank took its first optimizer step


def notes_to(prefix: str) -> None:
    """In a worker of `ddpkit run` (its shim): this rank's notes to the agent are the
    files `<prefix>.<note>`; a script that asks for `DistContext.current()` (its own
    process group) runs ddpkit's code."""
    from ddpkit.context import ON_CURRENT  # here: the CLI imports this module without torch

    _FLAG.notes = prefix
    if ddpkit_job not in ON_CURRENT:
        ON_CURRENT.append(ddpkit_job)


def tell_agent(note: str) -> None:
    """Under `ddpkit run`, leave `note` for the agent; elsewhere nothing."""
    if _FLAG.notes:
        with contextlib.suppress(OSError):  # a note is a hint: never an error of the job
            Path(f"{_FLAG.notes}.{note}").touch()


def ddpkit_job() -> None:
    """This rank runs ddpkit's code (`launch`, `DistContext.current()`): under `ddpkit
    run`, a stop signal before the job's first step then ends the job with 75, as under
    `launch`; a script without ddpkit code ends as under torchrun (see agent)."""
    if not _FLAG.ddpkit_job:
        _FLAG.ddpkit_job = True
        tell_agent(DDPKIT_JOB_NOTE)


def leave_notices_to_launcher() -> None:
    """In a worker of `launch`: the launcher, which a terminal's Ctrl-C reaches and which
    passes it on, says once what happens next; its workers say nothing more."""
    _FLAG.launcher_says = True


def _on_signal(signum: int, frame: Any) -> None:
    if _FLAG.listeners:
        if not _FLAG.signum:
            _FLAG.signum = signum  # the loop saves after the step the ranks agree on
        if signum != signal.SIGINT:
            return  # the same stop again (SLURM signals every process): the save goes on
        _FLAG.interrupts += 1
        if _FLAG.interrupts == 1:
            # A first Ctrl-C, perhaps after another signal (which is then saved on):
            # the save goes on. Said once per machine: by the launcher of `launch`,
            # which passes it on; else by local rank 0 (a terminal's Ctrl-C reaches
            # every worker of torchrun's).
            if not _FLAG.launcher_says and os.environ.get("LOCAL_RANK", "0") == "0":
                print(
                    "ddpkit: saving a checkpoint after this step, then stopping "
                    "(press Ctrl-C again to stop at once)",
                    file=sys.stderr,
                    flush=True,
                )
            return
    # Nothing here can save, or a second Ctrl-C: stop now. Raising lets `finally`
    # blocks release the process group and the workers on the way out.
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    stop = SystemExit(128 + signum)
    if _FLAG.starting:  # nothing trained yet: see starting_up
        setattr(stop, _STARTING_ATTR, signum)
    raise stop


def stopped_while_starting(exc: BaseException) -> int:
    """The stop signal (SIGTERM, SIGUSR1) that raised `exc`, a SystemExit, while this
    process was starting up (see `starting_up`); 0 for any other exception."""
    return int(getattr(exc, _STARTING_ATTR, 0))


@contextlib.contextmanager
def starting_up(
    *, watch_steps: bool = True, on_first_step: Callable[[], None] | None = None
) -> Iterator[None]:
    """While inside, this process counts as starting until its first optimizer step
    (`optimizer.step()` of any torch optimizer: Trainer's or a loop of your own). A stop
    signal that no saving loop records meanwhile raises a SystemExit that
    `stopped_while_starting` recognises: starting the job again loses nothing.

    `on_first_step` is called once, at that first step. `watch_steps` False: no
    optimizer runs in this process yet (the command line before it launches), so none is
    watched and torch is not imported; a region inside may watch its own.
    """
    before = _FLAG.starting
    _FLAG.starting = True
    handle = None
    if watch_steps:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        fired = False

        def first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            nonlocal fired
            if not fired:
                fired = True
                _FLAG.starting = False
                if on_first_step is not None:
                    on_first_step()

        # It stays for the region (torch iterates over the hooks as it calls this one,
        # so it cannot remove itself): one Python call per step, well under 1 µs.
        handle = register_optimizer_step_post_hook(first_step)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
        # A step taken inside was taken in the region around it too.
        _FLAG.starting = before and _FLAG.starting


def install_handlers(
    signals: tuple[int, ...] = STOP_SIGNALS, handler: Callable[[int, Any], None] | None = None
) -> dict[int, Any]:
    """Route `signals` to `handler` (default: record a stop for the saving loop, see
    `saving_on_signal`); returns the previous handlers, for `restore_handlers`. Does
    nothing outside the main thread, where Python cannot handle signals."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler or _on_signal) for s in signals}


def restore_handlers(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


# What a signal does where nobody chose: Python's defaults (SIGINT: KeyboardInterrupt).
_DEFAULT_HANDLERS = {
    signal.SIGTERM: signal.SIG_DFL,
    signal.SIGUSR1: signal.SIG_DFL,
    signal.SIGINT: signal.default_int_handler,
}


@contextlib.contextmanager
def saving_on_signal() -> Iterator[None]:
    """While inside, a stop signal is recorded (see `requested`) instead of stopping
    this process: the loop inside promises to poll it and save.

    The workers of `launch` and `ddpkit train` route the stop signals here from their
    start. A process that nobody prepared (a script that makes its own process group,
    under `ddpkit run`, torchrun or python) gets the same for the time inside: each of
    SIGTERM, SIGUSR1 and SIGINT that still does Python's default is routed here, and
    put back on the way out. A handler of the script's own, or SIG_IGN, stays."""
    current = {s: signal.getsignal(s) for s in _DEFAULT_HANDLERS}
    unset = tuple(s for s, h in current.items() if h is _DEFAULT_HANDLERS[s])
    previous = install_handlers(unset) if unset else {}
    _FLAG.listeners += 1
    try:
        yield
    finally:
        _FLAG.listeners -= 1
        if not _FLAG.listeners:
            _FLAG.signum = _FLAG.interrupts = 0
        restore_handlers(previous)


# Seconds between two stop votes: a vote is one small all-reduce (about 1 ms on gloo),
# so one per step cost 15-50 % of a few-millisecond CPU step. 0.1 s apart they cost
# about 1 %, and a signal stops the ranks within about 0.2 s of steps.
VOTE_INTERVAL_S = 0.1
_MAX_VOTE_EVERY = 10_000


class StopVote:
    """Whether any rank received a stop signal, decided on every rank after the same step.

    Call `step()` on every rank after every optimizer step. Every `every` steps it
    starts an all-reduce of this rank's signal and reads the one it started at the vote
    before, so every rank returns the same answer at the same step, without a wait of
    its own. `every` is chosen from the measured step time so that votes come about
    `interval` seconds apart, and is agreed in the vote itself (the largest proposal
    wins), so the ranks always vote at the same steps. It uses a gloo group of its own
    on GPUs (a CPU tensor needs no device sync)."""

    def __init__(self, ctx: DistContext, interval: float = VOTE_INTERVAL_S) -> None:
        import torch.distributed as dist

        self.ctx = ctx
        self.interval = interval
        self._group: Any = None
        if ctx.distributed and ctx.backend != "gloo":
            self._group = dist.new_group(backend="gloo")  # a collective: every rank
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._every = 1  # steps between votes: the same on every rank
        self._left = 1  # steps until the next vote
        self._since = time.perf_counter()  # when the last vote started

    def step(self) -> int:
        """The stop signal some rank received (the same on every rank), or 0."""
        if not self.ctx.distributed:
            return requested()
        self._left -= 1
        if self._left > 0:
            return 0
        now = time.perf_counter()
        per_step = (now - self._since) / self._every
        self._since = now
        decided, every = self._collect()
        if decided:
            return decided
        self._every = every or self._every
        import torch
        import torch.distributed as dist

        proposal = min(max(int(self.interval / max(per_step, 1e-6)), 1), _MAX_VOTE_EVERY)
        mine = torch.tensor([requested(), proposal], dtype=torch.int64)
        work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, mine)
        self._left = self._every
        return 0

    def close(self) -> int:
        """At the end of the loop: the stop signal some rank received (the same on every
        rank), or 0. Every rank calls this at the same point. A signal after the last
        vote started has no later vote to be read in, so this one votes now (one
        all-reduce that waits): a signal is never forgotten at the end."""
        if not self.ctx.distributed:
            return requested()
        decided, _ = self._collect()
        if decided:
            return decided
        import torch
        import torch.distributed as dist

        mine = torch.tensor([requested()], dtype=torch.int64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._group)
        return int(mine.item())

    def _collect(self) -> tuple[int, int]:
        """(the signal, the steps to the vote after next) of the pending vote."""
        if self._pending is None:
            return 0, 0
        work, value = self._pending
        self._pending = None
        work.wait()
        signum, every = value.tolist()
        return int(signum), int(every)
