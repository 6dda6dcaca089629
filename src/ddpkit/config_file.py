"""A job's options from a TOML file, and a user's job from `module:function`.

`ddpkit train --job package.module:build --config job.toml [flags]` reads the file
with `load_config_file`, imports the job with `load_job` (which also returns the
module's `DEFAULTS`), and merges `defaults < job DEFAULTS < file < flags` with
`merge_config` before building `TrainConfig`, whose own validation checks the ranges.

Keys and types are checked against the fields of `TrainConfig` as declared, so a field
added there is accepted here with no change.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, Literal, Union

from ddpkit.config import TrainConfig
from ddpkit.errors import ConfigError

if TYPE_CHECKING:  # ddpkit.job imports torch; reading a config file does not need it
    from ddpkit.job import BuildFn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

__all__ = [
    "load_config_file",
    "load_job",
    "merge_config",
    "validate_options",
]

TRAIN_TABLE = "train"


# -- the TOML file -------------------------------------------------------------------


def load_config_file(
    path: str | os.PathLike[str], *, config_class: type[Any] = TrainConfig
) -> dict[str, Any]:
    """The options that the TOML file at `path` sets, validated; `{}` for an empty file.

    The options are written either at the top level of the file or all under a
    `[train]` table (not both)::

        epochs = 20                  [train]
        batch_size = 64              epochs = 20
                                     batch_size = 64

    Every key must be a field of `config_class` (`TrainConfig`) and every value must
    have the field's type; an integer is taken for a float field (and made a float),
    but `true`/`false` is not taken for an integer. Ranges are not checked here:
    constructing `TrainConfig` does that. Raises `ConfigError` naming the file.
    """
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"config file {str(file)!r} not found (looked for {file.absolute()}): "
            "pass --config with the path of an existing TOML file"
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            f"config file {str(file)!r} is a folder: pass --config with the path of a TOML file"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"cannot read config file {str(file)!r}: {exc.strerror or exc}: "
            "check its permissions, or pass --config with another file"
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(file)!r} is not UTF-8 text (byte {exc.start}): "
            "TOML files must be UTF-8; save it as UTF-8"
        ) from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"config file {str(file)!r} is not valid TOML: {exc}{_quote_line(text, str(exc))}"
        ) from None
    return validate_options(
        _options_table(document, file),
        f"config file {str(file)!r}",
        config_class=config_class,
        toml=True,
    )


def _options_table(document: dict[str, Any], file: Path) -> dict[str, Any]:
    """The table that holds the options: the whole document, or its `[train]` table."""
    if TRAIN_TABLE not in document:
        return document
    table = document[TRAIN_TABLE]
    if not isinstance(table, dict):
        raise ConfigError(
            f"config file {str(file)!r}: {TRAIN_TABLE!r} must be a table (got {_show(table)}, "
            f"{_describe(table)}): write the options under a [{TRAIN_TABLE}] line, "
            "or at the top level of the file"
        )
    others = [key for key in document if key != TRAIN_TABLE]
    if others:
        raise ConfigError(
            f"config file {str(file)!r} has both a [{TRAIN_TABLE}] table and options at "
            f"the top level ({', '.join(others)}): put every option under [{TRAIN_TABLE}], "
            f"or drop the [{TRAIN_TABLE}] line and write them all at the top level"
        )
    return table


def _quote_line(text: str, message: str) -> str:
    """The offending line of a TOML syntax error, quoted, if the message names one."""
    match = re.search(r"at line (\d+)", message)
    if not match:
        return ""
    number = int(match.group(1))
    lines = text.splitlines()
    if not 1 <= number <= len(lines):
        return ""
    return f"\n    {number} | {lines[number - 1]}"


# -- merging -------------------------------------------------------------------------


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


# -- validation ----------------------------------------------------------------------


def validate_options(
    values: Mapping[str, Any],
    source: str,
    *,
    config_class: type[Any] = TrainConfig,
    toml: bool = False,
) -> dict[str, Any]:
    """`values` checked against the fields of `config_class`; `source` names where they
    come from in error messages (e.g. "config file 'job.toml'"), which write types and
    values as TOML does when `toml` is true and as Python does otherwise.

    Returns a new dict; an `int` given for a `float` field becomes a `float`, a list
    given for a `tuple` field becomes a tuple and a string for a `Path` field a `Path`.
    """
    fields = _field_types(config_class)
    result: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str) or key not in fields:
            raise ConfigError(_unknown_key_message(key, source, list(fields)))
        hint = fields[key]
        try:
            result[key] = _coerce(value, hint)
        except _Mismatch:
            raise ConfigError(
                f"{source}: {key} must be {_type_name(hint, toml=toml)} "
                f"(got {_show(value, toml=toml)}, {_describe(value, toml=toml)}): "
                f"{_example(key, hint, config_class, toml=toml)}"
            ) from None
        except _Unsupported:
            raise ConfigError(
                f"{source}: {key} cannot be set here (its type {_hint_text(hint)} has no "
                f"{'TOML' if toml else 'plain'} form): "
                f"remove {key} and set it in Python"
            ) from None
    return result


def _field_types(config_class: type[Any]) -> dict[str, Any]:
    """{field name: resolved type} for the fields of `config_class` that __init__ takes."""
    if not (isinstance(config_class, type) and dataclasses.is_dataclass(config_class)):
        raise TypeError(f"config_class must be a dataclass (got {config_class!r})")
    hints = typing.get_type_hints(config_class)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(config_class) if f.init}


def _unknown_key_message(key: object, source: str, valid: list[str]) -> str:
    text = str(key)
    guess = text.replace("-", "_").lower()
    close = [guess] if guess in valid else difflib.get_close_matches(text, valid, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{source}: unknown option {text!r}: {hint}valid options are {', '.join(valid)}"


class _Mismatch(Exception):
    """The value does not have the field's type."""


