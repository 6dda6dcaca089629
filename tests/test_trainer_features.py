"""Trainer for real jobs, on 2 real gloo ranks: accumulation, mixed precision, clipping,
schedulers, uneven shards, early stopping, compile, run logs."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset, Sampler, TensorDataset

import ddpkit
from ddpkit import DistContext, launch
from ddpkit.checkpoint.digest import model_digest, state_digest
from ddpkit.checkpoint.pt import latest_checkpoint
from ddpkit.errors import CheckpointError, WorkerError
from ddpkit.seed import seed_everything
from ddpkit.training.config import TrainConfig
from ddpkit.training.decisions import callback_states, load_callback_states
from ddpkit.training.trainer import Callback, EarlyStopping, Trainer


def _data(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


class _Record(Callback):
    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
        self.epochs.append(dict(metrics))


def _fit(ctx: DistContext, config: TrainConfig, opts: dict[str, Any]) -> dict[str, Any]:
    seed_everything(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=opts.get("lr", 0.05), momentum=0.9)
    sched = None
    if opts.get("scheduler"):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    record = _Record()
    trainer = Trainer(
        model,
        opt,
        _data(opts.get("n", 96)),
        ctx,
        config,
        loss_fn=nn.functional.mse_loss,
        scheduler=sched,
        callbacks=[record, *opts.get("callbacks", [])],
        train_sampler=opts.get("sampler"),
        log_fn=lambda s: None,
    )
    fit = trainer.fit()
    # Every rank's view, so that tests compare all ranks, not rank 0 alone.
    mine = (model_digest(trainer.model), state_digest(opt.state_dict()), fit.global_step)
    ranks: list[Any] = [mine]
    if ctx.distributed:
        ranks = [None] * ctx.world_size
        dist.all_gather_object(ranks, (*mine, fit.epochs, fit.stopped_early))
    return {
        "ranks": ranks,
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "digest": model_digest(trainer.model),
        "step": fit.global_step,
        "epochs": fit.epochs,
        "lr": opt.param_groups[0]["lr"],
        "metrics": record.epochs,
        "scaler": trainer.precision.scaler.state_dict() if trainer.precision.scaler else None,
        "stopped_early": fit.stopped_early,
    }


def test_k_micro_batches_equal_one_batch_of_k_times_b() -> None:
    micro = launch(_fit, TrainConfig(epochs=2, batch_size=4, accumulate=3), {}, nprocs=2)
    whole = launch(_fit, TrainConfig(epochs=2, batch_size=12), {}, nprocs=2)
    assert micro["step"] == whole["step"] == 2 * 4  # 96 / (12 x 2 ranks) per epoch
    for a, b in zip(micro["params"], whole["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_resumes_exactly_with_its_scaler(
    tmp_path: Path, precision: Literal["fp16", "bf16"]
) -> None:
    def cfg(epochs: int, folder: str) -> TrainConfig:
        return TrainConfig(
            epochs=epochs,
            batch_size=8,
            precision=precision,
            resume=True,
            checkpoint_dir=str(tmp_path / folder),
            clip_grad_norm=1.0,
        )

    straight = launch(_fit, cfg(4, "a"), {"scheduler": True}, nprocs=2)
    launch(_fit, cfg(2, "b"), {"scheduler": True}, nprocs=2)
    resumed = launch(_fit, cfg(4, "b"), {"scheduler": True}, nprocs=2)
    assert resumed["digest"] == straight["digest"]
    assert resumed["lr"] == straight["lr"] == 0.05 * 0.5**2  # the scheduler came back
    found = latest_checkpoint(tmp_path / "b", DistContext())
    assert found is not None
    if precision == "fp16":
        assert found[1]["scaler"] is not None and resumed["scaler"] == straight["scaler"]
    else:
        assert found[1]["scaler"] is None


def test_a_per_step_scheduler_survives_resume(tmp_path: Path) -> None:
    def cfg(epochs: int) -> TrainConfig:
        return TrainConfig(
            epochs=epochs,
            batch_size=8,
            scheduler_interval="step",
            checkpoint_dir=str(tmp_path),
            resume=True,
        )

    launch(_fit, cfg(1), {"scheduler": True}, nprocs=2)
    resumed = launch(_fit, cfg(2), {"scheduler": True}, nprocs=2)
    assert resumed["step"] == 12 and resumed["lr"] == 0.05 * 0.5**6  # stepped per step


class _Unequal(Sampler[int]):
    """Rank 0 gets 10 samples, rank 1 gets 25: unequal numbers of batches."""

    def __init__(self, rank: int) -> None:
        self.indices = list(range(10)) if rank == 0 else list(range(10, 35))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _fit_unequal(ctx: DistContext) -> dict[str, Any]:
    return _fit(ctx, TrainConfig(epochs=2, batch_size=4), {"sampler": _Unequal(ctx.rank)})


def test_uneven_shards_finish_without_hanging_or_dropping_work() -> None:
    out = launch(_fit_unequal, nprocs=2, hang_timeout=60)
    # every sample of both shards was trained on, in every epoch
    assert [m["samples"] for m in out["metrics"]] == [35, 35]
    assert out["epochs"] == 2
    # and both ranks end with the same model, optimizer state and step count
    assert out["ranks"][0] == out["ranks"][1]


def test_early_stopping_stops_every_rank_together() -> None:
    # The model trains (its loss falls), and a stopper that wants the loss to rise
    # stops it after 1 + 2 epochs: the ranks must stop together with equal models.
    rising = EarlyStopping("loss", patience=2, mode="max")
    out = launch(_fit, TrainConfig(epochs=10, batch_size=8), {"callbacks": [rising]}, nprocs=2)
    # every rank, not rank 0 alone: (digests, step, epochs, stopped early)
    assert [r[3:] for r in out["ranks"]] == [(3, True), (3, True)]
    assert out["ranks"][0] == out["ranks"][1]
    losses = [m["loss"] for m in out["metrics"]]
    assert min(losses) < losses[0]  # it did train: lr 0 made equal ranks trivial


def test_run_dir_gets_config_and_step_and_epoch_metrics(tmp_path: Path) -> None:
    config = TrainConfig(
        epochs=2, batch_size=4, run_dir=str(tmp_path), log_every=5, clip_grad_norm=5.0
    )
    launch(_fit, config, {}, nprocs=2)
    assert json.loads((tmp_path / "config.json").read_text())["log_every"] == 5
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x["kind"] == "step"]
    epochs = [x for x in lines if x["kind"] == "epoch"]
    assert [x["step"] for x in steps] == [5, 10, 15, 20]  # 12 steps per epoch, 24 in all
    assert all(x["grad_norm"] > 0 and x["loss"] > 0 and x["lr"] == 0.05 for x in steps)
    assert [x["epoch"] for x in epochs] == [1, 2] and all(x["samples"] == 96 for x in epochs)
    assert not (tmp_path / "tb").exists()  # TensorBoard only when loggers names it


@pytest.mark.slow
def test_compile_wraps_after_ddp_and_checkpoints_have_plain_keys(tmp_path: Path) -> None:
    config = TrainConfig(epochs=1, batch_size=16, compile=True, checkpoint_dir=str(tmp_path))
    out = launch(_fit, config, {}, nprocs=2)
    assert out["step"] == 3
    found = latest_checkpoint(tmp_path, DistContext())
    assert found is not None
    assert sorted(found[1]["model"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]


class _Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """A stream that shards itself: rank 0 yields 10 samples, rank 1 yields 22."""

    def __init__(self, rank: int) -> None:
        self.data = _data(32)
        self.indices = range(10) if rank == 0 else range(10, 32)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.data[i] for i in self.indices)


def _fit_stream(ctx: DistContext) -> tuple[list[dict[str, float]], list[Any]]:
    seed_everything(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record = _Record()
    config = TrainConfig(epochs=2, batch_size=4, accumulate=2)
    trainer = Trainer(
        model,
        opt,
        _Stream(ctx.rank),
        ctx,
        config,
        loss_fn=nn.functional.mse_loss,
        callbacks=[record],
        log_fn=lambda s: None,
    )
    trainer.fit()
    mine = (model_digest(model), state_digest(opt.state_dict()), trainer.global_step)
    return record.epochs, _every_rank(ctx, mine)


def test_an_iterable_dataset_of_unequal_shards_trains_everything() -> None:
    epochs, ranks = launch(_fit_stream, nprocs=2, hang_timeout=60)
    assert [m["samples"] for m in epochs] == [32, 32]
    assert ranks[0] == ranks[1]  # model, optimizer state and step on every rank
    assert ranks[0][2] == 2 * 3  # rank 1's 6 batches in groups of 2, each epoch


class _StopAfterSaving(Callback):
    """Ends the run (as a crash would) once the checkpoint of step `step` is written."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"stopped after saving step {self.step}")


