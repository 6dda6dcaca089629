"""Which ranks reach a piece of code: its guards as one condition, and two ranks it parts.

A rank test in a guard does not by itself mean that only some ranks get through.
In

    if not args.eval and not is_main:
        return
    if args.eval:
        dist.all_reduce(t)

every rank that reaches the `all_reduce` has `args.eval` set, so all of them do:
the early exit only keeps ranks out when `args.eval` is unset, and then nobody
reaches the call either. So the guards of a place are read as one boolean formula
over tests ("atoms"). A test of the rank is an atom that may differ between two
ranks; any other test is an atom that is the same on all of them (one flag, one
config). Code diverges when, for some setting of the shared atoms, one choice of
the rank atoms reaches it and another does not. `Divergence` is that concrete
pair, so a message can name both paths.

Rank atoms are taken as independent of one another (`rank == 0` and `is_main` may
both be true on one rank and both false on another), which errs towards finding a
divergence; shared atoms are matched by their source text, so the same test written
twice is the same atom.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ddpkit.check.index import AFTER, BODY, OPERAND, ORELSE, Guard, Scope, exits

# Beyond this many atoms the enumeration is skipped and any rank test counts as
# divergence, as a plain "is there a rank condition" check would say.
_MAX_ATOMS = 10

# A formula: True/False, ("atom", key), ("not", f), ("and", fs) or ("or", fs).
Formula = bool | tuple[str, Any]


@dataclass(frozen=True)
class Divergence:
    """Two ranks that the guards tell apart: one reaches the code, the other does not."""

    guard: Guard  # the guard whose rank test decides it (for messages)
    atom: ast.expr  # that rank test
    reach: dict[str, bool]  # atom key -> value on the rank that gets through
    skip: dict[str, bool]  # the same, on the rank that does not


def _key(expr: ast.expr) -> str:
    return ast.dump(expr)


class Atoms:
    """The tests met while building formulas, by key."""

    def __init__(self) -> None:
        self.nodes: dict[str, ast.expr] = {}
        self.guards: dict[str, Guard] = {}

    def atom(self, expr: ast.expr, guard: Guard) -> Formula:
        key = _key(expr)
        self.nodes.setdefault(key, expr)
        self.guards.setdefault(key, guard)
        return ("atom", key)

    def test(self, expr: ast.expr, guard: Guard) -> Formula:
        """The formula of a condition, through `and`, `or`, `not` and `!=`."""
        if isinstance(expr, ast.BoolOp):
            parts = [self.test(v, guard) for v in expr.values]
            return ("and" if isinstance(expr.op, ast.And) else "or", parts)
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
            return ("not", self.test(expr.operand, guard))
        if isinstance(expr, ast.Compare) and len(expr.ops) == 1:
            op = expr.ops[0]
            # `a != b` is `not (a == b)`, so both spellings meet as one atom.
            flipped = {ast.NotEq: ast.Eq(), ast.IsNot: ast.Is(), ast.NotIn: ast.In()}.get(type(op))
            if flipped is not None:
                same = ast.Compare(expr.left, [flipped], expr.comparators)
                ast.copy_location(same, expr)
                return ("not", self.atom(same, guard))
        return self.atom(expr, guard)

    def guard(self, guard: Guard) -> Formula:
        """The condition under which code behind `guard` runs."""
        test = self.test(guard.test, guard)
        owner = guard.owner
        if guard.branch == ORELSE:
            return ("not", test)
        if guard.branch == OPERAND:
            and_op = isinstance(owner, ast.BoolOp) and isinstance(owner.op, ast.And)
            return test if and_op else ("not", test)
        if guard.branch == AFTER:
            # `if test: return` lets the rest run when the test is false; an exit in
            # the else part only, when it is true.
            body_exits = isinstance(owner, ast.If) and exits(owner.body)
            return ("not", test) if body_exits else test
        assert guard.branch == BODY
        return test


def fails(body: list[ast.stmt]) -> bool:
    """True when a block always ends in an error: `raise`, or `sys.exit(1)` (an exit with
    a code other than 0 or None; `sys.exit()` is a normal way out)."""
    last = body[-1]
    if isinstance(last, ast.Raise):
        return True
    if not (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)):
        return False
    call = last.value
    if not exits([last]) or not call.args:
        return False
    code = call.args[0]
    return not (isinstance(code, ast.Constant) and code.value in (0, None))


def on_error_path(guards: tuple[Guard, ...]) -> bool:
    """Code behind `guards` sits in an `if` branch that ends in an error (`if not ok:
    cleanup(); raise ...`): it runs only when something went wrong."""
    for guard in guards:
        owner = guard.owner
        if isinstance(owner, ast.If) and (
            (guard.branch == BODY and fails(owner.body))
            or (guard.branch == ORELSE and fails(owner.orelse))
        ):
            return True
    return False


def value_of(formula: Formula, env: dict[str, bool]) -> bool:
    if isinstance(formula, bool):
        return formula
    kind, arg = formula
    if kind == "atom":
        return env[arg]
    if kind == "not":
        return not value_of(arg, env)
    if kind == "and":
        return all(value_of(f, env) for f in arg)
    return any(value_of(f, env) for f in arg)


def settings(keys: list[str]) -> Iterator[dict[str, bool]]:
    for values in itertools.product((False, True), repeat=len(keys)):
        yield dict(zip(keys, values, strict=True))


def conjunction(atoms: Atoms, guards: tuple[Guard, ...]) -> Formula:
    return ("and", [atoms.guard(g) for g in guards])


def diverges(
    formula: Formula, atoms: Atoms, is_rank: Callable[[ast.expr], bool]
) -> Divergence | None:
    """A pair of ranks that `formula` tells apart, or None when every rank agrees."""
    rank_keys = [k for k, node in atoms.nodes.items() if is_rank(node)]
    if not rank_keys:
        return None
    shared_keys = [k for k in atoms.nodes if k not in rank_keys]
    if len(atoms.nodes) > _MAX_ATOMS:
        key = rank_keys[-1]
        guard = atoms.guards[key]
        return Divergence(guard, atoms.nodes[key], {}, {})
    for shared in settings(shared_keys):
        for ranked in settings(rank_keys):
            env = {**shared, **ranked}
            if not value_of(formula, env):
                continue
            # This rank gets through; flip one rank test to find one that does not.
            for key in reversed(rank_keys):
                other = {**env, key: not env[key]}
                if not value_of(formula, other):
                    return Divergence(atoms.guards[key], atoms.nodes[key], env, other)
            for other_ranked in settings(rank_keys):
                other = {**shared, **other_ranked}
                if not value_of(formula, other):
                    key = next(k for k in rank_keys if other[k] != env[k])
                    return Divergence(atoms.guards[key], atoms.nodes[key], env, other)
    return None


class PathModel:
    """Divergence of the guards of code in one file, memoised per guard tuple."""

    def __init__(self, is_rank_condition: Callable[[ast.expr, Scope], bool]) -> None:
        self._is_rank = is_rank_condition
        self._memo: dict[tuple[int, int], tuple[tuple[Guard, ...], Divergence | None]] = {}

    def divergence(self, guards: tuple[Guard, ...], scope: Scope) -> Divergence | None:
        """Two ranks of which one passes `guards` and the other does not, or None."""
        if not guards or not any(self._is_rank(g.test, scope) for g in guards):
            return None
        key = (id(guards), id(scope))
        memo = self._memo.get(key)
        if memo is not None and memo[0] is guards:
            return memo[1]
        atoms = Atoms()
        formula = conjunction(atoms, guards)
        found = diverges(formula, atoms, lambda node: self._is_rank(node, scope))
        self._memo[key] = (guards, found)
        return found

    def any_diverges(self, paths: list[tuple[Guard, ...]], scope: Scope) -> bool:
        """True when some ranks take none of `paths` while others take one (a call made
        in both branches of `if rank == 0: ... else: ...` reaches every rank)."""
        atoms = Atoms()
        formula = ("or", [conjunction(atoms, guards) for guards in paths])
        return diverges(formula, atoms, lambda node: self._is_rank(node, scope)) is not None

    def everyone_passes(
        self, guards: tuple[Guard, ...], scope: Scope
    ) -> list[tuple[ast.expr, bool]] | None:
        """Guards that test the rank yet let every rank through for some setting of the
        other tests (`if not args.flag or rank == 0:` with the flag unset): that setting,
        as (test, value) pairs; None when the rank test always keeps some ranks out."""
        atoms = Atoms()
        formula = conjunction(atoms, guards)
        rank_keys = [k for k, node in atoms.nodes.items() if self._is_rank(node, scope)]
        shared_keys = [k for k in atoms.nodes if k not in rank_keys]
        if not rank_keys or not shared_keys or len(atoms.nodes) > _MAX_ATOMS:
            return None
        for shared in settings(shared_keys):
            if all(value_of(formula, {**shared, **r}) for r in settings(rank_keys)):
                return [(atoms.nodes[k], v) for k, v in shared.items()]
        return None

    def holds(self, guards: tuple[Guard, ...], env: dict[str, bool]) -> bool | None:
        """Whether code behind `guards` runs on a rank whose tests take the values `env`;
        None when that depends on a test not in `env` (`if step % 10 == 0 and rank == 0:`
        never runs where `rank == 0` is false, whatever the step)."""
        atoms = Atoms()
        formula = conjunction(atoms, guards)
        unknown = [k for k in atoms.nodes if k not in env]
        if len(unknown) > _MAX_ATOMS:
            return None
        values = {value_of(formula, {**env, **rest}) for rest in settings(unknown)}
        return values.pop() if len(values) == 1 else None
