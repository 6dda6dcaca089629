"""DDP113: some ranks leave a loop early on a value of their own, while the others stay
in it and make a collective (an all-reduce, DDP's backward): those wait forever.

`if approx_kl > target_kl: break` where the KL comes from this rank's minibatch,
`if rank == 0 and bad_epochs > patience: break`, rank 0 alone moving the counter of
a `while` loop. The value is per-rank when it is a rank test (see `ranks.py`) or is
computed from this rank's data: the items of a loop over a loader, what the trained
model returns, what a function of this file returns from those. A value that went
through a collective (`dist.all_reduce(flag)`, `flag = reduce_mean(...)`) is agreed
on by every rank and safe.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.callgraph import collective
from ddpkit.check.index import Scope
from ddpkit.check.names import dotted, tail
from ddpkit.check.rules.base import Hit, Rule, show
from ddpkit.collectives import COLLECTIVES
from ddpkit.findings import Severity

# Calls that return a value agreed on by every rank (ddpkit's, Accelerate's, torch's).
_AGREEING = frozenset(
    {
        *("reduce_mean", "reduce_sum", "gather_for_metrics", "reduce", "gather"),
        *("all_reduce", "all_gather", "broadcast", "broadcast_object_list", "all_gather_object"),
    }
)
# Reading these of per-rank data gives the same on every rank (DistributedSampler
# gives each rank as many samples, in batches of one size).
_SHAPE_READS = frozenset({"shape", "ndim", "dtype", "device", "size", "numel", "dim", "len"})
# Methods of a model that return no output of its forward.
_MODEL_ADMIN = frozenset(
    {
        *("parameters", "named_parameters", "state_dict", "load_state_dict", "train", "eval"),
        *("to", "cuda", "cpu", "zero_grad", "modules", "children", "buffers", "requires_grad_"),
    }
)
# Methods of a model named for what they set up, not for computing outputs from inputs.
_NOT_FORWARD = ("configure", "create", "build", "init", "load", "save", "register", "set")
_FIX = (
    "agree on the decision first: put it in a tensor and `dist.all_reduce(flag, "
    "op=dist.ReduceOp.MAX)` (or `dist.broadcast(flag, src=0)`) on every rank, then test "
    "the agreed flag"
)


@dataclass
class _ScopeFacts:
    """What one walk of a function's own code (not its nested functions) shows."""

    # (bound names, value, True for a `for` target) in source order.
    bindings: list[tuple[list[str], ast.expr, bool]] = field(default_factory=list)
    loops: list[ast.For | ast.While] = field(default_factory=list)


def _names(target: ast.expr) -> list[str]:
    """The names in `target`, in the order of `ast.walk`."""
    # The common targets without a walk: `x`, `self.x.y`, `a, b`.
    while isinstance(target, ast.Attribute):
        target = target.value
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
        return [e.id for e in target.elts if isinstance(e, ast.Name)]
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


_LOOPS_AND_BINDINGS = frozenset(
    {ast.For, ast.AsyncFor, ast.While, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr}
)


def _walk_scope(body: list[ast.stmt], facts: _ScopeFacts) -> None:
    for stmt in body:
        for node in _own_nodes(stmt):
            if type(node) not in _LOOPS_AND_BINDINGS:  # most nodes: calls, attributes
                continue
            if isinstance(node, (ast.For, ast.AsyncFor)):
                facts.bindings.append((_names(node.target), node.iter, True))
                if isinstance(node, ast.For):
                    facts.loops.append(node)
            elif isinstance(node, ast.While):
                facts.loops.append(node)
            elif isinstance(node, ast.Assign):
                names = [n for t in node.targets for n in _names(t)]
                facts.bindings.append((names, node.value, False))
            elif (
                isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr))
                and node.value is not None
            ):
                facts.bindings.append((_names(node.target), node.value, False))


# Left out of the walk: nested functions and classes (their own scopes), and the nodes
# with nothing below them that the rule looks at (it wants loops, bindings and calls).
_SKIPPED = frozenset(
    {
        *(ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Name, ast.Constant),
        *(
            cls
            for base in (ast.expr_context, ast.operator, ast.cmpop, ast.unaryop, ast.boolop)
            for cls in base.__subclasses__()
        ),
    }
)


