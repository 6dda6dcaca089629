"""DDP107: torch.load without map_location in a DDP script."""

from __future__ import annotations

from collections.abc import Iterator

from ddpkit.check.analysis import FileAnalysis
from ddpkit.check.index import BODY, ORELSE, Site
from ddpkit.check.model import Severity
from ddpkit.check.rules.base import Hit, Rule, argument, has_unknown_arguments

LOADERS = frozenset({"load"})


def _mapped(site: Site) -> bool:
    return argument(site.call, 1, "map_location") is not None


def _sibling_maps(site: Site, loads: list[Site]) -> bool:
    """`if args.gpu is None: torch.load(p) else: torch.load(p, map_location=loc)`.

    The other branch of the same `if` maps the load per GPU, so this branch is the
    one where a single process drives every GPU (or no group runs): nothing crowds.
    """
    for guard in site.guards:
        if guard.branch not in (BODY, ORELSE):
            continue
        for other in loads:
            if other is site or not _mapped(other):
                continue
            if any(g.owner is guard.owner and g.branch != guard.branch for g in other.guards):
                return True
    return False


def check(fa: FileAnalysis) -> Iterator[Hit]:
    if not fa.is_ddp_script:
        return
    loads = [site for site, _ in fa.resolved_calls("torch", LOADERS)]
    for site in loads:
        call = site.call
        if has_unknown_arguments(call) or _mapped(site) or _sibling_maps(site, loads):
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
