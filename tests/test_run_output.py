"""What the ranks of `ddpkit run` print: whole lines with their rank, the ranks that
--local-ranks-filter shows, each rank's log in --log-dir or, after a crash, in the
folder ddpkit keeps; and `ddpkit.print(all_ranks=True)`, whose lines never split.

Every job here runs with PYTHONUNBUFFERED=1 (common in containers): each `print` is then
two writes, its text and its newline, and lines from ranks that share an output mix
unless something keeps them whole.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import ROOT

UNBUFFERED = {"PYTHONUNBUFFERED": "1"}
PREFIXED = re.compile(r"\[rank (\d+)\] (.*)")


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _by_rank(stdout: str) -> dict[int, list[str]]:
    """Each rank's lines in the order they came; every line must carry a rank prefix."""
    ranks: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        match = PREFIXED.fullmatch(line)
        assert match, f"a line without its rank, or cut: {line!r}"
        ranks.setdefault(int(match[1]), []).append(match[2])
    return ranks


TALK = 3000

# Two ranks print long lines through ddpkit.print(all_ranks=True), both at once, into
# the one pipe that `launch`'s workers share with their parent.
ALL_RANKS_PRINT = f"""
import ddpkit

def talk(ctx):
    ddpkit.barrier()  # both at once
    for i in range({TALK}):
        ddpkit.print(f"step {{i}} |", "y" * (300 + i % 500), all_ranks=True)

if __name__ == "__main__":
    ddpkit.launch(talk, nprocs=2, backend="gloo")
"""


def test_print_on_all_ranks_never_splits_a_line(tmp_path: Path) -> None:
    script = _script(tmp_path, "talk.py", ALL_RANKS_PRINT)
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **UNBUFFERED},
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    expected = [f"step {i} | " + "y" * (300 + i % 500) for i in range(TALK)]
    assert _by_rank(out.stdout) == {0: expected, 1: expected}
