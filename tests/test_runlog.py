"""RunLog: a fresh run into a used run folder keeps the old record beside the new one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ddpkit.errors import ConfigError
from ddpkit.records import runlog
from ddpkit.records.runlog import RunLog


def _run(folder: Path, losses: list[float], *, resume: bool = False, **config: Any) -> RunLog:
    log = RunLog(str(folder), {"resume": resume, **config}, enabled=True)
    for step, loss in enumerate(losses, start=1):
        log.write("step", step, {"loss": loss})
    log.close()
    return log


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_a_fresh_run_keeps_the_last_record_as_metrics_1_and_starts_a_new_one(
    tmp_path: Path,
) -> None:
    first = _run(tmp_path, [3.0, 2.0])
    second = _run(tmp_path, [9.0])
    assert _losses(tmp_path / "metrics.jsonl") == [9.0]  # not 3, 2, 9: one run per file
    assert first.kept is None
    assert second.kept == tmp_path / "metrics.1.jsonl"
    assert _losses(second.kept) == [3.0, 2.0]
    third = _run(tmp_path, [7.0])
    assert third.kept == tmp_path / "metrics.2.jsonl"
    assert _losses(tmp_path / "metrics.1.jsonl") == [3.0, 2.0]
    assert _losses(tmp_path / "metrics.2.jsonl") == [9.0]
    assert _losses(tmp_path / "metrics.jsonl") == [7.0]


def test_a_resumed_run_appends_to_the_record_it_continues(tmp_path: Path) -> None:
    _run(tmp_path, [3.0, 2.0])
    resumed = _run(tmp_path, [1.0], resume=True, checkpoint_dir=str(tmp_path / "ckpt"))
    assert resumed.kept is None
    assert _losses(tmp_path / "metrics.jsonl") == [3.0, 2.0, 1.0]
    assert not (tmp_path / "metrics.1.jsonl").exists()


def _times(path: Path) -> list[float]:
    return [json.loads(line)["time"] for line in path.read_text().splitlines()]


def test_a_resumed_run_continues_the_time_of_the_record_it_continues(tmp_path: Path) -> None:
    first = RunLog(str(tmp_path), {"resume": False}, enabled=True)
    time.sleep(0.2)  # the first run trained a while
    first.write("step", 1, {"loss": 3.0})
    first.close()
    resumed = RunLog(str(tmp_path), {"resume": True}, enabled=True)
    resumed.write("step", 2, {"loss": 2.0})
    resumed.close()
    before, after = _times(tmp_path / "metrics.jsonl")
    assert before >= 0.2
    assert after >= before  # not back to 0: the resumed run's clock goes on
    fresh = RunLog(str(tmp_path), {"resume": False}, enabled=True)  # a new run starts at 0
    fresh.write("step", 1, {"loss": 1.0})
    fresh.close()
    assert _times(tmp_path / "metrics.jsonl")[0] < 0.2


def test_an_empty_record_is_not_kept_and_numbers_already_taken_are_skipped(
    tmp_path: Path,
) -> None:
    (tmp_path / "metrics.jsonl").touch()  # a run that stopped before its first line
    assert _run(tmp_path, [5.0]).kept is None
    (tmp_path / "config.1.json").write_text("{}")  # a file of the user's, say
    assert _run(tmp_path, [4.0]).kept == tmp_path / "metrics.2.jsonl"
    assert _losses(tmp_path / "metrics.2.jsonl") == [5.0]
    assert (tmp_path / "config.1.json").read_text() == "{}"
    assert json.loads((tmp_path / "config.2.json").read_text())["resume"] is False


# -- a start that fails leaves the folder as it was --------------------------------------
# A real write failure without root or a small disk: past RLIMIT_FSIZE a write fails with
# EFBIG (SIGXFSZ, which would kill the process, ignored), as on a full disk.
_START_UNDER_A_SIZE_LIMIT = """
import resource, signal, sys
from ddpkit.errors import ConfigError
from ddpkit.records.runlog import RunLog
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.RLIM_INFINITY))
try:
    RunLog(sys.argv[1], {"resume": False, "epochs": 3, "run_dir": sys.argv[1]}, enabled=True)
