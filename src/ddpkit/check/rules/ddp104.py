"""DDP104: saving `ddp_model.state_dict()` (keys `module.*`) instead of the inner model's."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import Ref, Scope, Site
from ddpkit.check.names import tail
from ddpkit.check.rules.base import (
    Hit,
    Rule,
    argument,
    assignments_to,
    contains,
    passed_for,
    show,
)
from ddpkit.check.rules.ddp103 import checkpoint_writes
from ddpkit.findings import Severity

# Code that strips the prefix itself, after which saving the wrapper's dict is fine.
_PREFIX_FIXERS = ("consume_prefix_in_state_dict_if_present",)

# (position, is a DDP wrap, scope) of each assignment to one name or `self.attr`.
_Timeline = list[tuple[tuple[int, int], bool, Scope]]
# A wrapped name: (scope, "model"); a wrapped attribute: (None, "Trainer.model").
_Key = tuple[Scope | None, str]


def _position(node: ast.AST) -> tuple[int, int]:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))


def _key(target: ast.expr, scope: Scope) -> _Key | None:
    """`model` in a scope, or `self.model` in a class."""
    if isinstance(target, ast.Name):
        return (scope, target.id)
    if (
        isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
        and scope.class_name
    ):
        return (None, f"{scope.class_name}.{target.attr}")
    return None


def _unwraps(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Attribute) and expr.attr == "module"


def _timelines(fa: FileAnalysis) -> dict[_Key, _Timeline]:
    """Assignment histories of the names and attributes that are ever a DDP wrapper:
    assigned a wrap, or handed one on (`self.model = model` after `model = DDP(model)`,
    `save_model = ema if use_ema else self.model`)."""
    handed_on: set[int] = set()  # assigned values (by id) that carry a wrapper
    # Targets that the code unwraps somewhere (`g = gen.module` in one branch, `g = gen`
    # in the other, the single-process one): a copy into them is the plain model.
    unwrapped = {
        key
        for a in fa.index.assignments
        if _unwraps(a.value) and (key := _key(a.target, a.scope)) is not None
    }
    timelines: dict[_Key, _Timeline] = {}
    for _ in range(3):  # model -> self.model -> save_model
        wrapped = {
            key
            for a in fa.index.assignments
            if (fa.is_ddp_wrap(a.value) or id(a.value) in handed_on)
            and (key := _key(a.target, a.scope)) is not None
        }
        timelines = {}
        for a in fa.index.assignments:
            key = _key(a.target, a.scope)
            if key in wrapped:
                carries = fa.is_ddp_wrap(a.value) or id(a.value) in handed_on
                timelines.setdefault(key, []).append((_position(a.value), carries, a.scope))
        news = False
        for a in fa.index.assignments:
            value = a.value
            if id(value) in handed_on or _key(a.target, a.scope) in unwrapped:
                continue
            branches = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
            if any(_unwraps(b) for b in branches):
                continue  # `model.module if ddp else model`: the plain model either way
            here = Site(value, a.scope, (), 0)
            if any(_is_wrapped_receiver(b, here, timelines, fa.index.module) for b in branches):
                handed_on.add(id(value))
                news = True
        if not news:
            break
    return timelines


def _wrapped_at(timeline: _Timeline | None, site: Site, same_scope_only: bool) -> bool:
    """Was the last assignment before `site` (in its scope, else overall) a DDP wrap?"""
    if not timeline:
        return False
    where = _position(site.node)
    before = [e for e in timeline if e[2] is site.scope and e[0] < where]
    if before:
        return max(before, key=lambda e: e[0])[1]
    if same_scope_only:
        return False
    return max(timeline, key=lambda e: e[0])[1]


def _is_wrapped_receiver(
    receiver: ast.expr, site: Site, timelines: dict[_Key, _Timeline], module: Scope
) -> bool:
    key = _key(receiver, site.scope)
    if key is None:
        return False
    if key[0] is None:  # self.attr: assigned in __init__, used in other methods
        return _wrapped_at(timelines.get(key), site, same_scope_only=False)
    local = timelines.get(key)
    if local:
        return _wrapped_at(local, site, same_scope_only=True)
    assert isinstance(receiver, ast.Name)
    return _wrapped_at(timelines.get((module, receiver.id)), site, same_scope_only=False)


def _strips_prefix(tree: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Constant) and isinstance(n.value, str) and "module" in n.value
        for n in ast.walk(tree)
    )


def _is_saved(fa: FileAnalysis, state_dict: ast.Call, site: Site) -> bool:
    """The state dict reaches a checkpoint write in the same function."""
    carriers: set[str] = set()

    def carries(expr: ast.expr) -> bool:
        return contains(expr, state_dict) or any(
            isinstance(n, ast.Name) and n.id in carriers for n in ast.walk(expr)
        )

    for a in fa.index.assignments:
        if a.scope is not site.scope or not carries(a.value):
            continue
        if _strips_prefix(a.value):
            return False
        target = a.target
        while isinstance(target, (ast.Subscript, ast.Attribute)):
            target = target.value  # ckpt["model"] = ... carries into ckpt
        if isinstance(target, ast.Name):
            carriers.add(target.id)
    objects = [
        argument(write.call, 0, "obj")
        for write, _ in checkpoint_writes(fa)
        if write.scope is site.scope
    ]
    # A helper such as `save_on_master(state, path)` or `utils.save_checkpoint(...)`
    # saves what it is given, like torch.save itself.
    for helper in _save_helpers(fa):
        if helper.scope is site.scope and helper.call.args:
            objects.append(helper.call.args[0])
    for obj in objects:
        if obj is not None and carries(obj):
            return not _strips_prefix(obj)
    return False


def _save_helpers(fa: FileAnalysis) -> Iterator[Site]:
    """Calls of the user's own save helpers (`save_on_master`, `save_checkpoint`)."""
    for name, sites in fa.calls_by_tail.items():
        if "save" not in name.lower() or name == "save":
            continue
        for site in sites:
            func = site.call.func
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id in fa.imports.aliases
                and func.value.id not in fa.links
            ):
                continue  # a library's save function (np.save, torch.jit.save, ...)
            yield site


