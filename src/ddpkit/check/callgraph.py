"""Where a function runs: on every rank, only behind a rank check, or unknown.

The DDP tutorial's `Trainer._save_checkpoint` holds a bare `torch.save`, yet it is fine:
its one caller calls it under `if self.gpu_id == 0`. A collective in the same
method would hang. So each function gets a context from the places that mention it,
in its own file and in the other checked files that import it:

- ALL: some chain of unguarded calls reaches it from module level (or from
  `mp.spawn(main, ...)`, which runs `main` on every rank).
- GUARDED: every path to it passes a rank test: each mention is behind a rank
  condition or inside a function already known to be GUARDED (or it is decorated
  `@rank_zero_only`). A function that only calls itself is not GUARDED.
- UNKNOWN: neither. Rules stay silent about UNKNOWN code.

Calls are matched to what they call: `f()` to the function f of this file or the
one it imports, `mod.f()` to f in the imported module, `self.m()` to the method of
the enclosing class, `x.m()` to x's class when `x = SomeClass(...)` is in sight (or
`x = make(...)` with a factory `make` of the program that returns one class).
Otherwise `x.m()` matches every method named m by name alone; such a guess never
makes a function ALL nor GUARDED, it only keeps it from being GUARDED.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

from ddpkit.check.index import BODY, ORELSE, ClassInfo, Guard, Index, Ref, Scope, Site
from ddpkit.check.linking import Link
from ddpkit.check.names import Imports, dotted
from ddpkit.check.paths import Divergence, PathModel
from ddpkit.check.ranks import RANK_ZERO_DECORATORS, RankModel
from ddpkit.collectives import COLLECTIVES


class Context(Enum):
    ALL = "all"
    GUARDED = "guarded"
    UNKNOWN = "unknown"


@dataclass(eq=False)
class Unit:
    """One checked file as the call graph sees it."""

    index: Index
    ranks: RankModel
    paths: PathModel
    proven: RankModel  # ranks by data flow only
    links: dict[str, Link] = field(default_factory=dict)
    script: bool = False  # it has an `if __name__ == "__main__":` block


@dataclass(frozen=True, slots=True)
class Edge:
    """A mention of a function: where it sits, under which rank guard."""

    ref: Ref
    owner: Scope | None  # the function the mention sits in (None at module level)
    guard: Guard | None  # the rank guard that keeps some ranks from the mention
    exact: bool  # False when matched by the method name alone
    divergence: Divergence | None = None  # the two ranks that guard tells apart
    proven: bool = False  # its rank test is a rank by data flow
    rank_zero_first: bool = False  # in a `with torch_distributed_zero_first(rank):` block


_Class = tuple[Unit, ClassInfo]
DISTRIBUTED = "torch.distributed"
# mpi4py's collectives, which some codebases (guided-diffusion and its descendants) use
# beside torch's: `MPI.COMM_WORLD.bcast(x)` waits for every rank just the same.
_MPI_WORLD = "mpi4py.MPI.COMM_WORLD"
MPI_COLLECTIVES = frozenset(
    {
        *("bcast", "Bcast", "allreduce", "Allreduce", "reduce", "Reduce"),
        *("gather", "Gather", "allgather", "Allgather", "scatter", "Scatter"),
        *("barrier", "Barrier", "alltoall", "Alltoall"),
    }
)


def _tests_parameters(paths: list[tuple[Guard, ...]], params: set[str]) -> bool:
    """A guard on one of the paths reads a parameter: what runs depends on the call."""
    return any(
        isinstance(node, ast.Name) and node.id in params
        for guards in paths
        for guard in guards
        for node in ast.walk(guard.test)
    )


def collective(imports: Imports, call: ast.Call) -> str | None:
    """The collective that `call` makes (`all_reduce`, or MPI's `bcast`), else None."""
    member = imports.resolves_to(call.func, DISTRIBUTED, COLLECTIVES)
    if member is not None:
        return member
    func = call.func
    if (
        isinstance(func, ast.Attribute)
        and func.attr in MPI_COLLECTIVES
        and imports.resolve(func.value) == _MPI_WORLD
    ):
        return func.attr
    return None


_MAX_HOPS = 4  # re-exports followed through `__init__.py` files


class CallGraph:
    def __init__(self, units: Sequence[Unit]) -> None:
        self._units = list(units)
        self._functions_named: dict[int, dict[str, list[Scope]]] = {}
        self._methods_named: dict[int, dict[str, list[Scope]]] = {}
        for unit in self._units:
            named: dict[str, list[Scope]] = {}
            for fn in unit.index.functions:
                if not fn.is_method:
                    named.setdefault(fn.name, []).append(fn)
            self._functions_named[id(unit)] = named
            methods: dict[str, list[Scope]] = {}
            for info in unit.index.classes.values():
                for name, method in info.methods.items():
                    methods.setdefault(name, []).append(method)
            self._methods_named[id(unit)] = methods
        unit_of = {fn: unit for unit in self._units for fn in unit.index.functions}
        self._unit_of = unit_of
        self._types: dict[tuple[Scope, str], list[_Class]] = {}
        for unit in self._units:
            self._instance_types(unit)
        self._incoming: dict[Scope, list[Edge]] = {
            fn: [] for unit in self._units for fn in unit.index.functions
        }
        for unit in self._units:
            for ref in unit.index.refs:
                targets, exact = self._targets(unit, ref)
                if not targets:
                    continue
                owner = None if ref.scope.is_module else ref.scope
                found = unit.paths.divergence(ref.guards, ref.scope)
                edge = Edge(
                    ref,
                    owner,
                    found.guard if found is not None else None,
                    exact,
                    found,
                    found is not None and unit.proven.is_rank_condition(found.atom, ref.scope),
                    id(ref.call_expr) in unit.index.calls_rank_zero_first,
                )
                for target in targets:
                    self._incoming[target].append(edge)
        self._reached: set[Scope] | None = None
        self._collectives: dict[Scope, frozenset[str]] = {}
        self._sites: dict[int, dict[Scope, list[Site]]] = {}
        for fn in unit_of:
            self._join_branches(fn, unit_of)
        self._context: dict[Scope, Context] = {}
        self._witness: dict[Scope, Edge] = {}
        self._solve()

    # -- resolution -------------------------------------------------------------------

    def _linked(self, unit: Unit, name: str) -> tuple[Unit, str | None] | None:
        """The file (and member) a local name is imported from, through re-exports."""
        link = unit.links.get(name)
        for _ in range(_MAX_HOPS + 1):
            if link is None:
                return None
            target, member = self._units[link.target], link.member
            functions = self._functions_named[id(target)]
            if member is None or member in target.index.classes or member in functions:
                return target, member
            link = target.links.get(member)
        return None

    def _module_of(self, unit: Unit, expr: ast.expr) -> Unit | None:
        """The checked file that `expr` (`utils`, `util.misc`) names, if any."""
        if not unit.links:  # it imports no checked file
            return None
        name = dotted(expr)
        if name is None or name not in unit.links:
            return None
        found = self._linked(unit, name)
        return found[0] if found is not None and found[1] is None else None

    def _class_named(self, unit: Unit, name: str) -> _Class | None:
        info = unit.index.classes.get(name)
        if info is not None:
            return unit, info
        found = self._linked(unit, name)
        if found is None or found[1] is None:
            return None
        cls = found[0].index.classes.get(found[1])
        return (found[0], cls) if cls is not None else None

    def _class_of(self, unit: Unit, func: ast.expr) -> _Class | None:
        """The class that a call of `func` constructs (`Trainer`, `utils.MetricLogger`)."""
        if isinstance(func, ast.Name):
            return self._class_named(unit, func.id)
        if isinstance(func, ast.Attribute):
            module = self._module_of(unit, func.value)
            if module is not None:
                return self._class_named(module, func.attr)
        return None

    def _made_by(self, unit: Unit, func: ast.expr) -> _Class | None:
        """The one class a factory of the program returns (`define_model(opt)` ending in
        `model = M(opt); return model`, or `return M(opt)`), else None."""
        factories: list[Scope] = []
        if isinstance(func, ast.Name):
            factories = self._functions_named[id(unit)].get(func.id, [])
            found = self._linked(unit, func.id)
            if not factories and found is not None and found[1] is not None:
                factories = self._functions_named[id(found[0])].get(found[1], [])
        elif isinstance(func, ast.Attribute):
            module = self._module_of(unit, func.value)
            if module is not None:
                factories = self._functions_named[id(module)].get(func.attr, [])
        if len(factories) != 1 or not factories[0].returns:
            return None
        factory = factories[0]
        home = self._unit_of[factory]
        made: set[_Class] = set()
        for returned in factory.returns:
            values = [returned]
            if isinstance(returned, ast.Name):
                values = [
                    a.value
                    for a in home.index.assignments
                    if a.scope is factory
                    and isinstance(a.target, ast.Name)
                    and a.target.id == returned.id
                ]
            for value in values:
                cls = self._class_of(home, value.func) if isinstance(value, ast.Call) else None
                if cls is None:
                    return None
                made.add(cls)
        return made.pop() if len(made) == 1 else None

    def _classes_called(self, unit: Unit, func: ast.expr, scope: Scope) -> list[_Class]:
        """The class a call of `func` constructs, directly or through a factory of the
        program; or the classes a variable of `scope` is bound to (`Exp = Exp_Forecast`
        in one branch, `Exp = Exp_Imputation` in another, then `Exp(args)`)."""
        cls = self._class_of(unit, func) or self._made_by(unit, func)
        if cls is not None:
            return [cls]
        if not isinstance(func, ast.Name):
            return []
        bound = [a.value for a in unit.index.assignments_to.get(func.id, ()) if a.scope is scope]
        classes = [self._class_of(unit, value) for value in bound]
        return [c for c in classes if c is not None] if None not in classes else []

    def _instance_types(self, unit: Unit) -> None:
        """`x = Trainer(...)` -> (scope, "x"); `self.t = Trainer(...)` -> (module, "t");
        also through a factory of the program (`model = define_model(opt)`)."""
        for a in unit.index.assignments:
            value = a.value
            if not isinstance(value, ast.Call):
                continue
            classes = self._classes_called(unit, value.func, a.scope)
            if not classes:
                continue
            if isinstance(a.target, ast.Name):
                self._types[(a.scope, a.target.id)] = classes
            elif isinstance(a.target, ast.Attribute):
                self._types.setdefault((unit.index.module, a.target.attr), classes)

    def _methods(self, cls: _Class, name: str, seen: set[int] | None = None) -> list[Scope]:
        """Method `name` of a class, looking through its base classes among checked files."""
        unit, info = cls
        method = info.methods.get(name)
        if method is not None:
            return [method]
        seen = seen if seen is not None else set()
        seen.add(id(info))
        found: list[Scope] = []
        for base in info.bases:
            base_cls = self._class_named(unit, base)
            if base_cls is not None and id(base_cls[1]) not in seen:
                found.extend(self._methods(base_cls, name, seen))
        return found

    def _members(self, unit: Unit, name: str) -> list[Scope]:
        """A function of `unit` named `name`, or the constructor of its class `name`."""
        targets = list(self._functions_named[id(unit)].get(name, ()))
        info = unit.index.classes.get(name)
        if info is not None:
            targets.extend(self._methods((unit, info), "__init__"))
        return targets

    def _in_module(self, module: Unit, name: str) -> list[Scope]:
        """`module.name(...)`: the module's own function (or class) `name`, or the one it
        imports under that name (`from .trainer import train` in a package's `__init__`)."""
        own = self._members(module, name)
        if own:
            return own
        found = self._linked(module, name)
        if found is None or found[1] is None:
            return []
        return self._members(found[0], found[1])

    def _by_name(self, unit: Unit, name: str) -> list[Scope]:
        """Every method named `name` in this file and the files it imports (a guess)."""
        found = list(self._methods_named[id(unit)].get(name, ()))
        targets = {link.target for link in unit.links.values()}
        for target in sorted(targets):
            other = self._units[target]
            if other is not unit:
                found.extend(self._methods_named[id(other)].get(name, ()))
        return found

    def _targets(self, unit: Unit, ref: Ref) -> tuple[list[Scope], bool]:
        """The functions a mention may stand for, and whether that is sure (not a guess)."""
        index = unit.index
        name = ref.name
        receiver = ref.receiver
        if receiver is None:
            own = self._members(unit, name)
            if own:
                return own, True
            found = self._linked(unit, name)
            if found is not None and found[1] is not None:
                return self._members(found[0], found[1]), True
            if found is not None and ref.call_expr is not None:
                # `from yolox.core import launch` found the submodule `launch.py` (the
                # package's `__init__.py`, which re-exports its function, is not checked);
                # called, the name is that module's function of the same name.
                return self._members(found[0], name), True
            return [], True
        module = self._module_of(unit, receiver)
        if module is not None:
            return self._in_module(module, name), True
        classes: list[_Class] = []
        if isinstance(receiver, ast.Name):
            if receiver.id in index.imports.aliases:
                return [], True  # torch.save, os.path.join: a library, not this program
            if receiver.id in ("self", "cls") and ref.scope.class_name:
                own_cls = self._class_named(unit, ref.scope.class_name)
                if own_cls is not None:
                    found_methods = self._methods(own_cls, name)
                    if found_methods:
                        return found_methods, True
            classes = self._types.get((ref.scope, receiver.id), [])
        elif isinstance(receiver, ast.Attribute):
            classes = self._types.get((index.module, receiver.attr), [])
        elif isinstance(receiver, ast.Call):  # Trainer(...).train()
            cls = self._class_of(unit, receiver.func)
            classes = [cls] if cls is not None else []
        if classes:
            return [m for cls in classes for m in self._methods(cls, name)], True
        if name == "__call__" and receiver is ref.node:
            return [], True  # `f(x)` of a variable of unknown type: no guess
        return self._by_name(unit, name), False

    def _join_branches(self, fn: Scope, unit_of: dict[Scope, Unit]) -> None:
        """`if rank == src: send(t) else: recv(t)` with both helpers calling one
        collective, or the same helper in both branches: every rank calls it once, so
        mentions from one function whose paths together cover every rank stand for an
        unguarded mention."""
        by_owner: dict[Scope, list[Edge]] = {}
        for edge in self._incoming.get(fn, ()):
            if edge.guard is not None and edge.exact and edge.owner is not None:
                by_owner.setdefault(edge.owner, []).append(edge)
        for owner, edges in by_owner.items():
            if len(edges) < 2:
                continue
            paths = unit_of[owner].paths
            if not paths.any_diverges([e.ref.guards for e in edges], owner):
                self._incoming[fn].append(Edge(edges[0].ref, owner, None, True))

    # -- solving ----------------------------------------------------------------------

    def _solve(self) -> None:
        incoming = self._incoming
        functions = [fn for unit in self._units for fn in unit.index.functions]
        guarded_roots = {fn for fn in functions if RANK_ZERO_DECORATORS & set(fn.decorators)}
        # ALL: reachable through sure, unguarded mentions from module level.
        outgoing: dict[Scope | None, list[Scope]] = {}
        for fn, edges in incoming.items():
            for edge in edges:
                if edge.guard is None and edge.exact:
                    outgoing.setdefault(edge.owner, []).append(fn)
        everywhere: set[Scope] = set()
        stack = list(outgoing.get(None, ()))
        while stack:
            fn = stack.pop()
            if fn in everywhere or fn in guarded_roots:
                continue
            everywhere.add(fn)
            stack.extend(outgoing.get(fn, ()))
        # GUARDED: the least set closed under "every mention (but its own recursive
        # calls) is sure and either rank-guarded or inside a GUARDED function".
        guarded = self._closed(
            guarded_roots - everywhere, everywhere, lambda e: e.guard is not None
        )
        for fn in functions:
            if fn in everywhere:
                self._context[fn] = Context.ALL
            elif fn in guarded:
                self._context[fn] = Context.GUARDED
                edges = [e for e in incoming[fn] if e.owner is not fn]
                if fn not in guarded_roots and edges:
                    self._witness[fn] = next((e for e in edges if e.guard is not None), edges[0])
            else:
                self._context[fn] = Context.UNKNOWN

    def _closed(
        self,
        roots: set[Scope],
        excluded: set[Scope],
        leads: Callable[[Edge], bool],
        counts: Callable[[Edge], bool] = lambda _: True,
    ) -> set[Scope]:
        """The least set holding `roots` and every function (but `excluded`) whose every
        mention that `counts` (but its own recursive calls) is sure and either `leads`
        there or sits inside a function of the set."""
        found = set(roots)
        candidates = [
            fn
            for fn, edges in self._incoming.items()
            if edges and fn not in excluded and fn not in found
        ]
        changed = True
        while changed and candidates:
            changed = False
            remaining = []
            for fn in candidates:
                edges = [e for e in self._incoming[fn] if e.owner is not fn and counts(e)]
                if edges and all(
                    e.exact and (leads(e) or (e.owner is not None and e.owner in found))
                    for e in edges
                ):
                    found.add(fn)
                    changed = True
                else:
                    remaining.append(fn)
            candidates = remaining
        return found

    # -- queries ------------------------------------------------------------------------

    def context(self, scope: Scope) -> Context:
        """Where code directly in `scope` runs (module level runs on every rank)."""
        if scope.is_module:
            return Context.ALL
        return self._context.get(scope, Context.UNKNOWN)

    @cached_property
    def _rank_zero_first(self) -> set[Scope]:
        # `Dataset.collate_fn` mentions the class but constructs nothing; a guess on a
        # method name (`super().__init__()` of another class) is left out too, as the
        # worst it does is keep a write from being reported.
        receivers = {
            id(r.receiver) for u in self._units for r in u.index.refs if r.receiver is not None
        }
        return self._closed(
            set(),
            set(),
            lambda e: e.rank_zero_first,
            lambda e: e.exact and id(e.ref.node) not in receivers,
        )

    def runs_rank_zero_first(self, scope: Scope) -> bool:
        """Every call that leads to `scope` is made in a `with torch_distributed_zero_first(
        rank):` block: rank 0 runs it to the end before the other ranks start it."""
        return scope in self._rank_zero_first

    def witness(self, scope: Scope) -> Edge | None:
        """Why `scope` is GUARDED: a rank-guarded mention, else one in a GUARDED function
        (None when a decorator says so)."""
        return self._witness.get(scope)

    def is_mentioned(self, fn: Scope) -> bool:
        """True when any checked file mentions `fn` (even by a guess on a method name)."""
        return bool(self._incoming.get(fn))

    def calls_of(self, fn: Scope) -> list[ast.Call]:
        """The calls, in any checked file, known for sure to call `fn`."""
        return [call for call, _ in self.callers_of(fn)]

    def callers_of(self, fn: Scope) -> list[tuple[ast.Call, Scope]]:
        """The calls known for sure to call `fn`, each with the scope it sits in."""
        return [
            (e.ref.call_expr, e.ref.scope)
            for e in self._incoming.get(fn, ())
            if e.exact and e.ref.call_expr
        ]

    def callees(self, unit: Unit, ref: Ref) -> list[Scope]:
        """The functions a mention in `unit` surely stands for (none when it is a guess)."""
        targets, exact = self._targets(unit, ref)
        return targets if exact else []

    def reachable(self, scope: Scope) -> bool:
        """Code in `scope` can run. Module level does, and so does what it mentions, and
        so on. Methods may be called by a framework (hooks, `forward`), so they count as
        starting points; so do all functions when no checked file is a script (a library:
        its callers are elsewhere). In a program with a script, a function that no
        running code mentions (`cleanup()` that nothing calls) is dead code."""
        if scope.is_module:
            return True
        if self._reached is None:
            self._reached = self._reach()
        return scope in self._reached

    @cached_property
    def group_code(self) -> set[Scope]:
        """The code that runs in the ranks of a process group: the functions (and module
        levels) whose calls reach an `init_process_group`, and all that they call (surely,
        not by a guess on a method name)."""
        callers: dict[Scope | None, list[Scope]] = {}
        called: dict[Scope | None, list[Scope]] = {}
        for fn, edges in self._incoming.items():
            for edge in edges:
                if edge.exact:
                    callers.setdefault(fn, []).append(edge.ref.scope)
                    called.setdefault(edge.ref.scope, []).append(fn)
        starts = [site.scope for site in self._group_starts]
        return _closure(_closure(starts, callers), called)

    @cached_property
    def _group_starts(self) -> list[Site]:
        return [
            site
            for unit in self._units
            if "init_process_group" in unit.index.seen
            for site in unit.index.calls_by_tail.get("init_process_group", ())
        ]

    @cached_property
    def _group_flags(self) -> frozenset[str]:
        """The flags that every way to `init_process_group` tests (`if cfg.enable_fsdp:
        setup()`, or in `setup` itself): with one of them unset, no group is started."""
        found: frozenset[str] | None = None
        for site in self._group_starts:
            flags = _flags(site.guards)
            if not flags and not site.scope.is_module:
                callers = [_flags(e.ref.guards) for e in self._incoming.get(site.scope, ())]
                flags = frozenset.intersection(*callers) if callers else frozenset()
            found = flags if found is None else found & flags
        return found or frozenset()

    @cached_property
    def _without_group(self) -> set[Scope]:
        flags = self._group_flags
        return self._closed(set(), set(), lambda e: _unset(e.ref.guards, flags)) if flags else set()

    def runs_without_group(self, site: Site) -> bool:
        """`site` runs only when a flag that starts the process group is unset
        (`if not cfg.enable_fsdp: save(model)`, or in a function called only so): then
        the program is a single process."""
        return _unset(site.guards, self._group_flags) or site.scope in self._without_group

    def _reach(self) -> set[Scope]:
        outgoing: dict[Scope | None, list[Scope]] = {}
        for fn, edges in self._incoming.items():
            for edge in edges:
                outgoing.setdefault(edge.owner, []).append(fn)
        library = not any(unit.script for unit in self._units)
        starts = list(outgoing.get(None, ()))
        starts.extend(fn for fn in self._unit_of if library or fn.is_method)
        return _closure(starts, outgoing)

    def collectives_of(self, fn: Scope, _depth: int = 0) -> frozenset[str]:
        """The collectives that any call of `fn` surely makes, directly or through the
        functions it surely calls (a few levels deep).

        Surely: on every rank and whatever the arguments. A collective made in both
        branches of a rank test counts (`if rank == 0: bcast(x) else: x = bcast(None)`);
        one behind a rank test alone, or a test of a parameter (`if synchronize:`,
        `if local_rank not in [-1, 0]:` given `rank=-1`), does not.
        """
        memo = self._collectives.get(fn)
        if memo is not None:
            return memo
        unit = self._unit_of.get(fn)
        if unit is None or _depth > _MAX_HOPS:
            return frozenset()
        self._collectives[fn] = frozenset()  # a recursive call adds nothing new
        paths: dict[str, list[tuple[Guard, ...]]] = {}
        for site in self._sites_in(unit, fn):
            if isinstance(site, Ref):
                for callee in self.callees(unit, site):
                    for made_there in self.collectives_of(callee, _depth + 1):
                        paths.setdefault(made_there, []).append(site.guards)
            elif (member := collective(unit.index.imports, site.call)) is not None:
                paths.setdefault(member, []).append(site.guards)
        params = set(fn.params)
        made = frozenset(
            member
            for member, guards in paths.items()
            if not _tests_parameters(guards, params) and not unit.paths.any_diverges(guards, fn)
        )
        self._collectives[fn] = made
        return made

    def _sites_in(self, unit: Unit, fn: Scope) -> list[Site]:
        """The calls in `fn` (plain calls, and mentions of the program's functions)."""
        if id(unit) not in self._sites:
            by_scope: dict[Scope, list[Site]] = {}
            for site in unit.index.calls:
                by_scope.setdefault(site.scope, []).append(site)
            for ref in unit.index.refs:
                if ref.call_expr is not None:
                    by_scope.setdefault(ref.scope, []).append(ref)
            self._sites[id(unit)] = by_scope
        return self._sites[id(unit)].get(fn, [])

    def called_in_loops(self) -> set[Scope]:
        """Functions that run inside a loop of their callers (directly or through calls)."""
        in_loop: set[Scope] = set()
        changed = True
        while changed:
            changed = False
            for fn, edges in self._incoming.items():
                if fn not in in_loop and any(
                    e.ref.loop_depth > 0 or e.owner in in_loop for e in edges
                ):
                    in_loop.add(fn)
                    changed = True
        return in_loop


def _flags(guards: Iterable[Guard]) -> frozenset[str]:
    """The plain flags (`cfg.enable_fsdp`) that `guards` need to be true."""
    found = (dotted(g.test) for g in guards if g.branch == BODY)
    return frozenset(name for name in found if name is not None)


def _unset(guards: Iterable[Guard], flags: frozenset[str]) -> bool:
    """One of `guards` needs one of `flags` to be false."""
    for guard in guards:
        test = guard.test
        if guard.branch == BODY and isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test = test.operand
        elif guard.branch != ORELSE:
            continue
        if dotted(test) in flags:
            return True
    return False


def _closure(starts: Iterable[Scope], step: Mapping[Scope | None, list[Scope]]) -> set[Scope]:
    """`starts` and all that `step` leads to from them, again and again."""
    found: set[Scope] = set()
    stack = list(starts)
    while stack:
        scope = stack.pop()
        if scope not in found:
            found.add(scope)
            stack.extend(step.get(scope, ()))
    return found
