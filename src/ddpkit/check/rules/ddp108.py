"""DDP108: torch.load(..., weights_only=False) unpickles, which can run arbitrary code."""

from __future__ import annotations

from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.rules.base import Hit, Rule, argument, is_constant
from ddpkit.check.rules.ddp107 import LOADERS
from ddpkit.findings import Severity


def check(fa: FileAnalysis) -> Iterator[Hit]:
    for site, _ in fa.resolved_calls("torch", LOADERS):
        flag = argument(site.call, None, "weights_only")
        if is_constant(flag, False):
            yield (
                flag,
                "`torch.load(..., weights_only=False)` unpickles the file, and unpickling "
                "can run arbitrary code from whoever wrote it; keep the default "
                "`weights_only=True` and store plain tensors, numbers and dicts (register "
                "other types with `torch.serialization.add_safe_globals`)",
            )


RULE = Rule(
    "DDP108",
    Severity.WARNING,
    "torch.load with weights_only=False can run arbitrary code",
    check,
)
