"""`ddpkit train`: run a built-in job on every GPU or CPU core of this machine."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from typing import Any

HELP = "train a built-in job (default: digits) with DDP on every GPU or CPU core"


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("train", help=HELP, description=HELP)
    p.add_argument("--example", default="digits", help="built-in job: digits (default) or seed")
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
    p.add_argument("--epochs", type=int, help="epochs to train (default: the example's)")
    p.add_argument("--batch-size", type=int, help="samples per rank per step")
    p.add_argument("--save-every", type=int, help="checkpoint every N epochs (and at the end)")
    p.add_argument("--checkpoint-dir", help="folder for checkpoints (default: none written)")
    p.add_argument("--keep-last", type=int, help="checkpoints to keep (default 3)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir",
    )
    p.add_argument("--seed", type=int, help="seed of every RNG and of the data order (default 0)")
    p.add_argument("--num-workers", type=int, help="data-loading processes per rank")
    p.add_argument(
        "--json", action="store_true", help="print the result as one JSON object on the last line"
    )
    p.set_defaults(func=run)


_CONFIG_FLAGS = (
    "epochs",
    "batch_size",
    "save_every",
    "checkpoint_dir",
    "keep_last",
    "seed",
    "num_workers",
)


def run(args: argparse.Namespace) -> int:
    # torch is imported here, not at module level, so `ddpkit --help` stays fast.
    from ddpkit.checkpoint import check_writable, latest_checkpoint
    from ddpkit.context import DistContext
    from ddpkit.job import example_module
    from ddpkit.launcher import launch, resolve_backend, resolve_nprocs, under_torchrun
    from ddpkit.trainer import TrainConfig

    logging.basicConfig(level=logging.INFO, format="ddpkit: %(message)s")
    module = example_module(args.example)
    backend = resolve_backend(args.backend)
    nproc = resolve_nprocs(args.nproc, backend)
    values: dict[str, Any] = dict(module.DEFAULTS)
    values.update({k: getattr(args, k) for k in _CONFIG_FLAGS if getattr(args, k) is not None})
    config = TrainConfig(resume=args.resume, **values)
    # Check what can be checked before any process starts, so bad input costs nothing.
    if config.checkpoint_dir is not None:
        check_writable(config.checkpoint_dir)
        if config.resume:
            latest_checkpoint(config.checkpoint_dir, DistContext.single("cpu"))
    result = launch(
        train_worker,
        args.example,
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
        print(
            f"done: {result['epochs']} epochs, {result['global_step']} steps, "
            f"loss {math.nan if result['final_loss'] is None else result['final_loss']:.4f}"
            + (f", test accuracy {acc:.2%}" if acc is not None else "")
            + f", {result['samples_per_s']:,.0f} samples/s, digest {result['model_digest'][:12]}",
            flush=True,
        )
    return 0


def train_worker(ctx: Any, example: str, config: Any) -> dict[str, Any]:
    """Runs on every rank: build the job, train it, describe the result (rank 0's wins)."""
    from ddpkit.checkpoint import model_digest
    from ddpkit.job import example_module
    from ddpkit.seed import seed_everything
    from ddpkit.trainer import Trainer

    seed_everything(config.seed)
    job = example_module(example).build(ctx)
    trainer = Trainer(
        job.model,
        job.optimizer,
        job.train_set,
        ctx,
        config,
        loss_fn=job.loss_fn,
        eval_set=job.eval_set,
        scheduler=job.scheduler,
    )
    fit = trainer.fit()
    return {
        "example": example,
        "epochs": fit.epochs,
        "global_step": fit.global_step,
        "samples_per_s": round(fit.samples_per_s, 1),
        # NaN is not JSON: a resumed run with no epoch left to train has no loss.
        "final_loss": None if math.isnan(fit.final_loss) else fit.final_loss,
        "test_accuracy": fit.eval.get("accuracy"),
        "eval_loss": fit.eval.get("eval_loss"),
        "checkpoint": str(fit.checkpoint) if fit.checkpoint else None,
        "model_digest": model_digest(trainer.model),
    }