def _every_rank(ctx: DistContext, mine: Any) -> list[Any]:
    ranks: list[Any] = [mine]
    if ctx.distributed:
        ranks = [None] * ctx.world_size
        dist.all_gather_object(ranks, mine)
    return ranks


def _fit_stream_resumable(ctx: DistContext, folder: str, stop: int | None) -> list[Any]:
    seed_everything(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = TrainConfig(
        epochs=2, batch_size=4, checkpoint_dir=folder, save_every_steps=4, resume=True
    )
    trainer = Trainer(
        model,
        opt,
        _Stream(ctx.rank),  # rank 0: 3 batches, rank 1: 6
        ctx,
        config,
        loss_fn=nn.functional.mse_loss,
        callbacks=[_StopAfterSaving(stop)],
        log_fn=lambda s: None,
    )
    trainer.fit()
    return _every_rank(ctx, (model_digest(trainer.model), state_digest(opt.state_dict())))


def test_uneven_stream_resumes_from_a_save_after_the_short_shard_ran_out(tmp_path: Path) -> None:
    straight = launch(_fit_stream_resumable, str(tmp_path / "a"), None, nprocs=2, hang_timeout=60)
    folder = str(tmp_path / "b")
    with pytest.raises(WorkerError, match="stopped after saving step 4"):
        launch(_fit_stream_resumable, folder, 4, nprocs=2, hang_timeout=60)  # rank 0 ran out
    resumed = launch(_fit_stream_resumable, folder, None, nprocs=2, hang_timeout=60)
    assert resumed[0] == resumed[1] == straight[0] == straight[1]


class _Indexed(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """40 samples that say which they are, so a test can see what was trained."""

    def __init__(self) -> None:
        self.data = _data(40)

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return (*self.data[i], i)


def _fit_recording(ctx: DistContext, folder: str, record: str, stop: int | None) -> int:
    """Trains 2 epochs of _Indexed; each rank appends 'epoch index' lines to `record`."""
    seed_everything(0)
    model = _mlp()
    config = TrainConfig(
        epochs=2, batch_size=4, checkpoint_dir=folder, save_every_steps=1, resume=True
    )
    epoch = [0]

    class _Epoch(Callback):
        def on_epoch_start(self, trainer: Trainer, e: int) -> None:
            epoch[0] = e

    def step(net: nn.Module, batch: Any) -> torch.Tensor:
        x, y, index = batch
        with open(f"{record}.{ctx.rank}", "a") as f:
            f.writelines(f"{epoch[0]} {i}\n" for i in index.tolist())
        return nn.functional.mse_loss(net(x), y)

    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        _Indexed(),
        ctx,
        config,
        training_step=step,
        callbacks=[_Epoch(), _StopAfterSaving(stop)],
        log_fn=lambda s: None,
    )
    return trainer.fit().global_step


def _trained(tmp_path: Path) -> list[list[int]]:
    """Per epoch, the sorted indices that every rank of every run trained."""
    seen: list[list[int]] = [[], []]
    for f in tmp_path.glob("record*"):
        for line in f.read_text().splitlines():
            e, i = map(int, line.split())
            seen[e].append(i)
    return [sorted(s) for s in seen]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_mid_epoch_resume_on_another_world_size_trains_each_sample_once(
    tmp_path: Path, before: int, after: int
) -> None:
    folder, record = str(tmp_path / "ck"), str(tmp_path / "record")
    with pytest.raises((WorkerError, RuntimeError), match="stopped after saving step 3"):
        launch(_fit_recording, folder, record, 3, nprocs=before)
    launch(_fit_recording, folder, record + "-resumed", None, nprocs=after)
    assert _trained(tmp_path) == [list(range(40)), list(range(40))]


def _fit_batchnorm(ctx: DistContext, strategy: str) -> list[Any]:
    seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
    config = TrainConfig(
        epochs=2,
        batch_size=4,
        sync_batchnorm=False,
        strategy=strategy,  # type: ignore[arg-type]
    )
    trainer = Trainer(
        model,
        lambda params: torch.optim.SGD(params, lr=0.05),
        _data(24),
        ctx,
        config,
        loss_fn=nn.functional.mse_loss,
        log_fn=lambda s: None,
    )
    trainer.fit()
    return _every_rank(ctx, [b.clone() for b in trainer.model.buffers()])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_per_rank_batchnorm_ends_with_the_same_buffers_on_every_rank(strategy: str) -> None:
    if strategy == "fsdp" and not ddpkit.parallel.fsdp.cpu_supported():
        pytest.skip("FSDP2 on CPU ranks needs torch >= 2.7")
    ranks = launch(_fit_batchnorm, strategy, nprocs=2)
    assert len(ranks[0]) == 3  # running mean, variance and the batch count
    assert all(torch.equal(a, b) for a, b in zip(ranks[0], ranks[1], strict=True))


# -- keep_best after a resume (issue 43, D01) -------------------------------------------
# The watched metric by progress (epochs done, or steps): best at 2, then worse than that
# but better than the best before it, which a resumed run must not take for the best.
_SCORES = {1: 0.5, 2: 0.3, 3: 0.4, 4: 0.35}


class _CrashAt(Callback):
    """Ends the run as a crash would, at the start of epoch (by epochs) or after step
    (by steps) `at`, before anything of it is saved."""

    def __init__(self, at: int | None, by_steps: bool) -> None:
        self.at, self.by_steps = at, by_steps

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        if not self.by_steps and epoch == self.at:
            raise RuntimeError(f"crashed at epoch {epoch}")

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if self.by_steps and step == self.at:
            raise RuntimeError(f"crashed after step {step}")


def _fit_keeping_best(ctx: DistContext, folder: str, by_steps: bool, crash: int | None) -> Any:
    """4 epochs (or 8 steps, evaluated and saved every 2) keeping the best `eval_err`;
    rank 0 returns the values it announced as the best so far."""
    seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 1))
    progress: list[Trainer] = []

    def err(net: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        done = progress[0].global_step // 2 if by_steps else progress[0].epoch
        return {"err": torch.tensor(_SCORES[done])}

    by: dict[str, Any] = (
        {"max_steps": 8, "eval_every_steps": 2, "save_every_steps": 2} if by_steps else {}
    )
    config = TrainConfig(
        epochs=None if by_steps else 4,
        batch_size=4,
        checkpoint_dir=folder,
        keep_best="eval_err",
        keep_last=10,
        resume=crash is None,
        **by,
    )
    said: list[str] = []
    trainer = Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=1e-2),
        _data(96),
        ctx,
        config,
        loss_fn=nn.functional.mse_loss,
        eval_set=_data(10),
        metrics_fn=err,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7),
        callbacks=[_CrashAt(crash, by_steps)],
        log_fn=said.append,
    )
    progress.append(trainer)
    trainer.fit()
    return [float(s.split()[1]) for s in said if "is the best so far" in s]


