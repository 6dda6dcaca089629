"""DDP109: an nccl process group with no device chosen per rank (all land on GPU 0)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import Scope, Site
from ddpkit.check.model import Severity
from ddpkit.check.rules.base import Hit, Rule, argument, assignments_to

# Any of these picks a device per process.
_DEVICE_SETTERS = ("set_device", "set_device_index", "set_default_device")
_VISIBLE = "CUDA_VISIBLE_DEVICES"


def _is_nccl_literal(expr: ast.expr) -> bool:
    if isinstance(expr, ast.Constant):
        return isinstance(expr.value, str) and "nccl" in expr.value.lower()
    if isinstance(expr, ast.IfExp):  # "nccl" if torch.cuda.is_available() else "gloo"
        return _is_nccl_literal(expr.body) or _is_nccl_literal(expr.orelse)
    return isinstance(expr, ast.Attribute) and expr.attr == "NCCL"


def _may_be_nccl(expr: ast.expr | None, scope: Scope, fa: FileAnalysis) -> bool:
    if expr is None:
        return False  # the default backend depends on the machine: do not guess
    return _is_nccl_literal(expr) or (
        isinstance(expr, ast.Name)
        and any(_is_nccl_literal(a.value) for a in assignments_to(fa, expr.id, scope))
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


def check(fa: FileAnalysis) -> Iterator[Hit]:
    for site in fa.process_group_inits:
        call = site.call
        if not _may_be_nccl(argument(call, 0, "backend"), site.scope, fa):
            continue
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
