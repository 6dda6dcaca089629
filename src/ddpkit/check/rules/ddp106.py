"""DDP106: a collective that only some ranks reach, so the others wait forever.

Error level needs a proof: a pair of ranks whose paths make different collective
calls, told apart by a value that is a rank by data flow (see `ranks.py` and
`paths.py`). A rank test known only by its name (`if is_master:` with no source in
sight) gives a warning.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterator

from ddpkit.check.analysis import DISTRIBUTED, FileAnalysis, RankOnly
from ddpkit.check.index import Site
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


def _on_subgroup(call: ast.Call) -> bool:
    """`group=g`: only the members call it, which may well be rank-dependent on purpose."""
    group = argument(call, None, "group")
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
        if ref.scope is site.scope and ref.call_expr is not None:
            if any(member in fa.callgraph.collectives_of(fn) for fn in fa.callees(ref)):
                found.append(ref)
    return found


def _counts(fa: FileAnalysis, events: list[Site], env: dict[str, bool]) -> int | None:
    """How many of `events` a rank with tests `env` passes; None when one cannot tell."""
    total = 0
    for event in events:
        holds = fa.paths.holds(event.guards, env)
        if holds is None:
            return None
        total += holds
    return total


def _balanced(fa: FileAnalysis, site: Site, member: str, why: RankOnly) -> bool:
    """The rank that skips the site makes `member` in this function at least as often
    as the rank that reaches it: `if rank == src: send() else: recv()` pairs, the same
    call in both branches (where one side makes more calls, the surplus is reported)."""
    found = why.divergence
    if found is None or not found.reach:
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


def _collectives(fa: FileAnalysis) -> Iterator[tuple[Site, str]]:
    yield from fa.resolved_calls(DISTRIBUTED, COLLECTIVES)
    yield from fa.resolved_calls(*_DCP)


def _paths(found: Divergence | None) -> str:
    """The two paths: ` (a rank where `rank == 0` holds calls it; one where it does not, never)`."""
    if found is None:
        return ""
    test = show(found.atom, 40)
    if found.reach.get(ast.dump(found.atom), True):
        return f" (a rank where `{test}` holds calls it; one where it does not, never)"
    return f" (a rank where `{test}` does not hold calls it; one where it does, never)"


def check(fa: FileAnalysis) -> Iterator[Hit]:
    for site, member in _collectives(fa):
        call = site.call
        if _on_subgroup(call):
            continue
        why = fa.rank_only(site)
        if why is None or (why.via is None and _balanced(fa, site, member, why)):
            continue
        name = f"`{show(call.func)}()`"
        if why.via is None:
            assert why.guard is not None
            where = f"runs only on the ranks that pass {describe_guard(why.guard)}"
        else:
            decorators = sorted(RANK_ZERO_DECORATORS.intersection(why.via.decorators))
            if why.guard is not None:
                how = f"is only called under {describe_guard(why.guard)}"
            elif decorators:
                how = f"`@{decorators[0]}` runs on rank 0 only"
            else:
                how = f"only runs on some ranks (see line {why.line})"
            where = f"is in `{scope_label(why.via)}`, which {how}"
        message = (
            f"{name} {where}{_paths(why.divergence)}; every rank must make the same "
            "collective calls or the job hangs: move it out of the rank check and keep only "
            "the rank-0 work (printing, saving) inside"
        )
        if why.proven:
            yield call, message
        else:
            yield (
                call,
                message + " (a warning: nothing shows that the test depends on the rank "
                "beyond its name)",
                Severity.WARNING,
            )


RULE = Rule(
    "DDP106",
    Severity.ERROR,
    "collective called only under a rank condition (hangs)",
    check,
)
