"""How findings are printed: one line each, or JSON, and the summary line."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence

from ddpkit.check.model import Finding, Severity


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def format_text(findings: Sequence[Finding]) -> str:
    """`path:line:col: CODE message`, one per line, in sorted order."""
    return "".join(f.format() + "\n" for f in findings)


def format_json(findings: Sequence[Finding]) -> str:
    return json.dumps([f.to_dict() for f in findings], indent=2) + "\n"


def summary(findings: Sequence[Finding], files_checked: int) -> str:
    """`3 findings in 5 files (1 error, 2 info)` or `no findings in 5 files`."""
    files = _plural(files_checked, "file")
    if not findings:
        return f"no findings in {files}"
    counts = Counter(f.severity for f in findings)
    # "info" has no plural; errors and warnings do.
    parts = [
        _plural(counts[s], s.value) if s is not Severity.INFO else f"{counts[s]} info"
        for s in Severity
        if counts[s]
    ]
    return f"{_plural(len(findings), 'finding')} in {files} ({', '.join(parts)})"
