"""Exceptions ddpkit raises. Each message names the problem and the fix."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

# The exit status of a job that stopped on a signal after saving, to be resumed
# (sysexits' EX_TEMPFAIL: "try again later").
PREEMPTED_EXIT = 75
# Set in the workers of `ddpkit run` (the folder their reports go to).
RUN_WORKER = "DDPKIT_STATUS_DIR"


class DdpkitError(Exception):
    """Base class of every error ddpkit raises on purpose."""


class ConfigError(DdpkitError, ValueError):
    """A bad option or argument; the message says which one and what to pass instead."""


class CheckpointError(DdpkitError):
    """A checkpoint that cannot be written or read."""


class WorkerError(DdpkitError):
    """A worker process of `launch` failed; carries the failing rank and its traceback."""

    def __init__(
        self,
        rank: int,
        message: str,
        *,
        exitcode: int | None = None,
        exc_type: str | None = None,
        traceback: str = "",
    ) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.exc_type = exc_type
        self.traceback = traceback
        super().__init__(message)

    def __str__(self) -> str:
        text = super().__str__()
        if self.traceback:
            text += f"\n\n--- traceback of rank {self.rank} ---\n{self.traceback.rstrip()}"
        return text


class HangError(DdpkitError):
    """No rank of a job made progress for the hang timeout; the job was stopped."""

    def __init__(self, summary: str, stacks: str) -> None:
        self.summary = summary
        self.stacks = stacks
        super().__init__(summary)

    def __str__(self) -> str:
        return f"{self.summary}\n\n{self.stacks}" if self.stacks else self.summary


class _TryAgainLater(DdpkitError, SystemExit):
    """A SystemExit with `code` 75 (`PREEMPTED_EXIT`) that, left uncaught, ends the
    process with its one line on stderr and no traceback."""

    @property
    def code(self) -> int:  # type: ignore[override]  # read-only: always 75
        """The exit status, as SystemExit's `code`: 75, "try again later"."""
        # Python reads `code` to end a process in which nothing caught the exception,
        # and then no Python frame is left to be the caller: only then is the line
        # printed (code that catches SystemExit and reads `code` says what it wants).
        caller = sys._getframe().f_back
        if caller is None:
            print(f"ddpkit: {self}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT


class Preempted(_TryAgainLater):
    """The job stopped on a signal after every rank saved the same step; resume it.

    `except Exception` and `except Preempted` catch it as any error. It is also a
    `SystemExit` with `code` 75 (`PREEMPTED_EXIT`): left uncaught in a script
    (`python train.py`), it ends the process as `ddpkit train` does, with one line on
    stderr, no traceback, and exit status 75, on which a scheduler's script can requeue
    the job. `signum` is the signal that reached the launching process (`launch`, the
    one that `ddpkit train` runs), or, when none did, the one the ranks agreed on.
    """

    def __init__(self, checkpoint: str | Path, step: int, signum: int) -> None:
        self.checkpoint, self.step, self.signum = Path(checkpoint), step, signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}; saved "
            f"{self.checkpoint}: resume from it (with ddpkit train: the same command and "
            "--resume)"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # sent from the workers to the launcher
        return (Preempted, (self.checkpoint, self.step, self.signum))


class StoppedAtStart(_TryAgainLater):
    """A stop signal (SIGTERM, SIGUSR1; `signum`) ended the job while it was starting,
    before any rank's first optimizer step (the ranks were joining, or building their
    model and data): nothing was lost, so the same command simply starts it again.

    Like `Preempted`, an error and a `SystemExit` with `code` 75 (`PREEMPTED_EXIT`):
    uncaught in a script, it ends the process with one line and exit status 75, so a
    requeue script that requeues a preempted job (exit 75) requeues this one too. No
    checkpoint was written (a job resumed with `--resume` resumes from the same one
    again).
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} while the job was starting, before "
            "its first training step: nothing was lost; start it again with the same command"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (StoppedAtStart, (self.signum,))