@pytest.mark.parametrize("by_steps", [False, True], ids=["by-epochs", "by-steps"])
def test_keep_best_after_a_resume_never_takes_a_worse_checkpoint(
    tmp_path: Path, by_steps: bool
) -> None:
    straight, cut = str(tmp_path / "straight"), str(tmp_path / "cut")
    kept = launch(_fit_keeping_best, straight, by_steps, None, nprocs=2)
    assert kept == [0.5, 0.3]  # the best is kept at 2 (epochs or evaluations) of 4
    # Crashed after 2 (a step or epoch that was the best so far, saved), then resumed.
    with pytest.raises((WorkerError, RuntimeError), match="crashed"):
        launch(_fit_keeping_best, cut, by_steps, 5 if by_steps else 2, nprocs=2)
    again = launch(_fit_keeping_best, cut, by_steps, None, nprocs=2)
    assert again == []  # 0.4 and 0.35 are worse than 0.3: nothing is the best so far
    assert assert_same_best(Path(straight), Path(cut)) == (4 if by_steps else 2 * 12)


def assert_same_best(straight: Path, resumed: Path) -> int:
    """Assert that best.pt in the two checkpoint folders holds the same step, best value
    and model tensors; return that step."""
    a = torch.load(straight / "best.pt", weights_only=True)
    b = torch.load(resumed / "best.pt", weights_only=True)
    assert b["global_step"] == a["global_step"]
    assert b["extra"]["best"] == a["extra"]["best"]
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    return int(a["global_step"])


