"""RunLog: the run folder's record of a training run, written by rank 0 only.

`config.json` holds the resolved config; `metrics.jsonl` one JSON object per line,
`{"kind": "step", ...}` every `log_every` optimizer steps (rank 0's numbers, so no rank
waits on another) and `{"kind": "epoch", ...}` after each epoch (numbers over all
ranks). Each record's `time` is the seconds since the run started training, and a
resumed run goes on from the `time` of the last record it continues (the time between
that record and the stop, and while no job ran, is not counted), so the `time` of a
run's records, and of its CSV files' rows, only ever grows. The loggers that the
config's `loggers` names (csv, tensorboard, mlflow, wandb: see `ddpkit.records.loggers`)
get the same records. `ddpkit plot RUN_DIR` draws them.

A new run (the config's `resume` false) into a folder whose metrics.jsonl (or CSV
file) already holds records keeps the last run's files under the first number N that
is free: metrics.N.jsonl, config.N.json, steps.N.csv, epochs.N.csv and tb.N/, and
`RunLog.kept` is the kept metrics.N.jsonl; so no file mixes two runs. A resumed run
appends to the files of the run it continues, after dropping their records of the
steps after its checkpoint (`resumed_step`): a run resumed from an older checkpoint
trains those steps again, and its records' step only ever grows, with no step twice.
A checkpoint written inside an epoch (`resumed_inside`; at its last step, say, by
keep_best) comes before that epoch's record: the resumed run writes the record at the
epoch's end, so one already at the checkpoint's step goes too, and no epoch has two.

A run log that cannot start (a full disk, a logger that fails to start, Ctrl-C) leaves
the folder as it was: config.json is written to a temporary file and renamed into place
last, and what was made or renamed until then is undone.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from ddpkit import storage
from ddpkit.errors import ConfigError
from ddpkit.records.loggers import (
    CSV_FILES,
    Logger,
    check_installed,
    csv_name,
    drop_rows_after,
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
    go and whether they continue the last run's files. `resumed_step`: the step of the
    checkpoint a resumed run continues from; the records after it are dropped.
    `resumed_inside`: that checkpoint was written inside an epoch whose record this run
    writes; a record of kind epoch at `resumed_step` is dropped as well."""

    def __init__(
        self,
        run_dir: str | None,
        config: dict[str, Any],
        *,
        enabled: bool,
        resumed_step: int | None = None,
        resumed_inside: bool = False,
    ) -> None:
        self.start = time.perf_counter()
        self.resumed_at = 0.0
        """The `time` of the last record that this (resumed) run continues; 0 for a
        new run. Its own records' `time` counts on from there."""
        self.resumed_step = resumed_step
        self.resumed_inside = resumed_inside
        self.dropped = 0
        """The records of metrics.jsonl after `resumed_step` (and the epoch's record at it,
        with `resumed_inside`) that were dropped."""
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
        changes = _Changes()
        try:
            self._start(config, names, changes)
        except BaseException:
            # Bad input, a full disk, Ctrl-C: no empty config.json, no half-kept last run.
            self.close(quiet=True)
            changes.undo()
            raise

    def _start(self, config: dict[str, Any], names: list[str], changes: _Changes) -> None:
        """Make the folder, keep the last run's files, open metrics.jsonl, start the
        loggers and then put config.json in place, recording each change in `changes`.
        config.json is written first, beside its name: on a full disk that write is
        the one that fails, before anything else changed."""
        assert self.folder is not None
        config_json = self.folder / "config.json"
        target = self.folder
        try:
            changes.folders = _missing_folders(self.folder)
            self.folder.mkdir(parents=True, exist_ok=True)
            target = config_json
            staged = storage.stage(config_json, json.dumps(config, indent=2, default=str) + "\n")
            changes.files.append(staged)
            if not config.get("resume"):
                self.kept = keep_last_run(self.folder, renamed=changes.renames)
            # Append: a resumed run continues the same record, and its clock.
            target = self.folder / "metrics.jsonl"
            if not _exists(target):
                changes.files.append(target)
            elif config.get("resume"):
                if self.resumed_step is not None:
                    self.dropped = drop_records_after(
                        self.folder, self.resumed_step, epoch_at_step=self.resumed_inside
                    )
                self.resumed_at = last_time(target)
            self._file = target.open("a", buffering=1)
        except OSError as exc:
            raise self._failed(target, exc) from None
        for name in names:
            try:
                self._loggers.append(start_logger(name, self.folder, config))
            except Exception as exc:
                if isinstance(exc, ConfigError):
                    raise
                self._logger_failed(name, str(self.folder), "start", exc)
        try:
            storage.install(staged, config_json, [])
        except OSError as exc:
            raise self._failed(config_json, exc) from None

    @property
    def active(self) -> bool:
        return self._file is not None

    def write(
        self,
        kind: str,
        step: int,
        values: dict[str, float | int | None],
        at: float | None = None,
    ) -> None:
        """One record; `at`: its `time` when it is not now (measured earlier)."""
        if self._file is None:
            return
        if at is None:
            at = time.perf_counter() - self.start
        now = round(self.resumed_at + at, 3)
        record: dict[str, Any] = {"kind": kind, "step": step, "time": now}
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


