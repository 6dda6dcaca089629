"""What the Trainer decides from its evaluations: ReduceLROnPlateau, early stopping and
keep_best, at epoch ends and at `eval_every_steps`; the combinations that cannot be
judged are refused before training; a metrics_fn's names are its own. Multi-rank cases
run 2 real gloo ranks and compare every rank's parameters, buffers, optimizer and
scheduler state, not rank 0's alone."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import ddpkit
from ddpkit.errors import ConfigError, WorkerError
from ddpkit.training.config import TrainConfig
from ddpkit.training.trainer import Callback, EarlyStopping, Trainer
from tests.matrix_jobs import _compare, held_state

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# -- a job unlike the examples: dict batches, dropout, AdamW ------------------------------------
class _Windows(Dataset[dict[str, torch.Tensor]]):
    """`n` fixed noisy regression windows as dicts (the eval set, or a finite train set)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = self.x.sum(1, keepdim=True) + 0.5 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class _Endless(IterableDataset[dict[str, torch.Tensor]]):
    """Windows forever, each rank its own stream."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(50 + self.rank)
        while True:
            x = torch.randn(6, generator=g)
            yield {"x": x, "y": x.sum(0, keepdim=True)}


class _DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


class _Evaluations(Callback):
    """Every evaluation's metrics and the learning rate after it, as the loop saw them."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, float], float]] = []

    def on_evaluate(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.seen.append((dict(metrics), 0.0))

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
        last, _ = self.seen[-1]
        self.seen[-1] = (last, trainer.optimizer.param_groups[0]["lr"])


def _plateau_job(ctx: ddpkit.DistContext, folder: str, phase: str, epochs: int) -> dict[str, Any]:
    ddpkit.seed_everything(0)
    record = _Evaluations()
    config = TrainConfig(
        epochs=epochs,
        batch_size=8,
        checkpoint_dir=str(Path(folder, "ck")),
        resume=phase == "resume",
        progress=False,
    )
    trainer = Trainer(
        _DictModel(),
        lambda params: torch.optim.AdamW(params, lr=0.02, weight_decay=0.01),
        _Windows(64, seed=1),
        ctx,
        config,
        eval_set=_Windows(21, seed=2),  # uneven over 2 ranks
        # An improvement must be 30 %: the eval loss soon "plateaus" by that measure.
        scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, factor=0.5, patience=0, threshold=0.3
        ),
        callbacks=[record],
        log_fn=lambda _: None,
    )
    trainer.fit()
    torch.save(
        held_state(trainer.model, trainer.optimizer, trainer.scheduler),
        Path(folder, f"{phase}-rank{ctx.rank}.pt"),
    )
    return {"compare": _compare(ctx, Path(folder), phase), "seen": record.seen}


def test_reduce_lr_on_plateau_steps_with_the_eval_loss_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    straight = tmp_path / "straight"
    straight.mkdir()
    done = ddpkit.launch(_plateau_job, str(straight), "straight", 6, nprocs=2)
    assert done["compare"]["ranks"] == []
    # The LR after each epoch is what a plateau scheduler fed each eval loss gives.
    twin = torch.optim.lr_scheduler.ReduceLROnPlateau(
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.02),
        factor=0.5,
        patience=0,
        threshold=0.3,
    )
    expected = []
    for metrics, _ in done["seen"]:
        twin.step(metrics["eval_loss"])
        expected.append(twin.get_last_lr()[0])
    assert [lr for _, lr in done["seen"]] == expected
    assert len(expected) == 6 and expected[-1] < 0.02  # it did drop
    # Cut after 2 epochs, resumed to 6: the scheduler (best, bad epochs, LR) came back.
    ddpkit.launch(_plateau_job, str(tmp_path), "cut", 2, nprocs=2)
    for f in straight.glob("straight-rank*.pt"):
        f.rename(tmp_path / f.name)
    resumed = ddpkit.launch(_plateau_job, str(tmp_path), "resume", 6, nprocs=2)
    assert resumed["compare"] == {"ranks": [], "resume": []}
    assert [lr for _, lr in resumed["seen"]] == expected[2:]


# -- refused before training, in one process -------------------------------------------------
def _trainer(config: TrainConfig, **kw: Any) -> Trainer:
    model = nn.Linear(4, 1)
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    return Trainer(
        model,
        torch.optim.AdamW(model.parameters()),
        data,
        ddpkit.DistContext(),
        config,
        loss_fn=nn.functional.mse_loss,
        log_fn=lambda _: None,
        **kw,
    )


def _plateau(mode: Literal["min", "max"] = "min") -> Any:
    return lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode=mode)


def test_reduce_lr_on_plateau_that_cannot_be_judged_is_refused_before_training() -> None:
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    no_eval = r"^ReduceLROnPlateau steps at each evaluation, with eval_loss, .*no eval set"
    with pytest.raises(ConfigError, match=no_eval):
        _trainer(TrainConfig(), scheduler=_plateau())
    with pytest.raises(ConfigError, match="leave scheduler_interval at 'epoch'"):
        _trainer(TrainConfig(scheduler_interval="step"), scheduler=_plateau(), eval_set=data)
    # It steps with what early stopping watches (no keep_best here), in that direction.
    with pytest.raises(ConfigError, match=r"mode='min'\) would step with 'eval_f1'.*mode='max'"):
        _trainer(
            TrainConfig(early_stopping_patience=2, early_stopping_metric="eval_f1"),
            scheduler=_plateau(),
            eval_set=data,
        )


