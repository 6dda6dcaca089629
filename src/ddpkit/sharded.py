"""Sharded checkpoints (strategy "fsdp"): a folder `ckpt-<step>.dcp/` in which every rank
wrote its own shards of the model and optimizer with `torch.distributed.checkpoint`,
and rank 0 wrote `meta.pt`, the rest of the training state (epochs, RNG streams of
every rank, scheduler, ...), as in a one-file checkpoint.

The folder is written under a temporary name and renamed once every rank has
finished, so a crash never leaves a half-written `ckpt-*.dcp`. A sharded checkpoint
loads on any number of ranks (DCP reshards), one process included.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from ddpkit.context import DistContext
from ddpkit.storage import fsync_folder, host_token, this_process

META = "meta.pt"
SUFFIX = ".dcp"


def tensors_of(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The model's and optimizer's state, keyed by parameter name (sharded under FSDP)."""
    # Imported here, as FSDP is (see fsdp.as_sharded): a DDP job never pays for it.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def write_shards(tensors: dict[str, Any], path: Path, ctx: DistContext) -> Path:
    """Every rank writes its shards of `tensors` into a new temporary folder beside
    `path`; returns that folder (the same on every rank). A collective."""
    name: list[Any] = [None]
    if ctx.is_main:
        me = this_process()
        path.parent.mkdir(parents=True, exist_ok=True)
        name = [
            tempfile.mkdtemp(
                prefix=f".{path.name}.{me.pid}@{host_token(me.host)}.",
                suffix=".tmp",
                dir=path.parent,
            )
        ]
    if ctx.distributed:
        dist.broadcast_object_list(name, src=0)
    tmp = Path(name[0])
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    dcp_save(tensors, checkpoint_id=tmp)
    return tmp


def publish(tmp: Path, path: Path) -> None:
    """Give the finished temporary folder its checkpoint name (rank 0 alone)."""
    if path.exists():  # the same step saved again (a resumed run's last checkpoint)
        shutil.rmtree(path)
    os.replace(tmp, path)
    fsync_folder(path.parent)


def load_shards(path: Path, model: nn.Module, optimizer: Any) -> None:
    """Load the model's and optimizer's state from the sharded checkpoint `path`, on any
    number of ranks. A collective."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    tensors = tensors_of(model, optimizer)
    dcp_load(tensors, checkpoint_id=path)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=tensors["model"],
        optim_state_dict=tensors["optimizer"],
    )