# -- callback states by name (issue 43, D10) ----------------------------------------------
class _Counter(Callback):
    """A callback with a state of its own: the epochs it saw."""

    def __init__(self) -> None:
        self.seen = 0

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float]) -> None:
        self.seen += 1

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state.get("seen", 0))  # lenient, as many users' callbacks are


def _fit_stopping(ctx: DistContext, folder: str, counter: bool, crash: int | None) -> Any:
    """Up to 8 epochs; `eval_err` never improves after epoch 1, so EarlyStopping (patience
    3, from the config, after the given callbacks) stops after epoch 4. Every rank's
    (epochs, stopped early, the counter's epochs, if any)."""
    seed_everything(0)
    model = _mlp()
    progress: list[Trainer] = []

    def err(net: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        return {"err": torch.tensor(0.1 * progress[0].epoch)}

    config = TrainConfig(
        epochs=8,
        batch_size=8,
        checkpoint_dir=folder,
        resume=crash is None,
        early_stopping_patience=3,
        early_stopping_metric="eval_err",
    )
    counted = [_Counter()] if counter else []
    plain = [Callback()] if counter and crash is None else []  # stateless
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        _data(48),
        ctx,
        config,
        loss_fn=nn.functional.mse_loss,
        eval_set=_data(10),
        metrics_fn=err,
        callbacks=[*plain, *counted, _CrashAt(crash, by_steps=False)],
        log_fn=lambda s: None,
    )
    progress.append(trainer)
    fit = trainer.fit()
    return _every_rank(ctx, (fit.epochs, fit.stopped_early, [c.seen for c in counted]))


