"""`ddpkit check`: find DDP pitfalls in training scripts by reading them, never running them.

The checker parses source with the standard `ast` module and imports nothing of
torch, so it is fast and safe on any file:

    from ddpkit.check import check_paths, check_source

    for finding in check_source(open("train.py").read(), "train.py"):
        print(finding.format())          # train.py:42:9: DDP106 ...

    report = check_paths(["scripts/"], ignore=["DDP110"])
    raise SystemExit(report.exit_code)   # 0 clean, 1 findings, 2 unreadable files
"""

from __future__ import annotations

from ddpkit.check.explain import explain
from ddpkit.check.model import UNREADABLE
from ddpkit.check.rules import RULES, Rule
from ddpkit.check.runner import (
    Report,
    SelectionError,
    check_file,
    check_paths,
    check_source,
    python_files,
)
from ddpkit.findings import Finding, Severity

__all__ = [
    "RULES",
    "UNREADABLE",
    "Finding",
    "Report",
    "Rule",
    "SelectionError",
    "Severity",
    "check_file",
    "check_paths",
    "check_source",
    "explain",
    "python_files",
]
