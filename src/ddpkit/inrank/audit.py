"""`ddpkit run --audit`: the DDP pitfalls a job actually committed while it ran.

A static checker must guess; a running job shows what happens. In each rank, `install`
puts hooks on the few calls that matter (the optimizer's step, `torch.save` and
`torch.load`, `DistributedSampler`, `DistributedDataParallel`, the process group's
start and end) and `finish` writes what they saw to `rank<N>.audit.json`. At the end,
the supervisor (`ddpkit.processes.audit.findings`) reads every rank's file and reports
only what happened, under the checker's codes, at the user's file and line (see
`_user_site`):

- DDP112, ranks trained different weights: the parameters that optimizers stepped
  differ between ranks when the group is destroyed (or at exit);
- DDP101, a shuffling `DistributedSampler` trained on twice with the same epoch (a
  whole pass after whose start an optimizer stepped);
- DDP103, one path written by `torch.save` from more than one rank;
- DDP104, a `torch.save` of a state dict whose keys all start with `module.`, taken
  from a DDP wrapper;
- DDP105 (info), a DDP-wrapped model with BatchNorm layers that are not synchronised;
- DDP107 (GPUs), `torch.load` on one rank returned tensors on another rank's GPU;
- DDP109 (GPUs), an nccl group on a rank whose current GPU is not its local rank;
- DDP111, the process group still alive at exit (of a job that ended well: a crash is
  no forgotten teardown).

The hooks cost a dictionary lookup per optimizer step and nothing per batch; the
weights are hashed once, after training. Nothing synchronises the device or talks to
the other ranks: the comparison happens in the supervisor, from the files.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.storage import write_json

# Set by `ddpkit run --audit` for its workers.
AUDIT_ENV = "DDPKIT_AUDIT"
_LOG = "rank{rank}.audit.json"
# Frames of these are never a finding's place: it points past them.
_NOT_USER = (
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ""),  # ddpkit
    os.path.join(os.path.dirname(os.__file__), ""),  # the standard library (runpy, importlib)
)
# Where installed packages live: never the user's own files, even inside the project
# (a venv in it).
_INSTALLED = ("site-packages", "dist-packages")

# (absolute path, line, and the library frame the user's line led to: "" or "path:line")
Site = tuple[str, int, str]


def _user_site() -> Site:
    """Where the user's code led to the hook that calls this: the innermost frame of the
    user's own files, and the library's frame inside it (accelerate's or timm's call of
    `torch.save`, say), or "" when the user's line called torch itself.

    The user's own files are those under the script's folder or the current folder,
    except installed packages (site-packages, dist-packages), the standard library,
    torch and ddpkit. Every other file is a library's. With no user's frame on the stack,
    the library's innermost frame is the place."""
    skipped = not_users()
    roots = _user_roots()
    library: tuple[str, int] | None = None
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        path = os.path.abspath(name)
        if not name.startswith("<") and not path.startswith(skipped):
            if path.startswith(roots) and not _installed(path):
                return path, frame.f_lineno, _library_frame(library)
            library = library or (path, frame.f_lineno)
        frame = frame.f_back  # type: ignore[assignment]
    return (*library, "") if library else ("<unknown>", 0, "")


def users_own(filename: str) -> bool:
    """Whether `filename` (a code object's) is one of the user's own files, by the rule
    of `_user_site`. `ddpkit run --cpu` shows its rehearsed GPU to these files alone."""
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    return (
        path.startswith(_user_roots()) and not path.startswith(not_users()) and not _installed(path)
    )


@functools.cache
def not_users() -> tuple[str, ...]:
    """Folders whose files are never the user's: ddpkit's, the standard library's, torch's."""
    import torch

    return (*_NOT_USER, os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), ""))


def _user_roots() -> tuple[str, ...]:
    """The folders of the user's own files: the script's and the current one."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    roots = {os.path.join(os.getcwd(), "")}
    if main:
        roots.add(os.path.join(os.path.dirname(os.path.abspath(main)), ""))
    return tuple(roots)


def _installed(path: str) -> bool:
    return any(part in _INSTALLED for part in path.split(os.sep))


def _library_frame(frame: tuple[str, int] | None) -> str:
    """A library's frame as `package/file.py:line` (from its site-packages), else by
    its path."""
    if frame is None:
        return ""
    path, line = frame
    parts = path.split(os.sep)
    installed = [i for i, part in enumerate(parts) if part in _INSTALLED]
    shown = "/".join(parts[installed[-1] + 1 :]) if installed else _shown(path)
    return f"{shown}:{line}"


def _shown(path: str) -> str:
    """A path as the user would write it: relative to this folder when inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


@dataclass
class _Optimizer:
    site: Site  # where its first step was taken
    params: list[Any]


