"""DDP107: torch.load without map_location in a DDP script."""

from __future__ import annotations

import ast
import re
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
# Random number generator states: Python's and numpy's, and torch's (a CPU tensor, for
# the CUDA generator too).
_RNG_STATES = frozenset({"getstate", "get_state", "get_rng_state"})
# What an annotation may name when the value holds only plain Python data.
_PLAIN_TYPES = frozenset(
    {"int", "float", "str", "bool", "bytes", "Path", "Optional", "Union"}
    | {"list", "List", "dict", "Dict", "tuple", "Tuple", "set", "Set", "Sequence"}
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
    if isinstance(obj, ast.Attribute):
        return _plain_field(fa, obj, scope)
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
    elif isinstance(obj, ast.BoolOp):
        parts = list(obj.values)
    elif isinstance(obj, ast.IfExp):
        parts = [obj.body, obj.orelse]
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
    if name in _PLAIN_RESULTS or name in _RNG_STATES or name.endswith("cpu"):
        return True
    resolved = fa.imports.resolve(call.func) or ""
    if name in _CPU_CONSTRUCTORS and resolved.startswith("torch."):
        return argument(call, None, "device") is None
    return resolved.startswith("numpy.") or _returns_no_gpu_tensor(fa, call, depth)


def _is_plain(annotation: ast.expr | None) -> bool:
    """An annotation of plain Python data: `int`, `int | None`, `typing.List[Path]`."""
    if annotation is None:
        return False
    nodes = list(ast.walk(annotation))
    modules = {id(n.value) for n in nodes if isinstance(n, ast.Attribute)}  # `typing.`
    return all(
        tail(n) in _PLAIN_TYPES
        if isinstance(n, (ast.Name, ast.Attribute))
        else not isinstance(n, ast.Constant) or n.value is None
        for n in nodes
        if id(n) not in modules
    )


def _plain_field(fa: FileAnalysis, obj: ast.Attribute, scope: Scope) -> bool:
    """`self.step` where the class declares `step: int = 0` (a dataclass field)."""
    info = fa.index.classes.get(scope.class_name or "")
    if info is None or not (isinstance(obj.value, ast.Name) and obj.value.id == "self"):
        return False
    return any(
        isinstance(stmt, ast.AnnAssign)
        and isinstance(stmt.target, ast.Name)
        and stmt.target.id == obj.attr
        and _is_plain(stmt.annotation)
        for stmt in info.node.body
    )


def _home(fa: FileAnalysis, fn: Scope) -> FileAnalysis | None:
    return next((peer for peer in fa.peers or [fa] if fn in peer.index.functions), None)


def _returns_no_gpu_tensor(fa: FileAnalysis, call: ast.Call, depth: int) -> bool:
    """A call of the program's own function that says it returns plain data (`-> int`), or
    whose every `return` holds no GPU tensor (`return {"step": self.step, ...}`)."""
    fns = [fn for ref in fa.index.refs if ref.call_expr is call for fn in fa.callees(ref)]
    homes = [(fn, _home(fa, fn)) for fn in fns]
    return bool(homes) and all(
        home is not None
        and isinstance(fn.node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (
            _is_plain(fn.node.returns)
            or (
                bool(fn.returns) and all(_no_gpu_tensor(home, r, fn, depth + 1) for r in fn.returns)
            )
        )
        for fn, home in homes
    )


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
    if not values and name in scope.params:
        return _passed_no_gpu_tensor(fa, scope, name, depth)
    return bool(values) and all(_no_gpu_tensor(fa, v, scope, depth + 1) for v in values)


def _passed_no_gpu_tensor(fa: FileAnalysis, fn: Scope, name: str, depth: int) -> bool:
    """Every call in sight of a function named like `fn` passes no GPU tensor for its
    parameter `name` (calls that give it nothing and have no default are of another
    function of that name: `Trainer.save_checkpoint(kind)` beside a checkpointer's)."""
    passed: list[tuple[FileAnalysis, ast.expr, Scope]] = []
    for peer in fa.peers or [fa]:
        for ref in peer.index.refs:
            call = ref.call_expr
            if call is None or ref.name != fn.name:
                continue
            value = passed_for(fn, call, name)
            if value is None and (has_unknown_arguments(call) or default_of(fn, name) is not None):
                return False
            if value is not None:
                passed.append((peer, value, ref.scope))
    return bool(passed) and all(_no_gpu_tensor(p, v, s, depth + 1) for p, v, s in passed)


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
    """The checkpoint writes of the program (this file and the files linked to it), and
    the calls of its save helpers: functions that hand a parameter to `torch.save`
    (`save_state_dict(folder, "train.pt", trainer_state)`)."""
    peers = fa.peers or [fa]
    saves: list[_Save] = []
    helpers: dict[Scope, str] = {}
    for peer in peers:
        for site, target in checkpoint_writes(peer):
            obj = argument(site.call, 0, "obj")
            if target is not None:
                saves.append((peer, site, obj, target))
            if isinstance(obj, ast.Name) and obj.id in site.scope.params:
                helpers[site.scope] = obj.id
    for peer in peers if helpers else ():
        for ref in peer.index.refs:
            call = ref.call_expr
            for fn in peer.callees(ref) if call is not None else ():
                if call is not None and fn in helpers:
                    obj = passed_for(fn, call, helpers[fn])
                    site = Site(call, ref.scope, ref.guards, ref.loop_depth)
                    saves.append((peer, site, obj, _helper_file(call, obj)))
    return saves


def _same_file(written: tuple[str, str] | None, read: tuple[str, str]) -> bool:
    """The keys name one file; a written name built around a value (`f"train/rank{r}.pt"`)
    also names each file it can make (`"train/rank0.pt"`)."""
    if written == read:
        return True
    if written is None or written[0] != "text" or read[0] != "text" or "\0" in read[1]:
        return False
    pattern = ".+".join(re.escape(part) for part in written[1].split("\0"))
    return re.fullmatch(pattern, read[1]) is not None


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
        and _same_file(_path_key(save[3]), key)
        and (key[0] == "text" or save[1].scope is site.scope)
    ]
    if same or site.scope.class_name is None:
        return same
    own = [s for s in saves if s[0] is fa and s[1].scope.class_name == site.scope.class_name]
    counterpart = site.scope.name.replace("load", "save", 1)
    return [s for s in own if s[1].scope.name == counterpart] or own


def _helper_file(call: ast.Call, obj: ast.expr | None = None) -> ast.expr:
    """The file that a call of a load or save helper of the program names: its arguments
    (but `obj`, what a save writes) taken together (`folder, "train.pt"`)."""
    return ast.Tuple([a for a in call.args if a is not obj], ast.Load())


def _reloads_own_save(fa: FileAnalysis, site: Site, saves: list[_Save]) -> bool:
    """The program itself wrote the loaded file, so its tensors come back where they were
    saved from: the CPU when no write can hold a GPU tensor (moved there first, numpy, a
    dict of numbers, a dataset's cache), or this same rank's own GPU when the path names
    the rank (`f"queue{rank}.pth"`)."""
    path = argument(site.call, 0, "f")
    if fa.imports.resolves_to(site.call.func, "torch", LOADERS) is None:
        path = _helper_file(site.call)
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


def _falls_back_from_own_save(
    fa: FileAnalysis, site: Site, loads: list[Site], saves: list[_Save]
) -> bool:
    """`try: state = load(d, "train.pt") except FileNotFoundError: state = load(d,
    "other.pt")`: the older name of a file the program writes, which holds the same."""
    for node in ast.walk(site.scope.node):
        if not isinstance(node, ast.Try):
            continue
        for handler in node.handlers:
            if handler.type is None or tail(handler.type) != "FileNotFoundError":
                continue
            if not any(n is site.call for stmt in handler.body for n in ast.walk(stmt)):
                continue
            tried = {id(n) for stmt in node.body for n in ast.walk(stmt)}
            if any(id(load.call) in tried and _reloads_own_save(fa, load, saves) for load in loads):
                return True
    return False


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
    candidates = [*unmapped, *_helper_loads(fa)]
    for site in candidates:
        call = site.call
        if has_unknown_arguments(call) or fa.rank_only(site) is not None:
            continue
        if saves is None:
            saves = _saves(fa)
        if _reloads_own_save(fa, site, saves) or _falls_back_from_own_save(
            fa, site, candidates, saves
        ):
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
