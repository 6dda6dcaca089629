"""The speed benchmark stays runnable: a small run writes its JSON with files/s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_check_speed_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "check_speed.json"
    result = subprocess.run(
        [
            sys.executable,
            "bench/check_speed.py",
            "--files",
            "6",
            "--repeat",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "files/s (one core, wall)" in result.stdout
    data = json.loads(out.read_text())["result"]
    assert data["files"] == 6
    assert data["files_per_s"] > 0
    assert 250 <= data["lines_per_file"] <= 350
    # Generated scripts are real DDP code: the checker parses them all.
    assert "DDP000" not in data["findings_by_code"]
