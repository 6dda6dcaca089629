"""Sharded checkpoints (strategy "fsdp"): a folder `ckpt-<step>.dcp/` in which every rank
wrote its own shards of the model and optimizer with `torch.distributed.checkpoint`,
and rank 0 wrote `meta.pt`, the rest of the training state (epochs, RNG streams of
every rank, scheduler, ...), as in a one-file checkpoint.

The folder is written under a temporary name and renamed once every rank has
finished, so a crash never leaves a half-written `ckpt-*.dcp`; one that is replaced or
pruned leaves its name by a rename too, before it is deleted (see `storage.install`).
A folder damaged some other way (a shard missing or cut short) is told apart by
`damage`, which checks it against its `.metadata`. A sharded checkpoint loads on any
number of ranks (DCP reshards), one process included. What goes into the shards and how
it is put back is the strategy's (`Strategy.checkpoint_tensors`, `load_checkpoint_tensors`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddpkit.context import DistContext
from ddpkit.errors import CheckpointError
from ddpkit.parallel.fsdp import dcp_failure
from ddpkit.storage import fsync_folder, host_token, install, this_process

META = "meta.pt"
SUFFIX = ".dcp"
INDEX = ".metadata"  # DCP's own: where each item of each rank lies in which shard file


def write_shards(tensors: dict[str, Any], path: Path, ctx: DistContext) -> Path:
    """Every rank writes its shards of `tensors` into a new temporary folder beside
    `path`; returns that folder (the same on every rank). A collective."""
    name: list[Any] = [None]
    if ctx.is_main:
        me = this_process()
        path.parent.mkdir(parents=True, exist_ok=True)
        prefix = f".{path.name}.{me.pid}@{host_token(me.host)}."
        name = [tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=path.parent)]
    if ctx.distributed:  # by the context, as ever: not by whatever group is initialised
        dist.broadcast_object_list(name, src=0)
    tmp = Path(name[0])
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    dcp_save(tensors, checkpoint_id=tmp)
    return tmp


def publish(tmp: Path, path: Path, retire: list[Path] | None = None) -> None:
    """Give the finished temporary folder its checkpoint name and remove the checkpoints
    of `retire` (rank 0 alone). An older folder of the same name (the same step saved
    again, a resumed run's last checkpoint) is renamed aside, never deleted in place."""
    fsync_folder(tmp)  # the shards' names in it, before the name that makes them visible
    install(tmp, path, retire or [])


def damage(path: Path) -> str | None:
    """What is wrong with the sharded checkpoint folder `path`, in a few words ("shard
    __1_0.distcp is missing"); None when it is whole: its `meta.pt` and DCP's `.metadata`
    are there, and so is every shard file `.metadata` names, at least as long as the
    items it places in it. Only sizes are read, not the shards' bytes."""
    # Imported here, as DCP is elsewhere: a job that never shards never pays for it.
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if not (path / META).is_file():
        return f"it has no {META}"
    try:
        # DCP's reader unpickles `.metadata` (as its own load does): a load of this
        # folder would read it anyway.
        metadata = FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        return f"it has no {INDEX}"
    except Exception as exc:
        return f"its {INDEX} cannot be read ({type(exc).__name__})"
    ends: dict[str, int] = {}  # shard file -> where its last item ends
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return f"its {INDEX} places no item in any file"
    for info in storage.values():
        name = str(info.relative_path)
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            return f"shard {name} is missing"
        except OSError as exc:
            return f"shard {name} cannot be read ({exc.strerror or exc})"
        # Shorter than its items is cut short; longer is harmless to a load (DCP reads
        # each item at its offset), and a later DCP may well add to the end of a file.
        if size < end:
            return f"shard {name} is cut short ({size:,} of {end:,} bytes)"
    return None


def joined_model(folder: Path, scratch: Path | None, fix: str) -> dict[str, Any]:
    """The whole model of the sharded checkpoint `folder`, its shards joined in this
    process alone (no process group), through a temporary file in `scratch` (None: the
    system's). Bytes that cannot be read raise CheckpointError naming the folder and
    ending with `fix`."""
    # Imported here, as DCP is elsewhere: a job that never shards never pays for it.
    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        joined = Path(tmp, "joined.pt")
        # Reached when the sizes are right and the bytes are not (`damage` checks the
        # sizes). DCP's own error is a BaseException, not an Exception.
        try:
            dcp_to_torch_save(folder, joined)
            state = torch.load(joined, map_location="cpu", weights_only=True)
        except (Exception, CheckpointException) as exc:
            kind, first = dcp_failure(exc)
            raise CheckpointError(
                f"checkpoint {folder} cannot be read ({kind}: {first}): {fix}"
            ) from None
    return dict(state["model"])
