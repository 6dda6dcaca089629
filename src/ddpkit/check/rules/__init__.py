"""The rules, one module each (`ddpNNN.py`), in code order. Codes are stable: never renumber."""

from __future__ import annotations

import importlib

from ddpkit.check.rules.base import Hit, Rule

# DDP101 .. DDP111, DDP113: DDP112 is the audit's (`ddpkit run --audit`: the ranks
# trained different weights), which only a run can see.
_CODES = (*range(101, 112), 113)
RULES: tuple[Rule, ...] = tuple(
    importlib.import_module(f"ddpkit.check.rules.ddp{code}").RULE for code in _CODES
)
RULES_BY_CODE: dict[str, Rule] = {rule.code: rule for rule in RULES}

__all__ = ["RULES", "RULES_BY_CODE", "Hit", "Rule"]
