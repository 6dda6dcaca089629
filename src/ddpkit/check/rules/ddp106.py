"""DDP106: a collective that only some ranks reach, so the others wait forever.

Error level needs a proof: a pair of ranks whose paths make different collective
calls, told apart by a value that is a rank by data flow (see `ranks.py` and
`paths.py`). A rank test known only by its name (`if is_master:` with no source in
sight) gives a warning.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from typing import Any

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.callgraph import MPI_COLLECTIVES, collective
from ddpkit.check.index import Ref, Scope, Site
from ddpkit.check.names import tail
from ddpkit.check.paths import Atoms, Divergence, conjunction, settings, value_of
from ddpkit.check.ranks import RANK_ZERO_DECORATORS
from ddpkit.check.rules.base import (
    Hit,
    Rule,
    argument,
    assignments_to,
    describe_guard,
    scope_label,
    show,
)
from ddpkit.check.sharding import Sharding
from ddpkit.collectives import COLLECTIVES
from ddpkit.findings import Severity

# torch.distributed.checkpoint save/load coordinate all ranks as well.
_DCP = (
    "torch.distributed.checkpoint",
    frozenset({"save", "load", "save_state_dict", "load_state_dict"}),
)


_COLLECTIVE_NAMES = COLLECTIVES | MPI_COLLECTIVES
# What a torchmetrics metric's `compute()` makes across the group.
_METRIC_SYNC = "all_gather"


def _on_subgroup(call: ast.Call) -> bool:
    """`group=g` (`process_group=g` for DCP): only the members call it, which may well be
    rank-dependent on purpose; without the group's members in sight, nothing is said."""
    group = argument(call, None, "group") or argument(call, None, "process_group")
    if group is None or (isinstance(group, ast.Constant) and group.value is None):
        return False
    return not (isinstance(group, ast.Attribute) and group.attr == "WORLD")


def _group_members(fa: FileAnalysis, group: ast.expr, site: Site) -> frozenset[int] | None:
    """The ranks of `g = dist.new_group([0, 1])` (or `ranks=[...]`), where they are in
    sight as literal numbers; None otherwise."""
    if not isinstance(group, ast.Name):
        return None
    for a in assignments_to(fa, group.id, site.scope):
        value = a.value
        if isinstance(value, ast.Call) and tail(value.func) == "new_group":
            ranks = argument(value, 0, "ranks")
            numbers = _numbers(ranks) if ranks is not None else None
            if numbers is not None:
                return numbers
    return None


def _numbers(expr: ast.expr) -> frozenset[int] | None:
    if isinstance(expr, (ast.List, ast.Tuple, ast.Set)) and all(
        isinstance(e, ast.Constant) and type(e.value) is int for e in expr.elts
    ):
        return frozenset(e.value for e in expr.elts)  # type: ignore[attr-defined]
    return None


_COMPARE: dict[type[ast.cmpop], Callable[[int, Any], bool]] = {
    ast.Eq: lambda r, c: r == c,
    ast.NotEq: lambda r, c: r != c,
    ast.Lt: lambda r, c: r < c,
    ast.LtE: lambda r, c: r <= c,
    ast.Gt: lambda r, c: r > c,
    ast.GtE: lambda r, c: r >= c,
    ast.In: lambda r, c: r in c,
    ast.NotIn: lambda r, c: r not in c,
}


def _on_rank(fa: FileAnalysis, atom: ast.expr, scope: Scope, rank: int) -> bool | None:
    """The value of a rank test such as `rank == 0` or `rank in (0, 1)` on `rank`."""
    if not (isinstance(atom, ast.Compare) and len(atom.ops) == 1):
        return None
    if not fa.ranks.is_rank_value(atom.left, scope):
        return None
    right = atom.comparators[0]
    constant: Any = _numbers(right)
    if constant is None and isinstance(right, ast.Constant) and type(right.value) is int:
        constant = right.value
    compare = _COMPARE.get(type(atom.ops[0]))
    if constant is None or compare is None:
        return None
    return compare(rank, constant)


def _subgroup_split(fa: FileAnalysis, site: Site) -> str | None:
    """`dist.all_reduce(t, group=g)` with `g = new_group([0, 1])` under `if rank == 0:`:
    a member of the group that does not call it (rank 1), so the others hang. Judged only
    where the members and the rank tests are plain numbers in sight."""
    group = argument(site.call, None, "group")
    members = _group_members(fa, group, site) if group is not None else None
    if members is None or not site.guards:
        return None
    atoms = Atoms()
    formula = conjunction(atoms, site.guards)
    shared = [k for k, n in atoms.nodes.items() if not fa.ranks.is_rank_condition(n, site.scope)]
    for setting in settings(shared):
        passing = set()
        for rank in sorted(members):
            env = dict(setting)
            for key, node in atoms.nodes.items():
                if key not in env:
                    value = _on_rank(fa, node, site.scope, rank)
                    if value is None:
                        return None
                    env[key] = value
            if value_of(formula, env):
                passing.add(rank)
        left_out = sorted(members - passing)
        if passing and left_out:
            return (
                f"its group's members are {sorted(members)}, but rank {left_out[0]} never "
                f"gets past {show(site.guards[-1].test)}"
            )
    return None