@pytest.mark.parametrize(
    ("before", "after"), [(True, False), (False, True)], ids=["dropped", "added"]
)
def test_a_resume_with_another_callback_list_keeps_early_stopping(
    tmp_path: Path, before: bool, after: bool
) -> None:
    # Crashed at the start of epoch 3 (bad epochs: 1 of 3), resumed with the user's
    # callback dropped (which crashed with KeyError 'best') or with two added before
    # EarlyStopping (which silently reset its count and trained to epoch 6).
    with pytest.raises((WorkerError, RuntimeError), match="crashed"):
        launch(_fit_stopping, str(tmp_path), before, 2, nprocs=2)
    ranks = launch(_fit_stopping, str(tmp_path), after, None, nprocs=2)
    assert ranks[0] == ranks[1]
    assert ranks[0][:2] == (4, True)
    assert ranks[0][2] == ([2] if after else [])  # an added callback starts afresh


def test_callback_states_are_kept_by_name_and_old_lists_load_where_unambiguous() -> None:
    first, second, counter = EarlyStopping("loss"), EarlyStopping("eval_loss"), _Counter()
    first.bad_epochs, second.bad_epochs, counter.seen = 1, 2, 5
    states = callback_states([first, counter, second])
    assert states == {
        "EarlyStopping": {"best": math.inf, "bad_epochs": 1},
        "_Counter": {"seen": 5},
        "EarlyStopping#1": {"best": math.inf, "bad_epochs": 2},
    }
    # Another order, one dropped: each takes the state saved under its own name.
    again, dropped = _Counter(), EarlyStopping("loss")
    load_callback_states([again, dropped], states, Path("ckpt-000000001.pt"))
    assert (again.seen, dropped.bad_epochs) == (5, 1)
    # An older checkpoint's list by position: the states that hold something go, in
    # order, to the callbacks that keep one, when they match one for one.
    fresh, stateless = EarlyStopping(), Callback()
    old = [{}, {"best": 0.5, "bad_epochs": 2}]
    load_callback_states([stateless, fresh], old, Path("ckpt-000000001.pt"))
    assert (fresh.best, fresh.bad_epochs) == (0.5, 2)
    with pytest.raises(CheckpointError, match="by position"):
        load_callback_states([_Counter()], old, Path("ckpt-000000001.pt"))


