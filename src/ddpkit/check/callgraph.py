"""Where a function of this file runs: on every rank, only behind a rank check, or unknown.

The DDP tutorial's `Trainer._save_checkpoint` holds a bare `torch.save`, yet it is fine:
its one caller calls it under `if self.gpu_id == 0`. A collective in the same
method would hang. So each function gets a context from the places that mention it:

- ALL: some chain of unguarded calls reaches it from module level (or from
  `mp.spawn(main, ...)`, which runs `main` on every rank).
- GUARDED: it is mentioned, and every mention is behind a rank condition or inside
  a GUARDED function (or it is decorated `@rank_zero_only`).
- UNKNOWN: neither (never mentioned, or called from code we cannot place). Rules
  stay silent about UNKNOWN code.

Calls are matched by name: `f()` to functions named f, `self.m()` to the method of
the enclosing class, `x.m()` to x's class when `x = SomeClass(...)` is in sight, and
otherwise to every method named m (more callers can only make a function less
GUARDED, so this errs towards silence).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from enum import Enum

from ddpkit.check.index import Guard, Index, Ref, Scope
from ddpkit.check.ranks import RANK_ZERO_DECORATORS, RankModel


class Context(Enum):
    ALL = "all"
    GUARDED = "guarded"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Witness:
    """Why a function is GUARDED: a guarded mention of it, or a decorator."""

    ref: Ref | None
    guard: Guard | None
    via: Scope | None  # set when the mention sits inside another GUARDED function


class CallGraph:
    def __init__(self, index: Index, ranks: RankModel) -> None:
        self._index = index
        self._ranks = ranks
        self._types = self._instance_types()
        self._functions_named: dict[str, list[Scope]] = {}
        for fn in index.functions:
            if not fn.is_method:
                self._functions_named.setdefault(fn.name, []).append(fn)
        self._incoming: dict[Scope, list[Ref]] = {fn: [] for fn in index.functions}
        for ref in index.refs:
            for target in self._targets(ref):
                self._incoming[target].append(ref)
        self._guard_of: dict[int, Guard | None] = {
            id(ref): ranks.rank_guard(ref.guards, ref.scope) for ref in index.refs
        }
        self._context: dict[Scope, Context] = {}
        self._witness: dict[Scope, Witness] = {}
        self._solve()

    # -- resolution -------------------------------------------------------------------

    def _instance_types(self) -> dict[tuple[Scope | None, str], str]:
        """`x = Trainer(...)` -> (scope, "x"): "Trainer"; `self.t = Trainer(...)` -> (None, "t")."""
        classes = self._index.classes
        types: dict[tuple[Scope | None, str], str] = {}
        for a in self._index.assignments:
            value = a.value
            if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)):
                continue
            if value.func.id not in classes:
                continue
            if isinstance(a.target, ast.Name):
                types[(a.scope, a.target.id)] = value.func.id
            elif isinstance(a.target, ast.Attribute):
                types[(None, a.target.attr)] = value.func.id
        return types

    def _methods(self, class_name: str, name: str, seen: set[str] | None = None) -> list[Scope]:
        """Method `name` of `class_name`, looking through base classes of this file."""
        info = self._index.classes.get(class_name)
        if info is None:
            return []
        method = info.methods.get(name)
        if method is not None:
            return [method]
        seen = seen if seen is not None else set()
        seen.add(class_name)
        found: list[Scope] = []
        for base in info.bases:
            if base not in seen:
                found.extend(self._methods(base, name, seen))
        return found

    def _all_methods(self, name: str) -> list[Scope]:
        return [m for info in self._index.classes.values() if (m := info.methods.get(name))]

    def _targets(self, ref: Ref) -> list[Scope]:
        index = self._index
        if ref.receiver is None:
            targets = list(self._functions_named.get(ref.name, ()))
            if ref.name in index.classes:
                targets.extend(self._methods(ref.name, "__init__"))
            return targets
        receiver = ref.receiver
        if isinstance(receiver, ast.Name):
            if index.imports.is_module_alias(receiver.id):
                return []  # torch.save, os.path.join: a library, not this file
            if receiver.id in ("self", "cls") and ref.scope.class_name:
                found = self._methods(ref.scope.class_name, ref.name)
                if found:
                    return found
            class_name = self._types.get((ref.scope, receiver.id))
            if class_name is not None:
                return self._methods(class_name, ref.name)
        elif isinstance(receiver, ast.Attribute):
            class_name = self._types.get((None, receiver.attr))
            if class_name is not None:
                return self._methods(class_name, ref.name)
        return self._all_methods(ref.name)

    # -- solving ----------------------------------------------------------------------

    def _owner(self, ref: Ref) -> Scope | None:
        """The function a mention sits in (None at module level)."""
        return None if ref.scope.is_module else ref.scope

    def _solve(self) -> None:
        incoming = self._incoming
        guarded_roots = {
            fn for fn in self._index.functions if RANK_ZERO_DECORATORS & set(fn.decorators)
        }
        # ALL: reachable through unguarded mentions from module level.
        outgoing: dict[Scope | None, list[Scope]] = {}
        for fn, refs in incoming.items():
            for ref in refs:
                if self._guard_of[id(ref)] is None:
                    outgoing.setdefault(self._owner(ref), []).append(fn)
        everywhere: set[Scope] = set()
        stack = list(outgoing.get(None, ()))
        while stack:
            fn = stack.pop()
            if fn in everywhere or fn in guarded_roots:
                continue
            everywhere.add(fn)
            stack.extend(outgoing.get(fn, ()))
        # GUARDED: the greatest set whose every mention is guarded or from inside the set.
        guarded = {
            fn
            for fn, refs in incoming.items()
            if fn not in everywhere and (refs or fn in guarded_roots)
        }
        changed = True
        while changed:
            changed = False
            for fn in list(guarded):
                if fn in guarded_roots:
                    continue
                for ref in incoming[fn]:
                    owner = self._owner(ref)
                    if self._guard_of[id(ref)] is None and (owner is None or owner not in guarded):
                        guarded.discard(fn)
                        changed = True
                        break
        for fn in self._index.functions:
            if fn in everywhere:
                self._context[fn] = Context.ALL
            elif fn in guarded:
                self._context[fn] = Context.GUARDED
                self._witness[fn] = self._find_witness(fn, guarded_roots)
            else:
                self._context[fn] = Context.UNKNOWN

    def _find_witness(self, fn: Scope, roots: set[Scope]) -> Witness:
        if fn in roots:
            return Witness(None, None, None)
        via: Ref | None = None
        for ref in self._incoming[fn]:
            guard = self._guard_of[id(ref)]
            if guard is not None:
                return Witness(ref, guard, None)
            via = via or ref
        return Witness(via, None, self._owner(via) if via is not None else None)

    # -- queries ------------------------------------------------------------------------

    def context(self, scope: Scope) -> Context:
        """Where code directly in `scope` runs (module level runs on every rank)."""
        if scope.is_module:
            return Context.ALL
        return self._context.get(scope, Context.UNKNOWN)

    def witness(self, scope: Scope) -> Witness | None:
        return self._witness.get(scope)

    def called_in_loops(self) -> set[Scope]:
        """Functions that run inside a loop of their callers (directly or through calls)."""
        in_loop: set[Scope] = set()
        changed = True
        while changed:
            changed = False
            for fn, refs in self._incoming.items():
                if fn in in_loop:
                    continue
                for ref in refs:
                    owner = self._owner(ref)
                    if ref.loop_depth > 0 or (owner is not None and owner in in_loop):
                        in_loop.add(fn)
                        changed = True
                        break
        return in_loop