def test_early_stopping_on_an_evaluation_without_an_eval_set_is_refused(tmp_path: Path) -> None:
    # As keep_best is: before training, not after the first epoch (and its checkpoint).
    with pytest.raises(ConfigError, match=r"^early stopping watches 'eval_loss'.*no eval set"):
        _trainer(TrainConfig(early_stopping_patience=2))
    with pytest.raises(ConfigError, match=r"^early stopping watches 'accuracy'.*no eval set"):
        _trainer(TrainConfig(), callbacks=[EarlyStopping("accuracy")])
    _trainer(TrainConfig(early_stopping_patience=2, early_stopping_metric="loss"))  # fine
    _trainer(TrainConfig(keep_best="loss", checkpoint_dir=str(tmp_path)))  # fine


# -- early stopping and keep_best at evaluations every N steps ---------------------------------
def _endless_job(ctx: ddpkit.DistContext, folder: str, opts: dict[str, Any]) -> dict[str, Any]:
    ddpkit.seed_everything(0)
    lines: list[str] = []
    config = TrainConfig(
        max_steps=opts.get("max_steps", 60),
        batch_size=4,
        eval_every_steps=opts.get("every", 2),
        keep_best=opts.get("keep_best"),
        checkpoint_dir=str(Path(folder, "ck")),
        run_dir=str(Path(folder, "run")),
        log_every=1,
        sync_batchnorm=False,
        progress=False,
    )
    trainer = Trainer(
        _DictModel(),
        lambda params: torch.optim.AdamW(params, lr=1e-2),
        _Endless(ctx.rank),
        ctx,
        config,
        eval_set=_Windows(10, seed=3),
        callbacks=opts.get("callbacks", []),
        log_fn=lines.append,
    )
    fit = trainer.fit()
    torch.save(
        held_state(trainer.model, trainer.optimizer, trainer.scheduler),
        Path(folder, f"run-rank{ctx.rank}.pt"),
    )
    stops = [None] * ctx.world_size
    torch.distributed.all_gather_object(stops, (fit.global_step, fit.stopped_early))
    return {
        "compare": _compare(ctx, Path(folder), "run"),
        "stops": stops,
        "lines": lines,
        "best": trainer.best,
    }


def test_early_stopping_judges_each_evaluation_of_an_endless_run_by_steps(tmp_path: Path) -> None:
    # The model trains, so its eval loss falls; a stopper that wants it to rise sees no
    # improvement after the first evaluation (step 2) and stops after 2 more (step 6).
    rising = EarlyStopping("eval_loss", patience=2, mode="max")
    out = ddpkit.launch(_endless_job, str(tmp_path), {"callbacks": [rising]}, nprocs=2)
    assert out["stops"] == [(6, True), (6, True)]  # every rank, at the same step
    assert out["compare"]["ranks"] == []
    evals = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if '"eval"' in line
    ]
    assert [e["step"] for e in evals] == [2, 4, 6]
    assert evals[2]["eval_loss"] < evals[0]["eval_loss"]  # it did train


def test_keep_best_by_loss_works_with_evaluations_every_n_steps(tmp_path: Path) -> None:
    out = ddpkit.launch(
        _endless_job, str(tmp_path), {"keep_best": "loss", "max_steps": 24, "every": 12}, nprocs=2
    )
    assert out["stops"] == [(24, False), (24, False)]
    assert out["compare"]["ranks"] == []
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    # Judged by the training loss under its epoch-line name, at steps 12 and 24 (the
    # loss falls, so both improve): at step 24, the run's last, the epoch line's loss.
    epoch = [r for r in records if r["kind"] == "epoch"]
    kept = [line.split(" is the best")[0] for line in out["lines"] if "is the best" in line]
    assert kept == [kept[0], f"loss {epoch[0]['loss']:.4f}"] and kept[0].startswith("loss ")
    assert out["best"] == pytest.approx(epoch[0]["loss"], rel=1e-6)
    assert (tmp_path / "ck" / "best.pt").exists()


# -- a metrics_fn's own names ----------------------------------------------------------------
def _accuracy_job(ctx: ddpkit.DistContext, folder: str, names: list[str]) -> dict[str, Any]:
    ddpkit.seed_everything(0)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(30, 5, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())  # 3 classes

    def metrics_fn(model: nn.Module, batch: Any) -> Mapping[str, torch.Tensor]:
        # The user's own accuracy: 1 for every sample, unlike any top-1 of this model.
        return {name: torch.tensor(1.0) for name in names}

    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        data,
        ctx,
        TrainConfig(epochs=1, batch_size=4, run_dir=folder, progress=False),
        eval_set=data,
        metrics_fn=metrics_fn,
        log_fn=lambda _: None,
    )
    return trainer.fit().eval


def test_a_metrics_fn_accuracy_is_reported_as_the_users(tmp_path: Path) -> None:
    result = ddpkit.launch(_accuracy_job, str(tmp_path), ["accuracy"], nprocs=2)
    assert result["eval_accuracy"] == 1.0  # the user's value, under its eval_ name
    assert 0.0 <= result["accuracy"] < 1.0  # ddpkit's top-1 beside it, not in its place
    epoch = [
        json.loads(line)
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if '"epoch"' in line
    ][-1]
    assert epoch["eval_accuracy"] == 1.0 and epoch["accuracy"] == result["accuracy"]


def test_a_metrics_fn_name_that_would_hide_the_eval_loss_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WorkerError, match=r"metrics_fn returned 'loss'.*rename it"):
        ddpkit.launch(_accuracy_job, str(tmp_path), ["loss"], nprocs=2)