# Bytes read from the end of metrics.jsonl for its last record's time: a record is a
# few hundred bytes, so the last whole one is in there.
_TAIL_BYTES = 64 * 1024


def last_time(path: Path) -> float:
    """The `time` of the last record in metrics.jsonl `path` that has one (a line cut
    short by a crash is passed over); 0.0 when none has."""
    with path.open("rb") as f:
        f.seek(max(f.seek(0, os.SEEK_END) - _TAIL_BYTES, 0))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            value = json.loads(line).get("time")
        except (ValueError, AttributeError):  # half a line, or not a record
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and math.isfinite(value):
            return float(value)
    return 0.0


def drop_records_after(folder: Path, step: int, *, epoch_at_step: bool = False) -> int:
    """Drop the records after `step` from the run log in `folder`: metrics.jsonl's, and
    the rows of the csv logger's files for the kinds of record it holds (a line cut
    short by a crash goes too); with `epoch_at_step`, the epoch's record at `step` too.
    Each file is replaced whole, and only when something is dropped; the number of
    metrics.jsonl's records dropped."""
    path = folder / "metrics.jsonl"
    keep: list[str] = []
    kinds: set[str] = set()
    lines = path.read_text(encoding="utf-8").splitlines()
    for line in lines:
        try:
            record = json.loads(line)
            at, kind = record["step"], record["kind"]
        except (ValueError, TypeError, KeyError):  # half a line, or not a record
            continue
        kinds.add(str(kind))
        last = step - 1 if epoch_at_step and kind == "epoch" else step
        if isinstance(at, int) and at <= last:
            keep.append(line)
    for kind in sorted(kinds):
        last = step - 1 if epoch_at_step and kind == "epoch" else step
        drop_rows_after(folder / csv_name(kind), last)
    if len(keep) == len(lines):
        return 0
    storage.write(path, "".join(f"{line}\n" for line in keep))
    return len(lines) - len(keep)


def keep_last_run(folder: Path, *, renamed: list[tuple[Path, Path]] | None = None) -> Path | None:
    """Rename the last run's files in `folder` to the first number N that none of them
    has (metrics.N.jsonl, config.N.json, steps.N.csv, epochs.N.csv, tb.N), when its
    metrics.jsonl or a CSV file holds records; the renamed metrics file, or None.
    Each rename done is appended to `renamed` as (old, new) as it is done, so that a
    failure half way can be undone too."""
    if not any(_has_records(folder / name) for name in RECORD_FILES):
        return None
    names = (*RECORD_FILES, *KEPT_WITH)
    number = 1
    while any(_exists(folder / _numbered(name, number)) for name in names):
        number += 1
    for name in names:
        if _exists(folder / name):
            storage.rename(folder / name, folder / _numbered(name, number))
            if renamed is not None:
                renamed.append((folder / name, folder / _numbered(name, number)))
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


class _Changes:
    """What starting a run log did to its folder so far, to undo when the start fails:
    the folders it made, the files it created, the last run's files it renamed."""

    def __init__(self) -> None:
        self.folders: list[Path] = []  # outermost first
        self.files: list[Path] = []
        self.renames: list[tuple[Path, Path]] = []  # (old, new)

    def undo(self) -> None:
        """Put the folder back as it was, as far as that can be done. Never raises: it
        runs while an error that must not be hidden is on its way out. A logger's own
        files are left, so a folder holding them stays as well."""
        for path in self.files:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        for old, new in reversed(self.renames):
            if not _exists(old):  # a logger may have made a new one: leave both
                with contextlib.suppress(OSError):
                    storage.rename(new, old)
        for folder in reversed(self.folders):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: never anything else's files


def _missing_folders(folder: Path) -> list[Path]:
    """The folders that `folder.mkdir(parents=True)` would make, outermost first."""
    missing: list[Path] = []
    while not _exists(folder) and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing[::-1]
