"""Seeding and RNG state capture, so a run can be repeated and resumed exactly."""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (if imported) and torch's RNGs (CPU and every GPU).

    Call it with the same seed on every rank before building the model, so that every
    rank starts from the same parameters. For training, give each rank its own stream
    with `seed_everything(rank_seed(seed, rank))` (`Trainer.fit` does this).
    """
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s training stream: reproducible, and different per rank.

    Ranks must not draw the same random numbers while they train: with the same stream,
    every rank would apply the same dropout masks and augmentations to its share of the
    batch, and the global batch would hold world-size correlated copies of them.
    """
    digest = hashlib.sha256(f"ddpkit-rank-seed:{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # below 2**63, as torch wants


def rng_state() -> dict[str, Any]:
    """This process's RNG states, as types that `torch.load(weights_only=True)` accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(_py_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        # This rank's own GPU only: every visible GPU's state would be 8 copies on an
        # 8-GPU node, and could not be restored where fewer GPUs are visible.
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    if "numpy" in sys.modules:
        kind, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state(legacy=True)
        state["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]
    return state


def _py_state() -> tuple[Any, ...]:
    version, internal, gauss = random.getstate()
    return (version, list(internal), gauss)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured; the GPU stream goes to the current device."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, torch.Tensor):
            torch.cuda.set_rng_state(cuda.cpu())  # onto the current device
        else:
            # Older checkpoints hold every visible GPU's state: this rank's device is
            # its entry, if the saving machine had that many GPUs.
            index = torch.cuda.current_device()
            if index < len(cuda):
                torch.cuda.set_rng_state(cuda[index].cpu(), index)
    if "numpy" in state and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        kind, keys, pos, has_gauss, gauss_ = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss_))
