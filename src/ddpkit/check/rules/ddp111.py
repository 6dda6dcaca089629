"""DDP111: a process group that is never destroyed on the normal way out."""

from __future__ import annotations

from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import Site
from ddpkit.check.rules.base import Hit, Rule
from ddpkit.findings import Severity


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


def _runs(fa: FileAnalysis, site: Site) -> bool:
    """The init can run, on every rank that gets to its function.

    A helper file checked alone (no script, no other checked file) is the exception:
    its callers are elsewhere and may well tear the group down, so its init counts only
    when the file itself runs it."""
    if id(site.call) in fa.index.calls_in_except:
        return False
    if len(fa.peers) < 2 and not fa.runs_as_script:
        return fa.runs_on_every_rank(site)
    return (
        fa.callgraph.reachable(site.scope) and fa.paths.divergence(site.guards, site.scope) is None
    )


def check(fa: FileAnalysis) -> Iterator[Hit]:
    # Only a call on a way through the program where nothing fails, and on every rank,
    # counts: a cleanup in `except` or before a `raise`, a `disconnect()` that only a
    # retry handler calls, a `close()` method that nothing calls or a destroy in the else
    # of `if rank == 0:` leaves the normal exit path without one. `finally` and
    # atexit.register count. Checked with a folder, a destroy in any file
    # linked to this one by imports counts.
    if fa.program_reaches("destroy_process_group"):
        return
    # An init that can run (see `CallGraph.reachable`: in a library, every function
    # can), or the set-up function of a module that a training script imports.
    reported: set[int] = set()
    for site in fa.process_group_inits:
        if id(site.scope) in reported:
            continue  # one finding per function: its inits are branches of one set-up
        if _runs(fa, site) or _setup_for_a_script(fa, site):
            reported.add(id(site.scope))
            yield (
                site.node,
                "`init_process_group` without `destroy_process_group()` on the normal exit "
                "path of the checked files: the job may hang or warn at exit and leaks the "
                "group's resources; call `dist.destroy_process_group()` in a `finally:` block "
                "(check the caller's files too if they tear it down)",
            )


RULE = Rule(
    "DDP111",
    Severity.WARNING,
    "init_process_group without destroy_process_group",
    check,
)
