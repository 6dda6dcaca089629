"""DDP107: torch.load without map_location in a DDP script."""

from __future__ import annotations

from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.model import Severity
from ddpkit.check.rules.base import Hit, Rule, argument, has_unknown_arguments

LOADERS = frozenset({"load"})


def check(fa: FileAnalysis) -> Iterator[Hit]:
    if not fa.is_ddp_script:
        return
    for site, _ in fa.resolved_calls("torch", LOADERS):
        call = site.call
        if has_unknown_arguments(call) or argument(call, 1, "map_location") is not None:
            continue
        yield (
            call,
            "`torch.load` without `map_location` puts every tensor back on the device "
            "that saved it (usually cuda:0), so all ranks crowd onto one GPU; pass "
            '`map_location=f"cuda:{local_rank}"` (or `"cpu"`)',
        )


RULE = Rule(
    "DDP107",
    Severity.WARNING,
    "torch.load without map_location in a DDP script",
    check,
)
