"""A folder is checked as one program: imports between its files link calls across them.

Each folder under `fixtures/programs/` is checked with `check_paths`; its files mark the lines
that must be reported with `# expect: CODE`, as the single-file fixtures do.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddpkit.check import check_file, check_paths

PROGRAMS = Path(__file__).parent / "fixtures" / "programs"
_EXPECT = re.compile(r"expect: (DDP\d{3})")


def _programs() -> list[Path]:
    return sorted(p for p in PROGRAMS.iterdir() if p.is_dir())


def _expected(folder: Path) -> set[tuple[str, int, str]]:
    return {
        (str(path.relative_to(folder)), number, match.group(1))
        for path in sorted(folder.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in _EXPECT.finditer(line)
    }


@pytest.mark.parametrize("folder", _programs(), ids=lambda p: p.name)
def test_program_findings_match_its_markers(folder: Path) -> None:
    report = check_paths([folder])
    got = {(str(Path(f.path).relative_to(folder)), f.line, f.code) for f in report.findings}
    expected = _expected(folder)
    details = "\n".join(f.format() for f in report.findings)
    assert got == expected, f"missing {sorted(expected - got)}, extra:\n{details}"


def test_a_helper_checked_alone_is_not_reported() -> None:
    # Without the script that calls it, the helper's init may be torn down elsewhere.
    assert check_file(PROGRAMS / "ddp111_helper_in_utils" / "utils.py") == []
    assert check_paths([PROGRAMS / "ddp111_helper_in_utils" / "utils.py"]).findings == []


def test_files_named_one_by_one_are_linked_too() -> None:
    folder = PROGRAMS / "ddp111_helper_in_utils"
    report = check_paths([folder / "main.py", folder / "utils.py"])
    assert [(Path(f.path).name, f.code) for f in report.findings] == [("utils.py", "DDP111")]


def test_a_call_across_modules_names_the_guard() -> None:
    report = check_paths([PROGRAMS / "ddp106_helper_under_rank"])
    (finding,) = report.findings
    assert finding.severity.value == "error"
    assert "`average`" in finding.message and "rank == 0" in finding.message
