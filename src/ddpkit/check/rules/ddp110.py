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
    default_of,
    has_unknown_arguments,
    option_dest,
    passed_for,
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


def _option_port(fa: FileAnalysis, name: str) -> ast.expr | None:
    """The fixed port that the program's option `--name` defaults to (argparse), else None."""
    for peer in fa.peers or [fa]:
        for option in peer.calls("add_argument"):
            default = argument(option.call, None, "default")
            if default is not None and option_dest(option.call) == name and _constant_port(default):
                return default
    return None


def _port_source(fa: FileAnalysis, expr: ast.expr, scope: Scope, depth: int = 0) -> str | None:
    """Why the port `expr` (code in `scope`) is a fixed one, in words, else None: it is an
    option with a fixed default (`args.port`), or a parameter that a call leaves at its
    fixed default, or is handed a fixed port, followed up through the callers (`_join(port)`
    called by `join(port=None)`, called by `run(port=29500)`)."""
    expr = _unstr(expr)
    if isinstance(expr, ast.Attribute):
        option = _option_port(fa, expr.attr)
        return None if option is None else f"the option `--{expr.attr}` defaults to {show(option)}"
    if not isinstance(expr, ast.Name) or expr.id not in scope.params or depth > 3:
        return None
    name = expr.id
    default = default_of(scope, name)
    fixed = default if default is not None and _constant_port(default) else None
    callers = fa.callgraph.callers_of(scope)
    for call, caller in callers:
        if has_unknown_arguments(call):
            continue  # `f(**kwargs)` may pass any port
        passed = passed_for(scope, call, name)
        where = f"`{show(call.func)}(...)` (line {call.lineno})"
        if passed is None and fixed is not None:
            return f"{where} leaves `{name}` at its default {show(fixed)}"
        if passed is not None and _constant_port(passed):
            return f"{where} passes {show(passed)} for `{name}`"
        if passed is not None and (why := _port_source(fa, passed, caller, depth + 1)):
            return why
    if callers:
        return None
    # Nothing here surely calls it: a command-line wrapper (`fire.Fire(run)`) fills the
    # parameters, or the script picks the function by name (`getattr(utils, "init_" + x)`).
    if depth > 0 and fixed is not None:
        return f"nothing here calls `{scope.name}`, whose `{name}` defaults to {show(fixed)}"
    option = _option_port(fa, name)
    return None if option is None else f"the option `--{name}` defaults to {show(option)}"


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
        elif not scope.is_module and (why := _port_source(fa, value, scope)) is not None:
            yield value, f"MASTER_PORT is set from `{show(_unstr(value))}`, and {why}: {_FIX}"


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


def _url_port_variable(url: ast.expr) -> ast.Name | None:
    """`port` of `f"tcp://{host}:{port}"`."""
    text = _url_text(url)
    if not isinstance(url, ast.JoinedStr) or text is None or "tcp://" not in text:
        return None
    for before, part in zip(url.values, url.values[1:], strict=False):
        if (
            isinstance(before, ast.Constant)
            and str(before.value).endswith(":")
            and isinstance(part, ast.FormattedValue)
            and isinstance(part.value, ast.Name)
        ):
            return part.value
    return None


def _variable_port(fa: FileAnalysis, port: ast.Name, site: Site) -> Iterator[Hit]:
    """The URL's port variable is a literal or falls back to one (`port =
    os.environ.get("MASTER_PORT", "29500")`), or is a parameter or option with a fixed
    default."""
    used = f"the port of the init_method URL (line {site.line})"
    for a in assignments_to(fa, port.id, site.scope):
        fallback = _fallback(a.value)
        if _constant_port(a.value):
            yield a.value, f"{used} is hard-coded to {show(a.value)}: {_FIX}"
        elif fallback is not None and _constant_port(fallback):
            yield (
                a.value,
                f"{used} falls back to {show(fallback)} when the environment has none: {_FIX}",
            )
    why = _port_source(fa, port, site.scope)
    if why is not None:
        yield site.call, f"{used} is `{port.id}`, and {why}: {_FIX}"


def _config_urls(fa: FileAnalysis) -> Iterator[Hit]:
    """`HParams(dist_url="tcp://localhost:54321")` where a file of the program starts the
    group with `init_method=hparams.dist_url`: a settings object built with a fixed URL."""
    used = {
        url.attr
        for peer in fa.peers or [fa]
        for site in peer.process_group_inits
        if isinstance(url := argument(site.call, 1, "init_method"), ast.Attribute)
    }
    if not used:
        return
    for site in fa.index.calls:
        for kw in site.call.keywords:
            if kw.arg in used and _has_port(kw.value) and not _names_another_machine(kw.value):
                yield (
                    kw.value,
                    f"`{kw.arg}`, the init_method of the process group, is the URL "
                    f"{show(kw.value)} with a fixed port: {_FIX}",
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
        elif (variable := _url_port_variable(url)) is not None:
            yield from _variable_port(fa, variable, site)
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
    yield from _config_urls(fa)


RULE = Rule(
    "DDP110",
    Severity.INFO,
    "hard-coded MASTER_PORT or tcp://host:port",
    check,
)
