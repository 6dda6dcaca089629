"""TrainConfig.loggers: the option itself, and each logger read back from what it wrote,
with the real packages, offline (MLflow in a SQLite store in the run folder, W&B in
offline mode, read back with its own `wandb leet inspect`)."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpkit.cli.config_file import load_config_file
from ddpkit.errors import ConfigError
from ddpkit.records.runlog import RunLog
from ddpkit.training.config import LOGGERS, TrainConfig, parse_option
from tests.conftest import run_cli

# What Trainer writes in two epochs of 3 steps each with a step line every 2 steps,
# in the order it writes them.
RECORDS: list[tuple[str, int, dict[str, Any]]] = [
    ("step", 2, {"loss": 0.9, "samples_per_s": 100.0, "grad_norm": 1.5, "epoch": 0, "lr": 0.1}),
    ("epoch", 3, {"epoch": 1, "loss": 0.8, "samples": 96, "lr": 0.1, "eval_loss": 0.85}),
    ("step", 4, {"loss": 0.7, "samples_per_s": 110.0, "grad_norm": None, "epoch": 1, "lr": 0.1}),
    ("step", 6, {"loss": 0.5, "samples_per_s": 120.0, "grad_norm": 0.25, "epoch": 1, "lr": 0.05}),
    ("epoch", 6, {"epoch": 2, "loss": 0.6, "samples": 96, "lr": 0.05, "eval_loss": 0.65}),
]


@pytest.fixture(autouse=True)
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracker reaches the network or the user's own settings and stores."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(home / "wandb-config"),
        "WANDB_CACHE_DIR": str(home / "wandb-cache"),
        "WANDB_DATA_DIR": str(home / "wandb-data"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }.items():
        monkeypatch.setenv(name, value)


def _config(run_dir: Path, *loggers: Any, **options: Any) -> dict[str, Any]:
    """The config dict that Trainer gives RunLog."""
    return TrainConfig(run_dir=str(run_dir), loggers=loggers, **options).to_dict()


def _train(run_dir: Path, *loggers: str, **options: Any) -> RunLog:
    """A RunLog written the way Trainer writes it, closed."""
    log = RunLog(str(run_dir), _config(run_dir, *loggers, **options), enabled=True)
    for kind, step, values in RECORDS:
        log.write(kind, step, dict(values))
    log.close()
    return log


def _series(kind: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` in the records of `kind` that have a number for it."""
    return [(s, v[key]) for k, s, v in RECORDS if k == kind and v.get(key) is not None]


# -- the option ---------------------------------------------------------------------------


def test_loggers_from_python_toml_and_flag_text_are_the_same_tuple(tmp_path: Path) -> None:
    from_list = TrainConfig(run_dir="run", loggers=["csv", "wandb"])
    from_tuple = TrainConfig(run_dir="run", loggers=("csv", "wandb"))
    assert from_list.loggers == ("csv", "wandb") and from_list == from_tuple
    assert hash(from_list) == hash(from_tuple)  # frozen: still hashable
    assert TrainConfig().loggers == ()  # none but metrics.jsonl unless asked
    toml = tmp_path / "job.toml"
    toml.write_text('run_dir = "run"\nloggers = ["csv", "wandb"]\n')
    assert TrainConfig(**load_config_file(toml)) == from_tuple
    assert parse_option("loggers", "csv,wandb") == ("csv", "wandb")
    assert parse_option("loggers", " csv , wandb, ") == ("csv", "wandb")
    assert parse_option("loggers", "") == ()  # a flag can empty what a file set
    assert TrainConfig(run_dir="run", loggers=["csv", "csv"]).loggers == ("csv",)
    assert json.loads(json.dumps(from_list.to_dict()))["loggers"] == ["csv", "wandb"]


def test_an_unknown_logger_gets_one_line_naming_the_valid_ones(tmp_path: Path) -> None:
    message = (
        "loggers must be a list of names from csv, tensorboard, mlflow, wandb "
        "(got 'neptune'): pass --loggers csv,tensorboard"
    )
    with pytest.raises(ConfigError) as from_python:
        TrainConfig(run_dir="run", loggers=["csv", "neptune"])  # type: ignore[list-item]
    assert str(from_python.value) == message
    toml = tmp_path / "job.toml"
    toml.write_text('loggers = ["csv", "neptune"]\n')
    with pytest.raises(ConfigError) as from_file:
        load_config_file(toml)
    assert str(from_file.value) == f"config file '{toml}': {message}"
    proc = run_cli("train", "--example", "linear", "--loggers", "csv,neptune", "--run-dir", "r")
    assert proc.returncode == 2 and proc.stderr == f"ddpkit: error: {message}\n"


