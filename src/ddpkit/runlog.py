"""RunLog: the run folder's record of a training run, written by rank 0 only.

`config.json` holds the resolved config; `metrics.jsonl` one JSON object per line,
`{"kind": "step", ...}` every `log_every` optimizer steps (rank 0's numbers, so no rank
waits on another) and `{"kind": "epoch", ...}` after each epoch (numbers over all
ranks). With the `tensorboard` extra installed the same scalars go to TensorBoard
event files in `tb/`. `ddpkit plot RUN_DIR` draws them.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.storage import os_error_in, write_failure


class RunLog:
    def __init__(self, run_dir: str | None, config: dict[str, Any], *, enabled: bool) -> None:
        self.start = time.perf_counter()
        self.folder = Path(run_dir) if run_dir and enabled else None
        self._file: Any = None
        self._tb: Any = None
        if self.folder is None:
            return
        target = self.folder
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            target = self.folder / "config.json"
            target.write_text(json.dumps(config, indent=2, default=str) + "\n")
            # Append: a resumed run continues the same record.
            target = self.folder / "metrics.jsonl"
            self._file = target.open("a", buffering=1)
        except OSError as exc:
            raise self._failed(target, exc) from None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # the tensorboard extra is not installed
            return
        self._tb = SummaryWriter(str(self.folder / "tb"))
        _quiet_tensorboard_thread()

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
        target = self._file.name
        try:
            self._file.write(json.dumps(record) + "\n")
            if self._tb is not None:
                target = self._tb.log_dir
                for key, value in values.items():
                    if isinstance(value, (int, float)) and key not in ("epoch", "step"):
                        self._tb.add_scalar(f"{kind}/{key}", value, step)
        except Exception as exc:
            if os_error_in(exc) is None:
                raise
            self.close(quiet=True)
            raise self._failed(Path(target), exc) from None

    def close(self, *, quiet: bool = False) -> None:
        """Close the files. `quiet`: after a failed write, which is being reported
        already, ignore that closing fails as well."""
        parts = [(self._file, "name"), (self._tb, "log_dir")]
        self._file = self._tb = None
        for part, name in parts:
            if part is None:
                continue
            try:
                part.close()
            except Exception as exc:
                if os_error_in(exc) is None:
                    raise
                if not quiet:
                    raise self._failed(Path(getattr(part, name)), exc) from None

    def _failed(self, path: Path, exc: BaseException) -> ConfigError:
        """A failed write (say a full disk) as one line naming the file and the fix."""
        error = os_error_in(exc)
        assert error is not None and self.folder is not None
        what, fix = write_failure(error, self.folder)
        return ConfigError(
            f"cannot write the run log {path}: {what}: {fix}, or pass another --run-dir"
        )


def _quiet_tensorboard_thread() -> None:
    """tensorboard writes from a thread of its own; when a write fails (a full disk),
    that thread prints a traceback, and the next add_scalar or close re-raises the error,
    which RunLog reports in one line. Keep that line the only report: hide the thread's
    traceback of an OSError (any other exception in any thread prints as before)."""
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
