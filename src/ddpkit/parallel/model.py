"""The model across ranks: the bare module under its wrappers, rank 0's buffers on every
rank, and state-dict keys without the wrappers' prefixes."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.context import DistContext


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module under DDP and `torch.compile` wrappers (what a checkpoint saves)."""
    while True:
        if isinstance(model, DDP):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def sync_buffers(model: nn.Module, ctx: DistContext) -> None:
    """Give every rank rank 0's buffers (BatchNorm's running statistics). A collective.

    DDP copies rank 0's buffers to the others before each forward, but a forward then
    updates each rank's own copy: without synchronized BatchNorm the ranks end a step
    with different statistics, and FSDP never copies them at all. Call it before an
    evaluation, a checkpoint or a digest that should see one model (`Trainer` does, and
    so does `save_state`). One broadcast per dtype of buffer.
    """
    if not ctx.distributed:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in unwrap(model).buffers():
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for buffers in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in buffers])
        dist.broadcast(flat, src=0)
        offset = 0
        for buffer in buffers:
            buffer.data.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()


def find_ddp(model: nn.Module) -> DDP | None:
    """The DDP wrapper at the top of `model` (under `torch.compile` too), or None."""
    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, DDP) else None


def strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the `module.` (DDP) and `_orig_mod.` (compile) key prefixes of a state dict."""
    out = {}
    for key, value in state.items():
        while key.startswith(("module.", "_orig_mod.")):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a model state dict, with or without DDP's `module.` prefixes, into `model`."""
    unwrap(model).load_state_dict(strip_prefixes(state))


def model_class_name(model: nn.Module) -> str:
    """The class of the bare `model`, as a person would import it ("torch.nn.Linear",
    "mypackage.nets.ResNet"); of a model sharded with FSDP, the class it was built as."""
    cls = type(unwrap(model))
    # fully_shard gives the model a class of its own (FSDPNet: FSDPModule and Net).
    cls = next(c for c in cls.__mro__ if not c.__module__.startswith("torch.distributed.fsdp"))
    module = cls.__module__
    if module.startswith("torch.nn.modules."):  # torch.nn.modules.linear.Linear
        module = "torch.nn"
    return f"{module}.{cls.__qualname__}"
