"""What a user sees while a Trainer runs: the start line, the progress bars (training
and evaluation), their loss, the bar erased on Ctrl-C; and the counts a run records
(samples seen, checkpoints every N steps)."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit import DistContext, launch
from ddpkit.checkpoint.digest import state_digest
from ddpkit.seed import seed_everything
from ddpkit.training.config import TrainConfig
from ddpkit.training.trainer import Callback, Trainer


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class _Slow(Callback):
    """Makes each step last `seconds`, so that the bar has time to show a loss."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        time.sleep(self.seconds)


class _Interrupt(Callback):
    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if step == 3:
            raise KeyboardInterrupt


def _trainer(config: TrainConfig, ctx: DistContext | None = None, **kw: Any) -> Trainer:
    seed_everything(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lines: list[str] = kw.pop("lines", [])
    return Trainer(
        model,
        opt,
        _data(),
        ctx or DistContext.single("cpu"),
        config,
        eval_set=_data(24),
        log_fn=lines.append,
        **kw,
    )


def _fit_with_bar(config: TrainConfig, **kw: Any) -> str:
    """What the bar wrote to stderr while `config` trained (tqdm writes there)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        _trainer(config, **kw).fit()
    return err.getvalue()


def test_the_start_line_says_how_the_run_trains(tmp_path: Path) -> None:
    lines: list[str] = []
    config = TrainConfig(
        epochs=1, batch_size=8, accumulate=2, checkpoint_dir=str(tmp_path / "ck"), progress=False
    )
    _trainer(config, lines=lines).fit()
    assert lines[0] == (
        "training: 1 process (gloo, cpu), ddp, precision 32, "
        f"batch 8 per rank x 2 accumulated, 16 per step, checkpoints {tmp_path / 'ck'}"
    )


def test_a_new_run_into_a_used_run_dir_says_where_the_old_records_went(tmp_path: Path) -> None:
    lines: list[str] = []
    config = TrainConfig(epochs=1, batch_size=8, run_dir=str(tmp_path))
    _trainer(config).fit()
    _trainer(config, lines=lines).fit()
    assert lines[1] == f"{tmp_path} held another run's records: kept as metrics.1.jsonl"


def test_the_bar_counts_epochs_of_all_and_shows_the_loss_between_log_lines() -> None:
    # log_every (50) is never reached in these 8 steps: the loss still shows.
    text = _fit_with_bar(TrainConfig(epochs=2, batch_size=8, progress=True), callbacks=[_Slow(0.3)])
    assert "epoch 1/2" in text and "epoch 2/2" in text
    assert "loss=" in text
    assert "eval" in text  # evaluation has a bar of its own


def test_an_interrupt_erases_the_bar_before_the_process_ends() -> None:
    from tqdm import tqdm

    trainer = _trainer(TrainConfig(epochs=1, batch_size=8, progress=True))
    trainer.callbacks.append(_Interrupt())
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            trainer.fit()
    except KeyboardInterrupt:
        # A worker ends right here (os._exit, see launcher.exit_now), while the
        # exception still holds the loop's frames: nothing the garbage collector would
        # close later gets closed. A bar left open stays half drawn on the terminal.
        open_bars = list(tqdm._instances)
    assert open_bars == []


def test_no_bar_unless_asked_or_on_a_terminal() -> None:
    assert "epoch 1/1" not in _fit_with_bar(TrainConfig(epochs=1, batch_size=8))


def _weights(trainer: Trainer) -> str:
    """A digest of what training changed: model, optimizer and scheduler state."""
    state = trainer.state_dict()
    return state_digest({k: state[k] for k in ("model", "optimizer", "scheduler", "epoch")})


def _steps_and_samples(ctx: DistContext, run_dir: str, ckpt: str) -> dict[str, Any]:
    config = TrainConfig(
        epochs=2,
        batch_size=4,
        log_every=2,
        run_dir=run_dir,
        checkpoint_dir=ckpt,
        save_every=0,
        save_every_steps=3,
    )
    trainer = _trainer(config, ctx=ctx)
    trainer.fit()
    return {"seen": trainer.samples_seen}


def test_samples_seen_and_checkpoints_every_n_steps_on_two_ranks(tmp_path: Path) -> None:
    out = launch(
        _steps_and_samples, str(tmp_path / "run"), str(tmp_path / "ck"), nprocs=2, start="spawn"
    )
    # 64 samples over 2 ranks, 4 each per step: 8 steps per epoch, 16 in all.
    assert out["seen"] == 128
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["samples_seen"] for r in steps] == [8 * r["step"] for r in steps]
    assert [r["samples_seen"] for r in records if r["kind"] == "epoch"] == [64, 128]
    # Every 3rd step, and after the last; keep_last (3) keeps the newest.
    names = sorted(p.name for p in (tmp_path / "ck").glob("ckpt-*.pt"))
    assert names == ["ckpt-000000012.pt", "ckpt-000000015.pt", "ckpt-000000016.pt"]


def test_a_run_resumed_from_a_mid_epoch_step_checkpoint_ends_as_the_straight_run(
    tmp_path: Path,
) -> None:
    straight = _trainer(TrainConfig(epochs=2, batch_size=8))
    straight.fit()
    every_5 = TrainConfig(
        epochs=2, batch_size=8, checkpoint_dir=str(tmp_path), save_every_steps=5, keep_last=9
    )
    _trainer(every_5).fit()
    for late in tmp_path.glob("ckpt-*.pt"):  # keep only step 5's, in the first epoch
        if late.name != "ckpt-000000005.pt":
            late.unlink()
    resumed = _trainer(
        TrainConfig(epochs=2, batch_size=8, checkpoint_dir=str(tmp_path), resume=True)
    )
    resumed.fit()
    assert _weights(resumed) == _weights(straight)
    assert resumed.samples_seen == straight.samples_seen == 128
