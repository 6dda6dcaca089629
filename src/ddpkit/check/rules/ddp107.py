"""DDP107: torch.load without map_location in a DDP script."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import BODY, ORELSE, Site
from ddpkit.check.names import dotted
from ddpkit.check.rules.base import Hit, Rule, argument, has_unknown_arguments
from ddpkit.check.rules.ddp103 import checkpoint_writes, per_rank_path
from ddpkit.findings import Severity

LOADERS = frozenset({"load"})
# A save: where it is, what it writes (None when unknown) and the path it writes to.
_Save = tuple[Site, ast.expr | None, ast.expr]


def _mapped(site: Site) -> bool:
    return argument(site.call, 1, "map_location") is not None


def _sibling_maps(site: Site, loads: list[Site]) -> bool:
    """`if args.gpu is None: torch.load(p) else: torch.load(p, map_location=loc)`.

    The other branch of the same `if` maps the load per GPU, so this branch is the
    one where a single process drives every GPU (or no group runs): nothing crowds.
    """
    for guard in site.guards:
        if guard.branch not in (BODY, ORELSE):
            continue
        for other in loads:
            if other is site or not _mapped(other):
                continue
            if any(g.owner is guard.owner and g.branch != guard.branch for g in other.guards):
                return True
    return False


def _path_key(path: ast.expr) -> tuple[str, str] | None:
    """What identifies a file across a save and a load: the variable that holds its path
    (`queue_path`, `args.resume`), else the literal parts of the path, which name the
    file even when its folder differs (`join(args.dump_dir, "feats.pt")` is reloaded
    as `join(args.load_dir, "feats.pt")`)."""
    name = dotted(path)
    if name is not None:
        return ("name", name)
    parts = [
        n.value for n in ast.walk(path) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]
    return ("text", "\0".join(parts)) if parts else None


def _on_cpu(obj: ast.expr) -> bool:
    """`x.cpu()`, `x.to("cpu")`, or a dict, list or tuple of such."""
    if isinstance(obj, ast.Call) and isinstance(obj.func, ast.Attribute):
        if obj.func.attr == "cpu" and not obj.args:
            return True
        if obj.func.attr == "to":
            device = argument(obj, 0, "device")
            return isinstance(device, ast.Constant) and device.value == "cpu"
        return False
    if isinstance(obj, ast.Dict):
        return bool(obj.values) and all(_on_cpu(v) for v in obj.values)
    if isinstance(obj, (ast.List, ast.Tuple)):
        return bool(obj.elts) and all(_on_cpu(e) for e in obj.elts)
    return False


def _saves(fa: FileAnalysis) -> list[_Save]:
    """The checkpoint writes of the program (this file and the files linked to it)."""
    return [
        (site, argument(site.call, 0, "obj"), target)
        for peer in fa.peers or [fa]
        for site, target in checkpoint_writes(peer)
        if target is not None
    ]


def _reloads_own_save(fa: FileAnalysis, site: Site, saves: list[_Save]) -> bool:
    """The program itself wrote the loaded file, so its tensors come back where they were
    saved from: the CPU when every write moved them there first (`x.cpu()`), or this same
    rank's own GPU when the path names the rank (`f"queue{rank}.pth"`)."""
    path = argument(site.call, 0, "f")
    if path is None or (key := _path_key(path)) is None:
        return False
    # A variable names the same file only in the same function.
    same = [
        obj
        for save, obj, target in saves
        if _path_key(target) == key and (key[0] == "text" or save.scope is site.scope)
    ]
    if not same:
        return False
    if per_rank_path(fa, path, site):
        return True
    return all(obj is not None and _on_cpu(obj) for obj in same)


def check(fa: FileAnalysis) -> Iterator[Hit]:
    if not (fa.is_ddp_script or any(peer.is_ddp_script for peer in fa.peers)):
        return
    loads = [site for site, _ in fa.resolved_calls("torch", LOADERS)]
    saves: list[_Save] | None = None
    for site in loads:
        call = site.call
        if has_unknown_arguments(call) or _mapped(site) or _sibling_maps(site, loads):
            continue
        if fa.rank_only(site) is not None:
            continue
        if saves is None:
            saves = _saves(fa)
        if _reloads_own_save(fa, site, saves):
            continue
        yield (
            call,
            "`torch.load` without `map_location` puts every tensor back on the device "
            "that saved it (usually cuda:0), so all ranks crowd onto one GPU; pass "
            '`map_location=f"cuda:{local_rank}"` (or `"cpu"`)',
        )


RULE = Rule(
    "DDP107",
    Severity.WARNING,
    "torch.load without map_location in a DDP script",
    check,
)
