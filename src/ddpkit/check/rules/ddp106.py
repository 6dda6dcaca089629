"""DDP106: a collective that only some ranks reach, so the others wait forever.

Error level needs a proof: a pair of ranks whose paths make different collective
calls, told apart by a value that is a rank by data flow (see `ranks.py` and
`paths.py`). A rank test known only by its name (`if is_master:` with no source in
sight) gives a warning.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.callgraph import MPI_COLLECTIVES, collective
from ddpkit.check.index import Ref, Site
from ddpkit.check.model import Severity
from ddpkit.check.paths import Divergence
from ddpkit.check.ranks import RANK_ZERO_DECORATORS
from ddpkit.check.rules.base import Hit, Rule, argument, describe_guard, scope_label, show
from ddpkit.collectives import COLLECTIVES

# torch.distributed.checkpoint save/load coordinate all ranks as well.
_DCP = (
    "torch.distributed.checkpoint",
    frozenset({"save", "load", "save_state_dict", "load_state_dict"}),
)


_COLLECTIVE_NAMES = COLLECTIVES | MPI_COLLECTIVES


def _on_subgroup(call: ast.Call) -> bool:
    """`group=g` (`process_group=g` for DCP): only the members call it, which may well be
    rank-dependent on purpose; without the group's members in sight, nothing is said."""
    group = argument(call, None, "group") or argument(call, None, "process_group")
    if group is None or (isinstance(group, ast.Constant) and group.value is None):
        return False
    return not (isinstance(group, ast.Attribute) and group.attr == "WORLD")


def _events(fa: FileAnalysis, site: Site, member: str) -> list[Site]:
    """The places in the site's function that make collective `member`: its own calls
    and calls of the program's functions that make it."""
    found: list[Site] = [
        other
        for other, other_member in _collectives(fa)
        if other.scope is site.scope and other_member == member
    ]
    for ref in fa.index.refs:
        if ref.scope is site.scope and ref.call_expr is not None and member in _made_by(fa, ref):
            found.append(ref)
    return found


def _made_by(fa: FileAnalysis, ref: Ref) -> frozenset[str]:
    """The collectives that the functions a call surely stands for make."""
    made: frozenset[str] = frozenset()
    for fn in fa.callees(ref):
        made |= fa.callgraph.collectives_of(fn)
    return made


def _counts(fa: FileAnalysis, events: list[Site], env: dict[str, bool]) -> int | None:
    """How many of `events` a rank with tests `env` passes; None when one cannot tell."""
    total = 0
    for event in events:
        holds = fa.paths.holds(event.guards, env)
        if holds is None:
            return None
        total += holds
    return total


def _balanced(fa: FileAnalysis, site: Site, member: str, found: Divergence) -> bool:
    """The rank that skips the site makes `member` in this function at least as often
    as the rank that reaches it: `if rank == src: send() else: recv()` pairs, the same
    call in both branches (where one side makes more calls, the surplus is reported)."""
    if not found.reach:
        return False
    events = _events(fa, site, member)
    reach, skip = _counts(fa, events, found.reach), _counts(fa, events, found.skip)
    if reach is not None and skip is not None:
        # Unequal counts hang the side that makes more calls: point at that side.
        return reach <= skip
    # A partner under a rank test of its own that the site's tests cannot decide:
    # the user is pairing them up on purpose; trust it.
    return any(
        event is not site and fa.paths.divergence(event.guards, event.scope) is not None
        for event in events
    )


def _collectives(fa: FileAnalysis) -> list[tuple[Site, str]]:
    """The calls of this file that make a collective, with its name."""
    found = [
        (site, member)
        for name in _COLLECTIVE_NAMES
        for site in fa.calls(name)
        if (member := collective(fa.imports, site.call)) is not None
    ]
    return found + fa.resolved_calls(*_DCP)


def _paths(found: Divergence | None) -> str:
    """The two paths: ` (a rank where `rank == 0` holds calls it; one where it does not, never)`."""
    if found is None:
        return ""
    test = show(found.atom, 40)
    if found.reach.get(ast.dump(found.atom), True):
        return f" (a rank where `{test}` holds calls it; one where it does not, never)"
    return f" (a rank where `{test}` does not hold calls it; one where it does, never)"


_FIX = (
    "every rank must make the same collective calls or the job hangs: move it out of the "
    "rank check and keep only the rank-0 work (printing, saving) inside"
)
_BY_NAME = " (a warning: nothing shows that the test depends on the rank beyond its name)"


def _hit(node: ast.AST, message: str, proven: bool) -> Hit:
    return (node, message) if proven else (node, message + _BY_NAME, Severity.WARNING)


def _guarded_collectives(fa: FileAnalysis) -> Iterator[Hit]:
    """A collective under a rank test in its own function, or in a function that only a
    `@rank_zero_only`-style decorator keeps from the other ranks."""
    for site, member in _collectives(fa):
        call = site.call
        if _on_subgroup(call):
            continue
        why = fa.rank_only(site)
        if why is None:
            continue
        name = f"`{show(call.func)}()`"
        if why.via is None:
            assert why.guard is not None and why.divergence is not None
            if _balanced(fa, site, member, why.divergence):
                continue
            where = f"runs only on the ranks that pass {describe_guard(why.guard)}"
        elif why.divergence is None:
            decorators = sorted(RANK_ZERO_DECORATORS.intersection(why.via.decorators))
            how = (
                f"`@{decorators[0]}` runs on rank 0 only"
                if decorators
                else f"only runs on some ranks (see line {why.line})"
            )
            where = f"is in `{scope_label(why.via)}`, which {how}"
        else:
            continue  # reported at the call under the rank test (`_guarded_calls`)
        yield _hit(call, f"{name} {where}{_paths(why.divergence)}; {_FIX}", why.proven)


def _guarded_calls(fa: FileAnalysis) -> Iterator[Hit]:
    """A call under a rank test of a function of the program that makes a collective
    (`if rank == 0: save_checkpoint()` with a barrier inside): reported at the call, where
    the fix goes."""
    for ref in fa.index.refs:
        if ref.call_expr is None or _on_subgroup(ref.call_expr):
            continue
        found = fa.paths.divergence(ref.guards, ref.scope)
        if found is None:
            continue
        made = _made_by(fa, ref)
        unbalanced = sorted(m for m in made if not _balanced(fa, ref, m, found))
        if not unbalanced:
            continue
        callee = next(fn for fn in fa.callees(ref) if fa.callgraph.collectives_of(fn))
        message = (
            f"`{show(ref.call_expr.func)}()` makes the collective `{unbalanced[0]}` (in "
            f"`{scope_label(callee)}`) but runs only on the ranks that pass "
            f"{describe_guard(found.guard)}{_paths(found)}; {_FIX}"
        )
        yield _hit(ref.call_expr, message, fa.is_proven(found, ref.scope))


def check(fa: FileAnalysis) -> Iterator[Hit]:
    yield from _guarded_collectives(fa)
    yield from _guarded_calls(fa)


RULE = Rule(
    "DDP106",
    Severity.ERROR,
    "collective called only under a rank condition (hangs)",
    check,
)
