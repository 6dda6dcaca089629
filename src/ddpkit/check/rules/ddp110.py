"""DDP110: a hard-coded rendezvous port; a second job on the machine collides (info)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import Scope, Site
from ddpkit.check.names import dotted, tail
from ddpkit.check.rules.base import (
    Hit,
    Rule,
    argument,
    assignments_to,
    has_unknown_arguments,
    option_dest,
    show,
)
from ddpkit.findings import Severity

_PORT_KEY = "MASTER_PORT"
_TCP_URL = re.compile(r"tcp://[^\s/]*:\d+")
_URL_HOST = re.compile(r"tcp://\[?([^\s/\[\]]*?)\]?:\d+(?:$|/)")
# Hosts that are the machine the job runs on.
_THIS_MACHINE = re.compile(r"^(?:localhost|127(?:\.\d+){3}|0\.0\.0\.0|::1?|)$", re.IGNORECASE)
_FIX = (
    "a second job on this machine fails with 'address already in use'; let torchrun "
    "pick one (`torchrun --standalone`), or choose a free port at run time"
)


def _unstr(expr: ast.expr) -> ast.expr:
    """`x` of `str(x)`, else `expr`."""
    if isinstance(expr, ast.Call) and tail(expr.func) == "str" and len(expr.args) == 1:
        return expr.args[0]
    return expr


def _constant_port(expr: ast.expr) -> bool:
    """`12355`, `"12355"`, `str(12355)`."""
    expr = _unstr(expr)
    if not isinstance(expr, ast.Constant):
        return False
    value = expr.value
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and value.strip().isdigit()
    )


def _is_port_key(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Constant) and expr.value == _PORT_KEY


def _url_text(expr: ast.expr) -> str | None:
    """The text of a URL literal; `{}` stands in for the parts an f-string fills in."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.JoinedStr):
        return "".join(
            v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{}"
            for v in expr.values
        )
    return None


