"""One pass over a module's syntax tree that records what every rule needs.

Rules never walk the tree themselves: walking is most of the cost of checking a
file, so it happens once, here. For each call and each mention of a function of
this file the index keeps the scope it is in, the conditions that must hold for it
to run (its guards) and how deeply it sits in loops. Whether a guard depends on the
rank is decided later (`ranks.py`), once all assignments are known.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass, field
from typing import Any, cast

from ddpkit.check.names import Imports, tail

# Guard.branch: which part of its owner the guarded code is in.
BODY = 0  # `if test:` body, `while test:` body, `x if test else y` -> x
ORELSE = 1  # the `else` part
AFTER = 2  # after `if test: return` in the same block (an early exit)
OPERAND = 3  # a later operand of `a and b` / `a or b` (runs only for some values of a)


@dataclass(frozen=True, slots=True, eq=False)
class Guard:
    """A condition under which some code runs."""

    test: ast.expr
    owner: ast.AST
    branch: int


@dataclass(eq=False, slots=True)
class Scope:
    """The module, or one function or method, with what its body says about itself."""

    node: ast.AST
    name: str
    parent: Scope | None
    # The class whose instance `self` is inside this code (methods and their closures).
    class_name: str | None = None
    # True for a `def` directly in a class body.
    is_method: bool = False
    params: tuple[str, ...] = ()
    decorators: tuple[str, ...] = ()
    returns: list[ast.expr] = field(default_factory=list)
    # Variables this function binds (parameters, assignment and loop targets): inside
    # it, and in the functions nested in it, such a name is never a module function.
    local_names: set[str] = field(default_factory=set)

    @property
    def is_module(self) -> bool:
        return self.parent is None


@dataclass(eq=False, slots=True)
class Site:
    """A call, loop or name mention at a place in a scope, with its guards."""

    node: ast.AST
    scope: Scope
    guards: tuple[Guard, ...]
    loop_depth: int

    @property
    def call(self) -> ast.Call:
        """The node of a call site (the index only makes call sites from calls)."""
        return cast(ast.Call, self.node)

    @property
    def line(self) -> int:
        return cast(int, getattr(self.node, "lineno", 1))


@dataclass(eq=False, slots=True)
class Ref(Site):
    """A mention of a name that may be a function, method or class of this file."""

    name: str = ""
    # The call when the mention is called (`name(...)`, `x.name(...)`), else None.
    call_expr: ast.Call | None = None
    # For `x.name`: the expression before the dot.
    receiver: ast.expr | None = None


@dataclass(eq=False, slots=True)
class Assignment:
    target: ast.expr
    value: ast.expr
    scope: Scope


@dataclass(eq=False, slots=True)
class ClassInfo:
    node: ast.ClassDef
    bases: tuple[str, ...]
    methods: dict[str, Scope] = field(default_factory=dict)


@dataclass(eq=False)
class Index:
    """Everything one pass over a module records."""

    tree: ast.Module
    imports: Imports
    module: Scope
    functions: list[Scope] = field(default_factory=list)
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    calls: list[Site] = field(default_factory=list)
    refs: list[Ref] = field(default_factory=list)
    loops: list[Site] = field(default_factory=list)  # `for` loops
    while_loops: list[Site] = field(default_factory=list)
    assignments: list[Assignment] = field(default_factory=list)
    # Names and attribute names read anywhere outside / inside `except` handlers.
    seen: set[str] = field(default_factory=set)
    seen_in_except: set[str] = field(default_factory=set)
    # The calls (by id) made inside `except` handlers: they run on errors only.
    calls_in_except: set[int] = field(default_factory=set)
    # The calls (by id) made in a `with torch_distributed_zero_first(rank):` block.
    calls_rank_zero_first: set[int] = field(default_factory=set)
    # The calls by the last name of the callee (`dist.barrier()` under "barrier").
    calls_by_tail: dict[str, list[Site]] = field(default_factory=dict)
    # The assignments to plain names (`x = ...`), by the name.
    assignments_to: dict[str, list[Assignment]] = field(default_factory=dict)


def build_index(tree: ast.Module, linked: frozenset[str] = frozenset()) -> Index:
    """Index `tree` in a single walk.

    `linked`: names that may stand for functions of other checked files (imported
    names, and the names those files define); mentions of them are recorded too.
    """
    indexer = _Indexer(tree, linked)
    # The handler table holds bound methods of the indexer: a reference cycle that
    # would keep the whole tree alive until the garbage collector runs.
    indexer._handlers.clear()
    index = indexer.index
    for site in index.calls:
        name = tail(site.call.func)
        if name is not None:
            index.calls_by_tail.setdefault(name, []).append(site)
    for a in index.assignments:
        if isinstance(a.target, ast.Name):
            index.assignments_to.setdefault(a.target.id, []).append(a)
    return index


def defined_names(tree: ast.Module) -> set[str]:
    """The functions, classes and methods a module defines (without walking expressions)."""
    funcs: set[str] = set()
    methods: set[str] = set()
    _collect_defs(tree.body, False, funcs, methods)
    return funcs | methods


_EXIT_CALLS = frozenset({"exit", "_exit", "quit"})
# Context managers that let rank 0 run the block first while the other ranks wait at a
# barrier, then let those run it (YOLO's `torch_distributed_zero_first`, transformers'
# `main_process_first`): whatever the block writes is written by rank 0 before anyone reads.
RANK_ZERO_FIRST = frozenset(
    {"torch_distributed_zero_first", "main_process_first", "local_main_process_first"}
)


def exits(body: list[ast.stmt]) -> bool:
    """True when a block always leaves: it ends in return, raise, continue, break or exit()."""
    last = body[-1]
    if isinstance(last, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
        return True
    return (
        isinstance(last, ast.Expr)
        and isinstance(last.value, ast.Call)
        and tail(last.value.func) in _EXIT_CALLS
    )


# Statements that hold other statements (and so maybe a `def`).
_COMPOUND: tuple[type[ast.stmt], ...] = (
    ast.If,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.With,
    ast.AsyncWith,
    ast.Try,
    ast.Match,
    *(t for t in (getattr(ast, "TryStar", None),) if t is not None),
)


def _collect_defs(
    body: list[ast.stmt], in_class: bool, funcs: set[str], methods: set[str], top: bool = True
) -> None:
    """Names of the functions (and classes) and of the methods defined in `body`.

    Module and class level are searched through `if`/`try`/`with` blocks; inside a
    function only its direct `def`s are (a `def` in a loop inside a function is rare,
    and missing it only leaves that function's context unknown, hence silent).
    """
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            (methods if in_class else funcs).add(stmt.name)
            _collect_defs(stmt.body, False, funcs, methods, top=False)
        elif isinstance(stmt, ast.ClassDef):
            funcs.add(stmt.name)
            _collect_defs(stmt.body, True, funcs, methods, top)
        elif top and isinstance(stmt, _COMPOUND):
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, name, None)
                if inner:
                    _collect_defs(inner, in_class, funcs, methods, top)
            for handler in getattr(stmt, "handlers", ()):
                _collect_defs(handler.body, in_class, funcs, methods, top)
            for case in getattr(stmt, "cases", ()):
                _collect_defs(case.body, in_class, funcs, methods, top)


_LEAF_TYPES: tuple[type[ast.AST], ...] = (
    ast.expr_context,
    ast.operator,
    ast.cmpop,
    ast.unaryop,
    ast.boolop,
    ast.Constant,
    ast.Pass,
    ast.Global,
    ast.Nonlocal,
)


class _Indexer:
    def __init__(self, tree: ast.Module, linked: frozenset[str]) -> None:
        funcs: set[str] = set()
        methods: set[str] = set()
        _collect_defs(tree.body, False, funcs, methods)
        self._func_names = funcs | linked
        self._method_names = methods | linked
        module = Scope(tree, "<module>", None)
        self.index = Index(tree, Imports(), module)
        self._scope = module
        self._guards: tuple[Guard, ...] = ()
        self._loop_depth = 0
        # Where names read here go: `seen`, or `seen_in_except` inside a handler.
        self._seen = self.index.seen
        self._rank_zero_first = False  # inside a `RANK_ZERO_FIRST` block
        self._class_name: str | None = None
        self._class_body: ClassInfo | None = None
        visit, visit_all = self._visit, self._visit_all
        self._handlers: dict[type[ast.AST], Any] = {
            ast.Module: lambda n: self._body(n.body),
            ast.FunctionDef: self._function,
            ast.AsyncFunctionDef: self._function,
            ast.ClassDef: self._class,
            ast.If: self._if,
            ast.While: self._while,
            ast.For: self._for,
            ast.AsyncFor: self._for,
            ast.With: self._with,
            ast.AsyncWith: self._with,
            ast.Try: self._try,
            ast.Import: self.index.imports.add,
            ast.ImportFrom: self.index.imports.add,
            ast.Assign: self._assign,
            ast.AnnAssign: self._ann_assign,
            ast.NamedExpr: self._named_expr,
            ast.Return: self._return,
            ast.Call: self._call,
            ast.Name: self._name,
            ast.Attribute: self._attribute,
            ast.IfExp: self._if,
            ast.BoolOp: self._bool_op,
            # The most common nodes get a direct handler: the generic walk costs more.
            ast.Expr: self._value,
            ast.keyword: self._value,
            ast.FormattedValue: self._value,
            ast.Starred: self._value,
            ast.Await: self._value,
            ast.BinOp: lambda n: (visit(n.left), visit(n.right)),
            ast.Subscript: lambda n: (visit(n.value), visit(n.slice)),
            ast.Tuple: self._elts,
            ast.List: self._elts,
            ast.Set: self._elts,
            ast.JoinedStr: self._joined_str,
            ast.Compare: lambda n: (visit(n.left), visit_all(n.comparators)),
            ast.UnaryOp: lambda n: visit(n.operand),
            ast.Dict: lambda n: (visit_all(n.keys), visit_all(n.values)),  # a key may be None
            ast.AugAssign: lambda n: (visit(n.target), visit(n.value)),
            ast.alias: _ignore,
            ast.arguments: _ignore,  # lambda parameters; their defaults hold no calls of note
        }
        try_star = getattr(ast, "TryStar", None)  # Python >= 3.11
        if try_star is not None:
            self._handlers[try_star] = self._try
        for leaf in _LEAF_TYPES:
            for cls in [leaf, *leaf.__subclasses__()]:
                self._handlers.setdefault(cls, _ignore)
        self._visit(tree)
        # A bare name bound as a variable in its function (`evaluate = {...}`, a
        # parameter `evaluate`) is that variable wherever it is read there, even above
        # the binding: Python decides a function's local names for its whole body.
        self.index.refs = [
            ref
            for ref in self.index.refs
            if ref.receiver is not None or not _is_local_variable(ref.scope, ref.name)
        ]

    # -- dispatch -----------------------------------------------------------------

    def _visit(self, node: ast.AST) -> None:
        handler = self._handlers.get(type(node))
        if handler is not None:
            handler(node)
            return
        visit = self._visit
        for name in node._fields:
            value = getattr(node, name, None)
            if type(value) is list:
                for item in value:
                    if isinstance(item, ast.AST):
                        visit(item)
            elif isinstance(value, ast.AST):
                visit(value)

    def _value(self, node: Any) -> None:
        self._visit(node.value)

    def _elts(self, node: ast.Tuple | ast.List | ast.Set) -> None:
        for elt in node.elts:
            self._visit(elt)

    def _joined_str(self, node: ast.JoinedStr) -> None:
        for value in node.values:
            if type(value) is not ast.Constant:
                self._visit(value)

    def _visit_all(self, nodes: list[Any]) -> None:
        for node in nodes:
            if node is not None:
                self._visit(node)

    def _site(self, node: ast.AST) -> Site:
        return Site(node, self._scope, self._guards, self._loop_depth)

    def _body(self, stmts: list[ast.stmt]) -> None:
        saved = self._guards
        for stmt in stmts:
            self._visit(stmt)
            # `if not is_main: return` guards everything after it in this block.
            if isinstance(stmt, ast.If) and (
                exits(stmt.body) or (stmt.orelse and exits(stmt.orelse))
            ):
                self._guards = (*self._guards, Guard(stmt.test, stmt, AFTER))
        self._guards = saved

    def _guarded(self, guard: Guard, node: Any) -> None:
        saved = self._guards
        self._guards = (*saved, guard)
        if isinstance(node, list):
            self._body(node)
        else:
            self._visit(node)
        self._guards = saved

    # -- scopes -------------------------------------------------------------------

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._visit_all(node.decorator_list)
        self._visit_all(node.args.defaults)
        self._visit_all(node.args.kw_defaults)
        args = node.args
        params = tuple(a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs])
        in_class = self._class_body
        scope = Scope(
            node,
            node.name,
            self._scope,
            class_name=self._class_name,
            is_method=in_class is not None,
            params=params,
            local_names=set(params),
            decorators=tuple(
                t
                for d in node.decorator_list
                if (t := tail(d.func if isinstance(d, ast.Call) else d)) is not None
            ),
        )
        self.index.functions.append(scope)
        if in_class is not None:
            in_class.methods[node.name] = scope
        saved = (self._scope, self._guards, self._loop_depth, self._seen, self._rank_zero_first)
        self._scope, self._guards, self._loop_depth = scope, (), 0
        self._seen = self.index.seen  # a def inside `except` runs whenever it is called
        self._rank_zero_first = False  # ... and so does a def inside a `with` block
        self._class_body = None
        self._body(node.body)
        self._scope, self._guards, self._loop_depth, self._seen, self._rank_zero_first = saved
        self._class_body = in_class

    def _class(self, node: ast.ClassDef) -> None:
        self._visit_all(node.decorator_list)
        self._visit_all(node.bases)
        for keyword in node.keywords:
            self._visit(keyword.value)
        info = ClassInfo(node, tuple(t for b in node.bases if (t := tail(b)) is not None))
        self.index.classes.setdefault(node.name, info)
        saved = (self._class_name, self._class_body)
        self._class_name, self._class_body = node.name, info
        self._body(node.body)
        self._class_name, self._class_body = saved

    # -- statements ---------------------------------------------------------------

    def _if(self, node: ast.If | ast.IfExp) -> None:
        self._visit(node.test)
        self._guarded(Guard(node.test, node, BODY), node.body)
        if node.orelse:  # always there in `x if test else y`
            self._guarded(Guard(node.test, node, ORELSE), node.orelse)

    def _while(self, node: ast.While) -> None:
        self.index.while_loops.append(self._site(node))
        self._visit(node.test)
        self._loop_depth += 1
        self._guarded(Guard(node.test, node, BODY), node.body)
        self._loop_depth -= 1
        self._body(node.orelse)

    def _bind(self, target: ast.expr | None) -> None:
        """Note the plain names a `for` or `with ... as` target binds in this function."""
        if type(target) is ast.Name:
            self._scope.local_names.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                self._bind(elt)

    def _for(self, node: ast.For | ast.AsyncFor) -> None:
        self.index.loops.append(self._site(node))
        self._bind(node.target)
        self._visit(node.iter)
        self._loop_depth += 1
        self._body(node.body)
        self._loop_depth -= 1
        self._body(node.orelse)

    def _with(self, node: ast.With | ast.AsyncWith) -> None:
        saved = self._rank_zero_first
        for item in node.items:
            self._visit(item.context_expr)
            self._bind(item.optional_vars)
            manager = item.context_expr
            if isinstance(manager, ast.Call) and tail(manager.func) in RANK_ZERO_FIRST:
                self._rank_zero_first = True
        self._body(node.body)
        self._rank_zero_first = saved

    def _try(self, node: Any) -> None:
        self._body(node.body)
        saved, self._seen = self._seen, self.index.seen_in_except
        for handler in node.handlers:
            if handler.type is not None:
                self._visit(handler.type)
            self._body(handler.body)
        self._seen = saved
        self._body(node.orelse)
        self._body(node.finalbody)

    def _record(self, target: ast.expr, value: ast.expr) -> None:
        assignments = self.index.assignments
        if (
            isinstance(target, (ast.Tuple, ast.List))
            and isinstance(value, (ast.Tuple, ast.List))
            and len(target.elts) == len(value.elts)
        ):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._record(t, v)
        else:
            assignments.append(Assignment(target, value, self._scope))
            if type(target) is ast.Name:
                self._scope.local_names.add(target.id)

    def _assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._record(target, node.value)
            if not isinstance(target, ast.Name):
                self._visit(target)
        self._visit(node.value)

    def _ann_assign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._record(node.target, node.value)
            self._visit(node.value)
        if not isinstance(node.target, ast.Name):
            self._visit(node.target)

    def _named_expr(self, node: ast.NamedExpr) -> None:
        self._record(node.target, node.value)
        self._visit(node.value)

    def _return(self, node: ast.Return) -> None:
        if node.value is not None:
            self._scope.returns.append(node.value)
            self._visit(node.value)

    # -- expressions --------------------------------------------------------------

    def _call(self, node: ast.Call) -> None:
        self.index.calls.append(self._site(node))
        if self._seen is not self.index.seen:
            self.index.calls_in_except.add(id(node))
        if self._rank_zero_first:
            self.index.calls_rank_zero_first.add(id(node))
        func = node.func
        if isinstance(func, ast.Name):
            self._name(func, node)
            if func.id not in self._func_names and "__call__" in self._method_names:
                # `stopper(loss)` on an instance runs its class's `__call__`.
                self._ref(func, "__call__", node, receiver=func)
        elif isinstance(func, ast.Attribute):
            self._attribute(func, node)
        else:
            self._visit(func)
        for arg in node.args:
            self._visit(arg)
        for keyword in node.keywords:
            self._visit(keyword.value)

    def _ref(
        self, node: ast.expr, name: str, call: ast.Call | None, receiver: ast.expr | None = None
    ) -> None:
        """Record a mention of one of the file's own functions or methods, with context."""
        site = (node, self._scope, self._guards, self._loop_depth)
        self.index.refs.append(Ref(*site, name=name, call_expr=call, receiver=receiver))

    def _name(self, node: ast.Name, call: ast.Call | None = None) -> None:
        if type(node.ctx) is not ast.Load:
            return
        name = node.id
        self._seen.add(name)
        if name in self._func_names:
            self._ref(node, name, call)

    def _attribute(self, node: ast.Attribute, call: ast.Call | None = None) -> None:
        name = node.attr
        if type(node.ctx) is ast.Load:
            self._seen.add(name)
            if name in self._method_names:
                self._ref(node, name, call, receiver=node.value)
        value = node.value
        if type(value) is ast.Name:  # `self.x`, `dist.barrier`: skip the dispatch
            self._name(value)
        else:
            self._visit(value)

    def _bool_op(self, node: ast.BoolOp) -> None:
        saved = self._guards
        values = node.values
        self._visit(values[0])
        for previous, value in itertools.pairwise(values):
            self._guards = (*self._guards, Guard(previous, node, OPERAND))
            self._visit(value)
        self._guards = saved


def _is_local_variable(scope: Scope | None, name: str) -> bool:
    """`name` is a variable of `scope` or of a function it is nested in (not the module)."""
    while scope is not None and scope.parent is not None:
        if name in scope.local_names:
            return True
        scope = scope.parent
    return False


def _ignore(node: ast.AST) -> None:
    """Leaves (operators, contexts, constants) hold nothing a rule needs."""
