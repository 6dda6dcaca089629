"""Precision: mixed precision in a hand-written loop (autocast, loss scaling, clipping)
with one object, on GPUs and on CPU."""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError

# Each accepted spelling (ddpkit's, and Fabric's) -> ddpkit's name.
_NAMES = {
    "32": "32",
    "32-true": "32",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "fp16": "fp16",
    "16": "fp16",
    "16-mixed": "fp16",
}
# The autocast dtype of each precision ("32": none), for Precision, Trainer and FSDP.
DTYPES = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


# cuBLAS's deterministic workspace, as torch's reproducibility notes give it.
CUBLAS_WORKSPACE = ":4096:8"


def use_deterministic() -> None:
    """Deterministic kernels from here on, in this whole process (`deterministic=True`).

    cuBLAS reads CUBLAS_WORKSPACE_CONFIG at its first call in the process, so this must
    run before the first matmul on the GPU; a value already set is kept.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    # Autotuning times several kernels and keeps the fastest, which may differ per run.
    torch.backends.cudnn.benchmark = False


def use_tf32(enabled: bool) -> None:
    """Allow (or forbid) TensorFloat-32 in float32 matmuls and cuDNN convolutions."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def _autocast_or_problem(device_type: str, dtype: torch.dtype) -> Any:
    """A torch.autocast to `dtype` on this kind of device, or why torch cannot make one
    (a str)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx = torch.autocast(device_type, dtype=dtype)
    except (RuntimeError, ValueError) as exc:
        return str(exc).strip().splitlines()[0]
    if not getattr(ctx, "_enabled", True):  # older torch warns and turns autocast off
        return str(caught[0].message).strip().splitlines()[0] if caught else "not supported"
    return ctx


class Precision:
    """Mixed precision for a hand-written loop: autocast, and under fp16 loss scaling.

    `precision` is "32" (full precision: everything here is a plain pass-through),
    "bf16" (autocast to bfloat16, on GPUs and on CPU) or "fp16" (autocast to float16,
    with a `torch.amp.GradScaler` that scales the loss so small gradients do not
    underflow); Fabric's spellings "32-true", "bf16-mixed" and "16-mixed" work too. A
    precision this torch cannot run on `ctx.device` is refused up front. Written once,
    the loop runs in every precision::

        prec = ddpkit.Precision("bf16", ctx)
        for x, y in loader:
            with prec.autocast():
                loss = loss_fn(model(x), y)
            prec.backward(loss)
            prec.clip_gradients(model, optimizer, max_norm=1.0)
            prec.step(optimizer)
            optimizer.zero_grad()

    Save `prec.state_dict()` in checkpoints (the fp16 loss scale; empty otherwise) and
    give it back with `prec.load_state_dict(...)` on resume.
    """

    def __init__(self, precision: str | int, ctx: DistContext | None = None) -> None:
        ctx = ctx or DistContext.current()
        name = _NAMES.get(str(precision))
        if name is None:
            raise ConfigError(
                f"precision must be '32', 'bf16' or 'fp16' (or Fabric's '32-true', "
                f"'bf16-mixed', '16-mixed'), got {precision!r}"
            )
        self.precision = name
        """ddpkit's name of it: "32", "bf16" or "fp16"."""
        self.device_type = ctx.device.type
        self.dtype: torch.dtype | None = DTYPES[name]
        """The autocast dtype (None for "32")."""
        self._autocast: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.dtype is not None:
            made = _autocast_or_problem(self.device_type, self.dtype)
            if isinstance(made, str):
                raise ConfigError(self._refusal(made))
            self._autocast = _Autocast(made)
        self.scaler: torch.amp.GradScaler | None = None
        """The loss scaler under fp16, else None."""
        if name == "fp16":
            try:
                self.scaler = torch.amp.GradScaler(self.device_type)
            except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
                raise ConfigError(self._refusal(f"no gradient scaler: {exc}")) from exc

    def _refusal(self, problem: str) -> str:
        where = "CPU" if self.device_type == "cpu" else self.device_type
        if self.precision == "fp16" and self.device_type == "cpu":
            fix = "use precision='bf16' on CPU"
        elif self.precision == "bf16" and self.device_type == "cuda":
            fix = "use precision='fp16' on this GPU"
        else:
            fix = "use precision='32'"
        return (
            f"precision {self.precision!r} does not work on {where} with torch "
            f"{torch.__version__} ({problem}): {fix}"
        )

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context for the forward pass and the loss: `torch.autocast` on this
        rank's device with the precision's dtype (nothing at "32"). Run the backward
        outside it::

            with prec.autocast():
                loss = loss_fn(model(x), y)
        """
        return self._autocast

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, on the loss multiplied by the loss scale under fp16."""
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()  # type: ignore[no-untyped-call]

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.step()`; under fp16 the scaler's: the gradients are unscaled first
        (unless `clip_gradients` did), a step whose gradients hold inf or NaN is
        skipped, and the loss scale is updated."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def clip_gradients(
        self,
        model: nn.Module | Iterable[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Clip the gradients of `model` (or of these parameters) to a total norm of at
        most `max_norm`, between `backward` and `step`; returns the total norm before
        clipping. Under fp16 the gradients of `optimizer` are unscaled first, so the
        norm is the true one (once per step: `step` then does not unscale again).
        After DDP's all-reduce every rank has the same gradients, so the same norm::

            norm = prec.clip_gradients(model, optimizer, max_norm=1.0)
        """
        self.unscale_gradients(optimizer)
        params = model.parameters() if isinstance(model, nn.Module) else model
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Under fp16, divide the gradients of `optimizer` by the loss scale now, to read
        or change the true gradients before `step` (at most once per step; `step` then
        does not unscale again). Nothing to do in other precisions."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state under fp16 (empty otherwise): save it in checkpoints."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned. A state saved under another precision
        (or an empty one) leaves the scaler as it is."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)

    def __repr__(self) -> str:
        return f"Precision({self.precision!r}, device_type={self.device_type!r})"


class _Autocast:
    """`torch.autocast`, entered again and again without building a new one each step.

    A torch.autocast keeps on itself the state its exit restores, so one object must
    not be open twice at once (nested, or in two threads): the spare one is used when
    it is free, a new one otherwise. Building a torch.autocast costs a step about as
    much as entering it."""

    def __init__(self, spare: Any) -> None:
        self._spare = spare
        self._spare_open = False
        self._open = threading.local()  # each thread's open contexts, innermost last

    def __enter__(self) -> None:
        ctx: Any = self._spare
        if self._spare_open:
            ctx = torch.autocast(self._spare.device, dtype=self._spare.fast_dtype)
        else:
            self._spare_open = True
        self._open.__dict__.setdefault("stack", []).append(ctx)
        ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        ctx = self._open.stack.pop()
        ctx.__exit__(*exc)
        if ctx is self._spare:
            self._spare_open = False
