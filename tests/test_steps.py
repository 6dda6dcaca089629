"""Training by steps (the nanoGPT style): `max_steps` with epochs optional, evaluations
every N steps, the best checkpoint kept, data that never ends, exact resume and verify.
Each rank's parameters, buffers, optimizer and scheduler state are compared, not rank
0's alone."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import ddpkit
from ddpkit.errors import ConfigError, Preempted
from ddpkit.parallel.data import ReplacementSampler, _rest_of_epoch, global_order
from ddpkit.training.config import TrainConfig
from ddpkit.training.job import build_job
from tests.conftest import run_cli
from tests.matrix_jobs import _compare, held_state
from tests.test_trainer_features import assert_same_best

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# -- the config ------------------------------------------------------------------------
def test_epochs_are_optional_with_max_steps() -> None:
    assert TrainConfig().epoch_limit() == 10
    assert TrainConfig(max_steps=100).epoch_limit() is None  # as many as it takes
    assert TrainConfig(max_steps=100, epochs=2).epoch_limit() == 2  # whichever ends first
    # A schedule's length: max_steps, or the epochs' steps when they end first.
    assert TrainConfig(max_steps=100).total_steps() == 100
    assert TrainConfig(batch_size=8, epochs=2).total_steps(160, 2) == 20
    assert TrainConfig(batch_size=8, epochs=2, max_steps=15).total_steps(160, 2) == 15
    with pytest.raises(ConfigError, match=r"pass config.total_steps\(len\(train_set\)"):
        TrainConfig(epochs=2).total_steps()


def test_keep_best_needs_a_checkpoint_folder() -> None:
    with pytest.raises(ConfigError, match="pass --checkpoint-dir DIR with --keep-best"):
        TrainConfig(keep_best="eval_loss")


# -- the gpt example, as a user runs it ------------------------------------------------------
def test_the_gpt_example_trains_by_steps_evaluates_and_keeps_the_best(tmp_path: Path) -> None:
    ck, runs = tmp_path / "ck", tmp_path / "run"
    out = run_cli(
        *("train", "--job", "ddpkit.examples.gpt:build", "--nproc", "2", "--batch-size", "8"),
        *("--max-steps", "12", "--eval-every-steps", "4", "--keep-best", "eval_loss"),
        *("--checkpoint-dir", str(ck), "--run-dir", str(runs), "--log-every", "2"),
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(" | ")[0] for line in lines if line.startswith("step ")] == [
        "step 4",
        "step 8",
        "step 12",
    ]
    assert any(line.startswith("epoch 1 | step 12/12 | loss ") for line in lines), out.stdout
    assert "done: 12 steps" in out.stdout
    records = [json.loads(line) for line in (runs / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in records if r["kind"] == "eval"}
    assert sorted(evals) == [4, 8, 12]  # the last step's evaluation is not repeated
    best_step = min(evals, key=lambda s: evals[s])
    best = torch.load(ck / "best.pt", weights_only=True)
    assert best["global_step"] == best_step
    # The newest keep_last checkpoints are there beside it, ending with the last step.
    assert (ck / "ckpt-000000012.pt").is_file()
    assert (
        torch.load(ck / "ckpt-000000012.pt", weights_only=True)["extra"]["best"] == evals[best_step]
    )


def test_the_progress_bar_of_a_run_by_steps_counts_steps(tmp_path: Path) -> None:
    out = run_cli(
        *("train", "--example", "gpt", "--nproc", "1", "--batch-size", "4"),
        *("--max-steps", "6", "--eval-every-steps", "0", "--progress"),
    )
    assert out.returncode == 0, out.stderr
    # tqdm redraws the bar in place: each state of it is in the stream, up to 6 of 6.
    assert re.search(r"epoch 1: +\d+%\|[^\r\n]*\| \d/6 ", out.stderr), out.stderr[-2000:]
    # Not the epoch's 1,800 batches (the eval bar counts its own batches).
    assert not re.search(r"epoch 1:[^\r\n]*/\d{3,} ", out.stderr)


# -- a map-style dataset drawn with replacement -----------------------------------------------
def test_draws_with_replacement_are_one_sequence_shared_out_over_the_ranks() -> None:
    data = TensorDataset(torch.arange(10))
    ranks = [ReplacementSampler(data, num_replicas=2, rank=r, seed=3) for r in range(2)]
    for sampler in ranks:
        sampler.set_epoch(1)
    orders = [list(s) for s in ranks]
    draws = global_order(ranks[0])
    assert len(draws) == 10 and len(set(draws)) < 10  # with replacement: repeats
    assert orders == [draws[0::2], draws[1::2]]
    ranks[0].set_epoch(2)
    assert list(ranks[0]) != orders[0]  # each epoch draws anew
    # A resume on another number of ranks shares out the rest of the same draws.
    one = ReplacementSampler(data, num_replicas=1, rank=0, seed=3)
    one.set_epoch(1)
    assert _rest_of_epoch(ranks[1], 4) == draws[4:][1::2]
    assert list(one) == draws
    with pytest.raises(ConfigError, match="replacement=True draws the training order itself"):
        ddpkit.prepare_loader(data, batch_size=2, replacement=True, evaluation=True)


# -- exact resume after a signal, on 2 ranks ---------------------------------------------------
class _SignalRank1(ddpkit.Callback):
    """SIGTERM to rank 1's own process after step `at`, as a cluster's preemption does."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, trainer: ddpkit.Trainer, step: int) -> None:
        if step == self.at and trainer.ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def _gpt(ctx: ddpkit.DistContext, folder: str, phase: str, stop_at: int) -> dict[str, Any]:
    config = TrainConfig(
        max_steps=40,  # the signal's vote comes some steps after it (~0.1 s)
        batch_size=8,
        replacement=True,  # random windows, as the example's DEFAULTS draw them
        eval_every_steps=8,
        keep_best="eval_loss",
        checkpoint_dir=str(Path(folder, "ck")),
        resume=phase == "resume",
        num_workers=1,  # a DataLoader worker per rank, as a real job has
        progress=False,
    )
    job = build_job(ctx, "gpt", config)
    callbacks = [_SignalRank1(stop_at)] if phase == "cut" else []
    trainer = job.trainer(ctx, config, callbacks=callbacks, log_fn=lambda _: None)
    return _fit_and_compare(ctx, trainer, folder, phase)


