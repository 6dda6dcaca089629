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
    is_constant,
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


# `torch.cuda` calls that, given no device, work on the current one.
_ON_CURRENT_DEVICE = frozenset(
    {
        "synchronize",
        "empty_cache",
        "current_device",
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "max_memory_reserved",
        "reset_peak_memory_stats",
    }
)
# With nccl these stage their pickled objects on the current device.
_OBJECT_COLLECTIVES = frozenset(
    {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"}
)


def _is_bare_cuda(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Constant) and expr.value == "cuda"


def _uses_current_device(fa: FileAnalysis, call: ast.Call) -> bool:
    """`x.cuda()`, `torch.device("cuda")`, `.to("cuda")`, `device="cuda"`,
    `torch.cuda.synchronize()`, a `pin_memory=True` loader (its thread opens a context on
    the current device), or an nccl object collective."""
    name = tail(call.func)
    if name in _OBJECT_COLLECTIVES:
        return True
    if any(k.arg == "pin_memory" and is_constant(k.value, True) for k in call.keywords):
        return True
    if any(k.arg == "device" and _is_bare_cuda(k.value) for k in call.keywords):
        return True
    if name in ("device", "to") and call.args and _is_bare_cuda(call.args[0]):
        return True
    if call.args or any(k.arg in (None, "device") for k in call.keywords):
        return False  # a device (or what may be one) is given
    if name == "cuda":
        return True
    return name in _ON_CURRENT_DEVICE and (fa.imports.resolve(call.func) or "").startswith(
        "torch.cuda."
    )


def _hard_coded_node_size(peer: FileAnalysis, expr: ast.expr) -> bool:
    """`8`, or a module constant bound to one (`GPUS_PER_NODE = 8`)."""
    if isinstance(expr, ast.Name):
        expr = next(
            (
                stmt.value
                for stmt in peer.tree.body
                if isinstance(stmt, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == expr.id for t in stmt.targets)
            ),
            expr,
        )
    return isinstance(expr, ast.Constant) and type(expr.value) is int and expr.value > 1


def _is_per_node_guess(peer: FileAnalysis, node: ast.AST) -> bool:
    """`MPI.COMM_WORLD.Get_rank() % GPUS_PER_NODE` with `GPUS_PER_NODE = 8`: a GPU index
    from the global rank modulo a fixed count, wrong on nodes with fewer GPUs."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)):
        return False
    left = node.left.func if isinstance(node.left, ast.Call) else node.left
    return tail(left) in _GLOBAL_RANK_NAMES and _hard_coded_node_size(peer, node.right)


def _per_node_guess(fa: FileAnalysis) -> ast.BinOp | None:
    """The first per-node guess (see `_is_per_node_guess`) in the group's code."""
    for peer in fa.served_files():
        for node in ast.walk(peer.tree):
            if isinstance(node, ast.BinOp) and _is_per_node_guess(peer, node):
                return node
    return None


def _guessed_device(fa: FileAnalysis, expr: ast.expr, scope: Scope) -> ast.expr | None:
    """`rank % 8`, given as is or through a variable that `scope` only assigns it."""
    if not isinstance(expr, ast.Name):
        return expr if _is_per_node_guess(fa, expr) else None
    values = [a.value for a in assignments_to(fa, expr.id, scope, module=False)]
    if values and all(_is_per_node_guess(fa, v) for v in values):
        return values[0]
    return None


def _per_node_devices(fa: FileAnalysis) -> Iterator[Hit]:
    """`set_device(rank % 8)` or DDP's `device_ids=[rank % 8]` in the ranks' code."""
    chosen = [(site, site.call.args[0]) for site in fa.calls("set_device") if site.call.args]
    for site in fa.ddp_wraps:
        ids = argument(site.call, 1, "device_ids")
        if isinstance(ids, (ast.List, ast.Tuple)) and len(ids.elts) == 1:
            chosen.append((site, ids.elts[0]))
    reported: set[tuple[Scope, str]] = set()  # one finding per function and call kind
    for site, device in chosen:
        guess = _guessed_device(fa, device, site.scope)
        kind = (site.scope, show(site.call.func))
        if guess is not None and kind not in reported and fa.in_process_group(site.scope):
            reported.add(kind)
            yield (
                site.call,
                f"the device `{show(device)}` is `{show(guess)}` (line {guess.lineno}), the "
                "global rank modulo a fixed GPU count: on a node with fewer GPUs it names one "
                "that does not exist (rank 4 asks for cuda:4 on a 4-GPU node); use the local "
                "rank (`int(os.environ['LOCAL_RANK'])`)",
            )


def _current_device_use(fa: FileAnalysis) -> tuple[ast.Call, int] | None:
    """A call of the group's code that works on the current device (GPU 0 in every rank
    unless something picks one), and the line it is on."""
    for peer in fa.served_files():
        for site in peer.index.calls:
            if _uses_current_device(peer, site.call):
                return site.call, site.line
    return None


# The global rank as code names it (`dist.get_rank()`, mpi4py's `comm.Get_rank()`).
_GLOBAL_RANK_NAMES = frozenset(
    {"get_rank", "Get_rank", "rank", "mpi_rank", "global_rank", "world_rank"}
)
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
    yield from _per_node_devices(fa)
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
        backend = argument(call, 0, "backend")
        # A backend read from a config file (`h.dist_config["dist_backend"]`): reported
        # at warning level, as what the finding depends on.
        unknown = (
            f" (a warning: this holds when `{show(backend)}`, read from a config, is nccl)"
            if isinstance(backend, ast.Subscript)
            else ""
        )
        if not unknown and not _may_be_nccl(backend, site.scope, fa):
            continue
        if has_unknown_arguments(call):
            continue  # `**kwargs` may hold the `device_id`
        if _chooses_device(fa, site):
            continue
        # Where every tensor and DDP's `device_ids` name the rank's GPU, the current
        # device is never used and its default (GPU 0) does no harm.
        use = _current_device_use(fa)
        guess = _per_node_guess(fa) if use is None else None
        if guess is not None:
            message = (
                f"nccl process group without `torch.cuda.set_device`, and the GPU index "
                f"`{show(guess)}` (line {guess.lineno}) is the global rank modulo a fixed "
                "count: on a node with fewer GPUs it names one that does not exist; use "
                "the local rank (`int(os.environ['LOCAL_RANK'])`) and `set_device` it"
            )
        elif use is not None:
            message = (
                f"nccl process group without `torch.cuda.set_device(local_rank)` (or "
                f"`device_id=`), yet `{show(use[0])}` (line {use[1]}) works on the current "
                "device: GPU 0 in every rank (out of memory, a context on GPU 0, or an nccl "
                "error); call `torch.cuda.set_device(local_rank)` before `init_process_group`"
            )
        else:
            continue
        yield (call, message + unknown, Severity.WARNING) if unknown else (call, message)


RULE = Rule(
    "DDP109",
    Severity.ERROR,
    "nccl process group without torch.cuda.set_device for the local rank",
    check,
)
