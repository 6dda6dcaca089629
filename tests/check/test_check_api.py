"""The Python API: check_source, check_file, check_paths, explain, selection."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit.check import (
    RULES,
    UNREADABLE,
    Finding,
    SelectionError,
    Severity,
    check_file,
    check_paths,
    check_source,
    explain,
)

SOURCE = """\
import os
import torch
import torch.distributed as dist

os.environ["MASTER_PORT"] = "29500"
dist.init_process_group("gloo")
torch.save({}, "ckpt.pt")
dist.destroy_process_group()
"""


def test_check_source_returns_sorted_findings() -> None:
    found = check_source(SOURCE, "train.py")
    assert [(f.line, f.code) for f in found] == [(5, "DDP110"), (7, "DDP103")]
    assert found == sorted(found)
    first = found[0]
    assert isinstance(first, Finding) and first.severity is Severity.INFO
    assert first.format().startswith("train.py:5:29: DDP110 ")
    assert first.to_dict()["severity"] == "info"


def test_select_and_ignore_by_code_or_prefix() -> None:
    assert [f.code for f in check_source(SOURCE, select=["DDP103"])] == ["DDP103"]
    assert [f.code for f in check_source(SOURCE, ignore=["DDP11"])] == ["DDP103"]
    with pytest.raises(SelectionError, match="unknown rule code 'X1'"):
        check_source(SOURCE, select=["X1"])


def test_syntax_error_is_a_finding_not_an_exception() -> None:
    found = check_source("def f(:\n", "bad.py")
    assert [f.code for f in found] == [UNREADABLE]
    # Unreadable files are never filtered away.
    assert [f.code for f in check_source("def f(:\n", select=["DDP103"])] == [UNREADABLE]


def test_check_paths_report(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(SOURCE)
    (tmp_path / "b.py").write_text("x = 1\n")
    report = check_paths([tmp_path])
    assert report.files_checked == 2 and report.exit_code == 1
    assert check_paths([tmp_path / "b.py"]).exit_code == 0
    missing = check_paths([tmp_path / "nope.py"])
    assert missing.exit_code == 2 and missing.missing == [tmp_path / "nope.py"]
    assert check_file(tmp_path / "nope.py")[0].code == UNREADABLE


def test_every_rule_is_explained_with_examples() -> None:
    for rule in RULES:
        text = explain(rule.code)
        assert text.startswith(f"{rule.code} ({rule.severity.value}): {rule.summary}")
        assert "Wrong:" in text and "Right:" in text
    assert explain("ddp000").startswith(UNREADABLE)
    with pytest.raises(KeyError):
        explain("DDP999")


def test_rule_codes_are_stable_and_unique() -> None:
    codes = [rule.code for rule in RULES]
    # DDP112 is the audit's (`ddpkit run --audit`): the ranks trained different weights.
    assert codes == [f"DDP{n}" for n in (*range(101, 112), 113)]
    assert [r.code for r in RULES if r.severity is Severity.INFO] == ["DDP110"]
