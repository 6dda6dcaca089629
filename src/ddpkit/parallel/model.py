"""prepare_model: put a model on this rank's device, synchronise its BatchNorm layers and
wrap it in DistributedDataParallel, in the right order."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.parallel.compression import bf16_allreduce_hook

log = logging.getLogger("ddpkit")


def prepare_model(
    model: nn.Module,
    ctx: DistContext,
    *,
    sync_batchnorm: bool = True,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    gradient_as_bucket_view: bool = True,
    bucket_cap_mb: float | None = None,
    broadcast_buffers: bool = True,
    strategy: str = "ddp",
    fsdp: dict[str, Any] | None = None,
    grad_compression: str = "none",
) -> nn.Module:
    """Put `model` on this rank's device and, with more than one rank, wrap it in DDP
    (or shard it with FSDP2, `strategy="fsdp"`).

    Call it on every rank, after building the model and before building the
    optimizer's parameter list from it is fine too (the parameters stay the same
    objects). With one process the model comes back unwrapped: DDP would only add a
    gradient copy per step.

    Args:
        model: the bare model (not already wrapped in DistributedDataParallel).
        ctx: this rank's `DistContext` (from `launch`).
        sync_batchnorm: turn BatchNorm layers into synchronised BatchNorm, so that their
            statistics are those of the global batch (PyTorch's layer on GPUs, ddpkit's
            own on CPU, where PyTorch's refuses to run). False keeps per-rank statistics.
        find_unused_parameters: let DDP handle parameters that get no gradient in a step.
        static_graph: promise DDP that the graph is the same every step.
        gradient_as_bucket_view: let gradients share DDP's buckets (saves one
            gradient-sized copy).
        bucket_cap_mb: DDP's bucket size in MiB (None: DDP's default).
        broadcast_buffers: copy rank 0's buffers to every rank before each forward
            (with either strategy).
        strategy: "ddp" replicates the model on every rank; "fsdp" shards its
            parameters, gradients and optimizer state over the ranks (`ddpkit.parallel.fsdp`),
            for models that do not fit on one device. With "fsdp", build the optimizer
            after this call, on the returned model's parameters.
        fsdp: options of `ddpkit.parallel.fsdp.shard_model` (`blocks`, `min_params`,
            `precision`, `offload`, `reshard_after_forward`).
        grad_compression: "bf16" all-reduces gradients in bfloat16
            (`ddpkit.parallel.compression`: half the bytes, each gradient rounded to ~3 digits);
            "none" sends them as they are.

    Returns:
        The model to train: DDP-wrapped with several ranks, the moved model with one.
    """
    if strategy not in ("ddp", "fsdp"):
        raise ConfigError(f"strategy must be 'ddp' or 'fsdp' (got {strategy!r})")
    if grad_compression not in ("none", "bf16"):
        raise ConfigError(f"grad_compression must be 'none' or 'bf16' (got {grad_compression!r})")
    if grad_compression != "none" and strategy != "ddp":
        raise ConfigError(
            "grad_compression works with strategy ddp only (FSDP reduces in its own "
            "dtypes): drop grad_compression, or use precision='bf16' with fsdp"
        )
    if isinstance(model, DDP):
        raise TypeError("model is already wrapped in DistributedDataParallel: pass the bare module")
    model = model.to(ctx.device)
    if not ctx.distributed:
        return model
    if sync_batchnorm:
        from ddpkit.parallel.syncbn import convert_sync_batchnorm

        model, converted = convert_sync_batchnorm(model, ctx.device.type)
        if converted and ctx.is_main:
            log.info(
                "converted %d BatchNorm layer(s) to SyncBatchNorm "
                "(statistics over the global batch; sync_batchnorm=False turns this off)",
                converted,
            )
    if strategy == "fsdp":
        from ddpkit.parallel.fsdp import shard_model

        sharded = shard_model(model, ctx, **(fsdp or {}))
        if broadcast_buffers and any(True for _ in sharded.buffers()):
            # As DDP does: each forward starts from rank 0's buffers, so that per-rank
            # BatchNorm statistics cannot drift apart (FSDP never copies buffers).
            sharded.register_forward_pre_hook(lambda module, args: sync_buffers(module, ctx))
        return sharded
    on_gpu = ctx.device.type == "cuda"
    kwargs: dict[str, object] = {}
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    if not broadcast_buffers:  # only when asked: newer torch warns that it is deprecated
        kwargs["broadcast_buffers"] = False
    ddp = DDP(
        model,
        device_ids=[ctx.device] if on_gpu else None,
        output_device=ctx.device if on_gpu else None,
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
        gradient_as_bucket_view=gradient_as_bucket_view,
        **kwargs,  # type: ignore[arg-type]
    )
    if grad_compression == "bf16":
        ddp.register_comm_hook(None, bf16_allreduce_hook)
    return ddp


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
