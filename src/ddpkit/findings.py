"""What ddpkit's checks report: a `Finding` at a place in a file, with a code and a
severity, and how findings are printed (one line each, or JSON, and a summary line).

`ddpkit check` finds them in the source; `ddpkit run --audit` in what a job did.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from ddpkit.storage import write_json


class Severity(str, Enum):
    """How bad a finding is.

    error: the job crashes, hangs or corrupts its output; warning: it runs but is
    wrong, slow or unsafe; info: it works here but breaks in a common setting.
    """

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    def __str__(self) -> str:
        return self.value


# What `ddpkit run --audit --log-dir DIR` leaves in DIR, for `ddpkit check --audit-log DIR`.
AUDIT_LOG = "audit.json"


@dataclass(frozen=True, order=True)
class Finding:
    """One problem found in one file. Lines and columns count from 1, as editors do."""

    path: str
    line: int
    col: int
    code: str
    severity: Severity
    message: str

    def format(self) -> str:
        """The `path:line:col: CODE message` line that `ddpkit check` prints."""
        return f"{self.path}:{self.line}:{self.col}: {self.code} {self.message}"

    def to_dict(self) -> dict[str, Any]:
        """The object that `ddpkit check --format json` prints for this finding."""
        return {**asdict(self), "severity": self.severity.value}


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def format_text(findings: Sequence[Finding]) -> str:
    """`path:line:col: CODE message`, one per line, in sorted order."""
    return "".join(f.format() + "\n" for f in findings)


def format_json(findings: Sequence[Finding]) -> str:
    return json.dumps([f.to_dict() for f in findings], indent=2) + "\n"


def summary(findings: Sequence[Finding], files_checked: int | None) -> str:
    """`3 findings in 5 files (1 error, 2 info)` or `no findings in 5 files` (without
    the files when `files_checked` is None: a run's audit)."""
    files = "" if files_checked is None else " in " + _plural(files_checked, "file")
    if not findings:
        return f"no findings{files}"
    counts = Counter(f.severity for f in findings)
    # "info" has no plural; errors and warnings do.
    parts = [
        _plural(counts[s], s.value) if s is not Severity.INFO else f"{counts[s]} info"
        for s in Severity
        if counts[s]
    ]
    return f"{_plural(len(findings), 'finding')}{files} ({', '.join(parts)})"


def write_audit_log(folder: str | Path, found: Sequence[Finding], exit_status: int) -> None:
    """`DIR/audit.json`: what an audited run committed, and how it ended."""
    document = {"exit_status": exit_status, "findings": [f.to_dict() for f in found]}
    write_json(Path(folder, AUDIT_LOG), document, indent=2)


def read_audit_log(folder: str | Path) -> tuple[list[Finding], int]:
    """The findings and exit status an audited run left in `folder`; ValueError (with
    the fix) when there is none or it is not one."""
    path = Path(folder, AUDIT_LOG)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        found = [
            Finding(
                str(f["path"]),
                int(f["line"]),
                int(f["col"]),
                str(f["code"]),
                Severity(f["severity"]),
                str(f["message"]),
            )
            for f in document["findings"]
        ]
        return found, int(document["exit_status"])
    except FileNotFoundError:
        raise ValueError(
            f"no audit log in {folder}: run the job with `ddpkit run --audit --log-dir "
            f"{folder} ...` first"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not an audit log ({exc}): run the audit again") from None


def confirm(
    found: Sequence[Finding], audited: Sequence[Finding], exit_status: int
) -> list[Finding]:
    """Static findings in the light of an audited run: one whose code and line the run
    committed is marked "confirmed at run time"; a DDP106 (a hang) is not an error when
    the run ended well, since nothing hung. What the run committed and the static
    findings lack follows, marked "run time only" (pass only the audited findings of
    the files and codes that were checked)."""

    def where(f: Finding) -> tuple[str, int, str]:
        return os.path.realpath(f.path), f.line, f.code

    seen = {where(f) for f in audited}
    made = {where(f) for f in found}
    result = [
        replace(f, message=f"{f.message} [run time only]") for f in audited if where(f) not in made
    ]
    for f in found:
        if where(f) in seen:
            f = replace(f, message=f"{f.message} [confirmed at run time]")
        elif f.code == "DDP106" and f.severity is Severity.ERROR and exit_status == 0:
            f = replace(
                f,
                severity=Severity.WARNING,
                message=f"{f.message} [a warning: an audited run of it ended without a hang]",
            )
        result.append(f)
    return sorted(result)
