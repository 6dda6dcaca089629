"""`ddpkit verify`: prove that the distributed job computes what one process computes
(and, with --resume, that a resumed run is bit-for-bit the uninterrupted one)."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from typing import Any

from ddpkit.cli.flags import (
    add_config_flags,
    add_job_flags,
    add_oversubscribe_flag,
    check_processes,
)

# Options that verify sets itself (it runs --steps steps, writes no files, logs nothing).
_NOT_FOR_VERIFY = (
    "epochs",
    "save_every",
    "checkpoint_dir",
    "resume",
    "keep_last",
    "run_dir",
    "log_every",
    "early_stopping_patience",
    "early_stopping_metric",
    "progress",
)
HELP = "check that N ranks compute what 1 process computes, or that resume is exact"
# The runs agreed, but no parameter changed in them: no proof either way.
NOTHING_TRAINED_EXIT = 4


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "verify",
        add_help=False,
        help=HELP,
        description=(
            "Equivalence (the default): run the job for --steps optimizer steps as --nproc "
            "processes with --batch-size each and as one process with the global batch, "
            "in the same data order, and compare every parameter and buffer after each "
            "step. --resume: run the steps straight, and half + checkpoint + resume in a "
            "fresh launch + half, and require bit-for-bit equal state. CPU and gloo only. "
            "Exit status 0 for PASS, 1 for FAIL, 4 when no parameter changed (no proof)."
        ),
    )
    add_job_flags(p)
    p.add_argument(
        "--loop",
        metavar="MODULE:FUNCTION",
        help="check your own training loop main(ctx) instead of a job: it builds its model "
        "with ddpkit.prepare_model and its data with ddpkit.prepare_loader "
        "(e.g. --loop train.py:main)",
    )
    p.add_argument(
        "loop_args",
        nargs="*",
        metavar="ARG",
        help="with --loop: the file's command line when its __main__ block calls "
        "ddpkit.launch(main, ...) (put it after --), main takes what that call passes; "
        "else what main takes after ctx, each read as a Python literal when it is one "
        "(3, 0.1, True), else as text",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes to compare with 1 (default 2)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps to run (default 8)")
    p.add_argument(
        "--resume",
        dest="check_resume",  # not TrainConfig.resume
        action="store_true",
        help="check that resuming is exact instead",
    )
    p.add_argument(
        "--dtype",
        choices=("float64", "float32"),
        default="float64",
        help="equivalence: promote model and data to float64 (default), or compare in float32",
    )
    p.add_argument("--atol", type=float, help="absolute tolerance (float64: 1e-9, float32: 1e-5)")
    p.add_argument("--rtol", type=float, help="relative tolerance (float64: 1e-7, float32: 1e-4)")
    p.add_argument(
        "--json", action="store_true", help="print the report as one JSON object on the last line"
    )
    add_oversubscribe_flag(p)
    add_config_flags(p, skip=_NOT_FOR_VERIFY)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddpkit.cli.flags import job_and_config, print_job_help
    from ddpkit.errors import ConfigError
    from ddpkit.verification import verify
    from ddpkit.verification.runs import script_loop_args

    if args.job_help:
        return print_job_help(args)
    if args.loop is not None and (args.job is not None or args.example is not None):
        raise ConfigError("--loop names what to check, as --job and --example do: pass one of them")
    if args.loop_args and args.loop is None:
        raise ConfigError(
            f"unexpected arguments {' '.join(args.loop_args)!r}: they go to a loop, so "
            "pass --loop FILE.py:main before them"
        )
    loop_args = None
    if args.loop is not None:  # a script whose __main__ block launches main: its command line
        loop_args = script_loop_args(args.loop, args.loop_args)
    if loop_args is None:
        loop_args = tuple(_literal(a) for a in args.loop_args)
    job, config = (None, None) if args.loop is not None else job_and_config(args)
    check_processes("--nproc", args.nproc, allow=args.allow_oversubscribe)  # CPU ranks only
    if config is not None:
        check_processes("--num-workers", config.num_workers, allow=args.allow_oversubscribe)
    report = verify(
        job,
        config,
        loop=args.loop,
        loop_args=loop_args,
        nproc=args.nproc,
        steps=args.steps,
        resume=args.check_resume,
        dtype=args.dtype,
        atol=args.atol,
        rtol=args.rtol,
        log_fn=lambda text: print(f"ddpkit: {text}", file=sys.stderr, flush=True),
    )
    print(report, flush=True)
    if args.json:
        print(json.dumps(report.to_dict()), flush=True)
    if report.passed:
        return 0
    return NOTHING_TRAINED_EXIT if report.proved_nothing else 1


def _literal(text: str) -> Any:
    """3 -> 3, 0.1 -> 0.1, True -> True, 'data/train' -> 'data/train'."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
