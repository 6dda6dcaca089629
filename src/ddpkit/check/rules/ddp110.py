"""DDP110: a hard-coded rendezvous port; a second job on the machine collides (info)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.model import Severity
from ddpkit.check.names import dotted, tail
from ddpkit.check.rules.base import Hit, Rule, argument, show

_PORT_KEY = "MASTER_PORT"
_TCP_URL = re.compile(r"tcp://[^\s/]*:\d+")
_FIX = (
    "a second job on this machine fails with 'address already in use'; let torchrun "
    "pick one (`torchrun --standalone`), or choose a free port at run time"
)


def _constant_port(expr: ast.expr) -> bool:
    """`12355`, `"12355"`, `str(12355)`."""
    if isinstance(expr, ast.Call) and tail(expr.func) == "str" and len(expr.args) == 1:
        expr = expr.args[0]
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


def _environ_ports(fa: FileAnalysis) -> Iterator[Hit]:
    for a in fa.index.assignments:
        target = a.target
        if (
            isinstance(target, ast.Subscript)
            and _is_port_key(target.slice)
            and (dotted(target.value) or "").endswith("environ")
            and _constant_port(a.value)
        ):
            yield a.value, f"MASTER_PORT is hard-coded to {show(a.value)}: {_FIX}"
    for site in fa.calls("setdefault", "putenv"):
        call = site.call
        if len(call.args) == 2 and _is_port_key(call.args[0]) and _constant_port(call.args[1]):
            yield call.args[1], f"MASTER_PORT is hard-coded to {show(call.args[1])}: {_FIX}"
    for site in fa.calls("update"):
        call = site.call
        for arg in call.args:
            if not isinstance(arg, ast.Dict):
                continue
            for key, value in zip(arg.keys, arg.values, strict=True):
                if key is not None and _is_port_key(key) and _constant_port(value):
                    yield value, f"MASTER_PORT is hard-coded to {show(value)}: {_FIX}"


def _url_ports(fa: FileAnalysis) -> Iterator[Hit]:
    for site in fa.process_group_inits:
        call = site.call
        url = argument(call, 1, "init_method")
        text = _url_text(url) if url is not None else None
        if url is not None and text is not None and _TCP_URL.search(text):
            yield url, f"the init_method URL {show(url)} has a fixed port: {_FIX}"
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
