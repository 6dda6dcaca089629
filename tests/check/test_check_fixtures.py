"""Golden fixtures: every rule fires where a fixture says `# expect: DDPnnn`, and nowhere else.

Each fixture marks the lines that must be reported with `# expect: CODE`; a file
without markers must come out clean. Files are named `ddpNNN_*.py` (must trigger
DDPNNN) and `ddpNNN_ok_*.py` (a near miss that must not); `multigpu.py` and
`multigpu_torchrun.py` are the PyTorch tutorial's scripts with its defects fixed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddpkit.check import RULES, check_file

FIXTURES = Path(__file__).parent / "fixtures"
_EXPECT = re.compile(r"expect: (DDP\d{3})")
_NAME = re.compile(r"^(ddp\d{3})_(ok_)?\w+\.py$")


def _fixtures() -> list[Path]:
    return sorted(FIXTURES.glob("*.py"))


def _expected(path: Path) -> set[tuple[int, str]]:
    return {
        (number, match.group(1))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in _EXPECT.finditer(line)
    }


@pytest.mark.parametrize("path", _fixtures(), ids=lambda p: p.name)
def test_fixture_findings_match_its_markers(path: Path) -> None:
    found = check_file(path)
    got = {(f.line, f.code) for f in found}
    expected = _expected(path)
    details = "\n".join(f.format() for f in found)
    assert got == expected, f"missing {sorted(expected - got)}, extra:\n{details}"


def test_every_rule_has_a_triggering_fixture_and_a_near_miss() -> None:
    triggers: dict[str, int] = {}
    near_misses: dict[str, int] = {}
    for path in _fixtures():
        match = _NAME.match(path.name)
        if match is None:
            continue
        code = match.group(1).upper()
        if match.group(2):
            assert not _expected(path), f"near miss {path.name} must expect no finding"
            near_misses[code] = near_misses.get(code, 0) + 1
        else:
            codes = {c for _, c in _expected(path)}
            assert code in codes, f"{path.name} must expect {code}"
            triggers[code] = triggers.get(code, 0) + 1
    for rule in RULES:
        assert triggers.get(rule.code), f"no fixture triggers {rule.code}"
        assert near_misses.get(rule.code), f"no near-miss fixture for {rule.code}"


def test_tutorial_multigpu_yields_only_the_hard_coded_port() -> None:
    found = check_file(FIXTURES / "multigpu.py")
    assert [f.code for f in found] == ["DDP110"]
    assert "12355" in found[0].message
    assert found[0].severity.value == "info"


def test_tutorial_multigpu_torchrun_is_clean() -> None:
    assert check_file(FIXTURES / "multigpu_torchrun.py") == []


def test_a_stop_flag_nothing_sets_is_a_warning_under_a_rank_test() -> None:
    # Only a user's hook could set `stop_training`, so the hang is not proven.
    (found,) = check_file(FIXTURES / "ddp113_stop_flag_read_on_main_rank.py")
    assert found.severity.value == "warning"