# -- accumulation after a resume with another batch size (issue 43, D09) -------------------
class _Scale(nn.Module):
    """loss = mean(w * v): each step moves w (SGD, lr 1) by exactly the mean of the v
    it trained on, when every sample of the step has its full weight."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return (self.w * v).mean()


def _fit_weighed(ctx: DistContext, folder: str, batch_size: int, crash: int | None) -> None:
    """One epoch of 48 samples `(index, v = index + 1)` with accumulate 2; each rank
    appends `step w indices...` lines to `folder/weights.<rank>` after every step."""
    seed_everything(0)
    model = _Scale()
    pending: list[int] = []

    def step(net: nn.Module, batch: Any) -> torch.Tensor:
        index, v = batch
        pending.extend(index.tolist())
        out: torch.Tensor = net(v)
        return out

    class _Weigh(Callback):
        def on_step_end(self, trainer: Trainer, at: int) -> None:
            w = float(cast(torch.Tensor, ddpkit.unwrap(trainer.model).w))
            with open(Path(folder, f"weights.{ctx.rank}"), "a") as f:
                f.write(" ".join(map(str, [at, w, *pending])) + "\n")
            pending.clear()

    config = TrainConfig(
        epochs=1,
        batch_size=batch_size,
        accumulate=2,
        checkpoint_dir=str(Path(folder, "ck")),
        save_every_steps=1,
        resume=crash is None,
    )
    data = TensorDataset(torch.arange(48), torch.arange(1, 49, dtype=torch.float32))
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        data,
        ctx,
        config,
        training_step=step,
        callbacks=[_Weigh(), _CrashAt(crash, by_steps=True)],
        log_fn=lambda s: None,
    )
    trainer.fit()


def test_a_resume_with_another_batch_size_steps_with_full_weight(tmp_path: Path) -> None:
    # Batches of 4, accumulate 2, 2 ranks: 16 samples a step. Saved after step 1 (and
    # crashed after step 2, unsaved), resumed with batches of 8: the 16 samples done
    # are 1 batch of 8 per rank, so the first group started mid-group: one batch at half
    # weight, then the epoch's last batch alone.
    folder = str(tmp_path)
    with pytest.raises((WorkerError, RuntimeError), match="crashed"):
        launch(_fit_weighed, folder, 4, 2, nprocs=2)
    for f in tmp_path.glob("weights.*"):
        f.rename(f.with_name("cut-" + f.name))
    launch(_fit_weighed, folder, 8, None, nprocs=2)

    def steps(prefix: str) -> dict[int, tuple[float, list[int]]]:
        out: dict[int, tuple[float, list[int]]] = {}
        for f in tmp_path.glob(f"{prefix}weights.*"):
            for line in f.read_text().splitlines():
                at, w, *index = line.split()
                seen = out.get(int(at), (float(w), []))[1]
                out[int(at)] = float(w), seen + [int(i) for i in index]
        return out

    cut, resumed = steps("cut-"), steps("")
    done = {1: cut[1]}  # what the checkpoint of step 1 holds
    assert sorted(resumed) == [2]  # the 32 samples left are one step of 2 x 8 per rank
    trained = [*done.values(), *resumed.values()]
    assert sorted(i for _, index in trained for i in index) == list(range(48))
    w = 0.0
    for after, index in trained:  # each step moved w by the mean v of its samples
        assert after == pytest.approx(w - sum(i + 1 for i in index) / len(index))
        w = after


# -- the record of an epoch resumed mid-way (issue 43, found by the matrix) ---------------
class _Regressor(nn.Module):
    """{"x", "y"} batches in, {"loss"} out (as a HuggingFace model), with dropout."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(dropout), nn.GELU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.smooth_l1_loss(self.head(self.net(x)), y)}


