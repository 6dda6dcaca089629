"""DDP107: torch.load without map_location in a DDP script."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import BODY, ORELSE, Scope, Site
from ddpkit.check.names import dotted, tail
from ddpkit.check.rules.base import (
    Hit,
    Rule,
    argument,
    default_of,
    has_unknown_arguments,
    is_constant,
    passed_for,
    show,
)
from ddpkit.check.rules.ddp103 import checkpoint_writes, per_rank_path
from ddpkit.findings import Severity

LOADERS = frozenset({"load"})
# A save: its file, where it is, what it writes (None when unknown), the path it writes to.
_Save = tuple[FileAnalysis, Site, ast.expr | None, ast.expr]


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


# Calls whose result holds no GPU tensor: Python numbers and text, numpy arrays
# (`t.numpy()`, `a.astype(...)`), an argparse namespace, a range.
_PLAIN_RESULTS = frozenset(
    {"len", "int", "float", "str", "bool", "round", "item", "tolist", "numpy", "astype"}
    | {"parse_args", "range"}
)
# torch's constructors, which make CPU tensors unless given a device.
_CPU_CONSTRUCTORS = frozenset(
    {"tensor", "as_tensor", "from_numpy", "zeros", "ones", "arange", "empty", "full"}
    | {"LongTensor", "FloatTensor", "IntTensor"}
)
# How many variables deep the value of a save is followed (`x = y`, `y = ...`).
_MAX_DEPTH = 4


def _no_gpu_tensor(fa: FileAnalysis, obj: ast.expr, scope: Scope, depth: int = 0) -> bool:
    """`obj` cannot hold a GPU tensor: tensors moved to the CPU (`x.cpu()`, `x.to("cpu")`,
    `to_cpu(x)`), numbers, text, numpy arrays, an argparse namespace, containers of
    these, or a variable that `scope` binds only to such values."""
    if depth > _MAX_DEPTH:
        return False
    parts: list[ast.expr | None]
    if isinstance(obj, (ast.Constant, ast.JoinedStr)):
        return True
    if isinstance(obj, ast.Name):
        return _bound_to_no_gpu_tensor(fa, obj.id, scope, depth)
    if isinstance(obj, ast.Call):
        return _call_makes_no_gpu_tensor(fa, obj, scope, depth)
    if isinstance(obj, ast.Dict):
        parts = list(obj.values)
    elif isinstance(obj, (ast.List, ast.Tuple, ast.Set)):
        parts = list(obj.elts)
    elif isinstance(obj, ast.DictComp):
        parts = [obj.value]
    elif isinstance(obj, (ast.ListComp, ast.SetComp)):
        parts = [obj.elt]
    elif isinstance(obj, ast.BinOp):
        parts = [obj.left, obj.right]
    else:
        return False
    return all(p is not None and _no_gpu_tensor(fa, p, scope, depth) for p in parts)


def _call_makes_no_gpu_tensor(fa: FileAnalysis, call: ast.Call, scope: Scope, depth: int) -> bool:
    name = tail(call.func) or ""
    if name == "to":
        device = argument(call, 0, "device")
        return isinstance(device, ast.Constant) and device.value == "cpu"
    if name == "vars":
        return bool(call.args) and _no_gpu_tensor(fa, call.args[0], scope, depth)
    if name in _PLAIN_RESULTS or name.endswith("cpu"):
        return True
    resolved = fa.imports.resolve(call.func) or ""
    if name in _CPU_CONSTRUCTORS and resolved.startswith("torch."):
        return argument(call, None, "device") is None
    return resolved.startswith("numpy.")


def _bound_to_no_gpu_tensor(fa: FileAnalysis, name: str, scope: Scope, depth: int) -> bool:
    """Every value `scope` gives the variable `name` (assigned, added to, stored under a
    key, counted by `for name in range(...)`) holds no GPU tensor; or a loop replaces each
    of its values by a CPU one (`for k, v in sd.items(): sd[k] = v.cpu()`)."""
    values: list[ast.expr] = []
    for a in fa.index.assignments:
        target = a.target.value if isinstance(a.target, ast.Subscript) else a.target
        if (
            isinstance(target, ast.Name)
            and target.id == name
            and a.scope in (scope, fa.index.module)
        ):
            values.append(a.value)
    for node in ast.walk(scope.node):
        if isinstance(node, ast.AugAssign) and dotted(node.target) == name:
            values.append(node.value)
        elif isinstance(node, ast.For) and dotted(node.target) == name:
            values.append(node.iter)  # its items hold no GPU tensor if it holds none
        elif isinstance(node, ast.For) and any(
            isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.target)
        ):
            return False  # a part of each item (`for i, x in enumerate(loader)`)
        elif isinstance(node, ast.For) and _replaces_each_value(fa, node, name, scope, depth):
            return True
    return bool(values) and all(_no_gpu_tensor(fa, v, scope, depth + 1) for v in values)


def _replaces_each_value(
    fa: FileAnalysis, loop: ast.For, name: str, scope: Scope, depth: int
) -> bool:
    """`for key, value in name.items(): name[key] = value.cpu()`."""
    walks = loop.iter
    if isinstance(walks, ast.Call) and isinstance(walks.func, ast.Attribute):
        walks = walks.func.value
    if dotted(walks) != name:
        return False
    return any(
        isinstance(stmt, ast.Assign)
        and any(isinstance(t, ast.Subscript) and dotted(t.value) == name for t in stmt.targets)
        and _no_gpu_tensor(fa, stmt.value, scope, depth)
        for stmt in loop.body
    )


def _in_dataset(fa: FileAnalysis, scope: Scope) -> bool:
    """`scope` is code of a dataset class (it has `__getitem__`, or derives from a
    `...Dataset`): data code runs on the CPU, in the loader's worker processes."""
    info = fa.index.classes.get(scope.class_name or "")
    return info is not None and (
        "__getitem__" in info.methods or any(b.endswith("Dataset") for b in info.bases)
    )


