"""DDP103: a checkpoint written by every rank instead of by rank 0 only."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.callgraph import Context
from ddpkit.check.index import BODY, Scope, Site
from ddpkit.check.names import tail
from ddpkit.check.rules.base import Hit, Rule, argument, assignments_to, show
from ddpkit.findings import Severity

# (module, names, position of the file argument)
_WRITERS = (
    ("torch", frozenset({"save"}), 1, "f"),
    ("torch.jit", frozenset({"save"}), 1, "f"),
    ("safetensors.torch", frozenset({"save_file", "save_model"}), 1, "filename"),
)


def checkpoint_writes(fa: FileAnalysis) -> Iterator[tuple[Site, ast.expr | None]]:
    """Calls that write a checkpoint, with the file (or buffer) they write to."""
    for module, names, position, keyword in _WRITERS:
        for site, _ in fa.resolved_calls(module, names):
            yield site, argument(site.call, position, keyword)


def _is_bytes_io(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Call) and tail(expr.func) == "BytesIO"


def _in_memory(target: ast.expr, site: Site, fa: FileAnalysis) -> bool:
    """`torch.save(obj, buffer)` with `buffer = io.BytesIO()` writes no file."""
    return _is_bytes_io(target) or (
        isinstance(target, ast.Name)
        and any(
            _is_bytes_io(a.value) for a in assignments_to(fa, target.id, site.scope, module=False)
        )
    )


def per_rank_path(fa: FileAnalysis, target: ast.expr, site: Site) -> bool:
    """The path names the rank, directly or through the variables it is built from:
    `path = f"out_{rank}.pt"`, or `f"{logdir}/data.pt"` with `logdir` set per rank."""
    return fa.ranks.built_from_rank(target, site.scope)


# Tests of "is this job distributed at all?": when they let every rank through,
# there is one process, so `if not args.distributed or rank == 0:` is a rank-0 guard.
_DISTRIBUTED_TESTS = frozenset(
    {
        "distributed",
        "is_distributed",
        "use_distributed",
        "ddp",
        "use_ddp",
        "is_ddp",
        "world_size",
        "is_initialized",
        "is_dist_avail_and_initialized",
        "n_gpu",
        "num_gpus",
    }
)


def _tests_distributed(expr: ast.expr) -> bool:
    return any(
        isinstance(node, (ast.Name, ast.Attribute)) and tail(node) in _DISTRIBUTED_TESTS
        for node in ast.walk(expr)
    )


def _condition(setting: list[tuple[ast.expr, bool]]) -> str:
    return " and ".join(f"`{show(t, 50)}`" if v else f"`not ({show(t, 50)})`" for t, v in setting)


def _writes_everywhere(fa: FileAnalysis, site: Site) -> str | None:
    """Why a write under a rank guard still runs on every rank, or None."""
    if fa.callgraph.context(site.scope) is not Context.ALL:
        return None
    setting = fa.paths.everyone_passes(site.guards, site.scope)
    if setting is None or any(_tests_distributed(test) for test, _ in setting):
        return None
    return _condition(setting)


def _item_names(fa: FileAnalysis, scope: Scope) -> set[str]:
    """Names that a `for` loop of `scope` binds to the items of data (not a `range`)."""
    names: set[str] = set()
    for loop in fa.index.loops:
        node = loop.node
        if loop.scope is not scope or not isinstance(node, (ast.For, ast.AsyncFor)):
            continue
        iterable = node.iter
        while (
            isinstance(iterable, ast.Call)
            and tail(iterable.func) in ("enumerate", "tqdm")
            and iterable.args
        ):
            iterable = iterable.args[0]
        if isinstance(iterable, ast.Call) and tail(iterable.func) == "range":
            continue  # `for epoch in range(n)`: the same numbers on every rank
        names.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
    return names


def per_item_path(fa: FileAnalysis, target: ast.expr, site: Site) -> bool:
    """`torch.save(sample, os.path.join(out, name))` in `for name in files:`: one output
    file per data item (a preprocessing script), not one checkpoint written by all."""
    items = _item_names(fa, site.scope)
    if not items:
        return False
    values = [target]
    if isinstance(target, ast.Name):
        values += [a.value for a in assignments_to(fa, target.id, site.scope, module=False)]
    return any(
        isinstance(n, ast.Name) and n.id in items for value in values for n in ast.walk(value)
    )


def _only_data_parallel(site: Site) -> bool:
    """The write sits in `if isinstance(model, nn.DataParallel):`, a branch that a
    DistributedDataParallel model never takes (DDP's saves go the other way)."""
    return any(
        guard.branch == BODY
        and isinstance(guard.test, ast.Call)
        and tail(guard.test.func) == "isinstance"
        and len(guard.test.args) == 2
        and tail(guard.test.args[1]) == "DataParallel"
        for guard in site.guards
    )


def _rank_zero_first(fa: FileAnalysis, site: Site) -> bool:
    """The write runs in a `with torch_distributed_zero_first(rank):` block, directly or
    through calls: rank 0 writes first and the other ranks find the file (a data cache)."""
    return id(site.call) in fa.index.calls_rank_zero_first or fa.callgraph.runs_rank_zero_first(
        site.scope
    )


def check(fa: FileAnalysis) -> Iterator[Hit]:
    for site, target in checkpoint_writes(fa):
        if target is None or fa.in_launcher(site) or not fa.in_process_group(site.scope):
            continue
        if _only_data_parallel(site) or _rank_zero_first(fa, site):
            continue
        if fa.callgraph.runs_without_group(site):
            continue  # `if not cfg.enable_fsdp: save(...)`: the run without a group
        condition = None
        if not fa.runs_on_every_rank(site):
            condition = _writes_everywhere(fa, site)
            if condition is None:
                continue
        if per_rank_path(fa, target, site) or per_item_path(fa, target, site):
            continue  # one file per rank (f"ckpt_rank{rank}.pt") or per data item is fine
        if _in_memory(target, site, fa):
            continue
        call = site.call
        fix = (
            "write it from rank 0 only: `if rank == 0:` (then `dist.barrier()` on every rank "
            "if others read it)"
        )
        if condition is None:
            yield (
                call,
                f"`{show(call.func)}` runs on every rank, so all processes write "
                f"`{show(target, 40)}` at once (a torn or clobbered file); {fix}",
            )
        else:
            yield (
                call,
                f"`{show(call.func)}` runs on every rank when {condition} holds (for example "
                f"a torchrun start without that option), so all processes write "
                f"`{show(target, 40)}` at once; {fix}",
                Severity.WARNING,
            )


RULE = Rule(
    "DDP103",
    Severity.ERROR,
    "checkpoint written on every rank, not under a rank-0 guard",
    check,
)
