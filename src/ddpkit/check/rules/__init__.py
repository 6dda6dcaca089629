"""The rules, one module each, in code order. Codes are stable: never renumber."""

from __future__ import annotations

from ddpkit.check.rules import (
    ddp101,
    ddp102,
    ddp103,
    ddp104,
    ddp105,
    ddp106,
    ddp107,
    ddp108,
    ddp109,
    ddp110,
    ddp111,
)
from ddpkit.check.rules.base import Hit, Rule

RULES: tuple[Rule, ...] = tuple(
    m.RULE
    for m in (
        ddp101,
        ddp102,
        ddp103,
        ddp104,
        ddp105,
        ddp106,
        ddp107,
        ddp108,
        ddp109,
        ddp110,
        ddp111,
    )
)
RULES_BY_CODE: dict[str, Rule] = {rule.code: rule for rule in RULES}

__all__ = ["RULES", "RULES_BY_CODE", "Hit", "Rule"]
