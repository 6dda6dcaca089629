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

from ddpkit.errors import ConfigError
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
    from ddpkit.checkpoint.pt import atomic_save, find_checkpoint, model_weights, names_one
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
    if not names_one(source):  # a checkpoint folder: its newest intact checkpoint
        found = find_checkpoint(source, ctx)  # skips damaged ones, as a resume does
        if found is None:
            raise ConfigError(f"no checkpoint in {source}: pass a folder that holds ckpt-* files")
        if found.skipped:
            print(f"ddpkit: {found.skip_note()}; exporting {found.path.name}", file=sys.stderr)
        source = found.path
    if out.is_dir():
        raise ConfigError(f"{out} is a folder: pass a file name, e.g. {out / 'model.pt'}")
    fix = f"export an intact one; `ddpkit export {source.parent} {out}` picks the newest"
    scratch = out.parent if out.parent.exists() else None  # where the joined file fits
    model = model_weights(source, ctx, scratch=scratch, fix=fix)
    atomic_save(strip_prefixes(model), out)
    print(f"wrote {out}: {len(model)} tensors of {source.name}", flush=True)
    return 0
