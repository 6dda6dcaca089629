"""A user's job from a `module:function` or `path/to/file.py:function` spec.

`ddpkit train --job package.module:build` and `ddpkit.verify("file.py:build", ...)`
name a job this way; `load_job` imports it (and the module's `DEFAULTS`) with an error
that names the fix for every way the spec can be wrong.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import stat
import sys
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.training.config import describe, validate_options
from ddpkit.userfiles import kind_of

# A job's build function: build(ctx) or build(ctx, config), returning a `Job` (which
# `build_job` checks); `build_arity` tells which. Typed loosely so that loading a spec
# never imports torch, as ddpkit.training.job does.
BuildFn = Callable[..., Any]

# The built-in jobs that `ddpkit train --example NAME` runs: each module under
# ddpkit.examples has `DEFAULTS` (TrainConfig values that suit it) and `build(ctx)`.
EXAMPLES = ("digits", "gpt", "linear")


def example_module(name: str) -> types.ModuleType:
    """The module of a built-in example; it has `build(ctx) -> Job` and `DEFAULTS`.
    A wrong name is refused before anything imports torch."""
    if name not in EXAMPLES:
        raise ConfigError(f"unknown example {name!r}: choose one of {', '.join(EXAMPLES)}")
    return importlib.import_module(f"ddpkit.examples.{name}")


def load_job(spec: str) -> tuple[BuildFn, dict[str, Any]]:
    """The `build(ctx) -> Job` (or `build(ctx, config)`) function that `spec` names, and
    its module's `DEFAULTS`.

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
    target, module = load_function(spec)
    module_part, _, attr_part = spec.rpartition(":")
    where = f"{module_part}:{attr_part}"
    if _takes_one_argument(target) is False:
        raise ConfigError(
            f"{where} cannot be called with one argument: define it as "
            f"def {attr_part.rsplit('.', 1)[-1]}(ctx: ddpkit.DistContext) -> ddpkit.Job "
            "(or with a second parameter, config: ddpkit.TrainConfig)"
        )

    defaults = getattr(module, "DEFAULTS", None)
    source = f"{module.__name__}.DEFAULTS"
    if defaults is None:
        return typing.cast(BuildFn, target), {}
    if not isinstance(defaults, Mapping):
        raise ConfigError(
            f"{source} must be a dict of TrainConfig options "
            f"(got {describe(defaults)}): "
            'write DEFAULTS = {"epochs": 10, "batch_size": 32}, or remove it'
        )
    return typing.cast(BuildFn, target), validate_options(defaults, source)


def load_function(spec: str) -> tuple[Any, types.ModuleType]:
    """The function that `spec` (`package.module:function` or `path/to/file.py:function`)
    names, and its module, loaded as `load_job` describes."""
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
            f"{where} is {describe(target)}, not a function: "
            f"pass --job {module_part}:build where build(ctx) returns a ddpkit.Job"
        )
    return target, module


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
    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(
            f"no such file {path_text!r} (for --job {spec}; looked for {path.absolute()}): "
            "pass --job path/to/file.py:build with an existing file, "
            "or package.module:build for an installed module"
        ) from None
    except OSError as exc:  # a folder on the way that this user may not enter, say
        raise _unreadable(path_text, spec, exc) from None
    if not stat.S_ISREG(info.st_mode):
        # Python would wait for a FIFO's writer, or read a device without end.
        kind = kind_of(info.st_mode)
        raise ConfigError(
            f"{path_text!r} is {kind}, not a Python file (for --job {spec}): "
            "pass --job path/to/file.py:build with a regular file"
        )
    # A file that cannot be read is said here: the import would raise the OSError as if
    # the module's own code had (which propagates as it is).
    try:
        os.close(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)))
    except OSError as exc:
        raise _unreadable(path_text, spec, exc) from None
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


def _unreadable(path_text: str, spec: str, exc: OSError) -> ConfigError:
    return ConfigError(
        f"cannot read {path_text!r} (for --job {spec}): {exc.strerror or exc}: "
        "check its permissions and its folder's, or pass --job with a file you can read"
    )


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
            f"that take (ctx) or (ctx, config): {', '.join(candidates)}"
        )
    return (
        f"{head}, and it has no function that takes (ctx) or (ctx, config): define "
        "def build(ctx: ddpkit.DistContext) -> ddpkit.Job in it"
    )


def _one_argument_functions(module: types.ModuleType) -> list[str]:
    """The public functions defined in `module` that can be called as a build."""
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and inspect.isfunction(obj)
        and obj.__module__ == module.__name__
        and _takes_one_argument(obj)
    ]


def build_arity(fn: Any) -> int | None:
    """How `fn` is called as a job's build: 2 for `build(ctx, config)`, 1 for
    `build(ctx)`, 0 when it can be called neither way, None when its signature cannot
    be read. A second parameter with a default is passed the config only when it is
    named `config`, so `build(ctx, width=64)` keeps its default."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    one, two = _binds(signature, 1), _binds(signature, 2)
    if two and (not one or "config" in signature.parameters):
        return 2
    return 1 if one else 0


def _binds(signature: inspect.Signature, count: int) -> bool:
    try:
        signature.bind(*[object()] * count)
    except TypeError:
        return False
    return True


def _takes_one_argument(fn: Any) -> bool | None:
    """Whether `fn` can be called as `build(ctx)` or `build(ctx, config)`."""
    arity = build_arity(fn)
    return None if arity is None else arity > 0