except ConfigError as exc:
    print(exc)
"""


def _start_under_a_size_limit(folder: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _START_UNDER_A_SIZE_LIMIT, str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout.strip()


def _contents(folder: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
        for p in folder.rglob("*")
    }


def test_a_full_run_folder_says_so_and_leaves_nothing_behind(tmp_path: Path) -> None:
    folder = tmp_path / "runs" / "a"  # neither folder exists yet
    message = _start_under_a_size_limit(folder)
    assert message.startswith(f"cannot write the run log {folder / 'config.json'}: "), message
    assert "file size limit" in message and "--run-dir" in message, message
    assert _contents(tmp_path) == {}  # no config.json, no metrics.jsonl, no folder


def test_a_full_run_folder_keeps_the_last_run_where_it_was(tmp_path: Path) -> None:
    _run(tmp_path, [3.0, 2.0])
    (tmp_path / "notes.txt").write_text("mine")
    before = _contents(tmp_path)
    message = _start_under_a_size_limit(tmp_path)
    assert "cannot write the run log" in message, message
    assert _contents(tmp_path) == before  # not renamed to metrics.1.jsonl, nothing added


def test_a_logger_that_cannot_start_leaves_the_folder_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _run(tmp_path, [3.0, 2.0])
    before = _contents(tmp_path)

    def refuse(name: str, folder: Path, config: object) -> None:
        raise ConfigError(f"loggers: {name} could not start: pass another")

    monkeypatch.setattr(runlog, "start_logger", refuse)
    with pytest.raises(ConfigError, match="csv could not start"):
        RunLog(str(tmp_path), {"resume": False, "loggers": ["csv"]}, enabled=True)
    assert _contents(tmp_path) == before
    with pytest.raises(ConfigError, match="csv could not start"):
        RunLog(str(tmp_path / "new"), {"resume": False, "loggers": ["csv"]}, enabled=True)
    assert _contents(tmp_path) == before


def test_a_folder_named_config_json_stops_the_start_and_is_kept(tmp_path: Path) -> None:
    """config.json is put in place whole by a rename, which never replaces a folder of
    that name (and so never deletes what it holds)."""
    (tmp_path / "config.json").mkdir()
    (tmp_path / "config.json" / "mine.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"config\.json: Is a directory"):
        RunLog(str(tmp_path), {"resume": False}, enabled=True)
    assert (tmp_path / "config.json" / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


# -- a resume from an older checkpoint (issue 43, D05) -------------------------------------
def _fit_logged(ctx: Any, run_dir: str, resume: bool) -> None:
    """3 epochs of 6 steps on 2 ranks, a step record every 2 steps, an evaluation every 4
    and at each epoch's end, into metrics.jsonl and the csv logger's files."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import ddpkit

    ddpkit.seed_everything(0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(58, 6, generator=g)
    data = TensorDataset(x, (x[:, :2].sum(1) > 0).long())
    model = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.2), nn.ReLU(), nn.Linear(12, 2))
    config = ddpkit.TrainConfig(
        epochs=3,
        batch_size=4,
        log_every=2,
        eval_every_steps=4,
        run_dir=run_dir,
        loggers=["csv"],
        checkpoint_dir=str(Path(run_dir, "ck")),
        keep_last=5,
        resume=resume,
    )
    trainer = ddpkit.Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        torch.utils.data.Subset(data, range(48)),
        ctx,
        config,
        eval_set=torch.utils.data.Subset(data, range(48, 58)),
        log_fn=lambda _: None,
    )
    trainer.fit()


_TIMING = ("time", "samples_per_s")