def _own_nodes(node: ast.AST) -> list[ast.AST]:
    """The loops, bindings and calls in `node` (itself included), not those of nested
    functions and classes, in the order of a depth-first walk that takes the last child
    first. A hand-written walk: this runs over every node of every file."""
    if type(node) in _SKIPPED:
        return []
    found: list[ast.AST] = []
    stack = [node]
    while stack:
        current = stack.pop()
        found.append(current)
        for name in current._fields:
            value = getattr(current, name, None)
            if type(value) is list:
                for item in value:
                    if isinstance(item, ast.AST) and type(item) not in _SKIPPED:
                        stack.append(item)
            elif isinstance(value, ast.AST) and type(value) not in _SKIPPED:
                stack.append(value)
    return found


def _reads(expr: ast.expr, names: set[str]) -> bool:
    """`expr` computes from one of `names`: not only its shape (`x.shape`, `len(x)`), nor
    only holds it in a dict or list (`{"epoch": epoch, "best": best_loss}`, a checkpoint
    whose other entries are the same on every rank)."""
    if not names:
        return False
    stack: list[ast.AST] = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Dict, ast.List, ast.Set, ast.Tuple)):
            continue
        if isinstance(node, ast.Attribute) and node.attr in _SHAPE_READS:
            continue
        if isinstance(node, ast.Call) and tail(node.func) in _SHAPE_READS:
            continue
        if isinstance(node, ast.Name):
            if node.id in names:
                return True
            continue  # nothing below a name
        stack.extend(ast.iter_child_nodes(node))
    return False


class _Agreement:
    """Functions of the program whose result every rank shares, known by name like
    `_AGREEING`: those that return what a collective gave (`dist.all_reduce(x); return
    x.item()`), wholly or, for a returned tuple (`return loss, gn, overflow` with
    `overflow` all-reduced), at some of its places. Worked out when a name is asked for."""

    def __init__(self, fa: FileAnalysis) -> None:
        self._fa = fa
        self._whole: dict[str, bool] = dict.fromkeys((*_AGREEING, *COLLECTIVES), True)
        self._places: dict[str, tuple[int, frozenset[int]]] = {}

    def whole(self, name: str | None) -> bool:
        if name is None:
            return False
        if name not in self._whole:
            self._whole[name] = False  # a recursive helper agrees on nothing
            self._whole[name] = self._work_out(name)
        return self._whole[name]

    def places(self, name: str | None) -> tuple[int, frozenset[int]]:
        """The length of the tuple `name` returns and its places every rank shares."""
        self.whole(name)
        return self._places.get(name or "", (0, frozenset()))

    def _work_out(self, name: str) -> bool:
        functions = [
            fn
            for peer in self._fa.peers or [self._fa]
            for fn in peer.index.functions
            if fn.name == name and fn.returns
        ]
        if len(functions) != 1:
            return False  # unknown, or several functions of that name
        fn = functions[0]
        agreed = self._agreed_in(fn)
        if agreed is None:
            return False
        if all(self._agreed_expr(r, agreed) for r in fn.returns):
            return True
        tuples = [r.elts for r in fn.returns if isinstance(r, ast.Tuple)]
        if len(tuples) == len(fn.returns) and len({len(t) for t in tuples}) == 1:
            shared = frozenset(
                i
                for i in range(len(tuples[0]))
                if all(self._agreed_expr(t[i], agreed) for t in tuples)
            )
            self._places[name] = (len(tuples[0]), shared)
        return False

    def _agreed_in(self, fn: Scope) -> set[str] | None:
        """The names of `fn` that hold a value every rank shares (handed to a collective,
        or bound to an agreed value); None when `fn` makes no collective."""
        assert isinstance(fn.node, (ast.FunctionDef, ast.AsyncFunctionDef))
        own = [node for stmt in fn.node.body for node in _own_nodes(stmt)]
        calls = [node for node in own if isinstance(node, ast.Call)]
        if not any(tail(c.func) in COLLECTIVES or self.whole(tail(c.func)) for c in calls):
            return None
        found: set[str] = set()
        for _ in range(2):  # `x = ...; dist.all_reduce(x); total = x * 2`
            for node in own:
                if isinstance(node, ast.Call) and tail(node.func) in COLLECTIVES:
                    found.update(n for arg in node.args for n in _names(arg))
                elif isinstance(node, ast.Assign) and self._agreed_expr(node.value, found):
                    found.update(n for t in node.targets for n in _names(t))
        return found

    def _agreed_expr(self, expr: ast.expr, names: set[str]) -> bool:
        """`expr` holds the same on every rank: built from constants, `names` and the
        results of agreeing functions (`allreduce(int(overflow), op=MAX) > 0`, `x.item()`
        of an all-reduced x)."""
        if isinstance(expr, ast.Constant):
            return True
        if isinstance(expr, ast.Name):
            return expr.id in names
        if isinstance(expr, ast.Call):
            if self.whole(tail(expr.func)):
                return True
            parts = [*expr.args, *(k.value for k in expr.keywords)]
            if isinstance(expr.func, ast.Attribute):
                parts.append(expr.func.value)
            return all(self._agreed_expr(part, names) for part in parts)
        if isinstance(expr, (ast.Compare, ast.BinOp, ast.BoolOp, ast.UnaryOp, ast.Attribute)):
            children = [c for c in ast.iter_child_nodes(expr) if isinstance(c, ast.expr)]
            return all(self._agreed_expr(child, names) for child in children)
        return False