class _Unsupported(Exception):
    """The field's type is not one that a plain value can have."""


_NONE_TYPE = type(None)


def _coerce(value: Any, hint: Any) -> Any:
    """`value` as a value of type `hint` (converted where lossless), or raise _Mismatch."""
    if hint is Any or hint is object:
        return value
    if hint is None or hint is _NONE_TYPE:
        if value is None:
            return None
        raise _Mismatch
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        # A member that takes the value as it is wins over one that converts it.
        for member in sorted(args, key=lambda m: m is float):
            try:
                return _coerce(value, member)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is Literal:
        for choice in args:
            if type(choice) is type(value) and choice == value:
                return value
        raise _Mismatch
    if hint is bool:
        return _need(value, isinstance(value, bool))
    if hint is int:
        return _need(value, isinstance(value, int) and not isinstance(value, bool))
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if hint is str:
        return _need(value, isinstance(value, str))
    if isinstance(hint, type) and issubclass(hint, PurePath):
        if isinstance(value, (str, PurePath)):
            return hint(value)
        raise _Mismatch
    if origin in (list, tuple, set, frozenset):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise _Mismatch
            return tuple(_coerce(v, a) for v, a in zip(value, args, strict=True))
        item = args[0] if args else Any
        return origin(_coerce(v, item) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        key_type, value_type = args or (Any, Any)
        return {_coerce(k, key_type): _coerce(v, value_type) for k, v in value.items()}
    if isinstance(hint, type):
        return _need(value, isinstance(value, hint))
    raise _Unsupported


def _need(value: Any, ok: bool) -> Any:
    if not ok:
        raise _Mismatch
    return value


_TYPE_NAMES: dict[Any, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def _type_name(hint: Any, *, toml: bool) -> str:
    """`hint` in words; None is left out for TOML, which cannot write it."""
    if hint in _TYPE_NAMES:
        name = _TYPE_NAMES[hint]
        return name if toml or hint is not bool else "True or False"
    if hint is None or hint is _NONE_TYPE:
        return "None"
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        members = [m for m in typing.get_args(hint) if not (toml and m is _NONE_TYPE)]
        return " or ".join(_type_name(m, toml=toml) for m in members)
    if origin is Literal:
        return "one of " + ", ".join(_show(c, toml=toml) for c in typing.get_args(hint))
    if isinstance(hint, type) and issubclass(hint, PurePath):
        return "a path (a string)"
    if origin in (list, tuple, set, frozenset):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        of = f" of {_plural(_type_name(args[0], toml=toml))}" if len(args) == 1 else ""
        return ("an array" if toml else f"a {origin.__name__}") + of
    if origin is dict:
        return "a table" if toml else "a dict"
    return _hint_text(hint)


def _plural(name: str) -> str:
    for article in ("an ", "a "):
        if name.startswith(article):
            return name[len(article) :] + "s"
    return name


def _hint_text(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _example(key: str, hint: Any, config_class: type[Any], *, toml: bool) -> str:
    """The fix: how to write `key` right, with its default as the example where possible."""
    default: Any = dataclasses.MISSING
    for f in dataclasses.fields(config_class):
        if f.name == key:
            default = f.default
    if default is not dataclasses.MISSING and default is not None:
        try:
            if _coerce(default, hint) == default:
                name = key if toml else f'"{key}"'
                sep = " = " if toml else ": "
                return f"write it like {name}{sep}{_show(default, toml=toml)}"
        except (_Mismatch, _Unsupported):
            pass
    return f"write {_type_name(hint, toml=toml)}"


def _show(value: Any, *, toml: bool = True) -> str:
    if isinstance(value, bool) and toml:
        return "true" if value else "false"
    if isinstance(value, str) and toml:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(value: Any, *, toml: bool = True) -> str:
    """What kind of TOML (or, with `toml` false, Python) value `value` is, in words."""
    if value is None:
        return "None"
    if toml:
        if isinstance(value, bool):
            return "a boolean"
        if isinstance(value, int):
            return "an integer"
        if isinstance(value, float):
            return "a float"
        if isinstance(value, str):
            return "a string"
        if isinstance(value, (list, tuple)):
            return "an array"
        if isinstance(value, dict):
            return "a table"
    name = type(value).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


# -- the job -------------------------------------------------------------------------


def load_job(spec: str, *, config_class: type[Any] = TrainConfig) -> tuple[BuildFn, dict[str, Any]]:
    """The `build(ctx) -> Job` function that `spec` names, and its module's `DEFAULTS`.

    `spec` is `package.module:function`, or `path/to/file.py:function` (a path ends
    in `.py` or holds a `/`). A file is loaded as a module named after its stem and
    registered in `sys.modules` (so its functions pickle by reference), and its folder
    is put first on `sys.path`, as `python path/to/file.py` would, so that it can
    import the modules beside it and so that spawned workers can import it too.
    `function` may be dotted (`module:obj.build`).

    `DEFAULTS` is an optional module-level dict of `TrainConfig` options that suit the
    job (as the built-in examples have), validated like a config file; `{}` if none.
    Raises `ConfigError` for a bad spec, a missing module or function, an import that
    fails (ImportError or SyntaxError, with the underlying message), a non-callable, a
    function that cannot take one argument, or bad `DEFAULTS`. Any other exception
    raised by the module's own code while it is imported propagates unchanged.
    """
    module_part, colon, attr_part = spec.rpartition(":")
    if (
        not colon
        or not module_part
        or not attr_part
        or "/" in attr_part
        or "\\" in attr_part
        or not all(part.isidentifier() for part in attr_part.split("."))
    ):
        raise ConfigError(
            f"--job must name a module and a function as MODULE:FUNCTION (got {spec!r}): "
            "pass --job package.module:build or --job path/to/file.py:build"
        )
    if _is_file(module_part):
        module = _load_file_module(module_part, spec)
    else:
        module = _import_module(module_part, spec)

    target: Any = module
    for depth, name in enumerate(attr_part.split(".")):
        if not hasattr(target, name):
            raise ConfigError(_missing_attr_message(module, attr_part, depth, spec))
        target = getattr(target, name)
    where = f"{module_part}:{attr_part}"
    if not callable(target):
        raise ConfigError(
            f"{where} is {_describe(target, toml=False)}, not a function: "
            f"pass --job {module_part}:build where build(ctx) returns a ddpkit.Job"
        )
    if _takes_one_argument(target) is False:
        raise ConfigError(
            f"{where} cannot be called with one argument: define it as "
            f"def {attr_part.rsplit('.', 1)[-1]}(ctx: ddpkit.DistContext) -> ddpkit.Job"
        )

    defaults = getattr(module, "DEFAULTS", None)
    source = f"{module.__name__}.DEFAULTS"
    if defaults is None:
        return typing.cast("BuildFn", target), {}
    if not isinstance(defaults, Mapping):
        raise ConfigError(
            f"{source} must be a dict of TrainConfig options "
            f"(got {_describe(defaults, toml=False)}): "
            'write DEFAULTS = {"epochs": 10, "batch_size": 32}, or remove it'
        )
    return typing.cast("BuildFn", target), validate_options(
        defaults, source, config_class=config_class
    )


def _is_file(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or "\\" in module_part


def _import_module(name: str, spec: str) -> types.ModuleType:
    if name.startswith("."):
        raise ConfigError(
            f"--job {spec}: a relative module name cannot be imported: "
            "pass the full name, --job package.module:build"
        )
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (name == missing or name.startswith(missing + ".")):
            searched = "" in sys.path or os.getcwd() in sys.path
            cwd_hint = (
                ""
                if searched
                else "; the current folder is not searched unless you run with PYTHONPATH=."
            )
            raise ConfigError(
                f"no module named {missing!r} (for --job {spec}): check the spelling and "
                f"that it is installed in this Python ({sys.executable}), or pass the file: "
                f"--job path/to/{name.rsplit('.', 1)[-1]}.py:build{cwd_hint}"
            ) from exc
        raise _import_failed(name, exc) from exc
    except (ImportError, SyntaxError) as exc:
        raise _import_failed(name, exc) from exc


def _import_failed(name: str, exc: BaseException) -> ConfigError:
    return ConfigError(
        f"module {name!r} raised {type(exc).__name__} while importing: {exc}: "
        "install what it needs or fix the import in it"
    )


def _load_file_module(path_text: str, spec: str) -> types.ModuleType:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"no such file {path_text!r} (for --job {spec}; looked for {path.absolute()}): "
            "pass --job path/to/file.py:build with an existing file, "
            "or package.module:build for an installed module"
        )
    path = path.resolve()
    name = path.stem
    existing = sys.modules.get(name)
    if existing is not None:
        existing_file = getattr(existing, "__file__", None)
        if existing_file and Path(existing_file).resolve() == path:
            return existing
        raise ConfigError(
            f"cannot load {path_text!r} as module {name!r}: a different module of that name "
            f"is already imported ({existing_file or 'built in'}): rename the file"
        )
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(
            f"cannot load {path_text!r} as a Python module (for --job {spec}): "
            "pass a .py file, --job path/to/file.py:build"
        )
    module = importlib.util.module_from_spec(module_spec)
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except (ImportError, SyntaxError) as exc:
        sys.modules.pop(name, None)
        raise _import_failed(path_text, exc) from exc
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _missing_attr_message(module: types.ModuleType, attr: str, depth: int, spec: str) -> str:
    missing = attr.split(".")[depth]
    where = (
        module.__name__ if depth == 0 else f"{module.__name__}:{'.'.join(attr.split('.')[:depth])}"
    )
    head = f"{where} has no attribute {missing!r} (for --job {spec})"
    candidates = _one_argument_functions(module)
    if candidates:
        return (
            f"{head}: pass --job {spec.rpartition(':')[0]}:NAME with one of its functions "
            f"that take one argument: {', '.join(candidates)}"
        )
    return (
        f"{head}, and it has no function that takes one argument: define "
        "def build(ctx: ddpkit.DistContext) -> ddpkit.Job in it"
    )


def _one_argument_functions(module: types.ModuleType) -> list[str]:
    """The public functions defined in `module` that can be called with one argument."""
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and inspect.isfunction(obj)
        and obj.__module__ == module.__name__
        and _takes_one_argument(obj)
    ]


def _takes_one_argument(fn: Any) -> bool | None:
    """Whether `fn(x)` binds; None when the signature cannot be read."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(object())
    except TypeError:
        return False
    return True
