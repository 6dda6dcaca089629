"""What the Trainer builds from its config before it trains: the prepared model (and
the one its evaluation runs) and the loaders."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset, Sampler

from ddpkit.context import DistContext
from ddpkit.parallel.data import DistributedLoader, prepare_loader
from ddpkit.parallel.model import unwrap
from ddpkit.parallel.strategy import Strategy, prepare_model
from ddpkit.training.config import TrainConfig


def models(
    model: nn.Module, config: TrainConfig, ctx: DistContext, strategy: Strategy
) -> tuple[nn.Module, nn.Module]:
    """(the model that trains, the model that evaluation runs): `model` moved,
    BatchNorm-synchronised, wrapped (DDP or FSDP) and compiled as the config says."""
    trained = prepare_model(
        model,
        ctx,
        sync_batchnorm=config.sync_batchnorm,
        find_unused_parameters=config.find_unused_parameters,
        bucket_cap_mb=config.bucket_cap_mb,
        grad_compression=config.grad_compression,
        strategy=strategy,
        fsdp={
            "precision": config.precision,
            "offload": config.fsdp_offload,
            "reshard_after_forward": config.fsdp_reshard_after_forward,
        },
    )
    if config.compile:
        # After DDP: compiling the wrapper lets DDP's optimizer split the graph at
        # bucket boundaries, so communication still overlaps the backward pass.
        trained = cast(nn.Module, torch.compile(trained))
    # What evaluation runs: the bare model (DDP's forward would broadcast buffers at
    # each batch, and ranks may hold unequal numbers of eval batches), compiled on its
    # own when training is (lazily: nothing is compiled before the first evaluation).
    bare = unwrap(trained)
    return trained, cast(nn.Module, torch.compile(bare)) if config.compile else bare


def loaders(
    config: TrainConfig,
    ctx: DistContext,
    train_set: Dataset[Any],
    eval_set: Dataset[Any] | None,
    train_sampler: Sampler[Any] | None,
    collate_fn: Callable[[list[Any]], Any] | None,
) -> tuple[DistributedLoader, DistributedLoader | None]:
    """(the training loader: each rank its shard, the eval loader: every sample once)."""
    train = prepare_loader(
        train_set,
        ctx,
        config.batch_size,
        seed=config.seed,
        sampler=train_sampler,
        replacement=config.replacement,
        num_workers=config.num_workers,
        drop_last=config.drop_last,
        collate_fn=collate_fn,
    )
    if eval_set is None:
        return train, None
    evaluation = prepare_loader(
        eval_set,
        ctx,
        config.batch_size,
        evaluation=True,
        num_workers=config.num_workers,
        collate_fn=collate_fn,
    )
    return train, evaluation
