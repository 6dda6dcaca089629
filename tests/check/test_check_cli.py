"""`ddpkit check` as a user runs it: `python -m ddpkit check ...` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli

FIXTURES = Path(__file__).parent / "fixtures"

UNGUARDED_SAVE = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.save({}, "ckpt.pt")
dist.destroy_process_group()
"""
HARD_CODED_PORT = 'import os\nos.environ["MASTER_PORT"] = "12355"\n'
CLEAN = "import torch\nprint(torch.ones(1))\n"


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text(UNGUARDED_SAVE)
    (tmp_path / "pkg" / "setup_env.py").write_text(HARD_CODED_PORT)
    (tmp_path / "clean.py").write_text(CLEAN)
    (tmp_path / ".venv").mkdir()  # hidden folders are not searched
    (tmp_path / ".venv" / "bad.py").write_text(UNGUARDED_SAVE)
    return tmp_path


def test_clean_file_exits_0(project: Path) -> None:
    result = run_cli("check", "clean.py", cwd=project)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "no findings in 1 file\n"


def test_findings_exit_1_sorted_with_summary(project: Path) -> None:
    result = run_cli("check", ".", cwd=project)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("pkg/setup_env.py:2:29: DDP110 MASTER_PORT is hard-coded")
    assert lines[1].startswith("pkg/train.py:5:1: DDP103 `torch.save` runs on every rank")
    assert lines[2] == "2 findings in 3 files (1 error, 1 info)"
    assert len(lines) == 3


def test_json_format(project: Path) -> None:
    result = run_cli("check", "--format", "json", "pkg", cwd=project)
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert [d["code"] for d in data] == ["DDP110", "DDP103"]
    assert set(data[0]) == {"path", "line", "col", "code", "severity", "message"}
    assert data[1]["severity"] == "error" and data[1]["line"] == 5 and data[1]["col"] == 1
    assert "2 findings" in result.stderr  # the summary keeps stdout pure JSON


def test_select_and_ignore(project: Path) -> None:
    selected = run_cli("check", "--select", "DDP103", "pkg", cwd=project)
    assert [line.split()[1] for line in selected.stdout.splitlines()[:-1]] == ["DDP103"]
    ignored = run_cli("check", "--ignore", "DDP103,DDP110", "pkg", cwd=project)
    assert ignored.returncode == 0 and ignored.stdout == "no findings in 2 files\n"
    prefix = run_cli("check", "--select", "DDP11", "pkg", cwd=project)
    assert prefix.returncode == 1 and "DDP110" in prefix.stdout and "DDP103" not in prefix.stdout
    unknown = run_cli("check", "--select", "E501", "pkg", cwd=project)
    assert unknown.returncode == 2 and "unknown rule code" in unknown.stderr


def test_noqa(tmp_path: Path) -> None:
    source = UNGUARDED_SAVE.replace('"ckpt.pt")', '"ckpt.pt")  # noqa: DDP103')
    (tmp_path / "t.py").write_text(source)
    result = run_cli("check", "t.py", cwd=tmp_path)
    assert result.returncode == 0, result.stdout


def test_syntax_error_is_reported_and_the_rest_still_checked(project: Path) -> None:
    (project / "broken.py").write_text("def f(:\n    pass\n")
    result = run_cli("check", ".", cwd=project)
    assert result.returncode == 2
    assert "broken.py:1:7: DDP000 syntax error, file not checked" in result.stdout
    assert "DDP103" in result.stdout and "DDP110" in result.stdout
    assert result.stdout.splitlines()[-1] == "3 findings in 4 files (2 errors, 1 info)"


def test_usage_errors_exit_2(project: Path) -> None:
    missing = run_cli("check", "nope.py", "clean.py", cwd=project)
    assert missing.returncode == 2
    assert "no such file or folder: nope.py" in missing.stderr
    assert "no findings in 1 file" in missing.stdout  # the others are still checked
    assert run_cli("check", cwd=project).returncode == 2
    assert run_cli("check", "--format", "xml", ".", cwd=project).returncode == 2


def test_explain() -> None:
    result = run_cli("check", "--explain", "DDP106")
    assert result.returncode == 0
    assert result.stdout.startswith("DDP106 (error): collective called only under a rank condition")
    assert "Wrong:" in result.stdout and "Right:" in result.stdout
    assert "dist.all_reduce(loss)" in result.stdout
    assert run_cli("check", "--explain", "DDP999").returncode == 2


def test_tutorial_scripts_through_the_cli() -> None:
    result = run_cli("check", str(FIXTURES / "multigpu.py"), str(FIXTURES / "multigpu_torchrun.py"))
    assert result.returncode == 1
    codes = [line.split()[1] for line in result.stdout.splitlines()[:-1]]
    assert codes == ["DDP110"]
    assert result.stdout.splitlines()[-1] == "1 finding in 2 files (1 info)"


def test_import_does_not_load_torch() -> None:
    code = "import ddpkit.check, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_pre_commit_hook_declared() -> None:
    text = (ROOT / ".pre-commit-hooks.yaml").read_text()
    assert "id: ddpkit-check" in text
    assert "entry: ddpkit check" in text
    assert "language: python" in text
    assert "types: [python]" in text


def test_audit_log_lists_what_only_the_run_saw(project: Path) -> None:
    """A finding the audited run committed but check did not make is listed too, marked
    so; the run's findings in files that were not checked, or of codes not selected, are
    not."""
    from ddpkit.findings import Finding, Severity, write_audit_log

    train = project / "pkg" / "train.py"
    both = Finding(str(train), 5, 1, "DDP103", Severity.ERROR, "ranks 0, 1 all wrote ckpt.pt")
    run_only = Finding(str(train), 4, 1, "DDP104", Severity.WARNING, "keys start with module.")
    elsewhere = Finding(str(project / "other.py"), 3, 1, "DDP101", Severity.WARNING, "epoch 0")
    (project / "logs").mkdir()
    write_audit_log(project / "logs", [both, run_only, elsewhere], 0)
    result = run_cli("check", "--audit-log", "logs", "pkg/train.py", cwd=project)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stderr
    (static,) = [ln for ln in lines if " DDP103 " in ln]
    assert static.endswith("[confirmed at run time]")
    (added,) = [ln for ln in lines if " DDP104 " in ln]
    assert added.startswith(f"{train}:4:1:") and added.endswith("[run time only]")
    assert "other.py" not in result.stdout
    selected = run_cli("check", "--audit-log", "logs", "--select", "DDP103", "pkg", cwd=project)
    assert " DDP104 " not in selected.stdout
