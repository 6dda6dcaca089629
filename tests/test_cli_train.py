"""`ddpkit train` end to end, as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli


def _result(proc: Any) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.slow
def test_default_job_trains_digits_on_every_core_to_95_percent() -> None:
    out = _result(run_cli("train", "--json"))
    assert out["job"] == "digits" and out["nproc"] >= 1
    assert out["test_accuracy"] >= 0.95
    for key in (
        "epochs",
        "global_step",
        "samples_per_s",
        "final_loss",
        "checkpoint",
        "model_digest",
    ):
        assert key in out


@pytest.mark.slow
def test_linear_example_resumed_after_two_epochs_matches_four_straight(tmp_path: Path) -> None:
    common = ("train", "--example", "linear", "--nproc", "2", "--json")
    straight = _result(run_cli(*common, "--epochs", "4", "--checkpoint-dir", str(tmp_path / "a")))
    first = _result(run_cli(*common, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "b")))
    resumed = run_cli(*common, "--epochs", "4", "--checkpoint-dir", str(tmp_path / "b"), "--resume")
    out = _result(resumed)
    assert "resumed from" in resumed.stdout and "epoch 3" in resumed.stdout
    assert first["model_digest"] != straight["model_digest"]
    assert out["model_digest"] == straight["model_digest"]
    assert out["global_step"] == straight["global_step"] == 4 * 32  # 2048 / (32 x 2)
    assert out["test_accuracy"] is None and out["checkpoint"].endswith("ckpt-000000128.pt")
    again = run_cli(
        *common[:-1], "--epochs", "4", "--checkpoint-dir", str(tmp_path / "b"), "--resume"
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1].startswith("already finished at epoch 4 (step 128, ")
    assert "nan" not in again.stdout


@pytest.mark.slow
def test_a_resume_past_a_corrupt_checkpoint_warns_once(tmp_path: Path) -> None:
    common = ("train", "--example", "linear", "--nproc", "2", "--checkpoint-dir", str(tmp_path))
    _result(run_cli(*common, "--epochs", "2", "--json"))
    newest = tmp_path / "ckpt-000000064.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    resumed = run_cli(*common, "--epochs", "3", "--resume", "--json")
    _result(resumed)
    said = resumed.stdout + resumed.stderr
    assert said.count("skipped corrupt ckpt-000000064.pt") == 1, said


def _one_line_error(proc: Any, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ddpkit: error:")
    for needle in needles:
        assert needle in lines[0]


def test_bad_input_is_one_clear_line(tmp_path: Path) -> None:
    _one_line_error(run_cli("train", "--nproc", "0"), "nprocs must be", "--nproc")
    _one_line_error(run_cli("train", "--batch-size", "0"), "batch_size must be >= 1")
    _one_line_error(run_cli("train", "--example", "mnist"), "unknown example 'mnist'", "digits")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _one_line_error(
        run_cli("train", "--checkpoint-dir", str(blocker / "ck")), "cannot write checkpoints"
    )
    corrupt = tmp_path / "ck"
    corrupt.mkdir()
    (corrupt / "ckpt-000000010.pt").write_bytes(b"\x00garbage")
    _one_line_error(run_cli("train", "--checkpoint-dir", str(corrupt), "--resume"), "could be read")


def test_help_and_version() -> None:
    out = run_cli("--help")
    assert out.returncode == 0 and "train" in out.stdout
    out = run_cli("train", "--help")
    assert out.returncode == 0 and "--checkpoint-dir" in out.stdout
    assert run_cli("--version").stdout.startswith("ddpkit ")


def test_help_shows_the_defaults_of_the_job_it_names(tmp_path: Path) -> None:
    (tmp_path / "job20.py").write_text('DEFAULTS = {"epochs": 20}\ndef build(ctx): ...\n')
    spec = f"{tmp_path / 'job20.py'}:build"
    for command in ("train", "verify"):
        out = run_cli(command, "--job", spec, "--help")
        assert out.returncode == 0, out.stderr
        text = "".join(out.stdout.split())  # argparse wraps the help lines, even a path
        assert "(default:20,from" + spec.replace(" ", "") in text or command == "verify"
        assert "micro-batch(default:32)" in text  # batch_size: the job leaves TrainConfig's
    out = run_cli("train", "-h")  # no job named: the default job's, digits
    text = " ".join(out.stdout.split())
    assert (
        "epochs to train (with --max-steps: as many as it takes) (default: 10, from digits)" in text
    )


JOB = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
import ddpkit

DEFAULTS = {"epochs": 5, "batch_size": 8}

def build(ctx):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 4, generator=g)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return ddpkit.Job(model=model, optimizer=opt, train_set=TensorDataset(x, y),
                      eval_set=TensorDataset(x[:37], y[:37]),
                      loss_fn=nn.functional.cross_entropy, scheduler=sched)
"""


