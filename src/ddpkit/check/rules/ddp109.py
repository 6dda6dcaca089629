"""DDP109: an nccl process group with no device chosen per rank (all land on GPU 0)."""

from __future__ import annotations

import ast
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

# Any of these picks a device per process.
_DEVICE_SETTERS = ("set_device", "set_device_index", "set_default_device")
_VISIBLE = "CUDA_VISIBLE_DEVICES"


def _is_nccl_literal(expr: ast.expr) -> bool:
    if isinstance(expr, ast.Constant):
        return isinstance(expr.value, str) and "nccl" in expr.value.lower()
    if isinstance(expr, ast.IfExp):  # "nccl" if torch.cuda.is_available() else "gloo"
        return _is_nccl_literal(expr.body) or _is_nccl_literal(expr.orelse)
    return isinstance(expr, ast.Attribute) and expr.attr == "NCCL"


def _is_nccl_given(fa: FileAnalysis, expr: ast.expr | None) -> bool:
    """A literal, or an option of the program whose argparse default is nccl
    (`args.dist_backend` after `add_argument("--dist-backend", default="nccl")`)."""
    if expr is None or _is_nccl_literal(expr):
        return expr is not None
    return isinstance(expr, ast.Attribute) and any(
        option_dest(option.call) == expr.attr
        and (default := argument(option.call, None, "default")) is not None
        and _is_nccl_literal(default)
        for peer in fa.peers or [fa]
        for option in peer.calls("add_argument")
    )


def _may_be_nccl(expr: ast.expr | None, scope: Scope, fa: FileAnalysis) -> bool:
    if expr is None:
        return False  # the default backend depends on the machine: do not guess
    if _is_nccl_given(fa, expr):
        return True
    if not isinstance(expr, ast.Name):
        return False
    if any(_is_nccl_literal(a.value) for a in assignments_to(fa, expr.id, scope)):
        return True
    # A helper's parameter: its default, or what a call of the helper passes for it
    # (`init(backend=args.dist_backend)`).
    return expr.id in scope.params and (
        _is_nccl_given(fa, default_of(scope, expr.id))
        or any(
            _is_nccl_given(fa, passed_for(scope, call, expr.id))
            for call in fa.callgraph.calls_of(scope)
        )
    )


def _sets_visible_devices(fa: FileAnalysis) -> bool:
    """`os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)` gives each process one GPU."""
    if any(
        isinstance(a.target, ast.Subscript)
        and isinstance(a.target.slice, ast.Constant)
        and a.target.slice.value == _VISIBLE
        for a in fa.index.assignments
    ):
        return True
    return any(
        _VISIBLE in ast.unparse(arg)
        for site in fa.calls("setdefault", "putenv", "update")
        for arg in site.call.args
    )


def _file_chooses_device(fa: FileAnalysis) -> bool:
    if any(fa.mentions(name) for name in _DEVICE_SETTERS):
        return True
    if any(fa.imports.resolve(s.call.func) == "torch.cuda.device" for s in fa.calls("device")):
        return True  # with torch.cuda.device(local_rank): ...
    return _sets_visible_devices(fa)


def _chooses_device(fa: FileAnalysis, site: Site) -> bool:
    if argument(site.call, None, "device_id") is not None:
        return True
    # Checked with a folder, the script that calls a setup helper often picks the device
    # (`CUDA_VISIBLE_DEVICES` at its top, `set_device` in main) before the helper runs.
    return any(_file_chooses_device(peer) for peer in fa.peers or [fa])


_GLOBAL_RANK_ENV = frozenset({"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"})


def _is_global_rank(fa: FileAnalysis, expr: ast.expr, scope: Scope, depth: int = 0) -> bool:
    """`int(os.environ["RANK"])`, `dist.get_rank()`, or a variable assigned one: the rank
    across all nodes, which is no device index on a second node (no `% gpus` taken)."""
    while isinstance(expr, ast.Call) and tail(expr.func) in ("int", "str") and expr.args:
        expr = expr.args[0]
    if isinstance(expr, ast.Subscript) and (dotted(expr.value) or "").endswith("environ"):
        return isinstance(expr.slice, ast.Constant) and expr.slice.value in _GLOBAL_RANK_ENV
    if isinstance(expr, ast.Call):
        if tail(expr.func) in ("get", "getenv") and expr.args:
            key = expr.args[0]
            return isinstance(key, ast.Constant) and key.value in _GLOBAL_RANK_ENV
        return fa.imports.resolve(expr.func) == "torch.distributed.get_rank" and not expr.args
    if isinstance(expr, ast.Name) and depth < 3:
        values = [a.value for a in assignments_to(fa, expr.id, scope, module=False)]
        return bool(values) and all(_is_global_rank(fa, v, scope, depth + 1) for v in values)
    return False


def _global_rank_devices(fa: FileAnalysis, site: Site) -> ast.Call | None:
    """A `set_device(rank)` with the global rank, on the init's path, before it."""
    for setter in fa.calls("set_device"):
        call = setter.call
        if (
            setter.scope is site.scope
            and setter.line < site.line
            and all(any(g is h for h in site.guards) for g in setter.guards)
            and call.args
            and _is_global_rank(fa, call.args[0], site.scope)
        ):
            return call
    return None


def check(fa: FileAnalysis) -> Iterator[Hit]:
    for site in fa.process_group_inits:
        call = site.call
        setter = _global_rank_devices(fa, site)
        if setter is not None:
            yield (
                call,
                f"`{show(setter.func)}({show(setter.args[0])})` (line {setter.lineno}) picks "
                "the device by the global rank: on a second node that index does not exist; "
                "use the local rank (`int(os.environ['LOCAL_RANK'])`)",
            )
            continue
        if not _may_be_nccl(argument(call, 0, "backend"), site.scope, fa):
            continue
        if has_unknown_arguments(call):
            continue  # `**kwargs` may hold the `device_id`
        if _chooses_device(fa, site):
            continue
        yield (
            call,
            "nccl process group without `torch.cuda.set_device(local_rank)` (or "
            "`device_id=`), so every rank uses GPU 0 (out of memory or an nccl error); "
            "call `torch.cuda.set_device(local_rank)` before `init_process_group`",
        )


RULE = Rule(
    "DDP109",
    Severity.ERROR,
    "nccl process group without torch.cuda.set_device for the local rank",
    check,
)
