"""DDP111: a process group that is never destroyed on the normal way out."""

from __future__ import annotations

from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.model import Severity
from ddpkit.check.rules.base import Hit, Rule


def check(fa: FileAnalysis) -> Iterator[Hit]:
    # Only a mention outside `except` counts: a cleanup that runs on errors alone
    # leaves the normal exit path without one. `finally` and atexit.register count.
    # Checked with a folder, a destroy in any file linked to this one by imports counts.
    if fa.program_mentions("destroy_process_group"):
        return
    # A helper that only sets the group up (its callers, elsewhere, may well tear it
    # down) is not reported alone: only an init known to run on every rank, through
    # the calls of this file or of the checked files that import it.
    inits = [site for site in fa.process_group_inits if fa.runs_on_every_rank(site)]
    if not inits:
        return
    yield (
        inits[0].node,
        "`init_process_group` without `destroy_process_group()` on the normal exit path: "
        "the job may hang or warn at exit and leaks the group's resources; call "
        "`dist.destroy_process_group()` in a `finally:` block",
    )


RULE = Rule(
    "DDP111",
    Severity.WARNING,
    "init_process_group without destroy_process_group",
    check,
)
