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
    assert out["example"] == "digits" and out["nproc"] >= 1
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
def test_seed_job_resumed_after_two_epochs_matches_four_straight(tmp_path: Path) -> None:
    common = ("train", "--example", "seed", "--nproc", "2", "--json")
    straight = _result(run_cli(*common, "--epochs", "4", "--checkpoint-dir", str(tmp_path / "a")))
    first = _result(run_cli(*common, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "b")))
    resumed = run_cli(*common, "--epochs", "4", "--checkpoint-dir", str(tmp_path / "b"), "--resume")
    out = _result(resumed)
    assert "resumed from" in resumed.stdout and "epoch 3" in resumed.stdout
    assert first["model_digest"] != straight["model_digest"]
    assert out["model_digest"] == straight["model_digest"]
    assert out["global_step"] == straight["global_step"] == 4 * 32  # 2048 / (32 x 2)
    assert out["test_accuracy"] is None and out["checkpoint"].endswith("ckpt-000000128.pt")


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
