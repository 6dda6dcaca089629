"""DDP101: a shuffling DistributedSampler that is never told the epoch."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from typing import cast

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import Scope, Site
from ddpkit.check.names import dotted, tail
from ddpkit.check.rules.base import (
    Hit,
    Rule,
    argument,
    assignments_to,
    has_unknown_arguments,
    is_constant,
    passed_for,
    show,
)
from ddpkit.findings import Severity

# Wrappers around the loader in `for batch in enumerate(tqdm(loader))`.
_ITER_WRAPPERS = frozenset({"enumerate", "tqdm", "iter", "islice", "zip"})


def _iterated(iterable: ast.expr) -> ast.expr | None:
    """What `for x in ...` iterates over, through `enumerate(tqdm(loader))` and the like."""
    while isinstance(iterable, ast.Call) and tail(iterable.func) in _ITER_WRAPPERS:
        if not iterable.args:
            return None
        iterable = iterable.args[0]
    return iterable if isinstance(iterable, (ast.Name, ast.Attribute, ast.Subscript)) else None


def _across_epochs(fa: FileAnalysis, loop: Site) -> bool:
    """The loop runs inside another loop, directly or because its function is called in one."""
    return loop.loop_depth > 0 or loop.scope in fa.functions_in_loops


def _assigned_name(fa: FileAnalysis, value: ast.expr, scope: Scope) -> str | None:
    for a in fa.index.assignments:
        if a.value is value and a.scope is scope and isinstance(a.target, ast.Name):
            return a.target.id
    return None


def _loader_of(fa: FileAnalysis, sampler: Site) -> ast.Call | None:
    """The DataLoader call in the same function that gets this sampler."""
    name = _assigned_name(fa, sampler.call, sampler.scope)
    for site in fa.calls("DataLoader"):
        if site.scope is not sampler.scope:
            continue
        given = argument(site.call, 3, "sampler")
        if given is sampler.call or (
            name is not None and isinstance(given, ast.Name) and given.id == name
        ):
            return site.call
    return None


def _data_loops(fa: FileAnalysis) -> list[tuple[Site, ast.expr]]:
    """The `for` loops of this file over something that may be a loader."""
    return [
        (loop, iterated)
        for loop in fa.index.loops
        if (iterated := _iterated(cast(ast.For, loop.node).iter)) is not None
    ]


def _iterated_across_epochs(fa: FileAnalysis, sampler: Site) -> bool:
    """Follow sampler -> loader -> `for` loops in the same function when they are in sight;
    when the loader leaves the function (returned, stored on self), any loop over data
    that runs across epochs counts: in this file, else in the files checked with it (a
    helper module's `build_loader()` is iterated by the training script)."""
    loader = _loader_of(fa, sampler)
    name = _assigned_name(fa, loader, sampler.scope) if loader is not None else None
    data_loops = _data_loops(fa)
    if name is not None:
        local = [
            loop
            for loop, it in data_loops
            if loop.scope is sampler.scope and isinstance(it, ast.Name) and it.id == name
        ]
        if local:
            return any(_across_epochs(fa, loop) for loop in local)
    if any(_across_epochs(fa, loop) for loop, _ in data_loops):
        return True
    return any(
        _across_epochs(peer, loop)
        for peer in fa.peers
        if peer is not fa
        for loop, _ in _data_loops(peer)
    )


# A word of a name that marks evaluation data: `val_set`, `valid_sampler`, `test_loader`,
# `datasets["eval"]`, `def validate(...)`.
_EVALUATION_WORD = re.compile(
    r"(val|valid|validation|validate|test|testing|eval|evaluate|evaluation)"
    r"(set|data|dataset|ds|loader|sampler)?"
)


def _names_evaluation(name: str | None) -> bool:
    words = re.split(r"[^a-zA-Z]+|(?<=[a-z])(?=[A-Z])", name or "")
    return any(_EVALUATION_WORD.fullmatch(word.lower()) for word in words)


def _for_evaluation(fa: FileAnalysis, sampler: Site) -> bool:
    """The sampler serves validation or testing, by the names of its dataset, itself, its
    loader or its function: an evaluation visits every sample whatever their order, so
    it needs no `set_epoch`."""
    dataset = argument(sampler.call, 0, "dataset")
    if isinstance(dataset, ast.Subscript) and isinstance(dataset.slice, ast.Constant):
        dataset = dataset.slice
    loader = _loader_of(fa, sampler)
    names = [
        dataset.value if isinstance(dataset, ast.Constant) else None,
        tail(dataset) if isinstance(dataset, (ast.Name, ast.Attribute)) else None,
        _assigned_name(fa, sampler.call, sampler.scope),
        _assigned_name(fa, loader, sampler.scope) if loader is not None else None,
        None if sampler.scope.is_module else sampler.scope.name,
    ]
    return any(isinstance(n, str) and _names_evaluation(n) for n in names)


def _may_shuffle(fa: FileAnalysis, shuffle: ast.expr, site: Site) -> bool:
    """`shuffle=True`; a variable that one branch sets True (`shuffle = False` for the
    test split, else True); or a parameter of the enclosing helper that one of its calls
    makes true: `shuffle=shuffle` given True (`data_sampler(ds, shuffle=True, ...)`),
    `shuffle=mode == "train"` given "train"."""
    if is_constant(shuffle, True):
        return True
    if isinstance(shuffle, ast.Name) and shuffle.id not in site.scope.params:
        return any(is_constant(a.value, True) for a in assignments_to(fa, shuffle.id, site.scope))
    wanted: object = True
    if (
        isinstance(shuffle, ast.Compare)
        and len(shuffle.ops) == 1
        and isinstance(shuffle.ops[0], ast.Eq)
        and isinstance(shuffle.comparators[0], ast.Constant)
    ):
        wanted = shuffle.comparators[0].value
        shuffle = shuffle.left
    scope = site.scope
    if not isinstance(shuffle, ast.Name) or shuffle.id not in scope.params:
        return False
    for call in fa.callgraph.calls_of(scope):
        given = passed_for(scope, call, shuffle.id)
        if isinstance(given, ast.Constant) and given.value == wanted:
            return True
    return False


def _prepared_loader_shuffles(fa: FileAnalysis, site: Site) -> bool:
    """`ddpkit.prepare_loader(dataset, ctx)` shuffles unless told not to: `shuffle=False`,
    `evaluation=True`, a sampler of one's own, or a DataLoader in sight that does not
    shuffle (its order is kept)."""
    call = site.call
    if has_unknown_arguments(call) or argument(call, None, "sampler") is not None:
        return False
    evaluation = argument(call, None, "evaluation")
    if evaluation is not None and not is_constant(evaluation, False):
        return False
    shuffle = argument(call, None, "shuffle")
    if shuffle is not None:
        return _may_shuffle(fa, shuffle, site)
    given = argument(call, 0, "dataset")
    values = [given]
    if isinstance(given, ast.Name):
        values += [a.value for a in assignments_to(fa, given.id, site.scope)]
    return not any(
        isinstance(v, ast.Call)
        and tail(v.func) == "DataLoader"
        and not is_constant(argument(v, 2, "shuffle"), True)
        for v in values
    )


def _prepared_loader_iterated_across_epochs(fa: FileAnalysis, site: Site) -> bool:
    """A `for` loop over the loader that `prepare_loader` returned runs across epochs:
    `loader = prepare_loader(...)` looped over in its function, `self.data = ...` in a
    method of its class."""
    targets = [a.target for a in fa.index.assignments if a.value is site.call]
    name = dotted(targets[0]) if len(targets) == 1 else None
    if name is None:
        return False
    for loop, iterated in _data_loops(fa):
        if dotted(iterated) != name:
            continue
        same_place = (
            loop.scope is site.scope
            if "." not in name
            else site.scope.class_name is not None
            and loop.scope.class_name == site.scope.class_name
        )
        if same_place and _across_epochs(fa, loop):
            return True
    return False


def check(fa: FileAnalysis) -> Iterator[Hit]:
    samplers = fa.calls("DistributedSampler")
    prepared = fa.ddpkit_calls("prepare_loader")
    # Another script that shares the helpers may tell its own sampler the epoch.
    if not (samplers or prepared) or fa.program_reaches("set_epoch", served_only=True):
        return
    for site in prepared:
        if _prepared_loader_shuffles(fa, site) and _prepared_loader_iterated_across_epochs(
            fa, site
        ):
            yield (
                site.call,
                "the loader of `prepare_loader` shuffles with the same seed every epoch "
                "because `set_epoch` is never called: call `loader.set_epoch(epoch)` at the "
                "start of each epoch (`ddpkit.Trainer` does it for you)",
            )
    for site in samplers:
        call = site.call
        if has_unknown_arguments(call):
            continue
        # DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)
        shuffle = argument(call, 3, "shuffle")
        when = ""
        if shuffle is not None and not _may_shuffle(fa, shuffle, site):
            if not isinstance(shuffle, ast.Subscript):
                continue  # shuffle=False needs no epoch; a variable we cannot judge
            # Read from a config file (`cfg["shuffle"]`): say what it depends on.
            when = f" (when `{show(shuffle)}` is true)"
        if _for_evaluation(fa, site):
            continue
        if not _iterated_across_epochs(fa, site):
            continue
        yield (
            call,
            f"DistributedSampler shuffles{when} with the same seed every epoch because `set_epoch` "
            "is never called: call `sampler.set_epoch(epoch)` (or "
            "`loader.sampler.set_epoch(epoch)`) at the start of each epoch",
        )


RULE = Rule(
    "DDP101",
    Severity.WARNING,
    "DistributedSampler iterated across epochs without set_epoch",
    check,
)