def test_a_bare_string_is_not_taken_for_a_list() -> None:
    with pytest.raises(ConfigError, match=r"must be a list of .* \(got 'csv', a str\)"):
        TrainConfig(run_dir="run", loggers="csv")  # type: ignore[arg-type]


def test_loggers_need_a_run_folder() -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(loggers=["csv"])
    assert str(info.value) == (
        "loggers need a run folder (got loggers=['csv']): pass --run-dir DIR with --loggers"
    )


def test_every_logger_name_has_a_logger() -> None:
    from ddpkit.records import loggers

    assert set(LOGGERS) == set(loggers._START)


# -- a tracker that is not installed ----------------------------------------------------


@pytest.mark.parametrize("name", ["wandb", "mlflow", "tensorboard"])
def test_a_tracker_that_is_not_installed_is_one_line_with_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"kind": "step"}\n')  # an earlier run's
    monkeypatch.setitem(sys.modules, name, None)  # `import name` fails as if not installed
    with pytest.raises(ConfigError) as info:
        RunLog(str(tmp_path), _config(tmp_path, "csv", name), enabled=True)
    assert str(info.value) == (
        f"loggers: {name!r} needs the {name} package: pip install 'ddpkit[{name}]'"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # left alone


def test_mlflow_without_its_sqlite_store_says_which_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow  # noqa: F401  (itself installed: only the store's package is missing)

    monkeypatch.setitem(sys.modules, "alembic", None)
    with pytest.raises(ConfigError) as info:
        RunLog(str(tmp_path / "run"), _config(tmp_path / "run", "mlflow"), enabled=True)
    assert str(info.value) == (
        "loggers: 'mlflow' needs the alembic package for its store in the run folder: "
        "pip install 'ddpkit[mlflow]'"
    )
    assert not (tmp_path / "run").exists()


def test_rank_1_starts_no_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # not even imported there
    log = RunLog(str(tmp_path), _config(tmp_path, "wandb", "csv"), enabled=False)
    log.write("step", 1, {"loss": 1.0})
    log.close()
    assert not log.active and list(tmp_path.iterdir()) == []


# -- csv ----------------------------------------------------------------------------------


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_csv_has_a_file_per_kind_with_the_records_of_metrics_jsonl(tmp_path: Path) -> None:
    _train(tmp_path, "csv")
    steps = _rows(tmp_path / "steps.csv")
    assert list(steps[0]) == ["step", "time", "loss", "samples_per_s", "grad_norm", "epoch", "lr"]
    assert [int(r["step"]) for r in steps] == [2, 4, 6]
    assert [float(r["loss"]) for r in steps] == [0.9, 0.7, 0.5]  # exact: written as repr
    assert [r["grad_norm"] for r in steps] == ["1.5", "", "0.25"]  # None: an empty cell
    epochs = _rows(tmp_path / "epochs.csv")
    assert [(int(r["step"]), int(r["epoch"]), float(r["eval_loss"])) for r in epochs] == [
        (3, 1, 0.85),
        (6, 2, 0.65),
    ]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["time"] for r in records if r["kind"] == "step"] == [float(r["time"]) for r in steps]


def test_csv_gets_a_new_column_for_a_value_that_comes_later(tmp_path: Path) -> None:
    log = RunLog(str(tmp_path), _config(tmp_path, "csv"), enabled=True)
    log.write("epoch", 3, {"epoch": 1, "loss": 0.8})
    log.write("epoch", 6, {"epoch": 2, "loss": math.nan, "accuracy": 0.75})
    log.write("epoch", 9, {"epoch": 3, "accuracy": 0.8})
    log.close()
    rows = _rows(tmp_path / "epochs.csv")
    assert list(rows[0]) == ["step", "time", "epoch", "loss", "accuracy"]
    assert [(r["epoch"], r["loss"], r["accuracy"]) for r in rows] == [
        ("1", "0.8", ""),
        ("2", "", "0.75"),  # NaN: null in metrics.jsonl, an empty cell here
        ("3", "", "0.8"),
    ]