def _fit_and_compare(
    ctx: ddpkit.DistContext, trainer: ddpkit.Trainer, folder: str, phase: str
) -> dict[str, Any]:
    """Fit, keep what every rank holds, and compare the ranks (and, resumed, each rank
    with the straight run's)."""
    trainer.fit()
    state = held_state(trainer.model, trainer.optimizer, trainer.scheduler)
    torch.save(state, Path(folder, f"{phase}-rank{ctx.rank}.pt"))
    return {"compare": _compare(ctx, Path(folder), phase), "step": trainer.global_step}


def test_a_run_by_steps_resumes_exactly_after_a_signal(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    straight.mkdir()
    done = ddpkit.launch(_gpt, str(straight), "straight", 0, nprocs=2)
    assert done["step"] == 40 and done["compare"]["ranks"] == []
    with pytest.raises(Preempted) as stopped:
        ddpkit.launch(_gpt, str(tmp_path), "cut", 5, nprocs=2)
    assert 5 <= stopped.value.step < 40  # mid-epoch: an epoch has 460 steps here
    for f in straight.glob("straight-rank*.pt"):
        f.rename(tmp_path / f.name)
    resumed = ddpkit.launch(_gpt, str(tmp_path), "resume", 0, nprocs=2)
    assert resumed["step"] == 40
    assert resumed["compare"] == {"ranks": [], "resume": []}
    # keep_best: the resumed run kept the straight run's best evaluation, bit for bit.
    assert assert_same_best(straight / "ck", tmp_path / "ck") % 8 == 0


# -- data that never ends ----------------------------------------------------------------
class _EndlessWindows(IterableDataset[dict[str, torch.Tensor]]):
    """Random windows of a fixed stream, forever, each rank its own: a shard by rank,
    drawn from a generator seeded by the rank (the same stream again each epoch)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(100 + self.rank)
        while True:
            x = torch.randn(6, generator=g)
            yield {"x": x, "y": x.sum(0, keepdim=True)}


class _DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


def _endless(ctx: ddpkit.DistContext, folder: str, phase: str, steps: int) -> dict[str, Any]:
    ddpkit.seed_everything(0)
    model = _DictModel()
    config = TrainConfig(
        max_steps=steps,
        batch_size=4,
        accumulate=2,
        save_every_steps=3,
        checkpoint_dir=str(Path(folder, "ck")),
        resume=phase == "resume",
        sync_batchnorm=False,
        progress=False,
    )
    trainer = ddpkit.Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=1e-2),
        _EndlessWindows(ctx.rank),
        ctx,
        config,
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)),
        log_fn=lambda _: None,
    )
    return _fit_and_compare(ctx, trainer, folder, phase)


def test_an_endless_iterable_dataset_trains_max_steps_and_resumes_exactly(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    straight.mkdir()
    done = ddpkit.launch(_endless, str(straight), "straight", 9, nprocs=2)
    assert done["step"] == 9 and done["compare"]["ranks"] == []
    # A run told to stop at step 7 (saved at 3, 6 and 7), then continued to step 9.
    first = ddpkit.launch(_endless, str(tmp_path), "first", 7, nprocs=2)
    assert first["step"] == 7
    assert sorted(p.name for p in (tmp_path / "ck").glob("ckpt-*")) == [
        "ckpt-000000003.pt",
        "ckpt-000000006.pt",
        "ckpt-000000007.pt",
    ]
    for f in straight.glob("straight-rank*.pt"):
        f.rename(tmp_path / f.name)
    resumed = ddpkit.launch(_endless, str(tmp_path), "resume", 9, nprocs=2)
    assert resumed["step"] == 9
    assert resumed["compare"] == {"ranks": [], "resume": []}


# -- verify ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_verify_passes_the_gpt_example() -> None:
    out = run_cli("verify", "--example", "gpt", "--nproc", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS  equivalence" in out.stdout