def _parameter_default(fn: ast.AST, name: str) -> tuple[ast.expr, int | None] | None:
    """The default of parameter `name` of `fn`, with its position (None: keyword-only)."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    for i, arg in enumerate(positional):
        if arg.arg == name:
            return (args.defaults[i - first_default], i) if i >= first_default else None
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if arg.arg == name:
            return (default, None) if default is not None else None
    return None


def _passes(call: ast.Call, position: int | None, name: str) -> bool:
    if has_unknown_arguments(call) or any(kw.arg == name for kw in call.keywords):
        return True
    return position is not None and position < len(call.args)


def _defaulted_port(fa: FileAnalysis, value: ast.expr, scope: Scope) -> str | None:
    """`str(port)` where `port` is a parameter whose fixed default a call leaves in place
    (`init_distributed(port=40112)` called as `init_distributed()`): why, else None."""
    value = _unstr(value)
    if not isinstance(value, ast.Name) or value.id not in scope.params:
        return None
    found = _parameter_default(scope.node, value.id)
    if found is None or not _constant_port(found[0]):
        return None
    default, position = found
    if position is not None and scope.is_method:
        position -= 1  # `self` is not passed in the call
    for call in fa.callgraph.calls_of(scope):
        if not _passes(call, position, value.id):
            return (
                f"MASTER_PORT is set from `{value.id}`, which `{show(call.func)}(...)` leaves "
                f"at its default {show(default)}: {_FIX}"
            )
    return None


def _master_port_values(fa: FileAnalysis) -> Iterator[tuple[ast.expr, Scope]]:
    """The values given to MASTER_PORT: `os.environ[...] = v`, `setdefault`, `update`."""
    for a in fa.index.assignments:
        target = a.target
        if (
            isinstance(target, ast.Subscript)
            and _is_port_key(target.slice)
            and (dotted(target.value) or "").endswith("environ")
        ):
            yield a.value, a.scope
    for site in fa.calls("setdefault", "putenv"):
        call = site.call
        if len(call.args) == 2 and _is_port_key(call.args[0]):
            yield call.args[1], site.scope
    for site in fa.calls("update"):
        for arg in site.call.args:
            if not isinstance(arg, ast.Dict):
                continue
            for key, value in zip(arg.keys, arg.values, strict=True):
                if key is not None and _is_port_key(key):
                    yield value, site.scope


def _fallback(value: ast.expr) -> ast.expr | None:
    """The default of `os.environ.get("MASTER_PORT", "29500")` / `os.getenv(...)`."""
    if (
        isinstance(value, ast.Call)
        and tail(value.func) in ("get", "getenv")
        and len(value.args) == 2
        and _is_port_key(value.args[0])
    ):
        return value.args[1]
    return None


def _environ_ports(fa: FileAnalysis) -> Iterator[Hit]:
    for value, scope in _master_port_values(fa):
        fallback = _fallback(value)
        if _constant_port(value):
            yield value, f"MASTER_PORT is hard-coded to {show(value)}: {_FIX}"
        elif fallback is not None and _constant_port(fallback):
            yield (
                value,
                f"MASTER_PORT falls back to {show(fallback)} when the environment has none: {_FIX}",
            )
        elif not scope.is_module and (why := _defaulted_port(fa, value, scope)) is not None:
            yield value, why


def _has_port(expr: ast.expr) -> bool:
    text = _url_text(expr)
    return text is not None and _TCP_URL.search(text) is not None


def _names_another_machine(expr: ast.expr) -> bool:
    """`tcp://10.1.2.3:23456`: a placeholder for some cluster's host that every run must
    replace, unlike `tcp://localhost:23456`, which works as is and then collides."""
    text = _url_text(expr)
    match = _URL_HOST.search(text) if text is not None else None
    return (
        match is not None and "{}" not in match.group(1) and not _THIS_MACHINE.match(match.group(1))
    )


def _stored_urls(fa: FileAnalysis, url: ast.Name | ast.Attribute, site: Site) -> Iterator[Hit]:
    """`url = "tcp://...:port"` or `args.dist_url = ...` before the init; argparse defaults."""
    if isinstance(url, ast.Name):
        stored = assignments_to(fa, url.id, site.scope)
    else:
        stored = [
            a
            for a in fa.index.assignments
            if isinstance(a.target, ast.Attribute) and a.target.attr == url.attr
        ]
    for a in stored:
        if _has_port(a.value):
            yield (
                a.value,
                f"the init_method URL {show(a.value)} (used at line {site.line}) has a "
                f"fixed port: {_FIX}",
            )
    if not isinstance(url, ast.Attribute):
        return
    for option in fa.calls("add_argument"):
        default = argument(option.call, None, "default")
        if (
            default is not None
            and option_dest(option.call) == url.attr
            and _has_port(default)
            and not _names_another_machine(default)
        ):
            yield (
                default,
                f"the default init_method URL {show(default)} (used at line {site.line}) has "
                f"a fixed port; unless every run passes another one, {_FIX}",
            )


def _url_ports(fa: FileAnalysis) -> Iterator[Hit]:
    reported: set[int] = set()
    for site in fa.process_group_inits:
        call = site.call
        url = argument(call, 1, "init_method")
        if url is None:
            continue
        if _has_port(url):
            yield url, f"the init_method URL {show(url)} has a fixed port: {_FIX}"
        elif isinstance(url, (ast.Name, ast.Attribute)):
            for hit in _stored_urls(fa, url, site):
                if id(hit[0]) not in reported:
                    reported.add(id(hit[0]))
                    yield hit
    for site in fa.calls("TCPStore"):
        call = site.call
        port = argument(call, 1, "port")
        if port is not None and _constant_port(port) and show(port) != "0":
            yield port, f"TCPStore listens on the fixed port {show(port)}: {_FIX}"


def check(fa: FileAnalysis) -> Iterator[Hit]:
    yield from _environ_ports(fa)
    yield from _url_ports(fa)


RULE = Rule(
    "DDP110",
    Severity.INFO,
    "hard-coded MASTER_PORT or tcp://host:port",
    check,
)
