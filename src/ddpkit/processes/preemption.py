"""The launcher's side of preemption: a stop signal that reaches `launch` or `ddpkit
train` goes on to the workers, which then agree on a step to save after (see
`ddpkit.inrank.preemption`), and they get a grace period to do so."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from ddpkit.inrank.preemption import STOP_SIGNALS, install_handlers

# Seconds the ranks get to save after a signal before they are stopped regardless.
DEFAULT_SIGNAL_GRACE = 60.0


class SignalForwarder:
    """The launcher's side: the first stop signal or Ctrl-C it receives goes on to the
    workers (the same signal, so that they say which came), and they get `grace`
    seconds to save; a second one stops now. Its `signum` is the signal that the job
    was stopped by, and the one its stop line names."""

    def __init__(self, pids: Callable[[], list[int]], grace: float) -> None:
        self.pids, self.grace = pids, grace
        self.signum = 0
        self.deadline: float | None = None  # time.monotonic() by which the ranks must stop
        self._sent: set[int] = set()  # the workers that the signal was passed on to

    def install(self) -> dict[int, Any]:
        """Handle the stop signals and Ctrl-C; returns the previous handlers."""
        return install_handlers((*STOP_SIGNALS, signal.SIGINT), self._handle)

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def stop_now(self) -> NoReturn:
        """Leave as the signal would have: KeyboardInterrupt or SystemExit(128 + n)."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + self.signum)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum:  # asked twice: stop at once (a save under way leaves no file)
            self.signum = signum
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.stop_now()
        self.signum, self.deadline = signum, time.monotonic() + self.grace
        if signum == signal.SIGINT:
            print(
                "ddpkit: stopping; a job with a checkpoint folder saves first "
                "(press Ctrl-C again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
        self.catch_up()

    def catch_up(self) -> None:
        """Pass the signal received on to the workers that it has not reached yet (one
        started just as it came); nothing before a signal."""
        for pid in self.pids():
            if self.signum and pid not in self._sent:
                self._sent.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, self.signum)
