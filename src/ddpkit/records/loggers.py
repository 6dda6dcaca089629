"""Where else a run's metrics go: the `loggers` option of TrainConfig.

Every logger gets each record that metrics.jsonl gets, from rank 0 only (RunLog runs
there), at the same global step:

- "csv": `steps.csv` and `epochs.csv` in the run folder, one row per record. The
  columns are `step`, `time` (seconds since the run started training, going on across
  a resume: see `ddpkit.records.runlog`) and then the record's values in
  the order they first came; an empty cell is a value that is missing or None (no
  gradient norm; a loss that was NaN or infinite, which metrics.jsonl writes as null).
  A record with a value the file has no column for rewrites the file with that column
  added at the end, so every row lines up with the header.
- "tensorboard": event files in `RUN_DIR/tb` (`tensorboard --logdir RUN_DIR`).
- "mlflow": a run in the MLflow tracking store of MLFLOW_TRACKING_URI when it is set,
  else in `RUN_DIR/mlflow.db` (`mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db`),
  in the experiment MLFLOW_EXPERIMENT_NAME (default "ddpkit"), named after the run
  folder. The config is the run's params; the run ends FINISHED, FAILED or KILLED.
- "wandb": a W&B run with its files in `RUN_DIR/wandb`, in the project WANDB_PROJECT
  (default "ddpkit"), named after the run folder (or WANDB_NAME), with the config as
  its config. WANDB_MODE=offline keeps it off the network (`wandb sync` uploads it).

The trackers name each metric `KIND/NAME` (`step/loss`, `epoch/eval_loss`) and get
every number of a record but `epoch` (the x axis is the global step); a value that is
None is left out. Each tracker is an extra, imported only when it is named. A resumed
run (TrainConfig.resume) starts a new tracker run, whose steps go on from the
checkpoint's.
"""

from __future__ import annotations

import csv
import importlib
import io
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from ddpkit import storage
from ddpkit.errors import ConfigError, Preempted

__all__ = [
    "CSV_FILES",
    "Logger",
    "check_installed",
    "csv_name",
    "drop_rows_after",
    "end_status",
    "first_line",
    "start_logger",
]

# The files "csv" writes, one per kind of record. RunLog keeps them with metrics.jsonl.
CSV_FILES = {"step": "steps.csv", "epoch": "epochs.csv"}

# The trackers: each imports the package of its name, which ddpkit's extra of that name installs.
_TRACKERS = ("tensorboard", "mlflow", "wandb")


class Logger(Protocol):
    """One place the records go. `where` names it in an error message."""

    name: str
    where: str

    def write(self, kind: str, step: int, record: Mapping[str, Any]) -> None: ...

    def close(self, status: str) -> None:
        """Finish: `status` is "FINISHED", "FAILED" or "KILLED" (a signal, Ctrl-C)."""


def check_installed(names: Iterable[str]) -> None:
    """Import the package of each tracker in `names` now, so that one that is missing
    stops the run before it touches the run folder: ConfigError with the pip command."""
    for name in names:
        if name in _TRACKERS:
            _require(name, name)
        if name == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI"):
            # mlflow-skinny keeps a local store in SQLite through these two; its old
            # folder store (./mlruns) refuses to start unless told to in the environment.
            for module in ("sqlalchemy", "alembic"):
                _require("mlflow", module, " for its store in the run folder")


def start_logger(name: str, folder: Path, config: Mapping[str, Any]) -> Logger:
    """The logger `name` (one of ddpkit.training.config.LOGGERS), started, writing into the run
    folder `folder`; `config` is the run's, for the trackers' params."""
    return _START[name](folder, config)


def end_status(error: BaseException | None) -> str:
    """How a run that stopped on `error` (None: it did not) ended, in MLflow's words."""
    if error is None:
        return "FINISHED"
    return "KILLED" if isinstance(error, (Preempted, KeyboardInterrupt)) else "FAILED"


def scalars(kind: str, record: Mapping[str, Any]) -> dict[str, float | int]:
    """The numbers of `record` as trackers name them: `{"step/loss": 0.31, ...}`."""
    return {
        f"{kind}/{key}": value
        for key, value in record.items()
        if key not in ("kind", "step", "time", "epoch")
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    }


