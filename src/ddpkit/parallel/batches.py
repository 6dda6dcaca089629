"""Batches of any shape: moving them to the device, counting their samples, and turning
one into a loss the way `Trainer` does.

A batch may be a tensor, an `(inputs, targets)` pair, a dict, a dataclass or any
nesting of tuples, lists and dicts of those; what is not a tensor is left as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError

LossFn = Callable[[Any, Any], torch.Tensor]
"""`loss_fn(outputs, targets) -> mean loss over the batch`."""
StepFn = Callable[[nn.Module, Any], torch.Tensor]
"""`training_step(model, batch) -> mean loss over the batch` (the batch is on the device)."""
MetricsFn = Callable[[nn.Module, Any], Mapping[str, Any]]
"""`metrics_fn(model, batch) -> {name: mean over the batch}`, for evaluation."""


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it moved to `device` (structure and types kept)."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`batch` with `fn` applied to every tensor in it (structure and types kept)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        mapped = {k: map_tensors(v, fn) for k, v in batch.items()}
        if type(batch) is dict:
            return mapped
        try:  # OrderedDict, HuggingFace's BatchEncoding, ...: keep the type if it allows
            return type(batch)(mapped)  # type: ignore[call-arg]
        except Exception:
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = [f.name for f in dataclasses.fields(batch) if f.init]
        return dataclasses.replace(batch, **{n: map_tensors(getattr(batch, n), fn) for n in fields})
    return batch


def count_samples(batch: Any) -> int:
    """Samples in `batch`: the first dimension of the first tensor found in it, depth
    first (of an `(inputs, targets)` pair, the inputs' tensor; targets nested in a tuple
    or dict, `(x, (y, y_aux))`, are not counted as samples)."""
    tensor = _first_tensor(batch)
    if tensor is None or tensor.ndim == 0:
        raise ConfigError(
            f"cannot tell how many samples a batch of {type(batch).__name__} holds: a batch "
            "must hold at least one tensor whose first dimension is the batch"
        )
    return int(tensor.shape[0])


def default_step(model: nn.Module, batch: Any, loss_fn: LossFn | None) -> tuple[torch.Tensor, Any]:
    """(loss, outputs) of one batch, the way Trainer computes it without a `training_step`:

    - `(inputs, targets)` with a `loss_fn`: `loss_fn(model(inputs), targets)`;
    - a dict: `model(**batch)`, which returns its own loss;
    - anything else: `model(batch)`, which returns its own loss.

    A model's own loss is `outputs.loss`, `outputs["loss"]`, or the output itself when it
    is a single number.
    """
    if loss_fn is not None and is_pair(batch):
        outputs = model(batch[0])
        return loss_fn(outputs, batch[1]), outputs
    outputs = model(**batch) if isinstance(batch, Mapping) else model(batch)
    return own_loss(outputs, batch), outputs


def own_loss(outputs: Any, batch: Any) -> torch.Tensor:
    """The loss a model returned with its outputs (see `default_step`)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, torch.Tensor) and outputs.ndim == 0:
        loss = outputs
    if not isinstance(loss, torch.Tensor):
        given = "a dict batch, called as model(**batch)," if isinstance(batch, Mapping) else "it"
        raise ConfigError(
            f"the model's output ({type(outputs).__name__}) holds no loss: for {given} the "
            "model must return its loss (as outputs.loss, outputs['loss'] or a single number); "
            "or give the job a loss_fn with (inputs, targets) batches, or a "
            "training_step(model, batch) -> loss"
        )
    return loss


def is_pair(batch: Any) -> bool:
    """Whether `batch` is an `(inputs, targets)` pair (a namedtuple is not)."""
    return isinstance(batch, (tuple, list)) and len(batch) == 2 and not hasattr(batch, "_fields")


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        children: Any = batch.values()
    elif isinstance(batch, (tuple, list)):
        children = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        children = (getattr(batch, f.name) for f in dataclasses.fields(batch))
    else:
        return None
    for child in children:
        found = _first_tensor(child)
        if found is not None:
            return found
    return None
