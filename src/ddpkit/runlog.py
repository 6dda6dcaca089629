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
import time
from pathlib import Path
from typing import Any


class RunLog:
    def __init__(self, run_dir: str | None, config: dict[str, Any], *, enabled: bool) -> None:
        self.start = time.perf_counter()
        self.folder = Path(run_dir) if run_dir and enabled else None
        self._file: Any = None
        self._tb: Any = None
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        # Append: a resumed run continues the same record.
        self._file = (self.folder / "metrics.jsonl").open("a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # the tensorboard extra is not installed
            return
        self._tb = SummaryWriter(str(self.folder / "tb"))

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
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and key not in ("epoch", "step"):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
