"""Which values are ranks, and which conditions hold on some ranks but not others.

People spell "this is rank 0" many ways: `rank == 0`, `self.gpu_id == 0`,
`dist.get_rank() == 0`, `int(os.environ["LOCAL_RANK"]) == 0`, `if not is_main:`,
`master_process = ddp_rank == 0`, an `is_main()` helper. The names are matched by
pattern, and names assigned from rank expressions (`gpu = rank`, `should_save =
rank == 0 and ...`) or parameters given a rank at a call of this file are followed.

Tests that are the same on every rank are not rank conditions, even when they mention
one: `local_rank != -1` and `local_rank >= 0` (the "am I distributed" idioms) and
`rank is None`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache

from ddpkit.check.index import Assignment, Guard, Index, Scope
from ddpkit.check.names import dotted, tail

# Names that hold a rank: rank, local_rank, ddp_rank, self.global_rank, args.gpu, gpu_id.
RANK_NAME = re.compile(
    r"^_*(?:[a-z0-9]+_)*rank(?:_?(?:id|idx|index|num|no))?$"
    r"|^_*(?:local_|global_)?gpu(?:_?(?:id|idx|index|rank))?$"
    r"|^_*(?:local_)?process_index$|^_*proc_?id$",
    re.IGNORECASE,
)
# Booleans that mean "this is the main process": is_main, master_process, is_rank_zero.
PREDICATE_NAME = re.compile(
    r"^_*(?:is|am)_(?:the_)?(?:global_|local_)?"
    r"(?:main|master|chief|leader|primary|rank_?0|rank_?zero|zero|first)"
    r"(?:_(?:process|proc|rank|node|worker|host|gpu|device))?$"
    r"|^_*(?:global_|local_)?(?:main|master|chief|leader|primary)_(?:process|proc|rank|node|worker|gpu)$"
    r"|^_*(?:rank_?0|rank_?zero)(?:_only)?$|^_*master$",
    re.IGNORECASE,
)
# Functions that return a rank: dist.get_rank(), get_local_rank(), accelerator.get_rank().
RANK_FUNCTION = re.compile(r"^_*get_(?:[a-z]+_)*rank$", re.IGNORECASE)
RANK_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "NODE_RANK",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "PMI_RANK",
    }
)
# The torch calls that return this process's rank.
RANK_SOURCES = frozenset(
    {
        "torch.distributed.get_rank",
        "torch.distributed.get_node_local_rank",
        "torch.distributed.get_group_rank",
        "mpi4py.MPI.COMM_WORLD.Get_rank",
    }
)
# Attributes that libraries document as the process's rank (ddpkit's ctx, Accelerate's
# Accelerator and PartialState, Lightning's Fabric and Trainer, HF's TrainingArguments)
# or that the launcher fills in (`--local_rank` of torch.distributed.launch).
LIBRARY_RANK_ATTRIBUTES = frozenset(
    {"rank", "local_rank", "global_rank", "node_rank", "process_index", "local_process_index"}
)
LIBRARY_MAIN_ATTRIBUTES = frozenset(
    {
        "is_main",
        "is_main_process",
        "is_local_main_process",
        "is_global_zero",
        "is_world_process_zero",
        "is_local_process_zero",
    }
)
# Calls whose `rank=` argument, and whose `device_ids=[...]`, is this process's rank.
_RANK_KEYWORD_USERS = frozenset({"init_process_group", "DistributedSampler"})
_DEVICE_IDS_USERS = frozenset({"DistributedDataParallel", "DDP"})
# Decorators whose function body runs on rank 0 only (Lightning, accelerate, mmengine).
RANK_ZERO_DECORATORS = frozenset(
    {"rank_zero_only", "master_only", "main_process_only", "on_main_process"}
)
# torch.multiprocessing.spawn / start_processes start one process per rank.
SPAWNERS = frozenset({"spawn", "start_processes"})


def _cached_match(pattern: re.Pattern[str]) -> Callable[[str], bool]:
    """A memoised `pattern.match(name) is not None`: the same names come up again and again."""

    @cache
    def match(name: str) -> bool:
        return pattern.match(name) is not None

    return match


is_rank_name = _cached_match(RANK_NAME)
is_predicate_name = _cached_match(PREDICATE_NAME)
is_rank_function = _cached_match(RANK_FUNCTION)

# Assigned values that can carry a rank or a rank condition; others are skipped unseen.
_MAY_CARRY = (
    ast.Name,
    ast.Attribute,
    ast.Call,
    ast.Subscript,
    ast.BinOp,
    ast.Compare,
    ast.BoolOp,
    ast.UnaryOp,
    ast.NamedExpr,
)
# Values whose truth can hinge on the rank beyond being a rank or a predicate name.
_CONDITION_TYPES = (ast.Compare, ast.BoolOp, ast.UnaryOp, ast.NamedExpr)
_WRAPPERS = frozenset({"int", "str", "bool"})
# How many assignments back `built_from_rank` follows a value.
_BUILT_FROM_HOPS = 3


def _env_key(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_same_everywhere(node: ast.expr) -> bool:
    """`None` or a negative number: compared with a rank, the answer is the same on all."""
    if isinstance(node, ast.Constant):
        value = node.value
        return value is None or (isinstance(value, int) and value < 0)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return isinstance(node.operand, ast.Constant)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_is_same_everywhere(e) for e in node.elts)
    return False


def _int_constant(node: ast.expr) -> int | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_constant(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


# `rank OP c` with the constant on the right, for `c OP rank` written the other way round.
_MIRRORED: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.Gt,
    ast.LtE: ast.GtE,
    ast.Gt: ast.Lt,
    ast.GtE: ast.LtE,
}


def _holds_alike_for_every_rank(expr: ast.Compare) -> bool:
    """`rank >= 0`, `local_rank < 0`, `0 <= rank`: ranks are 0, 1, 2, ..., so the answer
    is the same on every rank ("is distributed set up?"), unlike `rank > 0` or `rank < 2`."""
    if len(expr.ops) != 1:
        return False
    op = type(expr.ops[0])
    value = _int_constant(expr.comparators[0])
    if value is None:
        value = _int_constant(expr.left)
        if value is None or op not in _MIRRORED:
            return False
        op = _MIRRORED[op]
    if op in (ast.Lt, ast.GtE):  # rank < c is never, rank >= c always true for c <= 0
        return value <= 0
    if op in (ast.LtE, ast.Gt):
        return value < 0
    return False


def _from_line(names: dict[str, int], name: str, line: int) -> bool:
    """Note that `name` holds a rank from `line` on; True when that is news."""
    if names.get(name, line + 1) <= line:
        return False
    names[name] = line
    return True


def _add(names: set[str], name: str) -> bool:
    """Add `name` to `names`; True when it was not there yet."""
    news = name not in names
    names.add(name)
    return news


@dataclass
class RankFacts:
    """Attributes and functions shown to carry a rank, shared by the files of a program:
    `args.rank = int(os.environ["RANK"])` in `utils.py` makes `args.rank` a rank in
    `main.py` too, and `def is_main_process(): return get_rank() == 0` there makes
    `utils.is_main_process()` a rank test."""

    value_attrs: set[str] = field(default_factory=set)
    predicate_attrs: set[str] = field(default_factory=set)
    value_functions: set[str] = field(default_factory=set)
    predicate_functions: set[str] = field(default_factory=set)


class RankModel:
    """Answers "is this a rank?" and "does this condition differ between ranks?".

    With `by_name` (the default) a name shaped like a rank (`rank`, `gpu_id`,
    `is_master`) counts as one: that is how people name them, and rules that only keep
    quiet on rank-0 code are safer for it. With `by_name=False` a value is a rank only
    by data flow from a rank source: `dist.get_rank()`, a `RANK`-like environment
    variable, the process index `mp.spawn` passes, `--local_rank` from the launcher,
    the rank attributes of ddpkit, Accelerate and Lightning, and whatever is computed
    from those (assignments, parameters given them, functions returning them). That is
    the proof an error-level finding needs.
    """

    def __init__(
        self, index: Index, *, by_name: bool = True, facts: RankFacts | None = None
    ) -> None:
        self._index = index
        self._by_name = by_name
        # Per scope, the variables that hold a rank (or a rank test), with the first line
        # from which they do: `seed < 0` above `seed = base + get_rank()` is no rank test.
        self._value_names: dict[Scope, dict[str, int]] = {}
        self._predicate_names: dict[Scope, dict[str, int]] = {}
        facts = facts if facts is not None else RankFacts()
        self._value_attrs = facts.value_attrs
        self._predicate_attrs = facts.predicate_attrs
        self._value_functions = facts.value_functions
        self._predicate_functions = facts.predicate_functions
        if not by_name:
            self._value_attrs.update(LIBRARY_RANK_ATTRIBUTES)
            self._predicate_attrs.update(LIBRARY_MAIN_ATTRIBUTES)
        self._condition_memo: dict[int, bool] = {}
        # Answers are memoised only once the taint below has settled.
        self._settled = False
        if not by_name:
            self._follow_uses()
        self._follow_assignments(index.assignments)
        self._follow_parameters()
        self._follow_returns()
        self._settled = True

    def _rank_name(self, name: str) -> bool:
        return self._by_name and is_rank_name(name)

    def _predicate_name(self, name: str) -> bool:
        return self._by_name and is_predicate_name(name)

    def _rank_function(self, call: ast.Call, name: str) -> bool:
        if self._by_name:
            return is_rank_function(name)
        return self._index.imports.resolve(call.func) in RANK_SOURCES

    # -- taint ----------------------------------------------------------------------

    def _taint(self, target: ast.expr, scope: Scope, *, predicate: bool) -> bool:
        """Mark `target` as a rank value (or predicate); True when that is news."""
        if isinstance(target, ast.Name):
            table = self._predicate_names if predicate else self._value_names
            return _from_line(table.setdefault(scope, {}), target.id, target.lineno)
        if isinstance(target, ast.Attribute):
            return _add(self._predicate_attrs if predicate else self._value_attrs, target.attr)
        return False

    def _follow_assignments(self, assignments: Iterable[Assignment]) -> None:
        todo = [a for a in assignments if isinstance(a.value, _MAY_CARRY)]
        # A second round only revisits what came before the last new taint (an alias
        # used above its definition, e.g. a method above __init__); later ones saw it all.
        for _ in range(2):
            last_change = -1
            for position, a in enumerate(todo):
                value = a.value
                if self.is_rank_value(value, a.scope):
                    if self._taint(a.target, a.scope, predicate=False):
                        last_change = position
                elif (
                    self._condition(value, a.scope)
                    if isinstance(value, _CONDITION_TYPES)
                    else self.is_rank_predicate(value, a.scope)
                ) and self._taint(a.target, a.scope, predicate=True):
                    last_change = position
            if last_change <= 0:
                break
            todo = todo[:last_change]

    def _follow_uses(self) -> None:
        """A value the file hands to torch as this process's rank is one:
        `init_process_group(rank=r)`, `DistributedSampler(..., rank=r)`,
        `torch.cuda.set_device(local_rank)`, `DDP(model, device_ids=[local_rank])`."""
        for site in self._index.calls:
            call = site.call
            name = tail(call.func)
            given: list[ast.expr] = []
            if name in _RANK_KEYWORD_USERS:
                given = [k.value for k in call.keywords if k.arg == "rank"]
            elif name == "set_device" and call.args:
                given = [call.args[0]]
            elif name in _DEVICE_IDS_USERS:
                for k in call.keywords:
                    if k.arg == "device_ids" and isinstance(k.value, (ast.List, ast.Tuple)):
                        given = list(k.value.elts[:1])
            for value in given:
                if isinstance(value, ast.Name):  # the same value all along its function
                    _from_line(self._value_names.setdefault(site.scope, {}), value.id, 0)
                elif isinstance(value, ast.Attribute):
                    self._taint(value, site.scope, predicate=False)

    def _follow_parameters(self) -> None:
        """A parameter that a call of this file passes a rank to is a rank."""
        index = self._index
        by_name: dict[str, list[Scope]] = {}
        for fn in index.functions:
            if not fn.is_method:
                by_name.setdefault(fn.name, []).append(fn)
        for cls_name, info in index.classes.items():
            init = info.methods.get("__init__")
            if init is not None:
                by_name.setdefault(cls_name, []).append(init)
        changed = False
        for site in index.calls:
            call = site.call
            # mp.spawn(main, ...) calls main(rank, *args).
            if tail(call.func) in SPAWNERS and call.args and isinstance(call.args[0], ast.Name):
                for fn in by_name.get(call.args[0].id, ()):
                    if fn.params:
                        changed |= self._taint_param(fn, fn.params[0])
            if not isinstance(call.func, ast.Name):
                continue
            targets = by_name.get(call.func.id)
            if not targets:
                continue
            for fn in targets:
                params = fn.params[1:] if fn.is_method else fn.params
                for param, arg in zip(params, call.args, strict=False):
                    if self.is_rank_value(arg, site.scope):
                        changed |= self._taint_param(fn, param)
                for keyword in call.keywords:
                    if (
                        keyword.arg in params
                        and keyword.arg is not None
                        and self.is_rank_value(keyword.value, site.scope)
                    ):
                        changed |= self._taint_param(fn, keyword.arg)
        if changed:
            # `self.device = device` in __init__ now carries the rank too.
            self._follow_assignments(a for a in index.assignments if a.scope.is_method)

    def _taint_param(self, fn: Scope, param: str) -> bool:
        return not self._rank_name(param) and _from_line(
            self._value_names.setdefault(fn, {}), param, 0
        )

    def _follow_returns(self) -> None:
        """`def is_main(): return dist.get_rank() == 0` makes `is_main()` a predicate."""
        for _ in range(2):
            changed = False
            for fn in self._index.functions:
                if fn.name in self._value_functions or fn.name in self._predicate_functions:
                    continue
                if any(self.is_rank_value(r, fn) for r in fn.returns):
                    self._value_functions.add(fn.name)
                    changed = True
                elif any(self.is_rank_condition(r, fn) for r in fn.returns):
                    self._predicate_functions.add(fn.name)
                    changed = True
            if not changed:
                break

    def _has_name(self, table: dict[Scope, dict[str, int]], expr: ast.Name, scope: Scope) -> bool:
        """A variable tainted in this scope at or above this line, or at module level
        (module code has run before any function is called)."""
        local = table.get(scope)
        if local is not None and local.get(expr.id, expr.lineno + 1) <= expr.lineno:
            return True
        module = table.get(self._index.module)
        return module is not None and not scope.is_module and expr.id in module

    # -- queries --------------------------------------------------------------------

    def is_rank_value(self, expr: ast.expr, scope: Scope) -> bool:
        """True when `expr` evaluates to this process's rank (or a number made from it)."""
        if isinstance(expr, ast.Name):
            return self._rank_name(expr.id) or self._has_name(self._value_names, expr, scope)
        if isinstance(expr, ast.Attribute):
            return self._rank_name(expr.attr) or expr.attr in self._value_attrs
        if isinstance(expr, ast.Call):
            name = tail(expr.func)
            if name is None:
                return False
            if self._rank_function(expr, name) or name in self._value_functions:
                return True
            if name in _WRAPPERS and len(expr.args) == 1:
                return self.is_rank_value(expr.args[0], scope)
            if name in ("get", "getenv") and expr.args:
                return _env_key(expr.args[0]) in RANK_ENV
            return False
        if isinstance(expr, ast.Subscript):
            base = dotted(expr.value)
            return (
                base is not None and base.endswith("environ") and _env_key(expr.slice) in RANK_ENV
            )
        if isinstance(expr, ast.BinOp):  # rank % gpus_per_node, rank + 1
            return self.is_rank_value(expr.left, scope) or self.is_rank_value(expr.right, scope)
        return False

    def is_rank_predicate(self, expr: ast.expr, scope: Scope) -> bool:
        """True when `expr` is a boolean that says "this is the main process"."""
        if isinstance(expr, ast.Name):
            return self._predicate_name(expr.id) or self._has_name(
                self._predicate_names, expr, scope
            )
        if isinstance(expr, ast.Attribute):
            return self._predicate_name(expr.attr) or expr.attr in self._predicate_attrs
        if isinstance(expr, ast.Call):
            name = tail(expr.func)
            return name is not None and (
                self._predicate_name(name)
                or name in self._predicate_functions
                or (not self._by_name and name in LIBRARY_MAIN_ATTRIBUTES)
            )
        return False

    def is_rank_condition(self, expr: ast.expr, scope: Scope) -> bool:
        """True when `expr`, used as a condition, can be true on one rank and false on another."""
        if not self._settled:
            return self._condition(expr, scope)
        key = id(expr)
        memo = self._condition_memo.get(key)
        if memo is None:
            memo = self._condition(expr, scope)
            self._condition_memo[key] = memo
        return memo

    def _condition(self, expr: ast.expr, scope: Scope) -> bool:
        if isinstance(expr, ast.BoolOp):
            return any(self.is_rank_condition(v, scope) for v in expr.values)
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
            return self.is_rank_condition(expr.operand, scope)
        if isinstance(expr, ast.NamedExpr):
            return self.is_rank_condition(expr.value, scope)
        if isinstance(expr, ast.Compare):
            if all(isinstance(op, (ast.Is, ast.IsNot)) for op in expr.ops):
                return False
            operands = [expr.left, *expr.comparators]
            ranked = [
                o
                for o in operands
                if self.is_rank_value(o, scope) or self.is_rank_predicate(o, scope)
            ]
            if not ranked:
                return False
            others = [o for o in operands if not any(o is r for r in ranked)]
            if others and all(_is_same_everywhere(o) for o in others):
                return False
            return not _holds_alike_for_every_rank(expr)
        if isinstance(expr, ast.Call) and tail(expr.func) == "bool" and len(expr.args) == 1:
            return self.is_rank_condition(expr.args[0], scope)
        return self.is_rank_predicate(expr, scope) or self.is_rank_value(expr, scope)

    def rank_guard(self, guards: tuple[Guard, ...], scope: Scope) -> Guard | None:
        """The innermost guard that depends on the rank, or None."""
        for guard in reversed(guards):
            if self.is_rank_condition(guard.test, scope):
                return guard
        return None

    def mentions_rank(self, expr: ast.expr, scope: Scope) -> bool:
        """True when any part of `expr` is a rank (e.g. a path f"ckpt_{rank}.pt")."""
        return any(
            isinstance(node, ast.expr) and self.is_rank_value(node, scope)
            for node in ast.walk(expr)
        )

    def built_from_rank(self, expr: ast.expr, scope: Scope) -> bool:
        """True when `expr` mentions the rank, directly or through the variables it is
        built from, a few assignments deep: `path = join(rank_dir, "last.pt")` after
        `rank_dir = join(out, f"rank_{rank}")` names one file per rank."""
        values = [(expr, scope)]
        seen: set[str] = set()
        for _ in range(_BUILT_FROM_HOPS + 1):
            if any(self.mentions_rank(value, where) for value, where in values):
                return True
            names = {
                n.id for value, _ in values for n in ast.walk(value) if isinstance(n, ast.Name)
            }
            names -= seen
            seen |= names
            values = [
                (a.value, a.scope)
                for a in self._index.assignments
                if isinstance(a.target, ast.Name)
                and a.target.id in names
                and a.scope in (scope, self._index.module)
            ]
        return False
