"""The strategy: how a model is spread over the ranks, decided once per run.

"ddp" keeps a whole copy of the model on every rank and all-reduces the gradients;
"fsdp" shards parameters, gradients and optimizer state over the ranks (FSDP2). Everything
that depends on that choice is done here, so that the rest of ddpkit calls the object
instead of asking which it is: wrapping the model, what a checkpoint holds of the model
and optimizer and putting it back (the checkpoint layer, above this one, writes the files
and passes in its own checks), the model's whole state for digests, a whole tensor,
skipping a gradient sync.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.context import DistContext
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.inrank.preemption import ddpkit_job
from ddpkit.parallel.compression import bf16_allreduce_hook
from ddpkit.parallel.fsdp import (
    as_sharded,
    check_on_cpu,
    dcp_failure,
    gathered,
    load_sharded_state,
    shard_model,
    sharded_state,
)
from ddpkit.parallel.model import load_model_state, model_class_name, sync_buffers, unwrap
from ddpkit.parallel.sync import no_backward_sync
from ddpkit.parallel.watch import watcher

log = logging.getLogger("ddpkit")

NAMES = ("ddp", "fsdp")
_MARK = "_ddpkit_strategy"  # the attribute of a prepared model that names its strategy
_NOTHING = contextlib.nullcontext()  # stateless: one serves every step


def prepare_model(
    model: nn.Module,
    ctx: DistContext | None = None,
    *,
    sync_batchnorm: bool = True,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    gradient_as_bucket_view: bool = True,
    bucket_cap_mb: float | None = None,
    broadcast_buffers: bool = True,
    strategy: str | Strategy = "ddp",
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
        ctx: this rank's `DistContext` (default: `DistContext.current()`).
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
    ddpkit_job()  # under ddpkit run, a stop signal before the first step ends it with 75
    ctx = ctx or DistContext.current()
    plan = strategy if isinstance(strategy, Strategy) else Strategy(strategy, ctx)
    plan.check(grad_compression=grad_compression)
    if isinstance(model, DDP):
        raise TypeError("model is already wrapped in DistributedDataParallel: pass the bare module")
    seen_by = watcher()
    if seen_by is not None:  # ddpkit verify, checking a hand-written loop
        model = seen_by.model(model)
    model = model.to(ctx.device)
    # Remembered on the model, for save_state and load_state (see Strategy.of).
    object.__setattr__(model, _MARK, plan.name)
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
    return plan.wrap(
        model,
        fsdp=fsdp,
        broadcast_buffers=broadcast_buffers,
        grad_compression=grad_compression,
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
        gradient_as_bucket_view=gradient_as_bucket_view,
        **({} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}),
    )


@dataclass(frozen=True)
class Strategy:
    """How the model of this run is spread over its ranks (see the module docstring)."""

    name: str
    """"ddp" or "fsdp"."""
    ctx: DistContext = field(default_factory=DistContext.current)
    """The rank it runs on."""

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ConfigError(f"strategy must be 'ddp' or 'fsdp' (got {self.name!r})")

    @property
    def shards_model(self) -> bool:
        """The model's parameters are sharded: "fsdp" on more than one rank (with one
        process there is nothing to shard over)."""
        return self.name == "fsdp" and self.ctx.distributed

    @property
    def shards_checkpoints(self) -> bool:
        """Checkpoints are sharded DCP folders rather than one `.pt` file. Under "fsdp"
        also with one process, so that a run resumes on any number of ranks."""
        return self.name == "fsdp"

    def check(
        self, backend: str | None = None, *, offload: bool = False, grad_compression: str = "none"
    ) -> None:
        """Raise ConfigError, naming the fix, for options this strategy cannot run with.
        With the `backend` the ranks will use, also what this torch cannot shard on CPU
        ranks (before any process starts; `shard_model` checks it again)."""
        if grad_compression not in ("none", "bf16"):
            raise ConfigError(
                f"grad_compression must be 'none' or 'bf16' (got {grad_compression!r})"
            )
        if grad_compression != "none" and self.name != "ddp":
            raise ConfigError(
                "grad_compression works with strategy ddp only (FSDP reduces in its own "
                "dtypes): drop grad_compression, or use precision='bf16' with fsdp"
            )
        if self.name == "fsdp" and backend == "gloo":
            check_on_cpu(offload)

    def wrap(
        self,
        model: nn.Module,
        *,
        fsdp: dict[str, Any] | None = None,
        broadcast_buffers: bool = True,
        grad_compression: str = "none",
        **ddp_options: Any,
    ) -> nn.Module:
        """`model` (on this rank's device, BatchNorm already converted) sharded with
        FSDP2 or wrapped in DDP; unchanged with one process. `ddp_options` go to DDP."""
        if not self.ctx.distributed:
            return model
        if self.shards_model:
            sharded = shard_model(model, self.ctx, **(fsdp or {}))
            if broadcast_buffers and any(True for _ in sharded.buffers()):
                # As DDP does: each forward starts from rank 0's buffers, so that
                # per-rank BatchNorm statistics cannot drift apart (FSDP never copies
                # buffers).
                ctx = self.ctx
                sharded.register_forward_pre_hook(lambda module, args: sync_buffers(module, ctx))
            return sharded
        on_gpu = self.ctx.device.type == "cuda"
        if not broadcast_buffers:  # only when asked: newer torch warns that it is deprecated
            ddp_options["broadcast_buffers"] = False
        ddp = DDP(
            model,
            device_ids=[self.ctx.device] if on_gpu else None,
            output_device=self.ctx.device if on_gpu else None,
            **ddp_options,
        )
        if grad_compression == "bf16":
            ddp.register_comm_hook(None, bf16_allreduce_hook)
        return ddp

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole value of `tensor`: a shard is gathered (a collective: every rank
        calls it, under "fsdp"); any other tensor is returned as it is."""
        return gathered(tensor) if self.shards_model else tensor

    def gradient_norm(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """The 2-norm of the gradients of `params`, all together (None when none has
        one); of sharded gradients, a collective (see `takes_part`)."""
        grads = [p.grad.detach() for p in params if p.grad is not None]
        if not grads:
            return None
        get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # 2.6 may lack it
        if get_total_norm is not None:
            total: torch.Tensor = get_total_norm(grads)
        else:
            norms = [torch.linalg.vector_norm(g.float()) for g in grads]
            total = torch.linalg.vector_norm(torch.stack(norms))
        return self.whole(total)

    def takes_part(self, here: bool, anywhere: bool) -> bool:
        """Whether this rank computes a value of `whole` tensors that it wants (`here`)
        or that some rank wants (`anywhere`, the same on every rank): under "fsdp"
        `whole` is a collective, which every rank runs when any rank needs it."""
        return anywhere if self.shards_model else here

    def forwards_to_match(self, done: int, most: Callable[[], int]) -> int:
        """How many more forwards this rank, having run `done`, runs so that it runs as
        many as the rank that runs `most()`: under "fsdp" each forward gathers the
        parameters, a collective that must pair up over the ranks; under "ddp" none."""
        return max(0, most() - done) if self.shards_model else 0

    def check_optimizer(self, optimizer: object) -> None:
        """Raise ConfigError for an optimizer built before `wrap` under "fsdp", which
        replaces the model's parameters (a factory, called after wrapping, is fine)."""
        if self.shards_model and isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                "strategy fsdp replaces the model's parameters, so the optimizer must be "
                "built after sharding: pass optimizer=lambda params: torch.optim.AdamW("
                "params, lr=3e-4) (and a scheduler as lambda opt: ...)"
            )

    def skip_gradient_sync(
        self, model: nn.Module, skip: bool
    ) -> contextlib.AbstractContextManager[None]:
        """The context for a micro-batch's forward and backward that must not reduce
        its gradients yet (all micro-batches of an accumulation group but the last)."""
        if not (skip and self.ctx.distributed):
            return _NOTHING  # every step of a run on one process: nothing to skip
        return no_backward_sync(model)

    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The unwrapped model's state dict with whole tensors (what a digest or a
        comparison of ranks reads): shards are gathered, a collective under "fsdp"."""
        return {k: self.whole(v) for k, v in unwrap(model).state_dict().items()}

    # -- checkpoints: the checkpoint layer owns the files (a `.pt` file, a `.dcp`
    # folder, atomic writes); the strategy says what goes in them and puts it back.
    def checkpoint_tensors(
        self, model: nn.Module, optimizer: Any
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The model's and optimizer's state for a checkpoint: (the entries of rank 0's
        file, the tensors every rank writes its own part of, or None). Under "fsdp" the
        file only says `sharded` and the state is in the shards, so it loads on any
        number of ranks; under "ddp" the file holds the bare model's state dict."""
        if self.shards_checkpoints:
            return {"sharded": True}, sharded_state(model, optimizer)
        return {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}, None

    @staticmethod
    def holds_model(state: dict[str, Any]) -> bool:
        """Whether a checkpoint file's `state` has a model to put back, under either
        strategy: in itself ("ddp"), or in the shards beside it ("fsdp")."""
        return "model" in state or bool(state.get("sharded"))

    def check_resume(self, path: Path, state: dict[str, Any]) -> None:
        """Raise CheckpointError unless checkpoint `path` (its file's `state`) was written
        under this strategy, as a Trainer resume needs."""
        written = "fsdp" if state.get("sharded") else "ddp"
        if (written == "fsdp") != self.shards_checkpoints:
            raise CheckpointError(
                f"{path} was written with strategy {written} and this run uses "
                f"{self.name}: resume with the same --strategy"
            )

    def load_checkpoint_tensors(
        self,
        path: Path,
        state: dict[str, Any],
        model: nn.Module,
        optimizer: Any,
        check_whole: Callable[[nn.Module, dict[str, Any], Path], None],
    ) -> None:
        """Put checkpoint `path`'s model and optimizer state (its file's `state`) back,
        on every rank alike. A sharded one is read from its shards (a collective, on
        any number of ranks); a whole one is first passed to `check_whole` (the
        checkpoint layer's check that it holds this model), and refused by a sharded
        model."""
        if state.get("sharded"):
            _load_shards(path, state, model, optimizer)
            return
        if self.shards_model:
            raise CheckpointError(
                f"{path} holds the whole state of a model that was not sharded, and this "
                "model is sharded (strategy fsdp): resume it as it was saved (strategy ddp, "
                "or one process), or start the sharded run afresh in another folder"
            )
        check_whole(model, state, path)  # one line naming both models
        load_model_state(model, state["model"])
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as exc:
            raise CheckpointError(
                f"{path} holds an optimizer state that does not fit this optimizer ({exc}): "
                "build the optimizer as the run that saved it did"
            ) from None

    @staticmethod
    def of(model: nn.Module, ctx: DistContext) -> Strategy:
        """The strategy `prepare_model` gave `model` ("ddp" for a model it never saw)."""
        named = getattr(unwrap(model), _MARK, None)
        sharded = as_sharded(model) is not None or named == "fsdp"
        return Strategy("fsdp" if sharded else "ddp", ctx)


def _load_shards(path: Path, state: dict[str, Any], model: nn.Module, optimizer: Any) -> None:
    """Every rank reads its part of the shards (on any number of ranks: a collective)."""
    # Imported here, as DCP is: a loop that never shards never pays for it.
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load_sharded_state(path, model, optimizer)
    except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:
        # DCP raises the same exception on every rank, so every rank says the same.
        written = state.get("model_class") or "another model"
        kind, first = dcp_failure(exc)
        raise CheckpointError(
            f"{path} holds the sharded state of {written}, which does not fit this job's "
            f"model {model_class_name(model)} or its optimizer "
            f"({kind}: {first.rstrip(':')}): give each model its own folder, and build "
            "the optimizer as the run that saved it did"
        ) from None