def test_a_resumed_run_appends_to_its_csv_under_the_same_header(tmp_path: Path) -> None:
    checkpoints = str(tmp_path / "ckpt")
    _train(tmp_path, "csv", checkpoint_dir=checkpoints)
    resumed = _config(tmp_path, "csv", checkpoint_dir=checkpoints, resume=True)
    log = RunLog(str(tmp_path), resumed, enabled=True)
    log.write("step", 8, {"loss": 0.4, "samples_per_s": 90.0, "grad_norm": 0.5, "epoch": 2})
    log.close()
    assert log.kept is None
    rows = _rows(tmp_path / "steps.csv")
    assert [(r["step"], r["loss"], r["lr"]) for r in rows[-2:]] == [
        ("6", "0.5", "0.05"),
        ("8", "0.4", ""),  # no lr in this record
    ]
    assert (tmp_path / "steps.csv").read_text().count("step,time") == 1


def test_a_new_run_keeps_the_last_runs_files_under_one_number(tmp_path: Path) -> None:
    first = _train(tmp_path, "csv", "tensorboard", epochs=3)
    second = _train(tmp_path, "csv", epochs=4)
    assert first.kept is None and second.kept == tmp_path / "metrics.1.jsonl"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "config.1.json",
        "config.json",
        "epochs.1.csv",
        "epochs.csv",
        "metrics.1.jsonl",
        "metrics.jsonl",
        "steps.1.csv",
        "steps.csv",
        "tb.1",
    ]
    assert json.loads((tmp_path / "config.1.json").read_text())["epochs"] == 3
    assert json.loads((tmp_path / "config.json").read_text())["epochs"] == 4
    for name in ("steps.csv", "steps.1.csv"):  # one run each, not two in one
        assert [r["step"] for r in _rows(tmp_path / name)] == ["2", "4", "6"]


def test_a_csv_file_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "steps.csv").mkdir()  # where the file should go: a real EISDIR
    log = RunLog(str(tmp_path), _config(tmp_path, "csv"), enabled=True)
    with pytest.raises(ConfigError) as info:
        log.write("step", 2, {"loss": 0.9})
    assert str(info.value) == (
        f"cannot write the run log {tmp_path / 'steps.csv'}: Is a directory: "
        "check the folder and its disk, or pass another --run-dir"
    )
    assert not log.active
    log.close()  # closing again is harmless


# -- tensorboard ----------------------------------------------------------------------------


