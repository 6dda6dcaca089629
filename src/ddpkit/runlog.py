"""RunLog: the run folder's record of a training run, written by rank 0 only.

`config.json` holds the resolved config; `metrics.jsonl` one JSON object per line,
`{"kind": "step", ...}` every `log_every` optimizer steps (rank 0's numbers, so no rank
waits on another) and `{"kind": "epoch", ...}` after each epoch (numbers over all
ranks). The loggers that the config's `loggers` names (csv, tensorboard, mlflow,
wandb: see `ddpkit.loggers`) get the same records. `ddpkit plot RUN_DIR` draws them.

A new run (the config's `resume` false) into a folder whose metrics.jsonl (or CSV
file) already holds records keeps the last run's files under the first number N that
is free: metrics.N.jsonl, config.N.json, steps.N.csv, epochs.N.csv and tb.N/, and
`RunLog.kept` is the kept metrics.N.jsonl; so no file mixes two runs. A resumed run
appends to the files of the run it continues.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from ddpkit.errors import ConfigError
from ddpkit.loggers import (
    CSV_FILES,
    Logger,
    check_installed,
    end_status,
    first_line,
    start_logger,
)
from ddpkit.storage import os_error_in, write_failure

# The files that hold a run's records, and those kept with them when a new run starts.
RECORD_FILES = ("metrics.jsonl", *CSV_FILES.values())
KEPT_WITH = ("config.json", "tb")


class RunLog:
    """The record of one run in `run_dir` (nothing when `enabled` is false, on every
    rank but 0): `write` a record, `close` at the end. `config` is the run's, as
    `TrainConfig.to_dict()` gives it; its `loggers` and `resume` say where the records
    go and whether they continue the last run's files."""

    def __init__(self, run_dir: str | None, config: dict[str, Any], *, enabled: bool) -> None:
        self.start = time.perf_counter()
        self.folder = Path(run_dir) if run_dir and enabled else None
        self.kept: Path | None = None
        """The last run's metrics file, renamed (metrics.1.jsonl, ...) for this run's
        to start empty; None when nothing was renamed."""
        self._file: Any = None
        self._loggers: list[Logger] = []
        if self.folder is None:
            return
        names = list(config.get("loggers") or ())
        check_installed(names)  # a missing package leaves the folder as it was
        target = self.folder
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if not config.get("resume"):
                self.kept = keep_last_run(self.folder)
            target = self.folder / "config.json"
            target.write_text(json.dumps(config, indent=2, default=str) + "\n")
            # Append: a resumed run continues the same record.
            target = self.folder / "metrics.jsonl"
            self._file = target.open("a", buffering=1)
        except OSError as exc:
            raise self._failed(target, exc) from None
        for name in names:
            try:
                self._loggers.append(start_logger(name, self.folder, config))
            except Exception as exc:
                self.close(quiet=True)
                if isinstance(exc, ConfigError):
                    raise
                self._logger_failed(name, str(self.folder), "start", exc)

    @property
    def active(self) -> bool:
        return self._file is not None

    def write(self, kind: str, step: int, values: dict[str, float | int | None]) -> None:
        if self._file is None:
            return
        record: dict[str, Any] = {
            "kind": kind,
            "step": step,
            "time": round(time.perf_counter() - self.start, 3),
        }
        for key, value in values.items():
            record[key] = None if isinstance(value, float) and not math.isfinite(value) else value
        try:
            self._file.write(json.dumps(record) + "\n")
        except Exception as exc:
            if os_error_in(exc) is None:
                raise
            target = Path(self._file.name)
            self.close(quiet=True)
            raise self._failed(target, exc) from None
        for logger in self._loggers:
            try:
                logger.write(kind, step, record)
            except Exception as exc:
                self.close(quiet=True)
                self._logger_failed(logger.name, logger.where, f"log step {step}", exc)

    def close(self, *, quiet: bool = False) -> None:
        """Close the files and end the trackers' runs: FINISHED, or FAILED (KILLED for
        a signal or Ctrl-C) when called while an exception is on its way out. `quiet`:
        after a failed write, which is being reported already, ignore that closing fails
        as well."""
        status = "FAILED" if quiet else end_status(sys.exc_info()[1])
        file, loggers = self._file, self._loggers
        self._file, self._loggers = None, []
        failure: BaseException | None = None
        if file is not None:
            try:
                file.close()
            except Exception as exc:
                if os_error_in(exc) is None:
                    raise
                failure = self._failed(Path(file.name), exc)
        for logger in loggers:  # each ends, whichever failed before it
            try:
                try:
                    logger.close(status)
                except Exception as exc:
                    self._logger_failed(logger.name, logger.where, "finish", exc)
            except Exception as exc:
                failure = failure or exc
        if failure is not None and not quiet:
            raise failure

    def _logger_failed(self, name: str, where: str, doing: str, exc: Exception) -> NoReturn:
        """Raise a logger's failure `exc` in one line: a failed write (say a full disk)
        as the run log's own; a tracker's other errors (a server that does not answer)
        with their first line; an error of the csv logger's own code as it is."""
        if os_error_in(exc) is not None:
            raise self._failed(Path(where), exc) from None
        if name == "csv":
            raise exc
        raise ConfigError(
            f"loggers: {name} could not {doing} ({first_line(exc)}): "
            f"check {where}, or leave {name} out of --loggers"
        ) from exc

    def _failed(self, path: Path, exc: BaseException) -> ConfigError:
        """A failed write (say a full disk) as one line naming the file and the fix."""
        error = os_error_in(exc)
        assert error is not None and self.folder is not None
        what, fix = write_failure(error, self.folder)
        return ConfigError(
            f"cannot write the run log {path}: {what}: {fix}, or pass another --run-dir"
        )


def keep_last_run(folder: Path) -> Path | None:
    """Rename the last run's files in `folder` to the first number N that none of them
    has (metrics.N.jsonl, config.N.json, steps.N.csv, epochs.N.csv, tb.N), when its
    metrics.jsonl or a CSV file holds records; the renamed metrics file, or None."""
    if not any(_has_records(folder / name) for name in RECORD_FILES):
        return None
    names = (*RECORD_FILES, *KEPT_WITH)
    number = 1
    while any(_exists(folder / _numbered(name, number)) for name in names):
        number += 1
    for name in names:
        if _exists(folder / name):
            (folder / name).rename(folder / _numbered(name, number))
    for name in RECORD_FILES:
        if _exists(folder / _numbered(name, number)):
            return folder / _numbered(name, number)
    return None  # pragma: no cover - one of them held records


def _numbered(name: str, number: int) -> str:
    """`metrics.jsonl` as `metrics.2.jsonl`, `tb` as `tb.2`."""
    path = Path(name)
    return f"{path.stem}.{number}{path.suffix}"


def _has_records(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()
