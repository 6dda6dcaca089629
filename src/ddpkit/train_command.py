"""`ddpkit train`: run a built-in job or the user's own on every GPU or CPU core.

Every field of TrainConfig is a flag (`--batch-size`, `--precision`, ...); a TOML file
given with `--config` sets any of them, and flags given on the command line win.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import typing
from typing import Any

from ddpkit.config import PRECISIONS, TrainConfig

HELP = "train a built-in job (default: digits) or your own (--job) with DDP"
_CHOICES = {"precision": PRECISIONS, "scheduler_interval": ("epoch", "step")}


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("train", help=HELP, description=HELP)
    add_job_flags(p)
    p.add_argument(
        "--nproc",
        default="auto",
        help="processes: 'auto' = one per GPU, else one per CPU core (default)",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "gloo", "nccl"),
        help="auto = nccl on GPUs, gloo on CPU",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=300.0,
        help="stop and diagnose the job when no rank progresses this long (0: off)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the result as one JSON object on the last line"
    )
    add_config_flags(p)
    p.set_defaults(func=run)


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """--example / --job and --config: which job, with which TrainConfig file."""
    job = p.add_mutually_exclusive_group()
    job.add_argument("--example", help="built-in job: digits (the default) or seed")
    job.add_argument(
        "--job",
        metavar="MODULE:FUNCTION",
        help="your job: FUNCTION(ctx) returns a ddpkit.Job (also path/to/file.py:FUNCTION)",
    )
    p.add_argument("--config", metavar="FILE.toml", help="TrainConfig options from a TOML file")


def add_config_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per TrainConfig field but `skip`, with the field's help; None if not given."""
    options = p.add_argument_group("training options (TrainConfig; flags win over --config)")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        kind = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        if f.default is not None:
            help_ += f" (default: {f.default})"
        if kind is bool:
            options.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        else:
            options.add_argument(
                flag, type=kind, default=None, help=help_, choices=_CHOICES.get(f.name)
            )


def _base_type(hint: Any) -> Any:
    """int for `int` and `int | None`, and so on."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def run(args: argparse.Namespace) -> int:
    # torch is imported here, not at module level, so `ddpkit --help` stays fast.
    from ddpkit.checkpoint import check_writable, latest_checkpoint
    from ddpkit.context import DistContext
    from ddpkit.launcher import launch, resolve_backend, resolve_nprocs, under_torchrun

    logging.basicConfig(level=logging.INFO, format="ddpkit: %(message)s")
    job_name, config = job_and_config(args)
    backend = resolve_backend(args.backend)
    nproc = resolve_nprocs(args.nproc, backend)
    # Check what can be checked before any process starts, so bad input costs nothing.
    if config.checkpoint_dir is not None:
        check_writable(config.checkpoint_dir)
        if config.resume:
            latest_checkpoint(config.checkpoint_dir, DistContext.single("cpu"))
    result = launch(
        train_worker,
        job_name,
        config,
        nprocs=nproc,
        backend=backend,  # type: ignore[arg-type]
        hang_timeout=args.hang_timeout,
    )
    if under_torchrun():  # each rank ran in place: rank 0 speaks for the job
        if os.environ["RANK"] != "0":
            return 0
        nproc = int(os.environ["WORLD_SIZE"])
    result["nproc"] = nproc
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        acc = result["test_accuracy"]
        loss = math.nan if result["final_loss"] is None else result["final_loss"]
        print(
            f"done: {result['epochs']} epochs, {result['global_step']} steps, loss {loss:.4f}"
            + (f", test accuracy {acc:.2%}" if acc is not None else "")
            + f", {result['samples_per_s']:,.0f} samples/s, digest {result['model_digest'][:12]}",
            flush=True,
        )
    return 0


def job_and_config(args: argparse.Namespace) -> tuple[str, TrainConfig]:
    """The job the flags name (an example's name or a MODULE:FUNCTION spec) and its
    TrainConfig: the job's DEFAULTS, then --config's file, then the flags."""
    from ddpkit.config_file import load_config_file, load_job, merge_config
    from ddpkit.job import example_module

    if args.job:
        _, defaults = load_job(args.job)  # fail here, not in every worker
        job_name = args.job
    else:
        job_name = args.example or "digits"
        defaults = dict(example_module(job_name).DEFAULTS)
    from_file = load_config_file(args.config) if args.config else {}
    flags = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(TrainConfig)}
    return job_name, TrainConfig(**merge_config(defaults, from_file, flags))


def train_worker(ctx: Any, job_name: str, config: Any) -> dict[str, Any]:
    """Runs on every rank: build the job, train it, describe the result (rank 0's wins)."""
    from ddpkit.checkpoint import model_digest
    from ddpkit.job import build_job

    trainer = build_job(ctx, job_name, config.seed).trainer(ctx, config)
    fit = trainer.fit()
    return {
        "example": job_name,
        "epochs": fit.epochs,
        "global_step": fit.global_step,
        "samples_per_s": round(fit.samples_per_s, 1),
        # NaN is not JSON: a resumed run with no epoch left to train has no loss.
        "final_loss": None if math.isnan(fit.final_loss) else fit.final_loss,
        "test_accuracy": fit.eval.get("accuracy"),
        "eval_loss": fit.eval.get("eval_loss"),
        "checkpoint": str(fit.checkpoint) if fit.checkpoint else None,
        "run_dir": config.run_dir,
        "model_digest": model_digest(trainer.model),
    }
