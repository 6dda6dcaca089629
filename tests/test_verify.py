"""`ddpkit verify`: the built-in examples pass both checks; jobs broken in the ways DDP
jobs silently break fail with the right cause; near misses pass. Real processes, gloo."""

from __future__ import annotations

import json
from typing import Any

import pytest

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.verification import VerifyReport
from tests import verify_jobs
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("example", ["linear", "digits"])
@pytest.mark.parametrize("check", [[], ["--resume"]], ids=["equivalence", "resume"])
def test_the_examples_pass(example: str, check: list[str]) -> None:
    proc = run_cli("verify", "--example", example, "--steps", "6", "--json", *check)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("PASS")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["passed"] and report["causes"] == [] and report["nproc"] == 2
    if not check:  # equivalence was compared after every step, within tolerance
        assert len(report["max_abs_diff"]) == 7 and max(report["tolerance_used"]) <= 1


def _fails_with(report: VerifyReport, *words: str) -> None:
    assert not report.passed, str(report)
    text = " ".join(report.causes)
    assert all(w in text for w in words), str(report)


def test_unsynchronised_batchnorm_is_named() -> None:
    config = ddpkit.TrainConfig(batch_size=16, sync_batchnorm=False)
    report = ddpkit.verify(verify_jobs.batchnorm, config, steps=3)
    _fails_with(report, "BatchNorm not synchronised")
    assert report.first_divergence is not None and report.first_divergence["step"] == 1
    # The near miss: the same job with ddpkit's default SyncBatchNorm.
    assert ddpkit.verify(verify_jobs.batchnorm, ddpkit.TrainConfig(batch_size=16), steps=3).passed


def test_a_dataset_made_from_the_rank_is_named() -> None:
    config = ddpkit.TrainConfig(batch_size=16)
    report = ddpkit.verify(verify_jobs.rank_seeded_dropout, config, steps=3)
    _fails_with(report, "the ranks build different datasets")
    near_miss = ddpkit.verify(verify_jobs.dropout, config, steps=3)
    assert near_miss.passed, str(near_miss)
    assert "Dropout layer(s) switched off" in " ".join(near_miss.notes)


@pytest.mark.parametrize("workers", [0, 1])
def test_random_augmentation_and_dropout_pass(workers: int) -> None:
    # Each rank draws its own noise; the one process replays what each rank drew.
    config = ddpkit.TrainConfig(batch_size=16, num_workers=workers)
    report = ddpkit.verify(verify_jobs.noisy_dropout, config, steps=3)  # 2 epochs
    assert report.passed, str(report)


