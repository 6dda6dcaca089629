"""docs/port.md's diff: the port of the DDP tutorial's single_gpu.py, as the page shows it.

The page shows only the hunks that change, each with a line or two of context, against
the tutorial file pinned in the link above the diff. This module reads that diff and
applies it as `patch` would (each hunk where its context and removed lines are found,
in order; lines compared without trailing spaces), in pure Python, so that the tests
(on tests/real_shapes/single_gpu.py) and bench/real.py --port (on the real file) port
exactly what the page shows, and `check` runs the port of the real file.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "port.md"
# The link above the diff: https://github.com/{repo}/blob/{commit}/{path}
_PINNED = re.compile(r"https://github\.com/([\w.-]+/[\w.-]+)/blob/([0-9a-f]{40})/([\w./-]+\.py)")
_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True)
class Hunk:
    """One hunk: where it says it starts in the old file, and its lines as (mark, text)."""

    old_start: int
    lines: tuple[tuple[str, str], ...]

    @property
    def old(self) -> list[str]:
        return [text for mark, text in self.lines if mark in " -"]

    @property
    def new(self) -> list[str]:
        return [text for mark, text in self.lines if mark in " +"]


def diff_block(page: str | None = None) -> str:
    """The text of the page's one ```diff block."""
    text = PAGE.read_text(encoding="utf-8") if page is None else page
    blocks = text.split("```diff\n")
    if len(blocks) != 2:
        raise ValueError(f"docs/port.md has {len(blocks) - 1} diff blocks, not 1")
    return blocks[1].split("```", 1)[0]


def pinned(page: str | None = None) -> tuple[str, str, str]:
    """(repo, commit, path) of the file the diff is against, from the page's link."""
    text = PAGE.read_text(encoding="utf-8") if page is None else page
    before = text.split("```diff\n", 1)[0]
    found = _PINNED.findall(before)
    if not found:
        raise ValueError("docs/port.md names no pinned file above its diff")
    repo, commit, path = found[-1]
    return repo, commit, path


def parse(diff: str) -> list[Hunk]:
    """The hunks of `diff`; each header's line counts must be its body's."""
    hunks: list[Hunk] = []
    header: re.Match[str] | None = None
    body: list[tuple[str, str]] = []

    def close() -> None:
        if header is None:
            return
        hunk = Hunk(int(header[1]), tuple(body))
        old_n, new_n = int(header[2] or 1), int(header[4] or 1)
        if (len(hunk.old), len(hunk.new)) != (old_n, new_n):
            raise ValueError(
                f"{header[0]} counts {old_n} old and {new_n} new lines, "
                f"its body has {len(hunk.old)} and {len(hunk.new)}"
            )
        hunks.append(hunk)

    for line in diff.splitlines():
        if line.startswith(("--- ", "+++ ")) and header is None:
            continue  # the file names
        if line.startswith("@@"):
            close()
            header, body = _HEADER.match(line), []
            if header is None:
                raise ValueError(f"not a hunk header: {line!r}")
        elif header is None:
            raise ValueError(f"a line before the first hunk: {line!r}")
        elif line == "":
            body.append((" ", ""))  # a blank context line whose space an editor dropped
        elif line[0] in " -+":
            body.append((line[0], line[1:]))
        else:
            raise ValueError(f"not a diff line: {line!r}")
    close()
    if not hunks:
        raise ValueError("the diff has no hunks")
    return hunks


def changed_lines(diff: str) -> int:
    """Lines the port writes: the "+" lines."""
    return sum(mark == "+" for hunk in parse(diff) for mark, _ in hunk.lines)


def apply(diff: str, source: str, *, exact_lines: bool = False) -> str:
    """`source` with `diff` applied. Each hunk goes where its old lines next occur;
    `exact_lines` also requires it at the line its header names (the file it was made
    from). Context lines keep the source's own text. ValueError names a hunk that does
    not apply."""
    lines = source.splitlines()
    out: list[str] = []
    at = 0
    for number, hunk in enumerate(parse(diff), 1):
        want = [text.rstrip() for text in hunk.old]
        found = next(
            (
                i
                for i in range(at, len(lines) - len(want) + 1)
                if [text.rstrip() for text in lines[i : i + len(want)]] == want
            ),
            None,
        )
        if found is None:
            raise ValueError(f"hunk {number} (line {hunk.old_start}) does not apply: {want[0]!r}")
        if exact_lines and found + 1 != hunk.old_start:
            raise ValueError(f"hunk {number} is at line {found + 1}, not {hunk.old_start}")
        out += lines[at:found]
        theirs = iter(lines[found : found + len(want)])
        for mark, text in hunk.lines:
            if mark == " ":
                out.append(next(theirs))
            elif mark == "-":
                next(theirs)
            else:
                out.append(text)
        at = found + len(want)
    out += lines[at:]
    return "\n".join(out) + "\n"


def check(folder: Path, python: str, timeout: float = 300.0) -> list[str]:
    """Port the tutorial's single_gpu.py in `folder` (the real file, beside its
    datautils.py) by the diff, each hunk at the line its header names, and run the port
    as the page does: `python single_gpu.py 2 1` on 2 ranks (launch starts a rank per
    core: the run gets 2 cores) and `ddpkit verify --loop single_gpu.py:main -- 10 5`.
    Returns one line per step, "ok: ..." or "FAILED: ..."."""
    script = folder / "single_gpu.py"
    try:
        script.write_text(apply(diff_block(), script.read_text(), exact_lines=True))
    except ValueError as exc:
        return [f"FAILED: the diff does not apply: {exc}"]
    said = [f"ok: the diff applies to {script.name}, each hunk at its line"]
    cores = sorted(os.sched_getaffinity(0))[:2]
    runs = {
        "python single_gpu.py 2 1": ([python, "single_gpu.py", "2", "1"], "saved at checkpoints/"),
        "ddpkit verify --loop single_gpu.py:main -- 10 5": (
            [python, "-m", "ddpkit", "verify", "--loop", "single_gpu.py:main", "--", "10", "5"],
            "\nPASS  equivalence",
        ),
    }
    for name, (command, wanted) in runs.items():
        start = time.monotonic()
        out = subprocess.run(
            command,
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )
        seconds = time.monotonic() - start
        if out.returncode == 0 and wanted in "\n" + out.stdout:
            said.append(f"ok: {name} ({len(cores)} cores, {seconds:.0f} s)")
        else:
            tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
            said.append(f"FAILED: {name}: exit {out.returncode}: {' | '.join(tail)}")
    return said
