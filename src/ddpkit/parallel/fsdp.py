"""Sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`) for models whose
parameters, gradients and optimizer state do not fit on one device when replicated.

Each rank keeps 1/N of every sharded parameter (a DTensor); a block's full parameters
are gathered just before its forward (and backward) and freed after. Blocks are the
units that gather together: by default every module that directly holds at least
`min_params` parameters of its own subtree and is not inside another such block,
found from the leaves up, then the root for what is left.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.parallel.precision import DTYPES

# A block holds at least this many parameters by default: smaller ones would gather
# in messages too small to keep the network busy.
DEFAULT_MIN_PARAMS = 1_000_000


def as_sharded(model: nn.Module) -> Any | None:
    """`model` (or the module `torch.compile` wraps) if `fully_shard` sharded it, else None.

    It never imports FSDP itself: that import costs about 0.7 s of every start-up
    (sympy, DTensor), and nothing can be sharded before FSDP was imported."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    model = getattr(model, "_orig_mod", model)
    return model if fsdp is not None and isinstance(model, fsdp.FSDPModule) else None


def shard_model(
    model: nn.Module,
    ctx: DistContext,
    *,
    blocks: Sequence[type[nn.Module] | str] | Callable[[nn.Module], bool] | None = None,
    min_params: int = DEFAULT_MIN_PARAMS,
    precision: str = "32",
    offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply `fully_shard` to the blocks of `model`, then to `model` itself.

    Args:
        model: the bare model, on this rank's device.
        ctx: this rank's `DistContext`.
        blocks: which modules are blocks: module classes (`[TransformerBlock]`), their
            names in the model (`["encoder.layers.0", ...]`), or a function
            `module -> bool`; None picks them by size (`min_params`).
        min_params: with `blocks=None`, the parameters a block holds at least.
        precision: "32", or "bf16"/"fp16": parameters are gathered and computed in that
            dtype, gradients reduced in float32, and the sharded master copy stays
            float32 (a model with BatchNorm gathers float32; autocast computes).
        offload: keep the sharded parameters and optimizer state in CPU memory.
        reshard_after_forward: free a block's gathered parameters after its forward
            (less memory; gathered again for the backward).

    Returns:
        The model, its parameters replaced by sharded ones: build the optimizer on
        `model.parameters()` after this call.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if ctx.device.type == "cpu":
        check_on_cpu(offload)
    if precision not in DTYPES:
        raise ConfigError(f"precision must be one of 32, bf16, fp16 (got {precision!r})")
    if min_params < 1:
        raise ConfigError(f"min_params must be >= 1 (got {min_params})")
    dtype = DTYPES[precision]
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        # BatchNorm's running statistics are buffers, which FSDP leaves in float32:
        # low-precision weights beside them fail. Gather in float32; autocast (Trainer,
        # Precision) still computes in `precision`.
        dtype = None
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    offload_policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    for module in [*_blocks(model, blocks, min_params), model]:
        fully_shard(
            module,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp,
            offload_policy=offload_policy,
        )
    return model


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (FSDP's DTensor; a collective: every rank calls it),
    else `tensor` itself."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def sharded_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The model's and optimizer's state, keyed by parameter name, each rank holding its
    shards (what every rank writes its own part of in a sharded checkpoint)."""
    # Imported here, as FSDP is (see as_sharded): a DDP job never pays for DCP.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def load_sharded_state(path: Path, model: nn.Module, optimizer: Any) -> None:
    """Load the model's and optimizer's state from the DCP folder `path`, on any number
    of ranks (DCP reshards). A collective."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    tensors = sharded_state(model, optimizer)
    dcp_load(tensors, checkpoint_id=path)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=tensors["model"],
        optim_state_dict=tensors["optimizer"],
    )


def dcp_failure(exc: BaseException) -> tuple[str, str]:
    """(the type, the first line) of what `torch.distributed.checkpoint` raised: of its
    CheckpointException, which holds each rank's own error, the first one's."""
    from torch.distributed.checkpoint.api import CheckpointException

    cause = exc
    if isinstance(exc, CheckpointException) and exc.failures:
        cause = next(iter(exc.failures.values()))[0]
    text = str(cause).strip()
    return type(cause).__name__, text.splitlines()[0] if text else ""


def cpu_supported() -> bool:
    """Whether FSDP2 runs on CPU ranks with this torch (2.7 gave CPU streams the event
    methods it calls, pytorch#145935)."""
    return callable(getattr(torch.cpu.Stream, "record_event", None))


def check_on_cpu(offload: bool) -> None:
    """ConfigError, naming the fix, when strategy fsdp cannot run so on CPU ranks."""
    if offload:
        raise ConfigError(
            "fsdp_offload moves the shards from GPU to CPU memory, and these ranks run on "
            "the CPU already: drop --fsdp-offload"
        )
    if not cpu_supported():
        raise ConfigError(
            f"strategy fsdp on CPU ranks needs torch 2.7 or newer (FSDP2 records events on "
            f"CPU streams since then), and this is torch {torch.__version__}: upgrade "
            "torch, or use --strategy ddp"
        )


def _blocks(
    model: nn.Module,
    blocks: Sequence[type[nn.Module] | str] | Callable[[nn.Module], bool] | None,
    min_params: int,
) -> list[nn.Module]:
    """The modules to shard on their own, innermost first, never the root."""
    if blocks is None:
        return _by_size(model, min_params)
    if callable(blocks) and not isinstance(blocks, type):
        chosen = blocks
    else:
        items = (blocks,) if isinstance(blocks, type) else tuple(blocks)
        classes = tuple(c for c in items if isinstance(c, type) and issubclass(c, nn.Module))
        names = {n for n in items if isinstance(n, str)}
        named = dict(model.named_modules())
        unknown = sorted(names - named.keys())
        if len(classes) + len(names) != len(items) or unknown:
            raise ConfigError(
                "blocks must be nn.Module classes, names of the model's modules or a "
                f"function module -> bool (got {blocks!r}"
                + (f"; no module named {', '.join(unknown)}" if unknown else "")
                + "): pass blocks=[MyBlock]"
            )
        ids = {id(named[n]) for n in names}
        chosen = lambda m: isinstance(m, classes) or id(m) in ids  # noqa: E731
    # modules() is outer first: reversed, inner blocks are sharded before their parents.
    return [m for m in reversed(list(model.modules())) if m is not model and chosen(m)]


def _by_size(model: nn.Module, min_params: int) -> list[nn.Module]:
    """From the leaves up: a module whose not-yet-claimed parameters reach `min_params`
    becomes a block, and claims them."""
    claimed: set[int] = set()
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        """Unclaimed parameters under `module` (after its children had their turn)."""
        free = sum(visit(child) for child in module.children())
        own = sum(p.numel() for p in module.parameters(recurse=False) if id(p) not in claimed)
        free += own
        if module is not model and free >= min_params:
            found.append(module)
            claimed.update(id(p) for p in module.parameters())
            return 0
        return free

    visit(model)
    return found
