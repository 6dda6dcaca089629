"""What a rule is, and the small helpers rules share for reading call arguments."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeGuard

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import AFTER, OPERAND, ORELSE, Assignment, Guard, Scope
from ddpkit.findings import Severity

# A rule reports the node to point at and its message; a third item, when given, is
# the severity of this one finding (a rule whose proof is weaker here says so).
Hit = tuple[ast.AST, str] | tuple[ast.AST, str, Severity]


@dataclass(frozen=True)
class Rule:
    code: str
    severity: Severity
    summary: str
    check: Callable[[FileAnalysis], Iterable[Hit]]


def argument(call: ast.Call, position: int | None, keyword: str) -> ast.expr | None:
    """The argument given for parameter `keyword` (or at `position`), else None."""
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    if position is not None and position < len(call.args):
        arg = call.args[position]
        if not any(isinstance(a, ast.Starred) for a in call.args[: position + 1]):
            return arg
    return None


def passed_for(fn: Scope, call: ast.Call, name: str) -> ast.expr | None:
    """What a call of function `fn` passes for its parameter `name`, by keyword or by
    position (a method's `self` is not among the call's arguments), else None."""
    node = fn.node
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    positional = [a.arg for a in [*node.args.posonlyargs, *node.args.args]]
    if fn.is_method:
        positional = positional[1:]
    return argument(call, positional.index(name) if name in positional else None, name)


def default_of(fn: Scope, name: str) -> ast.expr | None:
    """The default value of parameter `name` of function `fn`, else None."""
    node = fn.node
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    pairs = [
        *zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True),
        *zip(args.kwonlyargs, args.kw_defaults, strict=True),
    ]
    return next((default for arg, default in pairs if arg.arg == name), None)


def option_dest(call: ast.Call) -> str | None:
    """`add_argument("--dist-url", ...)` -> "dist_url" (the attribute argparse sets)."""
    dest = argument(call, None, "dest")
    if isinstance(dest, ast.Constant) and isinstance(dest.value, str):
        return dest.value
    for arg in call.args:
        if (
            isinstance(arg, ast.Constant)
            and isinstance(arg.value, str)
            and arg.value.startswith("--")
        ):
            return arg.value[2:].replace("-", "_")
    return None


def has_unknown_arguments(call: ast.Call) -> bool:
    """`f(*args)` or `f(**kwargs)`: any parameter may be given, so rules stay silent."""
    return any(isinstance(a, ast.Starred) for a in call.args) or any(
        kw.arg is None for kw in call.keywords
    )


def is_constant(expr: ast.expr | None, value: object) -> TypeGuard[ast.Constant]:
    return isinstance(expr, ast.Constant) and expr.value is value


def assignments_to(
    fa: FileAnalysis, name: str, scope: Scope, module: bool = True
) -> list[Assignment]:
    """The assignments to variable `name` in `scope` (and, with `module`, at module level)."""
    scopes = (scope, fa.index.module) if module else (scope,)
    return [a for a in fa.index.assignments_to.get(name, ()) if a.scope in scopes]


def contains(tree: ast.AST, node: ast.AST) -> bool:
    return any(n is node for n in ast.walk(tree))


def show(node: ast.AST, limit: int = 60) -> str:
    """Source text of `node` for a message, shortened to one line."""
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_guard(guard: Guard) -> str:
    """`if rank == 0` (line 12), as people would point at it."""
    test = show(guard.test)
    if guard.branch == ORELSE:
        text = f"the else of `if {test}`"
    elif guard.branch == AFTER:
        text = f"the early exit `if {test}: return`"
    elif guard.branch == OPERAND:
        text = f"`{test} and ...`"
    else:
        text = f"`if {test}`"
    return f"{text} (line {guard.test.lineno})"


def scope_label(scope: Scope) -> str:
    if scope.class_name and scope.is_method:
        return f"{scope.class_name}.{scope.name}"
    return scope.name
