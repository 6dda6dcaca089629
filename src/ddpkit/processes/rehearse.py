"""`ddpkit run --cpu`: a GPU script's CUDA path, run unedited on CPU ranks over gloo.

A torchrun script is written for GPUs: `init_process_group("nccl")`,
`torch.cuda.set_device(local_rank)`, `model.to(local_rank)`, `DDP(model,
device_ids=[local_rank])`. In each rank of `ddpkit run --cpu`, before the script runs,
`install` maps what such a script asks of CUDA onto the CPU, so that the very path that
runs on the GPUs runs here (a laptop, a CI box), and its DDP mistakes show before the
GPUs are booked:

- the user's own files (the audit's rule: the script's folder and the current one, not
  an installed package) see one GPU per local rank: `torch.cuda.is_available()` is
  True, `device_count()` the local ranks; torch, ddpkit and the libraries see the
  machine as it is, so they stay on their CPU paths (Accelerate, Lightning Fabric);
- a CUDA device (`"cuda"`, `"cuda:1"`, `torch.device("cuda", 1)`, a bare index such as
  `1`) given to `.to()`, `.cuda()`, a factory's `device=`, `torch.load`'s
  `map_location` or `DDP(device_ids=..., output_device=...)` means the CPU;
- nccl means gloo; pinned memory is plain memory; `synchronize`, `set_device`, the
  seeds and the memory counters do nothing (the counters read 0);
- autocast on "cuda" is autocast on the CPU in bfloat16 when the script asks for
  bfloat16, else off (float32: float16 on the CPU is slow, and without a working
  GradScaler its gradients underflow); a GradScaler passes through (scale 1, no skip).

What cannot run on a CPU (a stream's concurrency, a CUDA graph, a CUDA kernel of the
script's own) stops the job with one line naming the call and the user's line
(`NotRehearsable`, exit status 2), as does any other CUDA call that reaches a CPU-only
torch ("Torch not compiled with CUDA enabled"), or a library's own check for CUDA.
Under `ddpkit run`, with or without `--cpu`, so does a script that starts its own ranks
(`refuse_own_ranks`).

The cost on a step is a Python call in front of `Tensor.to` and of the factories, and
a frame lookup in `torch.cuda.is_available()`; see `bench/rehearse_cost.py`.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# Set by `ddpkit run --cpu` for its workers.
REHEARSE_ENV = "DDPKIT_CPU_REHEARSAL"
# The exit status of a rank that met a call the rehearsal cannot run: bad input, as a
# refused flag is.
REFUSED_EXIT = 2

# torch functions that make a tensor and take `device=`.
_FACTORIES = (
    "tensor",
    "as_tensor",
    "scalar_tensor",
    "zeros",
    "ones",
    "empty",
    "empty_strided",
    "full",
    "rand",
    "randn",
    "randint",
    "randperm",
    "arange",
    "range",
    "linspace",
    "logspace",
    "eye",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "tril_indices",
    "triu_indices",
)
_TENSOR_FACTORIES = ("new_tensor", "new_zeros", "new_ones", "new_empty", "new_full")
# What cannot be rehearsed, and why, in the refusal's words.
_STREAMS = "CUDA streams run work concurrently, and a CPU rank runs one thing at a time"
_GRAPHS = "a CUDA graph replays recorded GPU kernels"
_REFUSED = {
    "Stream": _STREAMS,
    "ExternalStream": _STREAMS,
    "stream": _STREAMS,
    "current_stream": _STREAMS,
    "default_stream": _STREAMS,
    "set_stream": _STREAMS,
    "CUDAGraph": _GRAPHS,
    "graph": _GRAPHS,
    "make_graphed_callables": _GRAPHS,
}
# How a CPU-only torch (or a machine without a driver) says that CUDA is not there.
_NO_CUDA = (
    "Torch not compiled with CUDA enabled",
    "Found no NVIDIA driver",
    "no CUDA GPUs are available",
    "Tried to instantiate dummy base class",
    "Cannot access accelerator device when none is available",
    "CUDA is not available",  # a library's own check (timm's init_distributed_device)
)


# torch.cuda's calls that do nothing on a CPU rank, and its memory counters (0).
_DO_NOTHING = (
    "synchronize",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
    "empty_cache",
    "ipc_collect",
    "reset_peak_memory_stats",
    "reset_max_memory_allocated",
    "reset_max_memory_cached",
    "reset_accumulated_memory_stats",
    "set_per_process_memory_fraction",
)
_READ_ZERO = (
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "memory_cached",
    "max_memory_cached",
)


class NotRehearsable(SystemExit):
    """A call that needs a real GPU, met under `ddpkit run --cpu`. A SystemExit, so that
    the script's own `except Exception` does not swallow it: the rank ends with status 2
    and `ddpkit run` says the message once."""

    def __init__(self, message: str) -> None:
        super().__init__(REFUSED_EXIT)
        self.message = message

    def __str__(self) -> str:
        return self.message


def rehearsing() -> bool:
    """True in a rank of `ddpkit run --cpu`."""
    return bool(os.environ.get(REHEARSE_ENV))


# -- where the user's call is ---------------------------------------------------------


def _where(frames: Iterable[tuple[types.FrameType, int]]) -> tuple[str, str]:
    """(the user's file:line, the torch call made there) for `frames`, innermost first:
    the innermost frame of the user's own files (the audit's rule), followed by the
    library's line it led to, if any ("train.py:80 (in timm/data/loader.py:144)"); else
    the innermost frame outside ddpkit, torch and the standard library. The call is the
    outermost torch function below it."""
    from ddpkit.inrank.audit import _library_frame, _shown, not_users, users_own

    skipped = not_users()
    called, library = "", ""
    for frame, line in frames:
        name = frame.f_code.co_filename
        path = os.path.abspath(name)
        if path.startswith(skipped) or name.startswith("<"):
            module = str(frame.f_globals.get("__name__", ""))
            if module.startswith("torch") and not library:
                called = f"{module}.{frame.f_code.co_name}"
            continue
        if users_own(name):
            return f"{_shown(path)}:{line}" + (f" (in {library})" if library else ""), called
        library = library or _library_frame((path, line))  # timm/data/loader.py:144
    return library or "an unknown line", called


def _stack(frame: types.FrameType | None) -> Iterator[tuple[types.FrameType, int]]:
    while frame is not None:
        yield frame, frame.f_lineno
        frame = frame.f_back


# The fix for a refused call that a common script makes through its library: the
# option that takes the path without it (timm's train.py prefetches each batch on a
# side CUDA stream unless told not to).
_FIXES = {"timm/": "pass --no-prefetcher (timm's train.py: its loader's prefetch stream)"}
_ON_GPUS = "run this script on GPUs, or give it a path without this call when no GPU is there"


def _refuse(call: str, why: str) -> NotRehearsable:
    site, _ = _where(_stack(sys._getframe(1)))
    fix = next((f for where, f in _FIXES.items() if f"(in {where}" in site), "")
    return NotRehearsable(
        f"{call} at {site} cannot be rehearsed on CPU ranks (--cpu): {why}; {fix or _ON_GPUS}"
    )


def refuse_own_ranks() -> None:
    """In a rank of `ddpkit run`, a script that starts its own ranks
    (`torch.multiprocessing.spawn`, `start_processes`: the tutorial's multigpu.py) ends
    the job in one line: its children would inherit torchrun's
    TORCHELASTIC_USE_AGENT_STORE and wait forever for a store that nobody serves, and
    each of ddpkit's ranks would start a whole job of its own."""
    import torch.multiprocessing as mp

    spawning = sys.modules["torch.multiprocessing.spawn"]  # the module, which mp.spawn hides

    def refusing(name: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            site, _ = _where(_stack(sys._getframe(1)))
            script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "SCRIPT"
            raise NotRehearsable(
                f"{site} starts its own ranks with torch.multiprocessing.{name}(), inside "
                f"each rank of ddpkit run: run it as `python {script}`, or let ddpkit start "
                "the ranks: see docs/port.md"
            )

        return refused

    for name in ("spawn", "start_processes"):
        setattr(mp, name, refusing(name))
        setattr(spawning, name, getattr(mp, name))


def refusal(exc: BaseException) -> NotRehearsable | None:
    """`exc` as a refusal when it is CUDA missing under the rehearsal (a CUDA call that
    `install` does not map, made on a CPU-only torch), else None."""
    if isinstance(exc, NotRehearsable):
        return exc
    if not any(text in str(exc) for text in _NO_CUDA):
        return None
    import traceback

    frames = list(traceback.walk_tb(exc.__traceback__))
    site, called = _where(reversed(frames))
    call = f"{called}()" if called else "a CUDA call"
    said = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    fix = (
        # A library's line: it saw the machine as it is, as it does on a CPU machine.
        "only the script's own files see the rehearsed GPU, so that a library takes its "
        "CPU path: give this one its CPU option (timm: --device cpu), or run on GPUs"
        if " (in " in site
        else _ON_GPUS
    )
    return NotRehearsable(
        f"{call} at {site} cannot be rehearsed on CPU ranks (--cpu): it needs a GPU"
        f"{f' ({said})' if said else ''}; {fix}"
    )


# -- devices ------------------------------------------------------------------------


def _on_cuda(device: Any) -> bool:
    """Whether `device` names a GPU: "cuda", "cuda:1", torch.device("cuda", 1), or a
    bare index, which torch reads as a CUDA device."""
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, int):
        return not isinstance(device, bool)
    return getattr(device, "type", None) == "cuda"


def _device_kwarg(fn: Callable[..., Any], *, first: bool = False) -> Callable[..., Any]:
    """`fn` with a CUDA `device=` read as the CPU; with `first`, a CUDA device as the
    first argument after self too (`Tensor.to`, `Module.to`)."""

    @functools.wraps(fn)
    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        if first and len(args) > 1 and _on_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        device = kwargs.get("device")
        if device is not None and _on_cuda(device):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return on_cpu


def _patch_tensors(torch: Any) -> None:
    original_to = torch._C.TensorBase.to
    to_cpu = _device_kwarg(original_to, first=True)
    torch.nn.Module.to = _device_kwarg(torch.nn.Module.to, first=True)

    def cuda(self: Any, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        return original_to(self, "cpu", **kwargs)

    def pin_memory(self: Any, device: Any = None) -> Any:
        return self

    torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.pin_memory = to_cpu, cuda, pin_memory
    for name in _TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _device_kwarg(getattr(torch.Tensor, name)))
    for name in _FACTORIES:
        if hasattr(torch, name):
            setattr(torch, name, _device_kwarg(getattr(torch, name)))
    set_default_device = torch.set_default_device

    @functools.wraps(set_default_device)
    def set_default(device: Any) -> None:
        set_default_device("cpu" if device is not None and _on_cuda(device) else device)

    torch.set_default_device = set_default


def _map_location(where: Any) -> Any:
    """`torch.load`'s map_location on the CPU: a GPU, None (where each tensor was saved)
    and a function (`lambda s, loc: s.cuda(gpu)`) all keep every tensor on the CPU."""
    if where is None or callable(where) or _on_cuda(where):
        return "cpu"
    if isinstance(where, dict):
        return {k: "cpu" if _on_cuda(v) else v for k, v in where.items()}
    return where


def _patch_load(torch: Any) -> None:
    load = torch.load

    @functools.wraps(load)
    def load_on_cpu(f: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            args = (_map_location(args[0]), *args[1:])
        else:
            kwargs["map_location"] = _map_location(kwargs.get("map_location"))
        return load(f, *args, **kwargs)

    torch.load = load_on_cpu


# -- torch.cuda -----------------------------------------------------------------------


def _users(frame: types.FrameType | None) -> bool:
    """Whether `frame` is the user's own code (the audit's rule: the script's folder or
    the current one, not an installed package, torch, ddpkit or the standard library),
    which sees the rehearsed GPU. Every other caller sees the machine as it is, so that
    torch and ddpkit stay on their CPU paths, and a library with a CPU path of its own
    (Accelerate, Lightning Fabric, timm's helpers) takes it, as on a CPU machine."""
    from ddpkit.inrank.audit import users_own

    return frame is not None and users_own(frame.f_code.co_filename)


class _Event:
    """`torch.cuda.Event`: on a CPU rank, work is done when the call returns, so an
    event is a timestamp (`elapsed_time` in milliseconds, as CUDA's)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **_: Any) -> None:
        self.time: float | None = None

    def record(self, stream: Any = None) -> None:
        self.time = time.perf_counter()

    def elapsed_time(self, end: _Event) -> float:
        if self.time is None or end.time is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end.time - self.time) * 1000.0

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


class _Device:
    """`torch.cuda.device(i)`: a context in which nothing changes."""

    def __init__(self, device: Any) -> None:
        self.idx = device

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


def _patch_cuda(torch: Any, local_ranks: int) -> None:
    cuda = torch.cuda
    real_available, real_count = cuda.is_available, cuda.device_count
    current = [0]

    def is_available() -> bool:
        return True if _users(sys._getframe(1)) else bool(real_available())

    def device_count() -> int:
        return local_ranks if _users(sys._getframe(1)) else int(real_count())

    def set_device(device: Any) -> None:
        if isinstance(device, str):
            device = torch.device(device)
        current[0] = int(device if isinstance(device, int) else device.index or 0)

    def current_device() -> int:
        return current[0]

    def properties(device: Any = None) -> Any:
        return types.SimpleNamespace(
            name="CPU (ddpkit run --cpu)",
            major=8,
            minor=0,
            total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            multi_processor_count=torch.get_num_threads(),
            is_integrated=False,
        )

    mapped: dict[str, Any] = {
        "is_available": is_available,
        "device_count": device_count,
        "set_device": set_device,
        "current_device": current_device,
        "device": _Device,
        "Event": _Event,
        "is_bf16_supported": _returning(True),
        "get_device_name": lambda device=None: properties().name,
        "get_device_properties": properties,
        "get_device_capability": _returning((8, 0)),
        **{name: _returning(None) for name in _DO_NOTHING},
        **{name: _returning(0) for name in _READ_ZERO},
    }
    for name, value in mapped.items():
        setattr(cuda, name, value)
    for name, why in _REFUSED.items():
        setattr(cuda, name, _refusing(f"torch.cuda.{name}()", why))


def _returning(value: Any) -> Callable[..., Any]:
    """A new function that returns `value` (each name its own: torch.compile's rules
    refuse one object under two names)."""

    def fixed(*args: Any, **kwargs: Any) -> Any:
        return value

    return fixed


def _refusing(call: str, why: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise _refuse(call, why)

    return refused


def _patch_amp(torch: Any) -> None:
    real = torch.amp.autocast

    class Autocast(real):  # type: ignore[misc, valid-type]
        """autocast on "cuda" runs on the CPU: bfloat16 when asked for, else off."""

        def __init__(
            self,
            device_type: str,
            dtype: Any = None,
            enabled: bool = True,
            cache_enabled: bool | None = None,
        ) -> None:
            if device_type == "cuda":
                device_type = "cpu"
                if dtype is not torch.bfloat16:
                    dtype, enabled = None, False
            super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    class CudaAutocast(Autocast):
        """torch.cuda.amp.autocast(enabled, dtype, cache_enabled), float16 by default."""

        def __init__(
            self, enabled: bool = True, dtype: Any = torch.float16, cache_enabled: bool = True
        ) -> None:
            super().__init__("cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    torch.autocast = torch.amp.autocast = Autocast
    torch.cuda.amp.autocast = CudaAutocast
    scaler = torch.amp.GradScaler
    init = scaler.__init__
    signature = inspect.signature(init)

    @functools.wraps(init)
    def pass_through(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("device", "cuda") == "cuda":
            bound.arguments["device"], bound.arguments["enabled"] = "cpu", False
        init(*bound.args, **bound.kwargs)

    scaler.__init__ = pass_through


# -- torch.distributed, DDP, DataLoader, extensions -------------------------------------------


def _backend(backend: Any) -> Any:
    return "gloo" if backend is None or "nccl" in str(backend).lower() else backend


def _patch_distributed(torch: Any) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    init, new_group = dist.init_process_group, dist.new_group

    @functools.wraps(init)
    def init_gloo(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (_backend(args[0]), *args[1:])
        else:
            kwargs["backend"] = _backend(kwargs.get("backend"))
        kwargs.pop("device_id", None)  # a GPU to bind the group to
        kwargs.pop("pg_options", None)  # nccl's options
        return init(*args, **kwargs)

    @functools.wraps(new_group)
    def new_gloo_group(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = _backend(kwargs["backend"])
            kwargs.pop("pg_options", None)
        kwargs.pop("device_id", None)
        return new_group(*args, **kwargs)

    dist.init_process_group, dist.new_group = init_gloo, new_gloo_group
    ddp_init = DistributedDataParallel.__init__

    @functools.wraps(ddp_init)
    def ddp_on_cpu(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        # device_ids and output_device (the 2nd and 3rd arguments) name GPUs: a CPU
        # module takes neither.
        args = tuple(None if i < 2 else a for i, a in enumerate(args))
        kwargs.pop("device_ids", None)
        kwargs.pop("output_device", None)
        ddp_init(self, module, *args, **kwargs)

    DistributedDataParallel.__init__ = ddp_on_cpu  # type: ignore[method-assign]
    loader_init = DataLoader.__init__
    loader_signature = inspect.signature(loader_init)

    @functools.wraps(loader_init)
    def unpinned(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = loader_signature.bind(self, *args, **kwargs)
        bound.arguments.pop("pin_memory", None)
        bound.arguments.pop("pin_memory_device", None)
        loader_init(*bound.args, **bound.kwargs)

    DataLoader.__init__ = unpinned  # type: ignore[method-assign]


class _ExtensionFinder:
    """Refuses `torch.utils.cpp_extension.load`/`load_inline` of CUDA sources, patched
    when the script imports that module (importing it here would cost every rank a
    tenth of a second)."""

    name = "torch.utils.cpp_extension"

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: types.ModuleType) -> None:
            exec_module(module)
            _patch_extensions(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _patch_extensions(module: Any) -> None:
    load, load_inline = module.load, module.load_inline
    why = "it compiles CUDA kernels of the script's own"

    @functools.wraps(load)
    def cpu_load(name: str, sources: Any, *args: Any, **kwargs: Any) -> Any:
        files = [sources] if isinstance(sources, str) else list(sources)
        if any(str(s).endswith((".cu", ".cuh")) for s in files):
            raise _refuse(f"torch.utils.cpp_extension.load({name!r})", why)
        return load(name, sources, *args, **kwargs)

    @functools.wraps(load_inline)
    def cpu_load_inline(name: str, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cuda_sources") or (len(args) > 1 and args[1]):
            raise _refuse(f"torch.utils.cpp_extension.load_inline({name!r})", why)
        return load_inline(name, *args, **kwargs)

    module.load, module.load_inline = cpu_load, cpu_load_inline


def install() -> None:
    """Map this rank's CUDA calls onto the CPU (see the module's docstring). Installed
    by `ddpkit run --cpu`'s shim in each rank, after the audit's hooks, which it wraps."""
    import torch

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    _patch_tensors(torch)
    _patch_load(torch)
    _patch_cuda(torch, local_ranks)
    _patch_amp(torch)
    _patch_distributed(torch)
    if "torch.utils.cpp_extension" in sys.modules:
        _patch_extensions(sys.modules["torch.utils.cpp_extension"])
    else:
        sys.meta_path.insert(0, _ExtensionFinder())