def _is_wrapper_here(expr: ast.expr, site: Site, timelines: dict[_Key, _Timeline]) -> bool:
    # Only a load after the wrap in the same function is sure to fill the wrapper
    # (the tutorial loads into the plain model before wrapping it).
    key = _key(expr, site.scope)
    return key is not None and _wrapped_at(timelines.get(key), site, same_scope_only=True)


def _filled_parameters(fn: Scope) -> tuple[frozenset[str], bool]:
    """The parameters a helper calls `.load_state_dict(...)` on, and whether it does so on
    every keyword argument of its `**kwargs` (DINO's and SwAV's `restart_from_checkpoint`:
    `for key, value in kwargs.items(): value.load_state_dict(checkpoint[key])`)."""
    node = fn.node
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return frozenset(), False
    kwargs = node.args.kwarg.arg if node.args.kwarg is not None else None
    from_kwargs: set[str] = set()  # loop variables that take the values of **kwargs
    receivers: list[ast.expr] = []
    for n in ast.walk(node):
        if (
            isinstance(n, ast.For)
            and isinstance(n.iter, ast.Call)
            and isinstance(n.iter.func, ast.Attribute)
            and n.iter.func.attr in ("items", "values")
            and isinstance(n.iter.func.value, ast.Name)
            and n.iter.func.value.id == kwargs
        ):
            target = n.target
            if isinstance(target, ast.Tuple) and len(target.elts) == 2:
                target = target.elts[1]
            if isinstance(target, ast.Name):
                from_kwargs.add(target.id)
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "load_state_dict"
        ):
            receivers.append(n.func.value)
    filled: set[str] = set()
    every_keyword = False
    for receiver in receivers:
        if isinstance(receiver, ast.Subscript):  # kwargs[key].load_state_dict(...)
            receiver = receiver.value
            every_keyword |= isinstance(receiver, ast.Name) and receiver.id == kwargs
        elif isinstance(receiver, ast.Name):
            every_keyword |= receiver.id in from_kwargs
            if receiver.id in fn.params:
                filled.add(receiver.id)
    return frozenset(filled), every_keyword


def _helper_fills_wrapper(
    fa: FileAnalysis, ref: Ref, call: ast.Call, timelines: dict[_Key, _Timeline]
) -> bool:
    """`restart_from_checkpoint(path, model=ddp_model)`: a helper of the program, in this
    file or another, calls `load_state_dict` on the wrapper it is given."""
    positions = [i for i, arg in enumerate(call.args) if _is_wrapper_here(arg, ref, timelines)]
    keywords = [
        kw.arg
        for kw in call.keywords
        if kw.arg is not None and _is_wrapper_here(kw.value, ref, timelines)
    ]
    if not positions and not keywords:
        return False
    for fn in fa.callgraph.callees(fa.unit, ref):
        filled, every_keyword = _filled_parameters(fn)
        if not filled and not every_keyword:
            continue
        node = fn.node
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        positional = [a.arg for a in [*node.args.posonlyargs, *node.args.args]]
        if fn.is_method:
            positional = positional[1:]  # `self` is not passed in the call
        if any(i < len(positional) and positional[i] in filled for i in positions):
            return True
        if any(k in filled or (every_keyword and k not in fn.params) for k in keywords):
            return True
    return False


@dataclass
class _Resume:
    """How checkpoints are loaded back into the wrapper, so its `module.` keys fit:
    from the dict entries named `keys` (`ddp.load_state_dict(ckpt["netG_dict"])`), from a
    bare state dict (`ddp.load_state_dict(torch.load(p))`), or in a way not seen here."""

    keys: set[str] = field(default_factory=set)
    bare: bool = False
    unknown: bool = False

    def covers(self, shape: str | None) -> bool:
        """A save of this shape (a dict key, "" for a bare state dict) is what is resumed."""
        if self.unknown or shape is None:
            return True
        return self.bare if shape == "" else shape in self.keys