def _events(fa: FileAnalysis, site: Site, member: str) -> list[tuple[Site, int]]:
    """The places in the site's function that make collective `member`, with how many
    times each makes it: its own calls (once), and calls of the program's functions
    that make it (`receive_task()` with its two broadcasts pairs up with two direct
    ones in the other branch)."""
    found: list[tuple[Site, int]] = [
        (other, 1)
        for other, other_member in _collectives(fa)
        if other.scope is site.scope and other_member == member
    ]
    for ref in fa.index.refs:
        if ref.scope is site.scope and ref.call_expr is not None and member in _made_by(fa, ref):
            found.append((ref, max(_times(fa, fn, member) for fn in fa.callees(ref))))
    return found


def _times(fa: FileAnalysis, fn: Scope, member: str) -> int:
    """How many times a call of `fn` makes `member`: the number of its own calls of it
    when each runs once (no test, no loop around it) and it makes none through other
    functions; otherwise 1, as an unknown count was taken before."""
    home = fa.home_of(fn)
    if home is None:
        return 1
    own = [s for s, m in _collectives(home) if s.scope is fn and m == member]
    through = any(
        ref.scope is fn and ref.call_expr is not None and member in _made_by(home, ref)
        for ref in home.index.refs
    )
    if not own or through or any(s.guards or s.loop_depth for s in own):
        return 1
    return len(own)


def _made_by(fa: FileAnalysis, ref: Ref) -> frozenset[str]:
    """The collectives that the functions a call surely stands for make."""
    made: frozenset[str] = frozenset()
    for fn in fa.callees(ref):
        made |= fa.callgraph.collectives_of(fn)
    return made


def _counts(fa: FileAnalysis, events: list[tuple[Site, int]], env: dict[str, bool]) -> int | None:
    """How many collective calls `events` make on a rank with tests `env`; None when one
    cannot tell."""
    total = 0
    for event, times in events:
        holds = fa.paths.holds(event.guards, env)
        if holds is None:
            return None
        total += times * holds
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
    # the user is pairing them up on purpose; trust it. (One that the skipping rank never
    # runs, under the same `rank == 0`, pairs with nothing.)
    return any(
        event is not site
        and fa.paths.divergence(event.guards, event.scope) is not None
        and fa.paths.holds(event.guards, found.skip) is not False
        for event, _ in events
    )


def _is_synced_metric(fa: FileAnalysis, expr: ast.expr, scope: Scope) -> bool:
    """`acc` after `acc = Accuracy(...)` from torchmetrics (perhaps `.to(device)`, then
    perhaps `acc = acc.to(rank)`), built without `sync_on_compute=False`: its `compute()`
    gathers every rank's state once the process group is up."""
    if not isinstance(expr, ast.Name):
        return False
    made = False
    for a in assignments_to(fa, expr.id, scope):
        value = a.value
        # `Accuracy(...).to(device)`: the metric the chain starts from.
        while (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and isinstance(value.func.value, ast.Call)
        ):
            value = value.func.value
        if not isinstance(value, ast.Call):
            return False
        if (fa.imports.resolve(value.func) or "").startswith("torchmetrics."):
            sync = argument(value, None, "sync_on_compute")
            made = not (isinstance(sync, ast.Constant) and sync.value is False)
        elif not (isinstance(value.func, ast.Attribute) and tail(value.func.value) == expr.id):
            return False  # bound to something else too
    return made


def _collectives(fa: FileAnalysis) -> list[tuple[Site, str]]:
    """The calls of this file that make a collective, with its name."""
    found = [
        (site, member)
        for name in _COLLECTIVE_NAMES
        for site in fa.calls(name)
        if (member := collective(fa.imports, site.call)) is not None
    ]
    found += [
        (site, _METRIC_SYNC)
        for site in fa.calls("compute")
        if isinstance(func := site.call.func, ast.Attribute)
        and _is_synced_metric(fa, func.value, site.scope)
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
            split = _subgroup_split(fa, site)
            if split is not None:
                yield call, f"`{show(call.func)}()` on a sub-group: {split}; {_FIX}"
            continue
        why = fa.rank_only(site)
        if why is None:
            continue
        name = f"`{show(call.func)}()`"
        if tail(call.func) == "compute":
            name += " (a torchmetrics metric: it all-gathers its state from every rank)"
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
    (`if rank == 0: save_checkpoint()` with a barrier inside), or that runs a sharded
    model (see `sharding.py`): reported at the call, where the fix goes."""
    sharding = Sharding(fa)
    for ref in fa.index.refs:
        if ref.call_expr is None or _on_subgroup(ref.call_expr):
            continue
        found = fa.paths.divergence(ref.guards, ref.scope)
        if found is None:
            continue
        made = _made_by(fa, ref)
        unbalanced = sorted(m for m in made if not _balanced(fa, ref, m, found))
        if not unbalanced:
            model = sharding.runs(ref)
            if model is not None:
                message = (
                    f"`{show(ref.call_expr.func)}()` runs the sharded model `{model}`, whose "
                    "forward gathers its parameters from every rank, but only on the ranks "
                    f"that pass {describe_guard(found.guard)}{_paths(found)}; {_FIX}"
                )
                yield _hit(ref.call_expr, message, fa.is_proven(found, ref.scope))
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
