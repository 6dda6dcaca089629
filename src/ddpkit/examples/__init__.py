"""Built-in jobs that `ddpkit train --example NAME` runs. Each module has `DEFAULTS`
(TrainConfig values that suit it) and `build(ctx) -> Job`."""

from __future__ import annotations

import importlib
from types import ModuleType

from ddpkit.errors import ConfigError

EXAMPLES = ("digits", "seed")


def example_module(name: str) -> ModuleType:
    """The module of a built-in example; it has `build(ctx) -> Job` and `DEFAULTS`.
    A wrong name is refused before anything imports torch."""
    if name not in EXAMPLES:
        raise ConfigError(f"unknown example {name!r}: choose one of {', '.join(EXAMPLES)}")
    return importlib.import_module(f"ddpkit.examples.{name}")