def _require(name: str, module: str, why: str = "") -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] == top:  # the package is not there
            raise ConfigError(
                f"loggers: {name!r} needs the {top} package{why}: pip install 'ddpkit[{name}]'"
            ) from None
        # Installed but broken: one of its own imports fails.
        raise ConfigError(
            f"loggers: {name!r} cannot import {module} ({exc}): "
            f"reinstall it: pip install --force-reinstall 'ddpkit[{name}]'"
        ) from None


# -- csv --------------------------------------------------------------------------------


def csv_name(kind: str) -> str:
    """The file of the csv logger's records of `kind`: steps.csv, epochs.csv, KIND.csv."""
    return CSV_FILES.get(kind, f"{kind}.csv")


def drop_rows_after(path: Path, step: int) -> int:
    """Drop the rows of the csv logger's file `path` whose step is after `step` (a run
    resumed from a checkpoint of that step trains them again), and a row cut short;
    the number of rows dropped. The file is replaced whole, or left as it was."""
    if not path.is_file():
        return 0
    with path.open(newline="") as f:
        header, *rows = list(csv.reader(f)) or [[]]
    if "step" not in header:
        return 0
    at = header.index("step")

    def kept(row: list[str]) -> bool:
        return len(row) == len(header) and row[at].isdigit() and int(row[at]) <= step

    keep = [row for row in rows if kept(row)]
    if len(keep) == len(rows):
        return 0
    storage.write(path, _csv_text(header, keep), durable=False)
    return len(rows) - len(keep)


def _csv_text(header: list[str], rows: Iterable[list[str]]) -> str:
    """`header` and `rows` as the csv logger writes them."""
    text = io.StringIO()
    out = csv.writer(text, lineterminator="\n")
    out.writerow(header)
    out.writerows(rows)
    return text.getvalue()


class _CsvFile:
    """One CSV file of records, appended to, its header read back when it exists."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.columns: list[str] = []
        if path.exists() and path.stat().st_size:  # a resumed run: go on below its header
            with path.open(newline="") as f:
                self.columns = next(csv.reader(f), [])
        self._append()

    def _append(self) -> None:
        self._file = self.path.open("a", newline="", buffering=1)  # line-buffered: readable live
        self._rows = csv.writer(self._file, lineterminator="\n")

    def write(self, row: Mapping[str, Any]) -> None:
        new = [key for key in row if key not in self.columns]
        if new and self.columns:
            self._widen(new)
        elif new:
            self.columns = new
            self._rows.writerow(self.columns)
        # csv writes None as an empty cell, and a float as repr() does: exactly.
        self._rows.writerow([row.get(column) for column in self.columns])

    def _widen(self, new: list[str]) -> None:
        """Rewrite the file with the `new` columns added to its header (and empty cells
        for them in the rows written so far), then go on appending."""
        self._file.close()
        with self.path.open(newline="") as f:
            rows = list(csv.reader(f))[1:]
        self.columns += new
        widened = (row + [""] * (len(self.columns) - len(row)) for row in rows)
        # Whole or not at all, should the disk fill up.
        storage.write(self.path, _csv_text(self.columns, widened), durable=False)
        self._append()

    def close(self) -> None:
        self._file.close()


class CsvLogger:
    """`steps.csv` and `epochs.csv` in the run folder (see the module's docstring)."""

    name = "csv"

    def __init__(self, folder: Path, config: Mapping[str, Any]) -> None:
        self.folder = folder
        self.where = str(folder)
        self._files: dict[str, _CsvFile] = {}

    def write(self, kind: str, step: int, record: Mapping[str, Any]) -> None:
        path = self.folder / csv_name(kind)
        self.where = str(path)
        if kind not in self._files:
            self._files[kind] = _CsvFile(path)
        self._files[kind].write({k: v for k, v in record.items() if k != "kind"})

    def close(self, status: str) -> None:
        files, self._files = list(self._files.values()), {}
        for file in files:
            self.where = str(file.path)
            file.close()


# -- tensorboard ------------------------------------------------------------------------


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, folder: Path, config: Mapping[str, Any]) -> None:
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.where = str(folder / "tb")
        self._writer = SummaryWriter(self.where)
        _quiet_tensorboard_thread()

    def write(self, kind: str, step: int, record: Mapping[str, Any]) -> None:
        for key, value in scalars(kind, record).items():
            self._writer.add_scalar(key, value, step)

    def close(self, status: str) -> None:
        self._writer.close()


