"""The `ddpkit` command. Each subcommand lives in its own module and adds its own parser.

A subcommand module provides `add_parser(subparsers)`, which registers a parser whose
`func` default is `run(args) -> int` (the exit status). Heavy imports (torch) happen
inside `run`, so `ddpkit --help` and `ddpkit check` start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys
from collections.abc import Sequence

from ddpkit import __version__
from ddpkit.cli.flags import Parser
from ddpkit.errors import (
    PREEMPTED_EXIT,
    RUN_WORKER,
    DdpkitError,
    HangError,
    Preempted,
    StoppedAtStart,
    WorkerError,
)


def build_parser() -> argparse.ArgumentParser:
    from ddpkit.cli import check, export, info, plot, run, train, verify

    parser = Parser(
        prog="ddpkit",
        description="Run PyTorch training with DistributedDataParallel on every GPU or CPU core.",
    )
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (train, run, info, check, plot, verify, export):
        command.add_parser(sub)
    return parser


# Errors raised on purpose with a message that names the fix.
_USER_ERRORS = ("ConfigError", "CheckpointError")


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


# Errors of a write to stdout (a full disk, a closed pipe), whatever the buffer still holds.
_OUTPUT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in ("ENOSPC", "EPIPE", "EDQUOT", "EFBIG", "EIO")
    if hasattr(errno, name)
)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:  # also after --help or --version (argparse's SystemExit)
            sys.stdout.flush()  # here, where a failure can still be reported in one line
    except OSError as exc:
        if not _output_failed(exc):
            raise
        print(f"ddpkit: error: cannot write output: {exc.strerror or exc}", file=sys.stderr)
        _discard_stdout()
        return 2


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    # SIGTERM becomes an exception so that `finally` blocks stop and reap the workers.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    return _run(args)


def _output_failed(exc: OSError) -> bool:
    """Whether `exc` came from writing stdout (the write that failed may have been
    unbuffered, so a second flush that succeeds does not prove stdout works)."""
    try:
        sys.stdout.flush()
    except OSError:
        return True
    return exc.filename is None and exc.errno in _OUTPUT_ERRNOS


def _discard_stdout() -> None:
    """Send stdout to /dev/null, so that Python's own flush at exit cannot fail again
    (a second error message, with a traceback)."""
    with contextlib.suppress(OSError, ValueError):  # ValueError: no real file descriptor
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args))
    except HangError as exc:
        from ddpkit.processes.report import HANG_EXIT

        print(f"{exc}\n\nddpkit: stopped the hung job (exit status {HANG_EXIT})", file=sys.stderr)
        return HANG_EXIT
    except WorkerError as exc:
        if exc.exc_type in _USER_ERRORS:  # bad input found inside a worker: one line
            print(f"ddpkit: error: {super(WorkerError, exc).__str__()}", file=sys.stderr)
            return 2
        print(f"ddpkit: error: {exc}", file=sys.stderr)
        return 1
    except (Preempted, StoppedAtStart) as exc:  # saved, or nothing lost: a requeue goes on
        if RUN_WORKER in os.environ:
            raise  # a worker of `ddpkit run`: its agent judges the whole job, and says it
        print(f"ddpkit: {exc}", file=sys.stderr)
        return PREEMPTED_EXIT
    except DdpkitError as exc:
        # Our own errors already name the fix: one line, no traceback.
        print(f"ddpkit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr)
        return 130