def test_random_augmentation_passes_through_the_cli() -> None:
    proc = run_cli(
        "verify",
        "--job",
        "tests/verify_jobs.py:noisy_dropout",
        "--steps",
        "3",
        "--batch-size",
        "16",
        "--num-workers",
        "1",
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("PASS"), proc.stdout


@pytest.mark.parametrize("workers", [0, 1])
def test_random_augmentation_resumes_exactly(workers: int) -> None:
    config = ddpkit.TrainConfig(batch_size=16, num_workers=workers)
    report = ddpkit.verify(verify_jobs.noisy_dropout, config, resume=True)  # cut mid-epoch
    assert report.passed, str(report)


@pytest.mark.parametrize("resume", [False, True], ids=["equivalence", "resume"])
def test_unseeded_randomness_is_named(resume: bool) -> None:
    config = ddpkit.TrainConfig(batch_size=16)
    report = ddpkit.verify(verify_jobs.unseeded_noise, config, steps=3, resume=resume)
    _fails_with(report, "unseeded randomness", "__getitem__")
    assert "different datasets" not in str(report), str(report)


def test_data_every_rank_reads_whole_is_named() -> None:
    report = ddpkit.verify(verify_jobs.unsharded, ddpkit.TrainConfig(batch_size=16), steps=2)
    _fails_with(report, "data is not sharded", "256 samples")


def test_a_scheduler_left_out_of_the_checkpoint_is_named() -> None:
    config = ddpkit.TrainConfig(batch_size=16)
    report = ddpkit.verify(verify_jobs.hidden_scheduler, config, resume=True)
    _fails_with(report, "learning rate after resume")
    assert any("optimizer.param_groups.0.lr" in d for d in report.differences), str(report)
    # The near miss (the scheduler given to ddpkit) is test_trainer_features.py's
    # test_a_per_step_scheduler_survives_resume.


def test_a_summed_loss_is_named_and_exits_1() -> None:
    proc = run_cli(
        "verify", "--job", "tests/verify_jobs.py:summed_loss", "--steps", "2", "--json", cwd=ROOT
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("FAIL")
    assert "likely cause: gradient not averaged over the global batch" in proc.stdout
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # One process's update is exactly N = 2 times the 2-rank update, in the same direction.
    assert report["first_divergence"]["update_ratio"] == pytest.approx(2.0, rel=1e-6)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--nproc", "1"], "N >= 2 processes"),
        (["--resume", "--steps", "1"], "steps must be >= 2"),
        (["--atol", "-1"], "atol and rtol must be >= 0"),
        (["--example", "nope"], "unknown example"),
    ],
)
def test_bad_input_is_one_line(args: list[str], words: str) -> None:
    proc = (
        run_cli("verify", "--example", "linear", *args)
        if "--example" not in args
        else run_cli("verify", *args)
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr


def test_the_python_api_rejects_one_process() -> None:
    with pytest.raises(ConfigError, match="N >= 2"):
        ddpkit.verify("linear", nproc=1)


def test_jobs_of_dict_and_dataclass_batches_built_from_the_config_pass() -> None:
    # build(ctx, config) sizes OneCycleLR from config.steps_per_epoch: the one-process
    # run must build the job with its own config (the global batch), or its schedule
    # differs. Dataclass batches must be promoted to float64 like tuples.
    from tests import shaped_jobs

    config = ddpkit.TrainConfig(batch_size=32, num_workers=0, scheduler_interval="step")
    for build in (shaped_jobs.build_dict, shaped_jobs.build_step):
        report = ddpkit.verify(build, config, steps=6)
        assert report.passed, report


def test_a_job_in_which_no_parameter_changed_proves_nothing() -> None:
    # Before: 'PASS ... largest difference: 0 after step 0', exit 0.
    from ddpkit.cli.verify import NOTHING_TRAINED_EXIT

    proc = run_cli(
        "verify", "--job", "tests/verify_jobs.py:one_logit", "--steps", "3", "--json", cwd=ROOT
    )
    assert proc.returncode == NOTHING_TRAINED_EXIT, proc.stdout + proc.stderr
    assert NOTHING_TRAINED_EXIT not in (0, 1, 2)
    assert proc.stdout.startswith("NO PROOF  equivalence"), proc.stdout
    assert "no parameter changed in 3 steps" in proc.stdout, proc.stdout
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["passed"] and report["trained"] is False and report["causes"] == []
    # The near miss: a job whose loss moves the model passes, and says that it trained.
    near_miss = ddpkit.verify(verify_jobs.dropout, ddpkit.TrainConfig(batch_size=16), steps=2)
    assert near_miss.passed and near_miss.trained, str(near_miss)


def _largest_line(**fields: Any) -> str:
    report = VerifyReport(
        "equivalence",
        nproc=2,
        steps=2,
        batch_size=8,
        dtype="float64",
        atol=1e-9,
        rtol=1e-7,
        **fields,
    )
    return next(ln for ln in str(report).splitlines() if "largest difference" in ln)


def test_a_fail_never_reads_as_within_the_tolerance_alone() -> None:
    # Before: a FAIL on a likely cause, or on a NaN, said '(0% of the tolerance)'.
    small = {"max_abs_diff": [0.0, 3e-12, 8e-12], "tolerance_used": [0.0, 0.002, 0.004]}
    line = _largest_line(passed=False, causes=["ranks that build different datasets"], **small)
    assert "0% of the tolerance" not in line and "FAIL" in line and "cause" in line, line
    nan = {"step": 1, "tensor": "0.weight", "max_abs": float("nan"), "max_rel": float("nan")}
    line = _largest_line(
        passed=False,
        first_divergence=nan,
        max_abs_diff=[0.0, 0.0, 0.0],
        tolerance_used=[0.0, 0.0, 0.0],
    )
    assert "0% of the tolerance" not in line and "not a number" in line, line
    over = {"step": 1, "tensor": "0.weight", "max_abs": 3.1e-4, "max_rel": 0.01}
    line = _largest_line(
        passed=False,
        first_divergence=over,
        max_abs_diff=[0.0, 3.1e-4, 2e-4],
        tolerance_used=[0.0, 12.4, 8.0],
    )
    assert line.strip() == "largest difference: 0.00031 after step 1, 12x the tolerance", line
    line = _largest_line(passed=True, **small)  # a PASS may say how close it came
    assert line.strip() == "largest difference: 8e-12 after step 2 (under 1% of the tolerance)"
