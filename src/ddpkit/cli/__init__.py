"""The `ddpkit` command. Each subcommand lives in its own module and adds its own parser.

A subcommand module provides `add_parser(subparsers)`, which registers a parser whose
`func` default is `run(args) -> int` (the exit status). Heavy imports (torch) happen
inside `run`, so `ddpkit --help` and `ddpkit check` start fast.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from ddpkit import __version__
from ddpkit.errors import DdpkitError, HangError, WorkerError


def build_parser() -> argparse.ArgumentParser:
    from ddpkit.cli import check, info, plot, run, train, verify

    parser = argparse.ArgumentParser(
        prog="ddpkit",
        description="Run PyTorch training with DistributedDataParallel on every GPU or CPU core.",
    )
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (train, run, info, check, plot, verify):
        command.add_parser(sub)
    return parser


# Errors raised on purpose with a message that names the fix.
_USER_ERRORS = ("ConfigError", "CheckpointError")


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    # SIGTERM becomes an exception so that `finally` blocks stop and reap the workers.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        return int(args.func(args))
    except HangError as exc:
        from ddpkit.diagnosis.report import HANG_EXIT

        print(f"{exc}\n\nddpkit: stopped the hung job (exit status {HANG_EXIT})", file=sys.stderr)
        return HANG_EXIT
    except WorkerError as exc:
        if exc.exc_type in _USER_ERRORS:  # bad input found inside a worker: one line
            print(f"ddpkit: error: {super(WorkerError, exc).__str__()}", file=sys.stderr)
            return 2
        print(f"ddpkit: error: {exc}", file=sys.stderr)
        return 1
    except DdpkitError as exc:
        # Our own errors already name the fix: one line, no traceback.
        print(f"ddpkit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr)
        return 130
