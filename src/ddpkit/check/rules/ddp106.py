"""DDP106: a collective that only some ranks reach, so the others wait forever."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpkit.check.analysis import DISTRIBUTED, FileAnalysis, RankOnly
from ddpkit.check.index import Site
from ddpkit.check.model import Severity
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


def _balanced(fa: FileAnalysis, site: Site, member: str, why: RankOnly) -> bool:
    """`if is_main: barrier() ... else: barrier()`: each rank does reach one call.

    Another call of the same collective in the same function, under a different rank
    condition, means the user is pairing them up on purpose; trust it.
    """
    if why.guard is None or why.via is not None:
        return False
    for other, other_member in fa.resolved_calls(DISTRIBUTED, frozenset({member})):
        if other is site or other.scope is not site.scope or other_member != member:
            continue
        other_guard = fa.ranks.rank_guard(other.guards, other.scope)
        if other_guard is not None and why.guard not in other.guards:
            return True
    return False


def _collectives(fa: FileAnalysis) -> Iterator[tuple[Site, str]]:
    yield from fa.resolved_calls(DISTRIBUTED, COLLECTIVES)
    yield from fa.resolved_calls(*_DCP)


def check(fa: FileAnalysis) -> Iterator[Hit]:
    for site, member in _collectives(fa):
        call = site.call
        if _on_subgroup(call):
            continue
        why = fa.rank_only(site)
        if why is None or _balanced(fa, site, member, why):
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
        yield (
            call,
            f"{name} {where}; every rank must make the same collective calls or the job "
            "hangs: move it out of the rank check and keep only the rank-0 work (printing, "
            "saving) inside",
        )


RULE = Rule(
    "DDP106",
    Severity.ERROR,
    "collective called only under a rank condition (hangs)",
    check,
)
