"""DDP102: DataLoader(shuffle=True, sampler=...), which PyTorch rejects at run time."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import Site
from ddpkit.check.rules.base import Hit, Rule, argument, assignments_to, is_constant, show
from ddpkit.findings import Severity


def _always_given(fa: FileAnalysis, sampler: ast.expr, site: Site) -> bool:
    """The sampler is there whatever the settings: not `s if cond else None`, nor a name
    that is ever assigned such a choice or None."""
    values = [sampler]
    if isinstance(sampler, ast.Name):
        values = [a.value for a in assignments_to(fa, sampler.id, site.scope)]
    return bool(values) and not any(
        isinstance(v, ast.IfExp) or is_constant(v, None) for v in values
    )


def check(fa: FileAnalysis) -> Iterator[Hit]:
    for site in fa.calls("DataLoader"):
        call = site.call
        # DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, ...)
        shuffle = argument(call, 2, "shuffle")
        # `cfg["shuffle"]`, `args.shuffle`: a setting read from a config, true in some runs.
        setting = isinstance(shuffle, (ast.Subscript, ast.Attribute))
        if shuffle is None or not (is_constant(shuffle, True) or setting):
            continue
        for position, name in ((3, "sampler"), (4, "batch_sampler")):
            given = argument(call, position, name)
            if given is None or is_constant(given, None):
                continue
            if not setting:
                yield (
                    shuffle,
                    f"DataLoader gets both `shuffle=True` and `{name}=`, which raises "
                    f"ValueError at run time; drop `shuffle=True` (the {name} decides the "
                    "order; DistributedSampler shuffles by itself)",
                )
            elif _always_given(fa, given, site):
                yield (
                    shuffle,
                    f"DataLoader gets `shuffle={show(shuffle, 40)}` beside `{name}=`: a run "
                    f"where `{show(shuffle, 40)}` is true raises ValueError at start; pass "
                    f"`shuffle=False` with a {name} (DistributedSampler shuffles by itself)",
                    Severity.WARNING,
                )
            break


RULE = Rule(
    "DDP102",
    Severity.ERROR,
    "DataLoader given both shuffle=True and a sampler",
    check,
)
