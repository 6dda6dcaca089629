"""How `launch` starts its workers: forked, from a forkserver or spawned, and what a
function defined in a notebook or `python -c` allows."""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, Literal, cast

import torch

from ddpkit.errors import ConfigError
from ddpkit.processes.machine import cuda_driver_used

StartMethod = Literal["auto", "fork", "forkserver", "spawn"]


def _threads() -> int:
    """Threads of this process, native ones included (a store's server, OpenMP's pool)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1  # unknown


# Threads the libraries started on import (numpy's OpenBLAS server, which is safe to
# fork: it stops itself around a fork). Counted when this module is imported, which
# imports torch first.
_IMPORT_THREADS = _threads()


def start_method(
    requested: StartMethod = "auto", backend: str = "gloo", *, unimportable: str | None = None
) -> str:
    """How `launch` starts workers: "fork" where that is safe, else "forkserver".

    A forked worker starts in milliseconds with torch already imported; a spawned one
    is a new interpreter that imports torch again (about 1.5 s, all ranks at once
    competing for the cores). Fork is safe only while this process has started no
    thread since torch was imported: fork copies the calling thread alone, and a
    lock another thread held stays locked in the child (an OpenMP pool after a
    parallel op, a store's server, a logger's thread). Linux only, and CPU jobs only:
    a forked child cannot use CUDA once the parent has initialised it. `launch` counts
    the GPUs without CUDA (see `gpu_count`), so its parent stays fit to fork, but GPU
    jobs keep the forkserver until forked NCCL workers have run on GPUs. Elsewhere (GPU
    jobs, a parent with threads) the workers are forked from a server process that
    this process starts once, a new single-threaded interpreter that has imported
    torch and touched no GPU (multiprocessing's "forkserver", with torch preloaded):
    the first launch pays one import of torch, later ones none. "spawn" starts each
    worker as a new interpreter, as `mp.spawn` does.

    `unimportable` names the function (or what its arguments hold) when it was defined
    in a notebook, `python -c` or a script read from stdin: a spawned worker cannot
    import it, so a CPU job on Linux forks even while threads run, as Accelerate's
    `notebook_launcher` and Lightning's "ddp_notebook" do (a Jupyter kernel always
    runs threads of its own; they only move messages, and a worker never uses them).
    Where no start can work, ConfigError says what to do instead.
    """
    if unimportable is not None:
        return _start_for_unimportable(requested, backend, unimportable)
    if requested != "auto":
        return requested
    unsafe_fork = (
        sys.platform != "linux"
        or backend == "nccl"
        or cuda_driver_used()
        or torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        or threading.active_count() > 1
        or not 0 < _threads() <= _IMPORT_THREADS
    )
    if not unsafe_fork:
        return "fork"
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _start_for_unimportable(requested: StartMethod, backend: str, name: str) -> str:
    if requested in ("spawn", "forkserver"):
        raise ConfigError(
            f"{'spawned' if requested == 'spawn' else 'forkserver'} workers cannot run "
            f"{name!r} from a notebook, python -c or stdin: "
            "they cannot import what is defined there: pass start='auto' to fork them "
            f"(Linux, CPU jobs), or move {name!r} into a .py file and import it"
        )
    if requested == "fork":
        return "fork"
    if backend == "nccl":
        raise ConfigError(
            f"cannot start GPU workers for {name!r} from a notebook, python -c or stdin: "
            "spawned workers cannot import it and forked ones cannot use CUDA: move "
            f"{name!r} into a .py file and import it (or pass backend='gloo' to run on CPU)"
        )
    if sys.platform != "linux":
        raise ConfigError(
            f"cannot start workers for {name!r} from a notebook, python -c or stdin on "
            f"{sys.platform}: spawned workers cannot import it and ddpkit forks only on "
            f"Linux: move {name!r} into a .py file and import it"
        )
    if cuda_driver_used() or torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise ConfigError(
            "cannot start workers from a notebook after CUDA was initialised in it: restart "
            f"the kernel and call launch before any CUDA use (or move {name!r} into a .py file)"
        )
    return "fork"


def preload_in_forkserver(modules: list[str]) -> None:
    """Have multiprocessing's forkserver import `modules` when it starts (the first
    forkserver launch of this process), so that its workers begin with torch and ddpkit
    imported. No GPU is touched there.

    `set_forkserver_preload` replaces the whole list, and the server is one per process:
    the modules the program asked for itself are kept. Its `__main__` is not: the
    server would run the script's top level, which may touch a GPU.
    """
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    asked = [m for m in getattr(server, "_preload_modules", []) if m != "__main__"]
    multiprocessing.set_forkserver_preload(asked + [m for m in modules if m not in asked])


def check_picklable(fn: Callable[..., Any]) -> None:
    """A forked worker needs no pickled `fn`, a spawned one does: refuse what cannot
    pickle either way, so a job that runs here also runs where workers are spawned.

    A function from a notebook or `python -c` pickles (by name) but a spawned worker
    cannot find it, so it is always forked (see start_method); it is held to the same
    rule all the same, so that once moved into a .py file it runs there unchanged."""
    try:
        pickle.dumps(fn)
    except (AttributeError, TypeError, ValueError, pickle.PicklingError) as exc:
        raise ConfigError(
            f"cannot send {getattr(fn, '__name__', fn)!r} to the workers ({exc}): define "
            "the function at module level"
        ) from exc


def _main_kind() -> Literal["importable", "interactive", "unreadable"]:
    """How a spawned worker fares with this process's `__main__`. multiprocessing imports
    it again by module name (`python -m`) or from its file (`python script.py`); it skips
    one without a file (Jupyter, `python -c`), whose functions are then missing; and it
    fails on a file that is not one (`python -` reads stdin and names it "<stdin>")."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return "importable"
    path = getattr(main, "__file__", None)
    if path is None:
        return "interactive"
    return "importable" if os.path.isfile(path) else "unreadable"


class _NullWriter:
    def write(self, data: bytes) -> int:
        return len(data)


class _MainFinder(pickle.Pickler):
    """Pickles to nowhere, noting the first function or class from `__main__` it meets."""

    def __init__(self) -> None:
        super().__init__(cast(io.BufferedWriter, _NullWriter()), pickle.HIGHEST_PROTOCOL)
        self.found: str | None = None

    def persistent_id(self, obj: Any) -> None:
        if (
            self.found is None
            and isinstance(obj, (type, types.FunctionType))
            and obj.__module__ == "__main__"
        ):
            self.found = obj.__qualname__
        # None: pickle `obj` as usual.

    def reducer_override(self, obj: Any) -> Any:
        # A tensor holds data, never a function: skip copying it (a dataset may be large).
        if isinstance(obj, torch.Tensor):
            return (tuple, ())
        return NotImplemented


def unimportable(fn: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
    """The name of a function or class, in `fn` or in its arguments, that a spawned worker
    cannot import: one defined in a notebook, `python -c` or a script read from stdin
    (from stdin no spawned worker starts at all: then `fn`'s name). None when there is
    none, at once when `__main__` is a file (the usual case)."""
    kind = _main_kind()
    if kind == "importable":
        return None
    if kind == "unreadable":
        return str(getattr(fn, "__qualname__", fn))
    finder = _MainFinder()
    for obj in (fn, args):
        # What cannot pickle at all is refused elsewhere (or needs no pickling: a fork).
        with contextlib.suppress(Exception):
            finder.dump(obj)
        if finder.found is not None:
            return finder.found
    return None
