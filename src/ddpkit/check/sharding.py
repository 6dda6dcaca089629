"""Which models are sharded, and which calls run them: a sharded forward is a collective.

FSDP and FSDP2 (`FullyShardedDataParallel`, `fully_shard`) and Lightning's FSDP and
model-parallel strategies keep each parameter in pieces across the ranks; a forward
pass gathers the pieces from every rank. So `if rank == 0: generate_example(model)`
hangs the way `if rank == 0: dist.all_reduce(t)` does, with no `dist.` call in sight.

A model is sharded here when it is assigned from such a wrapper, or from
`fabric.setup(...)`/`setup_module(...)` in a file that builds a sharding strategy; a
parameter is sharded when a call of this file gives it a sharded model. A function
runs its sharded parameter when it calls it (`model(x)`) or hands it to a function
that is not one of Python's builtins (`generate(model, ...)`).
"""

from __future__ import annotations

import ast
import builtins
from functools import cached_property

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import Ref, Scope
from ddpkit.check.names import tail

_WRAPPERS = frozenset({"FullyShardedDataParallel", "FSDP", "fully_shard"})
_STRATEGIES = frozenset({"FSDPStrategy", "ModelParallelStrategy"})
_SETUPS = frozenset({"setup", "setup_module"})
_BUILTINS = frozenset(dir(builtins))


class Sharding:
    """The sharded models of one file, by scope, and the functions that run them."""

    def __init__(self, fa: FileAnalysis) -> None:
        self._fa = fa

    @cached_property
    def names(self) -> dict[Scope, set[str]]:
        fa = self._fa
        found: dict[Scope, set[str]] = {}
        if not fa.calls(*_WRAPPERS) and not fa.calls(*_STRATEGIES):
            return found
        setups = _WRAPPERS | (_SETUPS if fa.calls(*_STRATEGIES) else frozenset())
        for a in fa.index.assignments:
            value = a.value
            if (
                isinstance(a.target, ast.Name)
                and isinstance(value, ast.Call)
                and tail(value.func) in setups
            ):
                found.setdefault(a.scope, set()).add(a.target.id)
        for site in fa.calls("fully_shard"):
            first = site.call.args[0] if site.call.args else None
            if isinstance(first, ast.Name):
                found.setdefault(site.scope, set()).add(first.id)
        for _ in range(3):  # main -> fit(model=model) -> generate_example(fabric, model)
            if not self._follow_calls(found):
                break
        return found

    def _follow_calls(self, found: dict[Scope, set[str]]) -> bool:
        changed = False
        for ref in self._fa.index.refs:
            call = ref.call_expr
            sharded = found.get(ref.scope)
            if call is None or not sharded:
                continue
            for fn in self._fa.callees(ref):
                for param in _parameters_given(fn, call, sharded):
                    names = found.setdefault(fn, set())
                    if param not in names:
                        names.add(param)
                        changed = True
        return changed

    def runs(self, ref: Ref) -> str | None:
        """The sharded model that the call `ref` runs (by its name here), else None."""
        call = ref.call_expr
        sharded = self.names.get(ref.scope)
        if call is None or not sharded:
            return None
        for fn in self._fa.callees(ref):
            for param in _parameters_given(fn, call, sharded):
                if param in self.names.get(fn, ()) and self._runs_parameter(fn, param):
                    return param
        return None

    def _runs_parameter(self, fn: Scope, param: str) -> bool:
        for site in self._fa.index.calls:
            if site.scope is not fn:
                continue
            call = site.call
            if isinstance(call.func, ast.Name) and call.func.id == param:
                return True
            first = call.args[0] if call.args else None
            if (
                isinstance(first, ast.Name)
                and first.id == param
                and isinstance(call.func, ast.Name)
                and call.func.id not in _BUILTINS
            ):
                return True
        return False


def _parameters_given(fn: Scope, call: ast.Call, names: set[str]) -> list[str]:
    """The parameters of `fn` that `call` passes one of `names` to."""
    node = fn.node
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    positional = [a.arg for a in [*node.args.posonlyargs, *node.args.args]]
    if fn.is_method:
        positional = positional[1:]
    given = [
        positional[i]
        for i, arg in enumerate(call.args)
        if i < len(positional) and isinstance(arg, ast.Name) and arg.id in names
    ]
    given += [
        kw.arg
        for kw in call.keywords
        if kw.arg in fn.params and isinstance(kw.value, ast.Name) and kw.value.id in names
    ]
    return given