@dataclass
class _Recorder:
    rank: int
    events: list[dict[str, Any]] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)
    optimizers: dict[int, _Optimizer] = field(default_factory=dict)
    wrapped: set[int] = field(default_factory=set)  # ids of parameters inside a DDP
    init_site: Site | None = None
    digests: list[list[str]] | None = None
    wraps: list[bool] | None = None  # per optimizer: DDP (or FSDP) holds all its parameters
    failed: bool = False  # the rank's script raised or exited non-zero
    sampler_sites: dict[int, Site] = field(default_factory=dict)
    sampler_epochs: dict[int, set[int]] = field(default_factory=dict)
    # Optimizer steps so far, and per sampler its last whole pass not yet judged: (epoch,
    # steps when it started, its site). A pass trains when a step comes after its start
    # and before the sampler's next pass (or the end): an accuracy pass over the training
    # loader after the last epoch repeats that epoch's order, but nothing learns from it.
    steps: int = 0
    sampler_pending: dict[int, tuple[int, int, Site]] = field(default_factory=dict)

    def event(self, code: str, site: Site, message: str) -> None:
        key = (code, site[0], site[1])
        if any((e["code"], e["path"], e["line"]) == key for e in self.events):
            return
        self.events.append(
            {"code": code, "path": site[0], "line": site[1], "via": site[2], "message": message}
        )

    # -- the hooks ------------------------------------------------------------------

    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if id(optimizer) in self.optimizers:
            return  # the cost of an audited step: this count and lookup
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.optimizers[id(optimizer)] = _Optimizer(_user_site(), params)

    def on_ddp(self, module: Any) -> None:
        import torch

        site = _user_site()
        self.wrapped.update(id(p) for p in module.parameters())
        unsynced = [
            type(m).__name__
            for m in module.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            and "Sync" not in type(m).__name__
            and m.training
            and m.track_running_stats
        ]
        if unsynced:
            self.event(
                "DDP105",
                site,
                f"the model wrapped here has {len(unsynced)} BatchNorm layer(s) "
                f"({unsynced[0]}) that are not synchronised: each rank normalises with its "
                "own batch statistics; convert them with "
                "`torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)` if that matters",
            )

    def on_save(self, obj: Any, f: Any) -> None:
        site = _user_site()
        if isinstance(f, (str, os.PathLike)):
            path = os.path.abspath(os.fspath(f))
            self.saves.append({"path": path, "site": list(site)})
        if self.wrapped and _wrapper_keys(obj):
            self.event(
                "DDP104",
                site,
                "the state dict saved here came from the DDP wrapper: every key starts with "
                "`module.`, so it will not load into a plain model; save "
                "`model.module.state_dict()` instead",
            )

    def on_load(self, result: Any) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        here = torch.cuda.current_device()
        other = _foreign_device(result, here)
        if other is not None:
            self.event(
                "DDP107",
                _user_site(),
                f"`torch.load` on rank {self.rank} put tensors on cuda:{other}, not on its "
                f"own cuda:{here}: pass `map_location=f'cuda:{{local_rank}}'` (or 'cpu')",
            )

    def on_sampler_start(self, sampler: Any) -> None:
        """A pass over a sampler starts: its previous whole pass can now be judged."""
        self._judge_pass(id(sampler))

    def on_sampler_pass(self, sampler: Any, epoch: int, start_steps: int) -> None:
        """A whole pass over a sampler ended (a peek at one batch, as the DDP tutorial
        takes to learn the batch size before `set_epoch`, is not a pass); it is judged
        at the sampler's next pass or at the end, once it is known whether it trained."""
        if not getattr(sampler, "shuffle", False):
            return
        site = self.sampler_sites.get(id(sampler), _user_site())
        self.sampler_pending[id(sampler)] = (epoch, start_steps, site)

    def _judge_pass(self, key: int) -> None:
        pending = self.sampler_pending.pop(key, None)
        if pending is None:
            return
        epoch, start_steps, site = pending
        if self.steps == start_steps:
            return  # nothing trained on it: an evaluation pass
        epochs = self.sampler_epochs.setdefault(key, set())
        if epoch in epochs:
            self.event(
                "DDP101",
                site,
                f"this DistributedSampler was iterated twice with epoch {epoch}: every pass "
                "shuffles the same way; call `sampler.set_epoch(epoch)` at the start of each",
            )
        epochs.add(epoch)

    def on_init(self, backend: Any) -> None:
        import torch

        self.init_site = _user_site()
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if str(backend).lower() == "nccl" and torch.cuda.is_available():
            current = torch.cuda.current_device()
            if current != local:
                self.event(
                    "DDP109",
                    self.init_site,
                    f"the nccl group was created on rank {self.rank} with cuda:{current} as "
                    f"its current device, not its local rank's cuda:{local}: call "
                    "`torch.cuda.set_device(local_rank)` first",
                )

    def take_digests(self) -> None:
        """The stepped parameters' digests, once training is over. Sharded parameters
        (FSDP's: DTensors, flat parameters and the views into them) are left out: each
        rank holds its own shard by design."""
        from ddpkit.hashing import tensor_digest  # imports torch: here, as every use does

        self.digests = [
            [tensor_digest(p) for p in opt.params if not _sharded(p)]
            for opt in self.optimizers.values()
        ]
        # Now, while the parameters are held (see the hook on destroy_process_group).
        # FSDP's are sharded: FSDP holds them.
        self.wraps = [
            all(_sharded(p) or id(p) in self.wrapped for p in opt.params)
            for opt in self.optimizers.values()
        ]

    # -- the end -----------------------------------------------------------------------

    def write(self, folder: Path) -> None:
        import torch.distributed as dist

        for key in list(self.sampler_pending):
            self._judge_pass(key)
        alive = dist.is_available() and dist.is_initialized()
        if alive and self.init_site is not None and not self.failed:  # a crash skips teardown
            self.event(
                "DDP111",
                self.init_site,
                "the process group created here was still alive when the script ended: call "
                "`dist.destroy_process_group()` at the end (in a `finally:` block)",
            )
        if self.digests is None:
            self.take_digests()
        log = {
            "rank": self.rank,
            "failed": self.failed,
            "events": self.events,
            "saves": self.saves,
            "optimizers": [
                {"site": list(opt.site), "wrapped": wrapped, "digests": digests}
                for opt, digests, wrapped in zip(
                    self.optimizers.values(), self.digests or [], self.wraps or [], strict=False
                )
            ],
        }
        write_json(folder / _LOG.format(rank=self.rank), log)


