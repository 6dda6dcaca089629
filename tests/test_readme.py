"""The README's Python examples run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[index])
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def _port_versions() -> tuple[str, str, int]:
    """(the one-GPU script, its ddpkit version, lines changed) from the README's diff."""
    (diff,) = re.findall(r"```diff\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    old, new, changed = [], [], 0
    for line in diff.splitlines():
        mark, text = line[:1], line[1:]
        if mark in (" ", ""):
            old.append(text)
            new.append(text)
        elif mark == "-":
            old.append(text)
        elif mark == "+":
            new.append(text)
            changed += 1
        else:
            raise AssertionError(f"not a diff line: {line!r}")
    return "\n".join(old) + "\n", "\n".join(new) + "\n", changed


@pytest.mark.slow
def test_the_ported_script_runs_and_changes_at_most_15_lines(tmp_path: Path) -> None:
    old, new, changed = _port_versions()
    compile(old, "single_gpu.py", "exec")  # the "before" is a whole, valid script
    readme = (ROOT / "README.md").read_text()
    assert changed <= 15 and f"with {changed} changed lines" in readme
    script = tmp_path / "train.py"
    script.write_text(new)
    out = subprocess.run(
        [sys.executable, str(script), "3", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    # Printed once per save (rank 0 only), and written where it says.
    assert out.stdout.count("saved") == 2, out.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "ckpt-000000000.pt",
        "ckpt-000000002.pt",
    ]