class _PerRank:
    """Which variables of each function hold this rank's own values (see the module doc)."""

    def __init__(self, fa: FileAnalysis) -> None:
        self._fa = fa
        self._facts: dict[Scope, _ScopeFacts] = {}
        self._models = self._trained_models()
        self._functions = {fn.name: fn for fn in fa.index.functions if not fn.is_method}
        self._memo: dict[Scope, set[str]] = {}
        self._agreement = _Agreement(fa)

    def _trained_models(self) -> set[str]:
        """`model` and `self.net`: what the optimizer steps (`X.parameters()`) or DDP wraps."""
        models = {
            name
            for site in self._fa.calls("parameters", "named_parameters")
            if isinstance(site.call.func, ast.Attribute)
            and (name := dotted(site.call.func.value)) is not None
        }
        for a in self._fa.index.assignments:
            if self._fa.is_ddp_wrap(a.value) and (name := dotted(a.target)) is not None:
                models.add(name)
        return models

    def _computes_per_rank(self, value: ast.expr, depth: int) -> bool:
        """`value` runs the trained model, or calls a function of this file that returns
        per-rank data."""
        calls = [node for node in ast.walk(value) if isinstance(node, ast.Call)]
        return self._runs_model(calls) or self._returns_per_rank(calls, depth)

    def _runs_model(self, calls: list[ast.Call]) -> bool:
        for node in calls:
            func = node.func
            if dotted(func) in self._models:
                return True
            if (
                isinstance(func, ast.Attribute)
                and node.args
                and func.attr not in _MODEL_ADMIN
                and not func.attr.startswith(_NOT_FORWARD)
                and dotted(func.value) in self._models
            ):
                return True
        return False

    def _returns_per_rank(self, calls: list[ast.Call], depth: int) -> bool:
        """`evaluate(model, val_loader)`, a function of this file returning per-rank data."""
        for node in calls:
            if isinstance(node.func, ast.Name):
                fn = self._functions.get(node.func.id)
                if fn is not None and depth < 3:
                    names = self.names(fn, depth + 1)
                    if any(_reads(r, names) for r in fn.returns):
                        return True
        return False

    def names(self, scope: Scope, depth: int = 0) -> set[str]:
        if scope in self._memo:
            return self._memo[scope]
        self._memo[scope] = set()  # a recursive function adds nothing
        facts = self.facts(scope)
        agreed = self.agreed(scope) | {
            name
            for names, value, _ in facts.bindings
            if isinstance(value, ast.Call) and self._agreement.whole(tail(value.func))
            for name in names
        }
        tainted: set[str] = set()
        for _ in range(4):  # values handed on through a few assignments, loops included
            before = len(tainted)
            for names, value, is_loop in facts.bindings:
                if is_loop:
                    per_rank = _iterates_data(self._fa, value, scope) or _reads(value, tainted)
                    if per_rank and _counts(value):
                        names = names[1:]  # `for i, batch in enumerate(loader)`: i is not
                elif isinstance(value, ast.Call) and self._agreement.whole(tail(value.func)):
                    continue
                else:
                    names = self._unshared(names, value)
                    per_rank = _reads(value, tainted) or self._computes_per_rank(value, depth)
                if per_rank:
                    tainted.update(n for n in names if n not in agreed)
            if len(tainted) == before:
                break
        self._memo[scope] = tainted
        return tainted

    def facts(self, scope: Scope) -> _ScopeFacts:
        """What the walk of the function's own code shows, walked when first asked for."""
        if scope not in self._facts:
            self._facts[scope] = facts = _ScopeFacts()
            if isinstance(scope.node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
                _walk_scope(scope.node.body, facts)
        return self._facts[scope]

    def _unshared(self, names: list[str], value: ast.expr) -> list[str]:
        """`loss, gn, overflow = backward(...)`: the names at the places of the helper's
        returned tuple that are not shared by every rank."""
        if not isinstance(value, ast.Call):
            return names
        length, shared = self._agreement.places(tail(value.func))
        if len(names) != length:
            return names
        return [name for i, name in enumerate(names) if i not in shared]

    def agreed(self, scope: Scope) -> set[str]:
        """Names handed to a collective in `scope`: every rank holds the same value after."""
        found: set[str] = set()
        for site in self._fa.index.calls:
            if site.scope is scope and collective(self._fa.imports, site.call) is not None:
                for arg in site.call.args:
                    found.update(_names(arg))
        return found


def _counts(iterable: ast.expr) -> bool:
    return isinstance(iterable, ast.Call) and tail(iterable.func) == "enumerate"


def _iterates_data(fa: FileAnalysis, iterable: ast.expr, scope: Scope) -> bool:
    """`for batch in train_loader` (through enumerate/tqdm): this rank's shard of data."""
    while isinstance(iterable, ast.Call) and tail(iterable.func) in ("enumerate", "tqdm", "iter"):
        if not iterable.args:
            return False
        iterable = iterable.args[0]
    name = tail(iterable) if isinstance(iterable, (ast.Name, ast.Attribute)) else None
    if name is None:
        return False
    if "loader" in name.lower():
        return True
    return isinstance(iterable, ast.Name) and any(
        isinstance(a.target, ast.Name)
        and a.target.id == iterable.id
        and a.scope is scope
        and isinstance(a.value, ast.Call)
        and tail(a.value.func) in ("DataLoader", "prepare_loader")
        for a in fa.index.assignments
    )


def _data_ran_out(caught: ast.expr) -> bool:
    """`except StopIteration`, `except DataloaderExhaustedError`: this rank's own iterator
    ended, which need not happen on the same step on every rank (shards of a stream)."""
    types = caught.elts if isinstance(caught, ast.Tuple) else [caught]
    return any(
        (name := tail(t)) is not None and (name == "StopIteration" or "Exhausted" in name)
        for t in types
    )


@dataclass(frozen=True)
class _Exit:
    node: ast.stmt  # the break, continue or return, or the assignment to the counter
    tests: tuple[ast.expr, ...]  # the conditions on the way to it, in the loop


def _exits(body: list[ast.stmt], tests: tuple[ast.expr, ...], inner: bool) -> Iterator[_Exit]:
    """The ways out of a loop's body: `break`/`continue` of this loop, `return`."""
    for stmt in body:
        if isinstance(stmt, ast.Return) or (
            isinstance(stmt, (ast.Break, ast.Continue)) and not inner
        ):
            yield _Exit(stmt, tests)
        elif isinstance(stmt, ast.If):
            yield from _exits(stmt.body, (*tests, stmt.test), inner)
            yield from _exits(stmt.orelse, (*tests, stmt.test), inner)
        elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            yield from _exits(stmt.body, tests, True)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from _exits(stmt.body, tests, inner)
        elif isinstance(stmt, ast.Try):
            yield from _exits([*stmt.body, *stmt.orelse, *stmt.finalbody], tests, inner)
            for handler in stmt.handlers:
                if handler.type is not None and _data_ran_out(handler.type):
                    # The `except` is the test: the rank's own iterator ended.
                    yield from _exits(handler.body, (*tests, handler.type), inner)


def _counter_moves(
    loop: ast.While, body: list[ast.stmt], tests: tuple[ast.expr, ...]
) -> Iterator[_Exit]:
    """Assignments, under a condition, to a variable that the `while` test reads."""
    counters = set(_names(loop.test))
    for stmt in body:
        if isinstance(stmt, (ast.Assign, ast.AugAssign)) and tests:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(n in counters for t in targets for n in _names(t)):
                yield _Exit(stmt, tests)
        elif isinstance(stmt, ast.If):
            yield from _counter_moves(loop, stmt.body, (*tests, stmt.test))
            yield from _counter_moves(loop, stmt.orelse, (*tests, stmt.test))


class _Syncs:
    """The calls in a loop that wait for every rank: collectives, DDP's backward, and
    functions that make them."""

    def __init__(self, fa: FileAnalysis) -> None:
        self._fa = fa
        programs = fa.peers or [fa]
        self._ddp = any(p.ddp_wraps or p.ddpkit_calls("prepare_model") for p in programs)
        # A program with no group, no DDP and no collective of its own has nothing to wait on.
        self.possible = self._ddp or any(
            p.joins_process_group or p.calls(*COLLECTIVES) for p in programs
        )

    def _is_sync(self, call: ast.Call, home: FileAnalysis | None = None) -> str | None:
        member = collective((home or self._fa).imports, call)
        if member is not None:
            return f"`{member}`"
        if self._ddp and tail(call.func) == "backward":
            return "DDP's gradient all-reduce in `backward()`"
        return None

    def _function_syncs(self, fn: Scope, depth: int = 0) -> str | None:
        """What `fn` waits for: a collective it surely makes, or else one it may make,
        itself or through the functions it calls, in any file of the program (torchtitan's
        `dist_sum_tensor` all-reduces when it is given a mesh)."""
        made = self._fa.callgraph.collectives_of(fn)
        if made:
            return f"`{sorted(made)[0]}`"
        home = self._fa.home_of(fn)
        if home is None:
            return None
        for site in home.index.calls:
            if site.scope is fn and (found := self._is_sync(site.call, home)) is not None:
                return found
        if depth >= 2:
            return None
        for ref in home.index.refs:
            if ref.scope is fn and ref.call_expr is not None:
                for callee in home.callees(ref):
                    if (found := self._function_syncs(callee, depth + 1)) is not None:
                        return found
        return None

    def first_after(self, loop: ast.stmt, scope: Scope, line: int) -> tuple[int, str] | None:
        """The first sync in `loop` at or after `line` (a call of a function that syncs
        counts where it is called)."""
        end = getattr(loop, "end_lineno", loop.lineno)
        found: list[tuple[int, str]] = []
        for site in self._fa.index.calls:
            if site.scope is scope and line <= site.line <= end:
                what = self._is_sync(site.call)
                if what is not None:
                    found.append((site.line, what))
        for ref in self._fa.index.refs:
            if ref.scope is scope and ref.call_expr is not None and line <= ref.line <= end:
                for fn in self._fa.callees(ref):
                    what = self._function_syncs(fn)
                    if what is not None:
                        found.append((ref.line, f"{what} (in `{ref.name}`)"))
        return min(found) if found else None


def _never_raised(fa: FileAnalysis, test: ast.expr) -> bool:
    """`test` is an attribute (`callbacks.stop_training`) that the program only ever sets
    to False or None, if at all."""
    if not isinstance(test, ast.Attribute):
        return False
    return all(
        isinstance(a.value, ast.Constant) and a.value.value in (False, None)
        for peer in fa.peers or [fa]
        for a in peer.index.assignments
        if isinstance(a.target, ast.Attribute) and a.target.attr == test.attr
    )


def _why_per_rank(
    fa: FileAnalysis, tests: tuple[ast.expr, ...], scope: Scope, per_rank: set[str]
) -> tuple[ast.expr, str, bool] | None:
    """The condition that differs between ranks, why, and whether that is proven."""
    for test in reversed(tests):
        if fa.proven.is_rank_condition(test, scope):
            if test is not tests[-1] and _never_raised(fa, tests[-1]):
                # `if rank == 0: ... if callbacks.stop_training: return`: the exit
                # needs a hook from elsewhere to set the flag.
                flag = show(tests[-1], 40)
                return test, f"a test of the rank, then `{flag}`, which nothing here sets", False
            return test, "a test of the rank", True
    for test in reversed(tests):
        read = sorted(n.id for n in ast.walk(test) if isinstance(n, ast.Name) and n.id in per_rank)
        if read and _reads(test, per_rank):
            return test, f"`{read[0]}` comes from this rank's own data", True
    for test in reversed(tests):
        if fa.ranks.is_rank_condition(test, scope):
            return test, "a test of the rank (by its name)", False
        if _data_ran_out(test):
            # Equal shards (a DistributedSampler's) end on the same step: not proven.
            return test, "this rank's own data ran out", False
    return None


def _leaving(loop: ast.AST) -> list[_Exit]:
    """The ways out of `loop` taken on a condition (for a `while`, also the conditional
    moves of its counter)."""
    assert isinstance(loop, (ast.For, ast.AsyncFor, ast.While))  # what the index files as loops
    leaving = list(_exits(loop.body, (), False))
    if isinstance(loop, ast.While):
        leaving += _counter_moves(loop, loop.body, ())
    return [exit_ for exit_ in leaving if exit_.tests]


def check(fa: FileAnalysis) -> Iterator[Hit]:
    syncs = _Syncs(fa)
    if not syncs.possible:
        return
    per_rank = _PerRank(fa)
    # Only the functions with a loop left on a condition are walked (the index saw
    # every loop).
    sites = (*fa.index.loops, *fa.index.while_loops)
    exits = {site.node: _leaving(site.node) for site in sites}
    walked = {site.scope for site in sites if exits[site.node]}
    for scope in (fa.index.module, *fa.index.functions):
        if scope not in walked:
            continue
        for loop in per_rank.facts(scope).loops:
            for exit_ in exits[loop] if loop in exits else _leaving(loop):
                why = _why_per_rank(fa, exit_.tests, scope, per_rank.names(scope))
                if why is None:
                    continue
                start = exit_.node.lineno if isinstance(exit_.node, ast.Continue) else loop.lineno
                sync = syncs.first_after(loop, scope, start)
                if sync is None:
                    continue
                yield _hit(exit_, why, sync)


def _hit(exit_: _Exit, why: tuple[ast.expr, str, bool], sync: tuple[int, str]) -> Hit:
    test, reason, proven = why
    node = exit_.node
    if isinstance(node, (ast.Break, ast.Continue, ast.Return)):
        what = f"`{show(node)}` leaves the loop"
        if isinstance(node, ast.Continue):
            what = "`continue` skips the rest of the loop"
    else:
        what = f"`{show(node, 40)}` moves the loop's counter"
    message = (
        f"{what} on the ranks where `{show(test, 50)}` (line {test.lineno}) holds "
        f"({reason}), while the other ranks go on to {sync[1]} (line {sync[0]}) and wait "
        f"for them forever; {_FIX}"
    )
    # Shown at the `if` that decides to leave, where the fix goes.
    where = exit_.tests[-1] if isinstance(node, (ast.Break, ast.Continue, ast.Return)) else node
    return (where, message) if proven else (where, message, Severity.WARNING)


RULE = Rule(
    "DDP113",
    Severity.ERROR,
    "a loop left early on a per-rank value before a collective the other ranks still make",
    check,
)