class _Pairs(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.x, self.y = _data(n).tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class _Lopsided(Sampler[int]):
    """Shards 40 samples unevenly, shuffled each epoch: rank 0 gets 12, rank 1 gets 28."""

    def __init__(self, rank: int) -> None:
        self.rank, self.epoch = rank, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(40, generator=torch.Generator().manual_seed(self.epoch))
        return iter(order[:12] if self.rank == 0 else order[12:])

    def __len__(self) -> int:
        return 12 if self.rank == 0 else 28


class _CrashAfterStep(Callback):
    """Ends the run as a crash would, right after step `at` (nothing of it saved)."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if step == self.at:
            raise RuntimeError(f"crashed after step {step}")


def _fit_resumable_log(
    ctx: DistContext, folder: str, opts: dict[str, Any], batch_size: int = 4
) -> list[Any]:
    """2 epochs of 40 {"x", "y"} samples (5 steps an epoch on 2 ranks), AdamW with a
    per-step OneCycleLR (none with lr 0), a run log in folder/run and checkpoints in
    folder/ck; `opts`: TrainConfig fields, and "lr", "dropout", "stop" (the step after
    whose checkpoint `_StopAfterSaving` ends the run), "crash" (`_CrashAfterStep`),
    "lopsided" (shards of 12 and 28 samples, `_Lopsided`).
    Every rank's digest of model and optimizer state."""
    seed_everything(0)
    own = ("lr", "dropout", "stop", "crash", "lopsided")
    cfg = {k: v for k, v in opts.items() if k not in own}
    config = TrainConfig(
        epochs=2,
        batch_size=batch_size,
        checkpoint_dir=str(Path(folder, "ck")),
        run_dir=str(Path(folder, "run")),
        keep_last=20,
        log_every=1,
        **cfg,
    )
    lr = opts.get("lr", 1e-2)

    def one_cycle(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=40)

    trainer = Trainer(
        _Regressor(opts.get("dropout", 0.2)),
        lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.05),
        _Pairs(40),
        ctx,
        config,
        eval_set=_Pairs(10) if config.eval_every_steps else None,
        scheduler=one_cycle if lr else None,  # lr 0: no scheduler to set another
        train_sampler=_Lopsided(ctx.rank) if opts.get("lopsided") else None,
        callbacks=[_StopAfterSaving(opts.get("stop")), _CrashAfterStep(opts.get("crash"))],
        log_fn=lambda s: None,
    )
    trainer.fit()
    return _every_rank(
        ctx, (model_digest(trainer.model), state_digest(trainer.optimizer.state_dict()))
    )


