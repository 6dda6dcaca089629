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

from tests.conftest import ROOT, run_cli

UNBUFFERED = {"PYTHONUNBUFFERED": "1"}
LINES = 200

# Every rank prints LINES lines of different lengths on stdout, one on stderr, and one
# line through the file descriptor itself (as C code or a subprocess would).
CHATTY = f"""
import os, sys
rank = int(os.environ["RANK"])
for i in range({LINES}):
    print(f"line {{i}} of rank {{rank}}: " + "x" * (i % 97))
print(f"a warning from rank {{rank}}", file=sys.stderr)
sys.stdout.flush()
os.write(1, f"raw line of rank {{rank}}\\n".encode())
"""

PREFIXED = re.compile(r"\[rank (\d+)\] (.*)")


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _expected(rank: int) -> list[str]:
    lines = [f"line {i} of rank {rank}: " + "x" * (i % 97) for i in range(LINES)]
    return [*lines, f"raw line of rank {rank}"]


def _by_rank(stdout: str) -> dict[int, list[str]]:
    """Each rank's lines in the order they came; every line must carry a rank prefix."""
    ranks: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        match = PREFIXED.fullmatch(line)
        assert match, f"a line without its rank, or cut: {line!r}"
        ranks.setdefault(int(match[1]), []).append(match[2])
    return ranks


def test_every_line_shows_whole_with_its_rank(tmp_path: Path) -> None:
    script = _script(tmp_path, "chatty.py", CHATTY)
    out = run_cli("run", "--nproc", "2", str(script), env=UNBUFFERED)
    assert out.returncode == 0, out.stderr
    assert _by_rank(out.stdout) == {0: _expected(0), 1: _expected(1)}
    for rank in (0, 1):  # stderr stays stderr, prefixed too
        assert f"[rank {rank}] a warning from rank {rank}" in out.stderr.splitlines()


def test_local_ranks_filter_shows_only_those_ranks(tmp_path: Path) -> None:
    script = _script(tmp_path, "chatty.py", CHATTY)
    out = run_cli("run", "--nproc", "2", "--local-ranks-filter", "0", str(script), env=UNBUFFERED)
    assert out.returncode == 0, out.stderr
    assert _by_rank(out.stdout) == {0: _expected(0)}
    assert "[rank 0] a warning from rank 0" in out.stderr.splitlines()
    assert "rank 1" not in out.stderr


def test_log_dir_holds_each_ranks_output(tmp_path: Path) -> None:
    script = _script(tmp_path, "chatty.py", CHATTY)
    logs = tmp_path / "logs" / "run1"  # made, parents too
    out = run_cli(
        "run",
        *("--nproc", "2", "--log-dir", str(logs), "--no-rank-prefix", str(script)),
        env=UNBUFFERED,
    )
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["rank0.log", "rank1.log"]
    for rank in (0, 1):
        # The rank's own lines, unprefixed, stderr among them in the order written.
        lines = (logs / f"rank{rank}.log").read_text().splitlines()
        assert [ln for ln in lines if ln.startswith(("line", "raw"))] == _expected(rank)
        assert f"a warning from rank {rank}" in lines
    # --no-rank-prefix: the console has the bare lines, still whole.
    console = out.stdout.splitlines()
    assert sorted(console) == sorted(_expected(0) + _expected(1))


# Rank 1 fails at once; rank 0 is still starting (a sitecustomize holds it for 20 s at
# interpreter start-up), so it is stopped before it runs anything of ddpkit's.
SLOW_RANK_0 = """
import os, time
if os.environ.get("RANK") == "0" and os.environ.get("SLOW_RANK_0"):
    time.sleep(20)
"""

CRASH_AT_ONCE = """
import os, sys
if os.environ["RANK"] == "1":
    os.write(2, b"rank 1 says goodbye through the file descriptor\\n")
    raise ValueError("rank one is broken")
print("rank 0 ran", flush=True)
"""


def test_after_a_crash_every_ranks_log_is_kept(tmp_path: Path) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_RANK_0)
    script = _script(tmp_path, "crash.py", CRASH_AT_ONCE)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    path = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH", "")) if p)
    env = {"TMPDIR": str(scratch), "PYTHONPATH": path, "SLOW_RANK_0": "1", **UNBUFFERED}
    out = run_cli("run", "--nproc", "2", str(script), env=env)
    assert out.returncode == 1, out.stderr
    assert "rank 1 failed first: ValueError: rank one is broken" in out.stderr
    (kept,) = scratch.glob("ddpkit-failed-run-*")
    last = out.stderr.strip().splitlines()[-1]
    assert last == f"ddpkit: every rank's output, with its whole traceback: {kept}/rank<N>.log"
    assert sorted(p.name for p in kept.iterdir()) == ["rank0.log", "rank1.log"]
    assert "rank 0 ran" not in (kept / "rank0.log").read_text()  # stopped before it ran
    rank1 = (kept / "rank1.log").read_text()
    assert "rank 1 says goodbye through the file descriptor" in rank1
    assert "shim.py" in rank1 and "ValueError: rank one is broken" in rank1  # whole


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
