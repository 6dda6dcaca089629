"""`ddpkit plot`: PNG charts (loss, eval metrics, throughput, learning rate, gradient norm)
of one or more training runs."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError

# The choices only: ddpkit.records.plot imports nothing heavy (matplotlib only when drawing).
from ddpkit.records.plot import X_AXES

HELP = (
    "draw loss, eval, throughput, lr, grad_norm and profile charts (PNG) of one or more run folders"
)
_DEFAULT_MULTI_OUT = "plots"


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "plot",
        help=HELP,
        description=(
            f"{HELP}. Each RUN_DIR holds the metrics.jsonl a training run wrote; several runs "
            "are overlaid on the same axes, each with its own colour, line style and marker. "
            "Writes loss.png, eval.png (when the runs have eval metrics such as accuracy), "
            "throughput.png, lr.png, grad_norm.png and profile.png (when the runs logged "
            "them; profile.png: --profile's breakdown of each rank's step time). Needs "
            "matplotlib: pip install 'ddpkit[plot]'."
        ),
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder with metrics.jsonl")
    p.add_argument(
        "--out",
        metavar="DIR",
        help=f"folder for the PNGs (default: the run folder, or ./{_DEFAULT_MULTI_OUT} for "
        "several runs)",
    )
    p.add_argument(
        "--label",
        dest="labels",
        metavar="NAME",
        nargs="+",
        action="extend",
        help="legend name of each run, one per RUN_DIR in order (default: the folder's name)",
    )
    p.add_argument(
        "--x",
        choices=X_AXES,
        default="step",
        help="x axis of the loss, throughput, lr and grad_norm charts: optimizer steps, time "
        "since the start, or samples seen by all ranks, which lines up runs of different "
        "batch sizes (default step)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddpkit.records.plot import plot_runs

    logging.basicConfig(level=logging.WARNING, format="ddpkit: warning: %(message)s")
    run_dirs: list[str] = args.run_dirs
    # "" (an unset shell variable, say) would be Path("") = ".": charts drawn from, or
    # written into, the current folder.
    if any(not run_dir for run_dir in run_dirs):
        raise ConfigError(
            "RUN_DIR '' names no folder: pass the run folder that holds metrics.jsonl"
        )
    if args.out == "":
        raise ConfigError(
            "--out '' names no folder: pass --out DIR, or leave it out to write the charts "
            f"into the run folder (./{_DEFAULT_MULTI_OUT} for several runs)"
        )
    if args.out is not None:
        out = Path(args.out)
    elif len(run_dirs) == 1:
        out = Path(run_dirs[0])
    else:
        out = Path(_DEFAULT_MULTI_OUT)
    written = plot_runs(run_dirs, out, labels=args.labels, x=args.x)
    print(f"wrote {len(written)} chart(s) to {out}{os.sep}: {', '.join(p.name for p in written)}")
    return 0
