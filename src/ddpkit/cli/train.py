"""`ddpkit train`: run a built-in job or the user's own on every GPU or CPU core.

Every field of TrainConfig is a flag (`--batch-size`, `--precision`, ...); a TOML file
given with `--config` sets any of them, and flags given on the command line win.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import shlex
import sys
from collections.abc import Iterator
from typing import Any

from ddpkit.cli.flags import (
    add_config_flags,
    add_job_flags,
    add_process_flags,
    check_folder,
    check_processes,
    job_and_config,
    print_job_help,
)
from ddpkit.errors import PREEMPTED_EXIT, RUN_WORKER, Preempted, StoppedAtStart
from ddpkit.inrank.preemption import (
    STOP_SIGNALS,
    install_handlers,
    restore_handlers,
    starting_up,
    stopped_while_starting,
)
from ddpkit.processes.config import LaunchConfig
from ddpkit.processes.preemption import DEFAULT_SIGNAL_GRACE

HELP = "train a built-in job (default: digits) or your own (--job) with DDP"


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "train", help=HELP, description=HELP, add_help=False
    )
    add_job_flags(p)
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "gloo", "nccl"),
        help="auto = nccl on GPUs, gloo on CPU",
    )
    p.add_argument(
        "--signal-grace",
        type=float,
        default=DEFAULT_SIGNAL_GRACE,
        metavar="S",
        help="after SIGTERM, SIGUSR1 or Ctrl-C, seconds the ranks get to save a checkpoint "
        f"before they are stopped regardless (default {DEFAULT_SIGNAL_GRACE:.0f})",
    )
    p.add_argument(
        "--json", action="store_true", help="print the result as one JSON object on the last line"
    )
    add_process_flags(p)
    add_config_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.job_help:
        return print_job_help(args)
    logging.basicConfig(level=logging.INFO, format="ddpkit: %(message)s")
    config = None
    try:
        with _starting():
            job_name, config = job_and_config(args)
            result, nproc = _check_and_launch(args, job_name, config)
    except Preempted as exc:
        if RUN_WORKER in os.environ:
            raise  # a worker of `ddpkit run`: its shim tells the agent, which says it once
        print(f"ddpkit: {exc}\nddpkit: to continue: {_resume_command(config)}", file=sys.stderr)
        return PREEMPTED_EXIT
    except KeyboardInterrupt:
        if config is None:
            raise  # before the job was read: nothing to say but that (see cli._run)
        # Stopped before the job could save (or with --on-signal stop): say what is left.
        print(f"ddpkit: interrupted; {_what_is_saved(config)}", file=sys.stderr)
        return 130
    from ddpkit.processes.machine import under_torchrun

    if under_torchrun():  # each rank ran in place: rank 0 speaks for the job
        if os.environ["RANK"] != "0":
            return 0
        nproc = int(os.environ["WORLD_SIZE"])
    result["nproc"] = nproc
    if args.json:
        print(json.dumps(result), flush=True)
    elif result["final_loss"] is None:  # resumed with no epoch left to train
        print(
            f"already finished at epoch {result['epochs']} (step {result['global_step']}, "
            f"{result['checkpoint']}): nothing left to train; pass a larger --epochs to train "
            f"on, digest {result['model_digest'][:12]}",
            flush=True,
        )
    else:
        acc, loss, speed = result["test_accuracy"], result["final_loss"], result["samples_per_s"]
        # A run by steps may end inside its first epoch: "0 epochs" would say nothing.
        parts = [f"done: {result['epochs']} epochs", f"{result['global_step']} steps"]
        if not result["epochs"]:
            parts = [f"done: {result['global_step']} steps"]
        parts.append(f"loss {loss:.4f}")
        if acc is not None:
            parts.append(f"test accuracy {acc:.2%}")
        if speed:
            parts.append(f"{speed:,.0f} samples/s")
        parts.append(f"digest {result['model_digest'][:12]}")
        print(", ".join(parts), flush=True)
    return 0


@contextlib.contextmanager
def _starting() -> Iterator[None]:
    """While inside (reading the job, checking the options, starting the ranks), a stop
    signal (SIGTERM, SIGUSR1) that comes before any rank's first optimizer step raises
    StoppedAtStart: nothing was lost, and the same command starts the job again."""
    # Under torchrun (ddpkit run) its agent says what a signal did to the job. (Read
    # from the environment as processes.machine does: that module imports torch.)
    agent = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    handlers = install_handlers(STOP_SIGNALS)
    try:
        with starting_up(watch_steps=False):  # launch watches the ranks' steps
            yield
    except SystemExit as exc:
        signum = stopped_while_starting(exc)
        if not signum or agent:
            raise
        raise StoppedAtStart(signum) from None
    finally:
        restore_handlers(handlers)


def _check_and_launch(
    args: argparse.Namespace, job_name: str, config: Any
) -> tuple[dict[str, Any], int]:
    settings = LaunchConfig(
        nprocs=args.nproc,
        backend=args.backend,
        hang_timeout=args.hang_timeout,
        signal_grace=args.signal_grace,
    )
    # torch is imported only now (1.5-2 s): `--help` and bad flags answer at once.
    from ddpkit.checkpoint.pt import check_writable, find_checkpoint
    from ddpkit.context import DistContext
    from ddpkit.parallel.strategy import Strategy
    from ddpkit.processes.launcher import launch
    from ddpkit.processes.machine import resolve_backend, resolve_nprocs, under_torchrun

    backend = resolve_backend(args.backend)
    nproc = resolve_nprocs(args.nproc, backend)
    # Check what can be checked before any process starts, so bad input costs nothing.
    if backend == "gloo" and not under_torchrun():
        check_processes("--nproc", nproc, allow=args.allow_oversubscribe)
    check_processes("--num-workers", config.num_workers, allow=args.allow_oversubscribe)
    Strategy(config.strategy).check(
        backend, offload=config.fsdp_offload, grad_compression=config.grad_compression
    )
    if config.run_dir is not None:
        check_folder("run_dir", config.run_dir)
    if config.checkpoint_dir is not None:
        check_writable(config.checkpoint_dir)
        if config.resume:  # raises if none loads; the workers say what they skip
            find_checkpoint(config.checkpoint_dir, DistContext.single("cpu"))
    # Resolved once, here: what was checked above is what starts. (`config`, the
    # TrainConfig, goes to train_worker; `config=`, the LaunchConfig, to launch.)
    settings = dataclasses.replace(settings, nprocs=nproc, backend=backend)
    return launch(train_worker, job_name, config, config=settings), nproc


def _resume_command(config: Any) -> str:
    """This command line, with --resume."""
    again = [*sys.argv[1:], *([] if config.resume else ["--resume"])]
    return f"ddpkit {shlex.join(again)}"


def _what_is_saved(config: Any) -> str:
    """After an interrupt: the checkpoint a run can go on from, and how; or why none."""
    from ddpkit.checkpoint.pt import list_checkpoints

    if config.checkpoint_dir is None:
        return "nothing was saved (no --checkpoint-dir): pass --checkpoint-dir DIR to resume later"
    saved = list_checkpoints(config.checkpoint_dir)
    if not saved:
        return f"no checkpoint was written yet in {config.checkpoint_dir}"
    return f"the newest checkpoint is {saved[-1]}; to continue from it: {_resume_command(config)}"


def train_worker(ctx: Any, job_name: str, config: Any) -> dict[str, Any]:
    """Runs on every rank: build the job, train it, describe the result (rank 0's wins)."""
    from ddpkit.checkpoint.digest import model_digest
    from ddpkit.training.job import build_job

    trainer = build_job(ctx, job_name, config).trainer(ctx, config)
    fit = trainer.fit()
    return {
        "job": job_name,  # the --example name or --job spec
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