@pytest.mark.slow
def test_own_job_with_a_toml_config_trains_logs_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    job = tmp_path / "myjob.py"
    job.write_text(JOB)
    config = tmp_path / "job.toml"
    config.write_text(
        f'[train]\nepochs = 3\nbatch_size = 4\nprecision = "bf16"\naccumulate = 2\n'
        f'clip_grad_norm = 1.0\nlog_every = 2\nrun_dir = "{tmp_path / "run"}"\n'
    )
    out = run_cli(
        "train",
        "--job",
        f"{job}:build",
        "--config",
        str(config),
        "--epochs",
        "2",
        "--nproc",
        "2",
        "--json",
    )  # the flag beats the file
    result = _result(out)
    assert result["epochs"] == 2 and result["job"] == f"{job}:build"
    assert result["global_step"] == 2 * 8  # 128 / (4 x 2 micro-batches x 2 ranks)
    assert result["test_accuracy"] is not None
    run = tmp_path / "run"
    saved = json.loads((run / "config.json").read_text())
    assert saved["precision"] == "bf16" and saved["epochs"] == 2 and saved["accumulate"] == 2
    kinds = [json.loads(x)["kind"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("epoch") == 2 and kinds.count("step") == 8
    plotted = run_cli("plot", str(run))
    assert plotted.returncode == 0, plotted.stderr
    for name in ("loss.png", "eval.png", "throughput.png"):
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_config_file_and_job_are_one_clear_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("batch_sise = 8\n")
    _one_line_error(run_cli("train", "--config", str(config)), "batch_sise", "batch_size")
    _one_line_error(run_cli("train", "--job", "no_such_pkg_xyz:build"), "no_such_pkg_xyz")


@pytest.mark.slow
def test_digits_in_bf16_still_reaches_95_percent() -> None:
    out = _result(run_cli("train", "--precision", "bf16", "--json"))
    assert out["test_accuracy"] >= 0.95


LEAVES_AFTER_EPOCH_1 = """
import sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
import ddpkit


class LeaveOnRank1(ddpkit.Callback):
    def on_epoch_end(self, trainer, epoch, metrics):
        if trainer.ctx.rank == 1:
            sys.exit(0)  # a "done" that only this rank believes


def build(ctx):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 6, generator=g)
    y = x[:, :2].sum(1, keepdim=True)
    model = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.1), nn.Tanh(), nn.Linear(12, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return ddpkit.Job(model=model, optimizer=opt, train_set=TensorDataset(x, y),
                      loss_fn=nn.functional.mse_loss, callbacks=[LeaveOnRank1()])
"""


@pytest.mark.slow
def test_a_rank_that_exits_0_early_is_named_first(tmp_path: Path) -> None:
    # Rank 1 leaves after epoch 1; rank 0 waits for it in DDP's gradient all-reduce,
    # which gloo fails ("Connection closed by peer"). That error is a consequence: the
    # first line must name the rank that left, not blame rank 0.
    job = tmp_path / "leaves.py"
    job.write_text(LEAVES_AFTER_EPOCH_1)
    out = run_cli("train", "--job", f"{job}:build", "--nproc", "2", "--epochs", "3")
    assert out.returncode == 124, out.stderr
    first = next(ln for ln in out.stderr.splitlines() if ln.startswith("ddpkit:"))
    assert first.startswith("ddpkit: the job is hung: rank 1 ended while rank 0 waited"), first
    assert "rank 1: ended (returned, or exited with code 0)" in out.stderr
    assert "ddpkit: error: rank 0 raised" not in out.stderr