def test_tensorboard_only_when_named_and_read_back_with_event_accumulator(
    tmp_path: Path,
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _train(tmp_path / "plain")
    assert not (tmp_path / "plain" / "tb").exists()
    _train(tmp_path / "tb-run", "tensorboard")
    events = EventAccumulator(str(tmp_path / "tb-run" / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "step/loss" in tags and "epoch/eval_loss" in tags and "step/epoch" not in tags
    for kind, key in [("step", "loss"), ("step", "grad_norm"), ("epoch", "eval_loss")]:
        read = events.Scalars(f"{kind}/{key}")
        expected = _series(kind, key)
        assert [e.step for e in read] == [step for step, _ in expected], (kind, key)
        # float32 in the file
        assert [e.value for e in read] == pytest.approx([v for _, v in expected], rel=1e-6)


# -- mlflow -----------------------------------------------------------------------------------


def test_mlflow_run_in_the_run_folder_read_back_with_its_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    _train(run_dir, "mlflow", epochs=2)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("ddpkit")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    for kind, key in [("step", "loss"), ("step", "grad_norm"), ("epoch", "eval_loss")]:
        history = client.get_metric_history(run.info.run_id, f"{kind}/{key}")
        assert [(m.step, m.value) for m in history] == _series(kind, key)
    assert "step/epoch" not in run.data.metrics
    params = run.data.params
    assert params["epochs"] == "2" and params["loggers"] == "mlflow"
    assert params["run_dir"] == str(run_dir) and params["clip_grad_norm"] == "None"

    # MLFLOW_TRACKING_URI wins over the run folder; a run that stops on an error FAILED.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{run_dir / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "other")
    elsewhere = tmp_path / "elsewhere"
    log = RunLog(str(elsewhere), _config(elsewhere, "mlflow"), enabled=True)
    with pytest.raises(ZeroDivisionError):
        try:
            log.write("step", 1, {"loss": 2.0})
            1 / 0  # noqa: B018  (the training fails)
        finally:
            log.close()
    assert not (elsewhere / "mlflow.db").exists()
    other = client.get_experiment_by_name("other")
    assert other is not None
    [failed] = client.search_runs([other.experiment_id])
    assert failed.info.status == "FAILED" and failed.data.metrics == {"step/loss": 2.0}


# -- wandb --------------------------------------------------------------------------------------


def _wandb_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of the offline run in `run_dir`, read by wandb's own reader."""
    [folder] = (run_dir / "wandb").glob("offline-run-*")
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_wandb_offline_run_read_back_with_wandb_leet_inspect(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _train(run_dir, "wandb", epochs=2)
    records = _wandb_records(run_dir)
    config = next(r["run"]["config"]["update"] for r in records if r["type"] == "run")
    assert config["epochs"] == 2 and config["loggers"] == ["wandb"]
    assert config["run_dir"] == str(run_dir)
    history = [r["history"] for r in records if r["type"] == "history"]
    for kind, key in [("step", "loss"), ("step", "grad_norm"), ("epoch", "eval_loss")]:
        name = f"{kind}/{key}"
        logged = [(h["step"]["num"], h["item"][name]) for h in history if name in h["item"]]
        assert logged == _series(kind, key), (kind, key)
    assert not any("step/epoch" in h["item"] for h in history)
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]


def test_wandb_that_cannot_start_a_run_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process of its own: wandb reads its environment once per process.
    monkeypatch.setenv("WANDB_MODE", "nonsense")
    code = (
        "import sys\n"
        "from ddpkit.records.runlog import RunLog\n"
        "try:\n"
        "    RunLog(sys.argv[1], {'loggers': ['csv', 'wandb']}, enabled=True)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    line = out.stdout.strip()
    assert line.startswith("ConfigError loggers: wandb could not start a run (ValidationError: ")
    assert "nonsense" in line and "\n" not in line, line
    assert line.endswith("): log in with `wandb login`, or set WANDB_MODE=offline"), line


# -- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_ddpkit_train_with_loggers_csv_writes_the_csv_files(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ("train", "--example", "linear", "--nproc", "1", "--epochs", "2", "--log-every", "32")
    for _ in range(2):  # the second run keeps the first one's files
        proc = run_cli(*args, "--loggers", "csv", "--run-dir", str(run))
        assert proc.returncode == 0, proc.stderr
    steps = _rows(run / "steps.csv")
    assert [int(r["step"]) for r in steps] == [32, 64, 96, 128]  # 2048 samples / 32 a step
    assert all(float(r["loss"]) > 0 and float(r["samples_per_s"]) > 0 for r in steps)
    epochs = _rows(run / "epochs.csv")
    assert [(r["step"], r["epoch"]) for r in epochs] == [("64", "1"), ("128", "2")]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "epoch"]
    assert [float(r["loss"]) for r in epochs] == losses
    assert [r["step"] for r in _rows(run / "steps.1.csv")] == [r["step"] for r in steps]
    assert json.loads((run / "config.json").read_text())["loggers"] == ["csv"]


@pytest.mark.slow
def test_a_resumed_ddpkit_train_continues_the_time_column_of_epochs_csv(tmp_path: Path) -> None:
    run, checkpoints = tmp_path / "run", tmp_path / "ck"
    args = ["train", "--example", "linear", "--nproc", "2", "--loggers", "csv"]
    args += ["--run-dir", str(run), "--checkpoint-dir", str(checkpoints)]
    first = run_cli(*args, "--epochs", "2")
    assert first.returncode == 0, first.stderr
    resumed = run_cli(*args, "--epochs", "4", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    epochs = _rows(run / "epochs.csv")
    assert [r["epoch"] for r in epochs] == ["1", "2", "3", "4"]
    times = [float(r["time"]) for r in epochs]
    assert times == sorted(times), times  # epoch 3 does not start the clock again at 0
    assert times[2] > times[1], times
