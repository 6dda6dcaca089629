"""What the checker reports: a `Finding` at a place in a file, with a code and a severity."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


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


# The code of a file that could not be read or parsed; it is never filtered out,
# because a file that was not checked must not look clean.
UNREADABLE = "DDP000"


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