def _log(folder: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """metrics.jsonl's records (of `kind`, if given), less their timings."""
    out = []
    for line in (folder / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if kind is None or record["kind"] == kind:
            out.append({k: v for k, v in record.items() if k not in ("time", "samples_per_s")})
    return out


def test_a_mid_epoch_resume_writes_the_whole_epochs_record(tmp_path: Path) -> None:
    # Saved after step 9 of 10 (the second epoch's 4th of 5), stopped there and resumed:
    # the epoch's record held the loss and samples of step 10 alone (8 of 40), and
    # keep_best="loss" compared that step's loss with whole epochs.
    opts = {"save_every_steps": 3, "keep_best": "loss"}
    straight = launch(_fit_resumable_log, str(tmp_path / "a"), opts, nprocs=2)
    cut = tmp_path / "b"
    with pytest.raises((WorkerError, RuntimeError), match="stopped after saving step 9"):
        launch(_fit_resumable_log, str(cut), {**opts, "stop": 9}, nprocs=2)
    resumed = launch(_fit_resumable_log, str(cut), {**opts, "resume": True}, nprocs=2)
    assert resumed == straight  # every rank: model and optimizer state
    assert _log(cut, "epoch") == _log(tmp_path / "a", "epoch")  # loss bit for bit
    assert [r["samples"] for r in _log(cut, "epoch")] == [40, 40]
    assert_same_best(tmp_path / "a" / "ck", cut / "ck")


def test_samples_seen_after_a_resume_over_uneven_shards(tmp_path: Path) -> None:
    # Shards of 12 and 28 samples: 7 steps an epoch. Saved after step 13 (the second
    # epoch's 6th, rank 0's shard ran out at its 3rd), crashed after 14 and resumed: the
    # checkpoint held rank 0's count times the ranks (40 + 24, not 40 + 36), so the run
    # ended at samples_seen 68 instead of 80.
    opts = {"save_every_steps": 13, "lopsided": True}
    straight = launch(_fit_resumable_log, str(tmp_path / "a"), opts, nprocs=2)
    cut = tmp_path / "b"
    with pytest.raises((WorkerError, RuntimeError), match="crashed after step 14"):
        launch(_fit_resumable_log, str(cut), {**opts, "crash": 14}, nprocs=2)
    resumed = launch(_fit_resumable_log, str(cut), {**opts, "resume": True}, nprocs=2)
    assert resumed == straight
    want, got = _log(tmp_path / "a"), _log(cut)
    assert [r["samples_seen"] for r in got if r["kind"] == "epoch"] == [40, 80]
    assert got == want
    # Each step's line counts the samples of both shards so far (rank 0's stop at 12).
    seen = [r["samples_seen"] for r in want if r["kind"] == "step"]
    assert seen[:7] == [8, 16, 24, 28, 32, 36, 40]


@pytest.mark.parametrize(("before", "after", "batch"), [(2, 1, 4), (2, 2, 6), (1, 2, 4)], ids=str)
def test_a_resume_elsewhere_writes_the_whole_epochs_totals(
    tmp_path: Path, before: int, after: int, batch: int
) -> None:
    # lr 0 and no dropout: every sample's loss is the same whoever trains it, so the
    # epoch's mean loss is the straight run's, up to the order of the float sums.
    opts: dict[str, Any] = {"save_every_steps": 3, "lr": 0.0, "dropout": 0.0}
    launch(_fit_resumable_log, str(tmp_path / "a"), opts, nprocs=before)
    cut = tmp_path / "b"
    stop = 9 if before == 2 else 18  # the second epoch's 4th of 5 (on 1 rank: 8th of 10)
    with pytest.raises((WorkerError, RuntimeError), match=f"stopped after saving step {stop}"):
        launch(_fit_resumable_log, str(cut), {**opts, "stop": stop}, nprocs=before)
    launch(_fit_resumable_log, str(cut), {**opts, "resume": True}, batch, nprocs=after)
    want, got = _log(tmp_path / "a", "epoch"), _log(cut, "epoch")
    assert [(r["epoch"], r["samples"], r["samples_seen"]) for r in got] == [
        (1, 40, 40),
        (2, 40, 80),
    ]
    assert got[1]["loss"] == pytest.approx(want[1]["loss"], rel=1e-6)


def test_an_older_checkpoint_without_the_epochs_sums_still_resumes(tmp_path: Path) -> None:
    opts: dict[str, Any] = {"save_every_steps": 3}
    with pytest.raises((WorkerError, RuntimeError), match="stopped after saving step 9"):
        launch(_fit_resumable_log, str(tmp_path), {**opts, "stop": 9}, nprocs=2)
    path = tmp_path / "ck" / "ckpt-000000009.pt"
    state = torch.load(path, weights_only=True)
    del state["extra"]["epoch_sums"]  # as an older ddpkit wrote it
    torch.save(state, path)
    ranks = launch(_fit_resumable_log, str(tmp_path), {**opts, "resume": True}, nprocs=2)
    assert ranks[0] == ranks[1]
    # Its record covers the part this run trained: step 10's 8 samples.
    assert [r["samples"] for r in _log(tmp_path, "epoch")] == [40, 8]


def test_a_checkpoint_at_an_epochs_last_step_resumes_without_a_second_record(
    tmp_path: Path,
) -> None:
    # keep_best evaluates at each epoch's last step (5) and keeps it, before the epoch's
    # record; the run wrote that record, went on, and crashed after step 7, before any
    # other checkpoint. The resumed run wrote the first epoch's record a second time.
    opts = {"eval_every_steps": 5, "keep_best": "eval_loss", "save_every": 0}
    straight = launch(_fit_resumable_log, str(tmp_path / "a"), opts, nprocs=2)
    cut = tmp_path / "b"
    with pytest.raises((WorkerError, RuntimeError), match="crashed after step 7"):
        launch(_fit_resumable_log, str(cut), {**opts, "crash": 7}, nprocs=2)
    resumed = launch(_fit_resumable_log, str(cut), {**opts, "resume": True}, nprocs=2)
    assert resumed == straight
    epochs = [(r["epoch"], r["step"]) for r in _log(cut, "epoch")]
    assert epochs == [(1, 5), (2, 10)]
    assert _log(cut) == _log(tmp_path / "a")
    assert_same_best(tmp_path / "a" / "ck", cut / "ck")


def test_a_run_stopped_right_after_a_checkpoint_keeps_that_steps_line(tmp_path: Path) -> None:
    # The run ends right after the checkpoint of step 8 is written (a kill there); the
    # resumed run starts after step 8, so step 8's line must already be in the log.
    opts: dict[str, Any] = {"save_every_steps": 4}
    launch(_fit_resumable_log, str(tmp_path / "a"), opts, nprocs=2)
    cut = tmp_path / "b"
    with pytest.raises((WorkerError, RuntimeError), match="stopped after saving step 8"):
        launch(_fit_resumable_log, str(cut), {**opts, "stop": 8}, nprocs=2)
    launch(_fit_resumable_log, str(cut), {**opts, "resume": True}, nprocs=2)
    assert [r["step"] for r in _log(cut, "step")] == list(range(1, 11))
    assert _log(cut) == _log(tmp_path / "a")
