"""Synchronized BatchNorm for CPU tensors (gloo), where `torch.nn.SyncBatchNorm` refuses to run.

The math is that of `torch.nn.SyncBatchNorm`: in training, every rank normalizes with
the mean and biased variance of the global batch (all ranks together), the backward
pass all-reduces the two per-channel sums the input gradient needs, and the weight and
bias gradients stay local sums, which DDP then averages. The result equals plain
BatchNorm over the global batch.

`convert_sync_batchnorm` swaps every BatchNorm of a model for the right synchronized
layer: PyTorch's fused kernels on CUDA, this module's `SyncBatchNorm` elsewhere.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from ddpkit.errors import ConfigError

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of all ranks, for any device gloo can reduce on.

    Takes the arguments of `torch.nn.SyncBatchNorm` and inputs of shape (N, C, *).
    In training mode, with an initialised process group of more than one rank, the
    statistics are those of the global batch; ranks may hold different numbers of
    samples (even none). Each forward runs one collective on every rank of the group,
    and each backward that needs the input gradient runs one more, so every rank must
    call it the same number of times. In eval mode, or without a process group (or with
    a group of one), it is exactly `torch.nn.BatchNorm*d` and runs no collective: like
    PyTorch's SyncBatchNorm, eval without running statistics normalizes with the local
    batch, so ranks may evaluate different numbers of batches.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        # Only torch >= 2.13 knows `bias=` (a BatchNorm without bias cannot exist
        # before it), so pass it only when it differs from the default.
        options: dict[str, Any] = {"device": device, "dtype": dtype}
        if not bias:
            options["bias"] = False
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **options)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects input of shape (N, C, *) with at least 2 dimensions "
                f"(got a {input.dim()}D input of shape {tuple(input.shape)})"
            )
        if input.size(1) != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got an input with {input.size(1)} "
                f"channels (shape {tuple(input.shape)}): dimension 1 must hold the channels"
            )

    def _sync_group(self) -> dist.ProcessGroup | None:
        """The group to synchronize over, or None when plain BatchNorm gives the same result."""
        # Eval never synchronizes (as in PyTorch): evaluation loops often give ranks
        # different numbers of batches, and a collective there would hang the job.
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        # -1 when this rank is not a member of `group`: nothing to synchronize with.
        if group is None or dist.get_world_size(group) <= 1:
            return None
        return group

    def forward(self, input: Tensor) -> Tensor:
        group = self._sync_group()
        if group is None:
            out: Tensor = super().forward(input)
            return out
        self._check_input_dim(input)
        factor = 0.0
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            # momentum=None is nn.BatchNorm's cumulative average over all batches seen.
            factor = (
                1.0 / float(self.num_batches_tracked)
                if self.momentum is None
                else float(self.momentum)
            )
        stats = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        result: Tensor = _SyncBatchNormFunction.apply(  # type: ignore[no-untyped-call]
            input, self.weight, self.bias, *stats, self.eps, factor, group
        )
        return result


def _gather(packet: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's `packet`, one row per rank, in one collective."""
    world = dist.get_world_size(group)
    table = packet.new_empty(world * packet.numel())
    # all_gather_single is torch >= 2.13's name; all_gather_into_tensor warns there.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    # One flat tensor, not a list: gloo gathers it in one exchange, and on this kind of
    # machine a gather costs a third of an all_reduce of the same bytes.
    gather(table, packet, group=group)
    return table.view(world, -1)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalization with global statistics; its backward is the global BatchNorm gradient.

    The arithmetic runs in ATen's fused CPU BatchNorm kernels (local statistics, the
    normalization with given statistics, the two per-channel backward sums), so what
    synchronization adds to plain BatchNorm is mostly the two collectives.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        factor: float,
        group: dist.ProcessGroup,
    ) -> Tensor:
        channels = x.size(1)
        # float16/bfloat16 statistics lose too much; float64 inputs keep their precision.
        cdtype = torch.promote_types(x.dtype, torch.float32)
        # Autocast would be free to run these ops in half precision; the statistics
        # must stay in float32 or better whatever the caller's autocast settings are.
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(cdtype)
            local_count = x.numel() // channels
            if local_count > 0:
                # The fused kernel's mean and biased variance (a third of var_mean's time).
                mean, var = torch.batch_norm_update_stats(xc, None, None, 0.0)
                local_m2 = var.to(torch.float64) * local_count
            else:
                # An empty rank still joins the collective, or its peers would hang.
                mean = local_m2 = torch.zeros(channels, dtype=torch.float64, device=x.device)
            # float64 keeps counts exact (float32 is exact only up to 2**24 values per
            # channel per rank) and makes the combination below as accurate as the data.
            packet = torch.cat(
                [
                    torch.tensor([float(local_count)], dtype=torch.float64, device=x.device),
                    mean.to(torch.float64),
                    local_m2.to(torch.float64),
                ]
            )
            # A gather of per-rank (count, mean, M2) rather than an all_reduce of sums
            # and sums of squares: they combine exactly with any counts, and without
            # the cancellation of E[x^2] - E[x]^2 when the mean is large.
            table = _gather(packet, group)
            counts = table[:, :1]
            means = table[:, 1 : channels + 1]
            m2s = table[:, channels + 1 :]
            total = float(counts.sum())
            if total == 1.0:
                # Every rank sees the same total, so every rank raises here together.
                raise ValueError(
                    "Expected more than 1 value per channel when training, got 1 over "
                    f"{table.size(0)} ranks (local input shape {tuple(x.shape)}): use a "
                    "larger batch or drop the last incomplete batch (drop_last=True)"
                )
            if total == 0.0:
                # Nothing to normalize anywhere; running stats stay, as in nn.BatchNorm.
                global_mean = torch.zeros(channels, dtype=torch.float64, device=x.device)
                global_m2 = torch.zeros_like(global_mean)
            else:
                global_mean = (counts * means).sum(0) / total
                # Chan et al.: within-rank M2 plus the spread of the rank means.
                global_m2 = m2s.sum(0) + (counts * (means - global_mean) ** 2).sum(0)
            global_var = global_m2 / max(total, 1.0)

            if running_mean is not None and running_var is not None and total > 0:
                # nn.BatchNorm tracks the unbiased variance of the (here: global) batch.
                unbiased = global_m2 / (total - 1.0)
                for stat, batch in ((running_mean, global_mean), (running_var, unbiased)):
                    stat.copy_(stat.to(torch.float64) * (1.0 - factor) + batch * factor)

            mean_c = global_mean.to(cdtype)
            var_c = global_var.to(cdtype)
            # Inference-mode BatchNorm with the global statistics is exactly the
            # training-mode output, in one fused pass.
            out = F.batch_norm(
                xc, mean_c, var_c, _as(weight, cdtype), _as(bias, cdtype), False, 0.0, eps
            )

        ctx.save_for_backward(x, weight, mean_c, var_c)
        ctx.group, ctx.total, ctx.eps = group, total, eps
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, mean, var = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        cdtype = mean.dtype
        channels = x.size(1)
        grad_input = grad_weight = grad_bias = None
        with torch.autocast(x.device.type, enabled=False):
            g = grad_out.to(cdtype)
            xc = x.to(cdtype)
            invstd = torch.rsqrt(var + ctx.eps)
            if x.numel() > 0:
                # The fused kernel's per-channel sum(g * x_hat) and sum(g).
                _, sum_gx, sum_g = torch.ops.aten.native_batch_norm_backward(
                    g, xc, None, None, None, mean, invstd, True, ctx.eps, [False, True, True]
                )
            else:
                # Zeros are what the peers need (and the kernel divides by the count).
                sum_gx = sum_g = torch.zeros(channels, dtype=cdtype, device=x.device)
            # Local sums on purpose: DDP averages parameter gradients over the ranks.
            if need_weight and weight is not None:
                grad_weight = sum_gx.to(weight.dtype)
            if need_bias and weight is not None:  # a bias exists only with a weight
                grad_bias = sum_g.to(weight.dtype)
            if need_input:
                # needs_input_grad is the same on every rank (same model, same graph),
                # so either every rank joins this collective or none does.
                sums = _gather(torch.cat([sum_g, sum_gx]), ctx.group).sum(0)
                total = max(ctx.total, 1.0)
                mean_g, mean_gx = sums[:channels] / total, sums[channels:] / total
                scale = invstd if weight is None else invstd * weight.to(cdtype)
                # scale * (g - mean_g - x_hat * mean_gx): the x_hat terms as one fused
                # inference-mode BatchNorm of x, then g * scale added in place.
                grad_input = F.batch_norm(
                    xc, mean, var, -mean_gx * scale, -mean_g * scale, False, 0.0, ctx.eps
                )
                # scale's (C,) viewed as (1, C, 1, ...), to broadcast against the input.
                grad_input.addcmul_(g, scale.view(1, -1, *([1] * (x.dim() - 2))))
                grad_input = grad_input.to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _as(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.to(dtype)


def convert_sync_batchnorm(
    module: nn.Module,
    device: str | torch.device | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[nn.Module, int]:
    """Replace every BatchNorm of `module` with a synchronized one; return (module, count).

    For a model on a CUDA device the layers become `torch.nn.SyncBatchNorm` (fused
    kernels); on any other device, ddpkit's `SyncBatchNorm`. `device` ("cuda", "cuda:1",
    "cpu", a `torch.device`) says which device the model will run on; by default, the
    device of its parameters (CPU when it has none), so convert after moving the model,
    or pass the device when converting before. Parameters and buffers are carried over
    as the same tensors (like PyTorch's conversion), so values, `requires_grad` and an
    optimizer built beforehand all stay valid; training mode is kept. Layers that are
    already synchronized for that device are left alone and not counted. If `module`
    itself is a BatchNorm, the replacement is returned, so always use the returned
    module.
    """
    batchnorms = [sub for sub in module.modules() if isinstance(sub, _BatchNorm)]
    for sub in batchnorms:
        if isinstance(sub, LazyModuleMixin) and sub.has_uninitialized_params():
            raise ConfigError(
                f"{type(sub).__name__} has no parameters yet, so it cannot be converted to "
                "SyncBatchNorm: run one forward pass (or use BatchNorm*d with num_features) "
                "before preparing the model"
            )
    if _device_type(module, device) == "cuda":
        count = sum(not isinstance(sub, nn.SyncBatchNorm) for sub in batchnorms)
        converted: nn.Module = nn.SyncBatchNorm.convert_sync_batchnorm(  # type: ignore[no-untyped-call]
            module, process_group
        )
        return converted, count
    # Keyed by id: a BatchNorm shared by two parents must stay one shared layer.
    memo: dict[int, tuple[nn.Module, nn.Module]] = {}
    result = _convert(module, process_group, memo)
    return result, sum(1 for old, new in memo.values() if new is not old)


def _device_type(module: nn.Module, device: str | torch.device | None) -> str:
    """The kind of device ("cuda", "cpu", ...) `module` runs on: `device`'s, else that of
    its first parameter or buffer, else "cpu"."""
    if device is not None:
        return torch.device(device).type
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return "cpu" if first is None else first.device.type


def _convert(
    module: nn.Module,
    process_group: dist.ProcessGroup | None,
    memo: dict[int, tuple[nn.Module, nn.Module]],
) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)][1]
    out = module
    # A torch.nn.SyncBatchNorm is replaced too: on CPU it cannot run under DDP.
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = _to_sync(module, process_group)
    memo[id(module)] = (module, out)
    for name, child in module.named_children():
        new_child = _convert(child, process_group, memo)
        if new_child is not child:
            out.add_module(name, new_child)
    return out


def _to_sync(bn: _BatchNorm, process_group: dist.ProcessGroup | None) -> SyncBatchNorm:
    sync = SyncBatchNorm(
        bn.num_features,
        bn.eps,
        bn.momentum,
        bn.affine,
        bn.track_running_stats,
        process_group,
        bias=bn.bias is not None or not bn.affine,  # no bias to leave out without affine
    )
    if bn.affine:
        sync.weight, sync.bias = bn.weight, bn.bias
    sync.running_mean, sync.running_var = bn.running_mean, bn.running_var
    sync.num_batches_tracked, sync.training = bn.num_batches_tracked, bn.training
    if hasattr(bn, "qconfig"):
        sync.qconfig = bn.qconfig
    return sync