def _records(folder: Path) -> dict[str, list[Any]]:
    """metrics.jsonl's records and each csv file's rows, without their timing fields."""
    out: dict[str, list[Any]] = {}
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    out["metrics.jsonl"] = [
        {k: v for k, v in json.loads(line).items() if k not in _TIMING} for line in lines
    ]
    for path in sorted(folder.glob("*.csv")):
        header, *rows = [line.split(",") for line in path.read_text().splitlines()]
        keep = [i for i, name in enumerate(header) if name not in _TIMING]
        out[path.name] = [[header[i] for i in keep]] + [[row[i] for i in keep] for row in rows]
    return out


@pytest.mark.slow
def test_a_resume_from_an_older_checkpoint_drops_the_records_after_it(tmp_path: Path) -> None:
    from ddpkit import launch

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    launch(_fit_logged, str(straight), False, nprocs=2)
    launch(_fit_logged, str(cut), False, nprocs=2)
    # The newer checkpoints are gone (deleted, or corrupt and skipped): resume at step 6.
    for step in (12, 18):
        (cut / "ck" / f"ckpt-{step:09d}.pt").unlink()
    launch(_fit_logged, str(cut), True, nprocs=2)
    expected, got = _records(straight), _records(cut)
    assert sorted(got) == ["epochs.csv", "eval.csv", "metrics.jsonl", "steps.csv"]
    for name in ("steps.csv", "eval.csv", "epochs.csv"):
        steps = [int(row[0]) for row in got[name][1:]]
        assert steps == sorted(set(steps)), name  # never back, never twice
    assert got == expected


def test_a_resumed_run_log_drops_the_records_after_its_step(tmp_path: Path) -> None:
    first = RunLog(str(tmp_path), {"resume": False, "loggers": ["csv"]}, enabled=True)
    for step in range(1, 7):
        first.write("step", step, {"loss": 1.0 / step})
        if step % 3 == 0:
            first.write("epoch", step, {"epoch": step // 3, "loss": 0.5})
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "step", "st')  # cut short by a crash
    resumed = RunLog(
        str(tmp_path), {"resume": True, "loggers": ["csv"]}, enabled=True, resumed_step=3
    )
    assert resumed.dropped == 5  # steps 4, 5, 6, epoch 2 and the half line
    resumed.write("step", 4, {"loss": 0.2})
    resumed.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [
        ("step", 1),
        ("step", 2),
        ("step", 3),
        ("epoch", 3),
        ("step", 4),
    ]
    steps = (tmp_path / "steps.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in steps] == ["step", "1", "2", "3", "4"]
    epochs = (tmp_path / "epochs.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in epochs] == ["step", "3"]


def test_a_run_resumed_inside_an_epoch_drops_that_epochs_record_at_its_step(
    tmp_path: Path,
) -> None:
    # A checkpoint at step 4, the first epoch's last, written before that epoch's record
    # (keep_best); the run went on to step 6. Resumed from it, the run writes the first
    # epoch's record again at the epoch's end: the old one goes, the step's line stays.
    first = RunLog(str(tmp_path), {"resume": False, "loggers": ["csv"]}, enabled=True)
    for step in range(1, 7):
        first.write("step", step, {"loss": 1.0 / step})
        if step == 4:
            first.write("eval", step, {"eval_loss": 0.3})
            first.write("epoch", step, {"epoch": 1, "loss": 0.5})
    first.close()
    config = {"resume": True, "loggers": ["csv"]}
    resumed = RunLog(str(tmp_path), config, enabled=True, resumed_step=4, resumed_inside=True)
    assert resumed.dropped == 3  # the epoch's record, steps 5 and 6
    resumed.write("epoch", 4, {"epoch": 1, "loss": 0.5})
    resumed.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [
        *[("step", s) for s in range(1, 5)],
        ("eval", 4),
        ("epoch", 4),
    ]
    epochs = (tmp_path / "epochs.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in epochs] == ["step", "4"]
    steps = (tmp_path / "steps.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in steps] == ["step", "1", "2", "3", "4"]
