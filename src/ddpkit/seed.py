"""Seeding and RNG state capture, so a run can be repeated and resumed exactly.

torch is imported where it is used: `import ddpkit` notes here how the RNGs stand (see
`note_streams`) without importing torch, so that `ddpkit check` starts fast.
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

# How each RNG stood when ddpkit first saw it in this process: one that stands otherwise
# when `launch` starts its ranks was seeded by the script (see `seeded_by_script`).
_FIRST_SEEN: dict[str, Any] = {}

# torch seeds its generator from 64 bits of the OS's entropy at start: a seed below this
# is one a script set (0, 42, args.seed) but for a chance of 2**-32.
_SMALL_SEED = 2**32


def note_streams() -> None:
    """Note how each RNG stands, the first time it is seen (Python's at `import ddpkit`,
    torch's and NumPy's once they are imported)."""
    _FIRST_SEEN.setdefault("python", random.getstate())
    if "torch" in sys.modules:
        _FIRST_SEEN.setdefault("torch", sys.modules["torch"].initial_seed())
    if "numpy" in sys.modules:
        _FIRST_SEEN.setdefault("numpy", _numpy_key())


def _numpy_key() -> tuple[Any, ...]:
    _, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state(legacy=True)
    return (keys.tobytes(), int(pos), int(has_gauss), float(gauss))


def seeded_by_script() -> dict[str, Any]:
    """The RNG states of the streams this process's script seeded since ddpkit first saw
    them (`torch.manual_seed`, `random.seed`, `np.random.seed`, `seed_everything`), as
    they stand now: what `launch` hands its ranks to start from (`start_rank_streams`).

    torch's stream counts as seeded when its seed changed or is below 2**32 (a seed torch
    drew itself is 64 random bits), so a model built unseeded before `launch` leaves it
    unseeded; Python's and NumPy's when their state changed, by a seed or by a draw."""
    import torch

    note_streams()  # a stream first seen now has not been seeded since
    state = rng_state()
    seeded: dict[str, Any] = {}
    seed = torch.initial_seed()
    if seed != _FIRST_SEEN["torch"] or seed < _SMALL_SEED:
        seeded["torch"], seeded["torch_seed"] = state["torch"], seed
    if random.getstate() != _FIRST_SEEN["python"]:
        seeded["python"] = state["python"]
    if "numpy" in state and _numpy_key() != _FIRST_SEEN.get("numpy"):
        seeded["numpy"] = state["numpy"]
    return seeded


def start_rank_streams(seeded: dict[str, Any]) -> None:
    """Start the RNGs of a rank that `launch` forked as those of a new interpreter that
    runs the script (as under `ddpkit run`, torchrun or `mp.spawn`): the streams the
    script seeded (`seeded_by_script`) as they stood when it called `launch`, the same
    on every rank; the others from the OS's entropy, different on every rank and at every
    launch. A forked process would otherwise draw its parent's stream, so every rank
    would make the same "random" dataset. A seed set in the function comes after this."""
    import torch

    random.seed()  # from os.urandom
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    torch.seed()  # CPU and every GPU
    if "torch" in seeded:
        torch.manual_seed(seeded["torch_seed"])  # the GPUs' streams, which a script seeds alike
        torch.set_rng_state(seeded["torch"])
    if "python" in seeded:
        _set_python(seeded["python"])
    if "numpy" in seeded:
        _set_numpy(seeded["numpy"])


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (if imported) and torch's RNGs (CPU and every GPU).

    Call it with the same seed on every rank before building the model, so that every
    rank starts from the same parameters. For training, give each rank its own stream
    with `seed_everything(rank_seed(seed, rank))` (`Trainer.fit` does this).
    """
    import torch

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
    import torch

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
    import torch

    torch.set_rng_state(state["torch"].cpu())
    _set_python(state["python"])
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
    if "numpy" in state:
        _set_numpy(state["numpy"])


def _set_python(state: list[Any]) -> None:
    version, internal, gauss = state
    random.setstate((version, tuple(internal), gauss))


def _set_numpy(state: list[Any]) -> None:
    if "numpy" not in sys.modules:
        return
    np = sys.modules["numpy"]
    kind, keys, pos, has_gauss, gauss = state
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


note_streams()  # at `import ddpkit`, before the script seeds anything