def _reloaded_into_wrapper(fa: FileAnalysis, timelines: dict[_Key, _Timeline]) -> _Resume | None:
    """`ddp_model.load_state_dict(...)`, directly or through a helper: the checkpoint is
    made to resume this same wrapper, so its `module.` keys load back as they are."""
    resume = _Resume()
    found = False
    for site in fa.calls("load_state_dict"):
        func = site.call.func
        if isinstance(func, ast.Attribute) and _is_wrapper_here(func.value, site, timelines):
            found = True
            given = site.call.args[0] if site.call.args else None
            if isinstance(given, ast.Subscript) and isinstance(given.slice, ast.Constant):
                resume.keys.add(str(given.slice.value))
            elif isinstance(given, ast.Call) and tail(given.func) == "load":
                resume.bare = True
            else:
                resume.unknown = True
    for ref in fa.index.refs:
        call = ref.call_expr
        if call is not None and _helper_fills_wrapper(fa, ref, call, timelines):
            found = True
            resume.unknown = True
    return resume if found else None


def _saved_shape(fa: FileAnalysis, state_dict: ast.Call, site: Site) -> str | None:
    """Where a saved state dict sits: under a key of a dict literal, "" when it is saved
    as it is (`torch.save(ddp.state_dict(), p)`), None when that is not in sight."""
    for write, _ in checkpoint_writes(fa):
        if write.scope is not site.scope:
            continue
        obj = argument(write.call, 0, "obj")
        if obj is state_dict:
            return ""
        if isinstance(obj, ast.Dict):
            for key, value in zip(obj.keys, obj.values, strict=True):
                if value is state_dict and isinstance(key, ast.Constant):
                    return str(key.value)
    return None


def _handed_a_wrapper(
    fa: FileAnalysis, receiver: ast.expr, site: Site, depth: int = 0
) -> FileAnalysis | None:
    """`train(net, ...)` after `net = DDP(net)`: a parameter that a call of its function,
    in any file of the program, passes the wrapper (also through a few such hand-offs).
    The file where the wrapper is made, else None."""
    fn = site.scope
    if (
        not isinstance(receiver, ast.Name)
        or receiver.id not in fn.params
        or assignments_to(fa, receiver.id, fn, module=False)
        or depth > 2
    ):
        return None
    for peer in fa.peers or [fa]:
        timelines: dict[_Key, _Timeline] | None = None
        for ref in peer.index.refs:
            call = ref.call_expr
            if call is None or ref.name != fn.name or fn not in peer.callees(ref):
                continue
            given = passed_for(fn, call, receiver.id)
            if given is None:
                continue
            timelines = timelines if timelines is not None else _timelines(peer)
            if _is_wrapped_receiver(given, ref, timelines, peer.index.module):
                return peer
            further = _handed_a_wrapper(peer, given, ref, depth + 1)
            if further is not None:
                return further
    return None


def _wraps(fa: FileAnalysis) -> bool:
    return bool(fa.ddp_wraps or fa.ddpkit_calls("prepare_model"))


def check(fa: FileAnalysis) -> Iterator[Hit]:
    if not any(_wraps(peer) for peer in fa.peers or [fa]) or any(
        fa.mentions(name) for name in _PREFIX_FIXERS
    ):
        return
    candidates = fa.calls("state_dict")
    if not candidates:
        return
    timelines = _timelines(fa) if _wraps(fa) else {}
    own_resume = _reloaded_into_wrapper(fa, timelines) if timelines else None
    for site in candidates:
        call = site.call
        if not isinstance(call.func, ast.Attribute) or call.args or call.keywords:
            continue
        receiver = call.func.value
        resume = own_resume
        if not _is_wrapped_receiver(receiver, site, timelines, fa.index.module):
            # Handed in by a caller: the wrapper's file tells how it is resumed.
            maker = _handed_a_wrapper(fa, receiver, site)
            if maker is None:
                continue
            resume = _reloaded_into_wrapper(maker, _timelines(maker))
        if not _is_saved(fa, call, site):
            continue
        if resume is not None and resume.covers(_saved_shape(fa, call, site)):
            continue  # what the wrapper resumes from: its `module.` keys fit
        model = show(receiver)
        # prepare_model leaves a one-process model unwrapped: `.module` would fail there.
        inner = f"{model}.module"
        if fa.ddpkit_calls("prepare_model"):
            inner = f"ddpkit.unwrap({model})"
        yield (
            call,
            f"`{model}.state_dict()` is taken from the DDP wrapper, so every key starts with "
            f"`module.` and the checkpoint will not load into a plain model; save "
            f"`{inner}.state_dict()` instead",
        )


RULE = Rule(
    "DDP104",
    Severity.WARNING,
    "state_dict() saved from the DDP wrapper instead of model.module",
    check,
)
