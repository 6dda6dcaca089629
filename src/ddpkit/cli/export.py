"""`ddpkit export`: one plain file of a checkpoint's model weights, for inference.

A sharded checkpoint (strategy "fsdp", a `ckpt-*.dcp` folder) is gathered into one
state dict; a one-file checkpoint gives its model. The output loads with
`model.load_state_dict(torch.load(OUT, weights_only=True))`. A damaged checkpoint is
refused in one line; of a checkpoint folder, the newest one that is intact is exported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.userfiles import kind_of

HELP = "write a checkpoint's model weights as one file (also from a sharded checkpoint)"


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("export", help=HELP, description=HELP)
    p.add_argument(
        "checkpoint",
        help="a ckpt-*.pt file, a ckpt-*.dcp folder, or a checkpoint folder (its newest)",
    )
    p.add_argument("out", help="the file to write, e.g. model.pt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddpkit.checkpoint.pt import atomic_save, find_checkpoint, load_checkpoint
    from ddpkit.checkpoint.sharded import damage
    from ddpkit.context import DistContext
    from ddpkit.parallel.model import strip_prefixes

    source, out = Path(args.checkpoint), Path(args.out)
    ctx = DistContext.single("cpu")
    if not source.exists():
        raise ConfigError(f"checkpoint {source} does not exist: pass a ckpt-* file or folder")
    kind = kind_of(source.stat().st_mode)
    if kind not in ("a regular file", "a folder"):  # a FIFO would block, a device not end
        raise ConfigError(
            f"checkpoint {source} is not a regular file ({kind}): pass a ckpt-*.pt file, "
            "a ckpt-*.dcp folder or a checkpoint folder"
        )
    if source.is_dir() and source.suffix != ".dcp":
        found = find_checkpoint(source, ctx)  # skips damaged ones, as a resume does
        if found is None:
            raise ConfigError(f"no checkpoint in {source}: pass a folder that holds ckpt-* files")
        if found.skipped:
            print(f"ddpkit: {found.skip_note()}; exporting {found.path.name}", file=sys.stderr)
        source = found.path
    if out.is_dir():
        raise ConfigError(f"{out} is a folder: pass a file name, e.g. {out / 'model.pt'}")
    if source.is_dir():
        problem = damage(source)
        if problem is not None:
            raise CheckpointError(
                f"checkpoint {source} is damaged ({problem}): export an intact one; "
                f"`ddpkit export {source.parent} {out}` picks the newest"
            )
        model = _gather_model(source, out)
    else:
        model = load_checkpoint(source, ctx)["model"]
    atomic_save(strip_prefixes(model), out)
    print(f"wrote {out}: {len(model)} tensors of {source.name}", flush=True)
    return 0


def _gather_model(folder: Path, out: Path) -> dict[str, Any]:
    """The whole model of a sharded checkpoint (its shards joined in this process)."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        joined = Path(tmp, "joined.pt")
        # Reached when the sizes are right and the bytes are not. DCP's own error is a
        # BaseException that holds each rank's error (here the one rank's).
        try:
            dcp_to_torch_save(folder, joined)
            state = torch.load(joined, map_location="cpu", weights_only=True)
        except (Exception, CheckpointException) as exc:
            cause: BaseException = exc
            if isinstance(exc, CheckpointException) and exc.failures:
                cause = next(iter(exc.failures.values()))[0]
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
            raise CheckpointError(
                f"checkpoint {folder} cannot be read ({type(cause).__name__}: {first}): "
                f"export an intact one; `ddpkit export {folder.parent} {out}` picks the newest"
            ) from None
    return dict(state["model"])