def _quiet_tensorboard_thread() -> None:
    """Hide the traceback that tensorboard's writer thread prints when a write fails with an
    OSError (a full disk): the next add_scalar or close re-raises it, and RunLog reports that
    in one line. Any other exception in any thread prints as before."""
    previous = threading.excepthook
    if getattr(previous, "_ddpkit_quiet_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not (
            type(args.thread).__module__.startswith("tensorboard.")
            and isinstance(args.exc_value, OSError)
        ):
            previous(args)

    hook._ddpkit_quiet_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


# -- mlflow -----------------------------------------------------------------------------


class MlflowLogger:
    name = "mlflow"

    def __init__(self, folder: Path, config: Mapping[str, Any]) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        store = folder.resolve() / "mlflow.db"
        self.where = uri or str(store)
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._client = MlflowClient(tracking_uri=uri or f"sqlite:///{store}")
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ddpkit"
        found = self._client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            # Artifacts (none are logged; a user's own may be) stay in the run folder
            # too, not in ./mlruns of wherever the job was started.
            where = None if uri else (folder.resolve() / "mlartifacts").as_uri()
            experiment_id = self._client.create_experiment(experiment, artifact_location=where)
        run = self._client.create_run(
            experiment_id, run_name=folder.resolve().name, tags={"ddpkit.run_dir": str(folder)}
        )
        self._run_id = run.info.run_id
        params = [Param(key, _param_text(value)) for key, value in config.items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a call
            self._client.log_batch(self._run_id, params=params[start : start + 100])

    def write(self, kind: str, step: int, record: Mapping[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [
            self._metric(key, float(value), now, step)
            for key, value in scalars(kind, record).items()
        ]
        if metrics:
            self._client.log_batch(self._run_id, metrics=metrics)

    def close(self, status: str) -> None:
        self._client.set_terminated(self._run_id, status)


def _param_text(value: Any) -> str:
    """A config value as a param: a list as the flag takes it ("csv,mlflow")."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(part) for part in value)
    return str(value)


# -- wandb ------------------------------------------------------------------------------


class WandbLogger:
    name = "wandb"

    def __init__(self, folder: Path, config: Mapping[str, Any]) -> None:
        wandb = _require("wandb", "wandb")
        self.where = str(folder / "wandb")
        (folder / "wandb").mkdir(exist_ok=True)  # wandb would put it in /tmp otherwise
        try:
            self._run = wandb.init(
                dir=str(folder),
                project=os.environ.get("WANDB_PROJECT") or "ddpkit",
                name=os.environ.get("WANDB_NAME") or folder.resolve().name,
                config=dict(config),
                # Leave a run that the job itself started alone (and its wandb.log).
                reinit="create_new",
            )
        except Exception as exc:
            raise ConfigError(
                f"loggers: wandb could not start a run ({first_line(exc)}): "
                "log in with `wandb login`, or set WANDB_MODE=offline"
            ) from exc

    def write(self, kind: str, step: int, record: Mapping[str, Any]) -> None:
        values = scalars(kind, record)
        if values:
            self._run.log(values, step=step)

    def close(self, status: str) -> None:
        self._run.finish(exit_code=0 if status == "FINISHED" else 1)


def first_line(exc: BaseException) -> str:
    """`exc` in one line: its type and its message, squeezed onto one line (the first
    line of a validation error says only how many errors follow), at most 200 chars."""
    text = " ".join(str(exc).split())
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# One for each name of ddpkit.training.config.LOGGERS.
_START: dict[str, Callable[[Path, Mapping[str, Any]], Logger]] = {
    cls.name: cls for cls in (CsvLogger, TensorBoardLogger, MlflowLogger, WandbLogger)
}
