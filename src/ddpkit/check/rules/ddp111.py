"""DDP111: a process group that is never destroyed on the normal way out."""

from __future__ import annotations

from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import Site
from ddpkit.check.model import Severity
from ddpkit.check.rules.base import Hit, Rule


def _setup_for_a_script(fa: FileAnalysis, site: Site) -> bool:
    """`enable()` of `trainlib/distributed.py`: a top-level function that no checked file
    calls (its caller is elsewhere, e.g. a config step that was not checked), in a module
    that the program's training script imports. The script runs it, and nothing in the
    program tears the group down."""
    scope = site.scope
    if scope.is_module or scope.is_method or scope.parent is None or not scope.parent.is_module:
        return False
    if fa.ranks.rank_guard(site.guards, scope) is not None:
        return False
    return not fa.callgraph.is_mentioned(scope) and fa.imported_by_a_script()


def check(fa: FileAnalysis) -> Iterator[Hit]:
    # Only a call outside `except`, in code that can run, counts: a cleanup that runs on
    # errors alone, or a `cleanup()` helper that nothing calls, leaves the normal exit
    # path without one. `finally` and atexit.register count. Checked with a folder, a
    # destroy in any file linked to this one by imports counts.
    if fa.program_reaches("destroy_process_group"):
        return
    # A helper that only sets the group up (its callers, elsewhere, may well tear it
    # down) is not reported alone: only an init known to run on every rank, through
    # the calls of this file or of the checked files that import it, or the set-up
    # function of a module that a checked training script imports (`_setup_for_a_script`).
    inits = [site for site in fa.process_group_inits if fa.runs_on_every_rank(site)]
    if not inits:
        inits = [site for site in fa.process_group_inits if _setup_for_a_script(fa, site)]
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
