"""TrainConfig options from a TOML file (`ddpkit train --config job.toml`).

`ddpkit train` merges `defaults < job DEFAULTS < file < flags` with `merge_config`
before building `TrainConfig`. The file's values are checked by
`ddpkit.training.config.validate_options`, as every other source of options is.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.training.config import describe, validate_options
from ddpkit.userfiles import NotRegularFile, read_regular

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

__all__ = ["load_config_file", "merge_config"]

TRAIN_TABLE = "train"
# Larger files are not read: a file of TrainConfig options is a few hundred bytes, and a
# file that never ends (a device) would be read until memory runs out.
MAX_CONFIG_BYTES = 2**20


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The options that the TOML file at `path` sets, checked; `{}` for an empty file.

    The options are written either at the top level of the file or all under a
    `[train]` table (not both)::

        epochs = 20                  [train]
        batch_size = 64              epochs = 20
                                     batch_size = 64

    Every key must be a field of `TrainConfig` and every value right for it (an
    integer is taken for a float field). Raises `ConfigError` naming the file.
    """
    if not os.fspath(path):  # Path("") is ".", the current folder
        raise ConfigError(
            "--config '' names no file: pass --config with the path of a TOML file, or leave it out"
        )
    file = Path(path)
    name = f"config file {str(file)!r}"
    data = _read_regular_file(file, name)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{name} is not UTF-8 text (byte {exc.start}): "
            "TOML files must be UTF-8; save it as UTF-8"
        ) from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"{name} is not valid TOML: {exc}{_quote_line(text, str(exc))}: correct it "
            "(each option is written name = value, e.g. epochs = 10)"
        ) from None
    return validate_options(_options_table(document, name), name)


def _read_regular_file(file: Path, name: str) -> bytes:
    """The bytes of `file`, a regular file of at most MAX_CONFIG_BYTES; else ConfigError
    (see `ddpkit.userfiles.read_regular`)."""
    try:
        data, size = read_regular(file, MAX_CONFIG_BYTES)
    except NotRegularFile as exc:
        if exc.kind == "a folder":
            raise ConfigError(
                f"{name} is a folder: pass --config with the path of a TOML file"
            ) from None
        raise ConfigError(
            f"{name} is not a regular file ({exc.kind}): pass --config with the path of a TOML file"
        ) from None
    except FileNotFoundError:
        raise ConfigError(
            f"{name} not found (looked for {file.absolute()}): "
            "pass --config with the path of an existing TOML file"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"cannot read {name}: {exc.strerror or exc}: "
            "check its permissions, or pass --config with another file"
        ) from None
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{name} is too large ({size / 2**20:.1f} MiB, over the limit of "
            f"{MAX_CONFIG_BYTES // 2**20} MiB): a file of TrainConfig options is far smaller; "
            "pass --config with the right file"
        )
    return data


def _options_table(document: dict[str, Any], name: str) -> dict[str, Any]:
    """The table that holds the options: the whole document, or its `[train]` table."""
    if TRAIN_TABLE not in document:
        return document
    table = document[TRAIN_TABLE]
    if not isinstance(table, dict):
        raise ConfigError(
            f"{name}: {TRAIN_TABLE!r} must be a table (got {table!r}, {describe(table)}): "
            f"write the options under a [{TRAIN_TABLE}] line, or at the top level of the file"
        )
    others = [key for key in document if key != TRAIN_TABLE]
    if others:
        raise ConfigError(
            f"{name} has both a [{TRAIN_TABLE}] table and options at "
            f"the top level ({', '.join(others)}): put every option under [{TRAIN_TABLE}], "
            f"or drop the [{TRAIN_TABLE}] line and write them all at the top level"
        )
    return table


def _quote_line(text: str, message: str) -> str:
    """The offending line of a TOML syntax error, quoted, if the message names one: on
    the same line as the error, since every error of the command is one line."""
    match = re.search(r"at line (\d+)", message)
    if not match:
        return ""
    number = int(match.group(1))
    lines = text.splitlines()
    if not 1 <= number <= len(lines):
        return ""
    line = lines[number - 1].strip()
    if len(line) > 80:  # a line of a whole table helps no one
        line = line[:77] + "..."
    return f": line {number} is {line!r}"


def merge_config(
    defaults: Mapping[str, Any], file_values: Mapping[str, Any], flags: Mapping[str, Any]
) -> dict[str, Any]:
    """`defaults`, overridden by `file_values`, overridden by `flags` (a new dict).

    A flag whose value is `None` was not given on the command line and is skipped, so
    it does not hide the file's value. (A `store_true` flag must have `default=None`
    for the same reason.) `None` in `defaults` or `file_values` is kept.
    """
    merged = dict(defaults)
    merged.update(file_values)
    merged.update((key, value) for key, value in flags.items() if value is not None)
    return merged
