"""DDP102: DataLoader(shuffle=True, sampler=...), which PyTorch rejects at run time."""

from __future__ import annotations

from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.rules.base import Hit, Rule, argument, is_constant
from ddpkit.findings import Severity


def check(fa: FileAnalysis) -> Iterator[Hit]:
    for site in fa.calls("DataLoader"):
        call = site.call
        # DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, ...)
        shuffle = argument(call, 2, "shuffle")
        if shuffle is None or not is_constant(shuffle, True):
            continue
        for position, name in ((3, "sampler"), (4, "batch_sampler")):
            given = argument(call, position, name)
            if given is not None and not is_constant(given, None):
                yield (
                    shuffle,
                    f"DataLoader gets both `shuffle=True` and `{name}=`, which raises "
                    f"ValueError at run time; drop `shuffle=True` (the {name} decides the "
                    "order; DistributedSampler shuffles by itself)",
                )
                break


RULE = Rule(
    "DDP102",
    Severity.ERROR,
    "DataLoader given both shuffle=True and a sampler",
    check,
)