def _sharded(param: Any) -> bool:
    return type(param).__name__ in ("DTensor", "FlatParameter") or bool(
        getattr(param, "_fsdp_flattened", False)
    )


def _wrapper_keys(obj: Any, depth: int = 0) -> bool:
    """A state dict (or one inside a checkpoint dict) whose keys all start with module."""
    if not isinstance(obj, dict) or not obj or depth > 2:
        return False
    keys = list(obj)
    if all(isinstance(k, str) for k in keys) and all(k.startswith("module.") for k in keys):
        return True
    return any(_wrapper_keys(v, depth + 1) for v in obj.values() if isinstance(v, dict))


def _foreign_device(obj: Any, here: int, depth: int = 0) -> int | None:
    """The index of a GPU other than `here` that a loaded tensor lies on, if any."""
    import torch

    if isinstance(obj, torch.Tensor):
        device = obj.device
        return device.index if device.type == "cuda" and device.index != here else None
    if depth > 3:
        return None
    values = (
        obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    )
    for value in values:
        found = _foreign_device(value, here, depth + 1)
        if found is not None:
            return found
    return None


def install(rank: int) -> _Recorder:
    """Put the hooks in place in this rank; `finish` writes what they saw."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils.data.distributed import DistributedSampler

    recorder = _Recorder(rank)
    register_optimizer_step_post_hook(recorder.on_step)

    def after(cls: Any, name: str, hook: Any) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            hook(self)
            return result

        setattr(cls, name, wrapper)

    after(DistributedDataParallel, "__init__", recorder.on_ddp)
    after(
        DistributedSampler,
        "__init__",
        lambda s: recorder.sampler_sites.__setitem__(id(s), _user_site()),
    )
    original_iter = DistributedSampler.__iter__

    @functools.wraps(original_iter)
    def sampler_iter(self: Any) -> Any:
        epoch = int(getattr(self, "epoch", 0))
        recorder.on_sampler_start(self)
        start_steps = recorder.steps
        yield from original_iter(self)
        recorder.on_sampler_pass(self, epoch, start_steps)

    DistributedSampler.__iter__ = sampler_iter  # type: ignore[method-assign]
    save, load = torch.save, torch.load

    @functools.wraps(save)
    def audited_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.on_save(obj, f)
        return save(obj, f, *args, **kwargs)

    @functools.wraps(load)
    def audited_load(*args: Any, **kwargs: Any) -> Any:
        result = load(*args, **kwargs)
        recorder.on_load(result)
        return result

    torch.save, torch.load = audited_save, audited_load
    init, destroy = dist.init_process_group, dist.destroy_process_group

    @functools.wraps(init)
    def audited_init(*args: Any, **kwargs: Any) -> Any:
        result = init(*args, **kwargs)
        recorder.on_init(dist.get_backend())
        return result

    @functools.wraps(destroy)
    def audited_destroy(*args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs.get("group") and recorder.digests is None:
            recorder.take_digests()  # training is over: the weights it ends with
            # ... and the audit lets go of them, so that they are freed when the script
            # frees them, as without it: a gloo group freed later, from a frame's clean-up,
            # can deadlock on the GIL with its own worker thread.
            for optimizer in recorder.optimizers.values():
                optimizer.params = []
        return destroy(*args, **kwargs)

    dist.init_process_group, dist.destroy_process_group = audited_init, audited_destroy
    return recorder


def finish(recorder: _Recorder, folder: Path, *, failed: bool = False) -> None:
    """Write what this rank's hooks saw (at the end of the script, crashed or not:
    `failed` when it raised or exited non-zero)."""
    recorder.failed = failed
    try:
        recorder.write(folder)
    except Exception as exc:  # the audit never turns a finished job into a failed one
        print(f"ddpkit: the audit of rank {recorder.rank} failed: {exc}", file=sys.stderr)
