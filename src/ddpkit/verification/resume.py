"""The resume check: is stopping, checkpointing and resuming exact?

K steps straight, and about K/2 steps + checkpoint + a fresh launch that resumes + the
rest, on N processes; parameters, buffers, optimizer, scheduler and every RNG state
must be bit-for-bit equal on every rank. A training set whose samples draw from a source
ddpkit does not seed fails too: such a run cannot be resumed exactly, even where the
numbers happen to agree.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ddpkit.context import DistContext
from ddpkit.parallel.batches import map_tensors
from ddpkit.processes.launcher import launch
from ddpkit.seed import rng_state
from ddpkit.storage import write_json
from ddpkit.training.config import TrainConfig
from ddpkit.training.job import JobRef, build_job
from ddpkit.training.trainer import Callback, Trainer
from ddpkit.verification.causes import resume_causes, unseeded_cause
from ddpkit.verification.probe import probe_dataset
from ddpkit.verification.report import VerifyReport
from ddpkit.verification.runs import (
    DEFAULT_STEPS,
    LogFn,
    Stop,
    check_args,
    fit,
    leaves,
    make_trainer,
    resume_cut,
    same,
    silent,
    snapshot,
    whole,
)

MAX_LISTED = 6  # differences listed per rank


def check_resume(
    job: JobRef,
    config: TrainConfig | None = None,
    *,
    nproc: int = 2,
    steps: int = DEFAULT_STEPS,
    log_fn: LogFn = None,
) -> VerifyReport:
    """Is K/2 steps + checkpoint + resume in a fresh launch + K/2 steps bit-for-bit the
    same as K steps straight, on every rank (model, optimizer, scheduler, RNG)?"""
    config = check_args(config, nproc, steps, minimum=2)
    config = replace(config, epochs=steps, save_every=0)
    with tempfile.TemporaryDirectory(prefix="ddpkit-verify-") as tmp:
        # The straight run and the first half share a launch; the resume gets its own.
        cut = resume_cut(steps)
        for phases, what in (
            (("straight", "first-half"), f"{steps} steps, then {cut} steps + checkpoint"),
            (("resumed",), f"a fresh launch: resume + {steps - cut} steps"),
        ):
            (log_fn or silent)(f"{what} on {nproc} processes...")
            launch(_resume_rank, job, config, steps, tmp, phases, nprocs=nproc, backend="gloo")
        report = VerifyReport(
            "resume", passed=True, nproc=nproc, steps=steps, batch_size=config.batch_size
        )
        for rank in range(nproc):
            straight, resumed = (
                torch.load(Path(tmp, f"{phase}-rank{rank}.pt"), weights_only=True)
                for phase in ("straight", "resumed")
            )
            diffs = _state_differences(straight, resumed)
            if len(diffs) > MAX_LISTED:
                diffs[MAX_LISTED:] = [f"... and {len(diffs) - MAX_LISTED} more"]
            report.differences += [f"rank {rank}: {d}" for d in diffs]
            report.causes += [c for c in resume_causes(straight, resumed) if c not in report.causes]
        unseeded = json.loads(Path(tmp, "probe.json").read_text())["unseeded"]
    if unseeded is not None:
        report.causes.insert(0, unseeded_cause(unseeded))
    report.passed = not report.differences and unseeded is None
    return report


class _StopAt(Callback):
    """Ends the run after `step`, on every rank; with `save`, checkpoints first."""

    def __init__(self, step: int, save: bool = False) -> None:
        self.step, self.save = step, save

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if step >= self.step:
            if self.save:
                trainer.save()
            raise Stop


def _resume_rank(
    ctx: DistContext,
    job: JobRef,
    config: TrainConfig,
    steps: int,
    folder: str,
    phases: Sequence[str],
) -> None:
    checkpoints = str(Path(folder, "checkpoints"))
    for phase in phases:  # each builds the job afresh, seeded as `ddpkit train` does
        built = build_job(ctx, job, config)
        if phase == "straight" and ctx.is_main:  # the probe leaves the RNGs as they were
            write_json(Path(folder, "probe.json"), probe_dataset(built.train_set))
        if phase == "straight":
            trainer = make_trainer(ctx, built, config, [_StopAt(steps)])
        elif phase == "first-half":
            half = replace(config, checkpoint_dir=checkpoints)
            trainer = make_trainer(ctx, built, half, [_StopAt(resume_cut(steps), save=True)])
        else:
            again = replace(config, checkpoint_dir=checkpoints, resume=True)
            trainer = make_trainer(ctx, built, again, [_StopAt(steps)])
        fit(trainer)
        if phase == "first-half":
            continue
        state = {
            "model": snapshot(trainer.model),
            # Whole tensors, so that the parent compares them without a process group.
            "optimizer": map_tensors(trainer.optimizer.state_dict(), whole),
            "scheduler": trainer.scheduler.state_dict() if trainer.scheduler else None,
            "callbacks": [cb.state_dict() for cb in built.callbacks],
            "rng": rng_state(),
            "global_step": trainer.global_step,
        }
        torch.save(state, Path(folder, f"{phase}-rank{ctx.rank}.pt"))


def _state_differences(straight: dict[str, Any], resumed: dict[str, Any]) -> list[str]:
    """Every value that differs between the two runs' final states, named."""
    a, b = dict(leaves(straight)), dict(leaves(resumed))
    found = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            found.append(f"{name}: only in the {'straight' if name in a else 'resumed'} run")
        elif not same(a[name], b[name]):
            x, y = a[name], b[name]
            if (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.is_floating_point()
                and x.shape == y.shape
            ):
                found.append(f"{name}: max abs diff {float((x - y).abs().max()):.3g}")
            elif isinstance(x, torch.Tensor):
                found.append(f"{name}")
            else:
                found.append(f"{name}: {x!r} straight, {y!r} resumed")
    return found