def _saves(fa: FileAnalysis) -> list[_Save]:
    """The checkpoint writes of the program (this file and the files linked to it)."""
    return [
        (peer, site, argument(site.call, 0, "obj"), target)
        for peer in fa.peers or [fa]
        for site, target in checkpoint_writes(peer)
        if target is not None
    ]


def _writers(fa: FileAnalysis, site: Site, path: ast.expr, saves: list[_Save]) -> list[_Save]:
    """The saves in sight that wrote the file a load reads: those of the same path (a
    variable names the same file only in the same function); else, for a load in a
    method, the saves of its own class: those of its counterpart (`load_network` reads
    what `save_network` wrote) when there is one, else all of them."""
    key = _path_key(path)
    same = [
        save
        for save in saves
        if key is not None
        and _path_key(save[3]) == key
        and (key[0] == "text" or save[1].scope is site.scope)
    ]
    if same or site.scope.class_name is None:
        return same
    own = [s for s in saves if s[0] is fa and s[1].scope.class_name == site.scope.class_name]
    counterpart = site.scope.name.replace("load", "save", 1)
    return [s for s in own if s[1].scope.name == counterpart] or own


def _reloads_own_save(fa: FileAnalysis, site: Site, saves: list[_Save]) -> bool:
    """The program itself wrote the loaded file, so its tensors come back where they were
    saved from: the CPU when no write can hold a GPU tensor (moved there first, numpy, a
    dict of numbers, a dataset's cache), or this same rank's own GPU when the path names
    the rank (`f"queue{rank}.pth"`)."""
    path = argument(site.call, 0, "f")
    if path is None:
        return False
    writers = _writers(fa, site, path, saves)
    if not writers:
        return False
    if per_rank_path(fa, path, site):
        return True
    return all(
        obj is not None and (_in_dataset(peer, save.scope) or _no_gpu_tensor(peer, obj, save.scope))
        for peer, save, obj, _ in writers
    )


def _helper_loads(fa: FileAnalysis) -> list[Site]:
    """Calls of the program's loader helpers that leave out their `map_location`: a
    function that hands its own `map_location` parameter, None by default, on to
    `torch.load` (`def torch_load(path, map_location=None)`) loads without one then."""
    helpers = {
        load.scope: given.id
        for peer in fa.peers or [fa]
        for load, _ in peer.resolved_calls("torch", LOADERS)
        if isinstance(given := argument(load.call, 1, "map_location"), ast.Name)
        and given.id in load.scope.params
        and is_constant(default_of(load.scope, given.id), None)
    }
    return [
        Site(call, ref.scope, ref.guards, ref.loop_depth)
        for ref in (fa.index.refs if helpers else ())
        if (call := ref.call_expr) is not None
        and any(
            fn in helpers and passed_for(fn, call, helpers[fn]) is None for fn in fa.callees(ref)
        )
    ]


def check(fa: FileAnalysis) -> Iterator[Hit]:
    if not (fa.is_ddp_script or any(peer.is_ddp_script for peer in fa.peers)):
        return
    loads = [site for site, _ in fa.resolved_calls("torch", LOADERS)]
    unmapped = [site for site in loads if not _mapped(site) and not _sibling_maps(site, loads)]
    saves: list[_Save] | None = None
    for site in [*unmapped, *_helper_loads(fa)]:
        call = site.call
        if has_unknown_arguments(call) or fa.rank_only(site) is not None:
            continue
        if saves is None:
            saves = _saves(fa)
        if _reloads_own_save(fa, site, saves):
            continue
        what = "`torch.load` without `map_location`"
        if fa.imports.resolves_to(call.func, "torch", LOADERS) is None:
            what = f"`{show(call.func)}` leaves its `map_location` at None, so its `torch.load`"
        yield (
            call,
            f"{what} puts every tensor back on the device that saved it (usually cuda:0), "
            'so all ranks crowd onto one GPU; pass `map_location=f"cuda:{local_rank}"` '
            '(or `"cpu"`)',
        )


RULE = Rule(
    "DDP107",
    Severity.WARNING,
    "torch.load without map_location in a DDP script",
    check,
)
