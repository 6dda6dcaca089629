"""Two questions asked of a job's training set before it trains: do all ranks build the
same one, and does fetching a sample draw only from the random generators ddpkit seeds?

Both are answered by fetching a few samples with every RNG (torch's, Python's `random`
and NumPy's) set to a fixed state first, and putting the RNGs back as they were after.
A sample fetched twice from the same state must come out the same; a sample fetched on
two ranks from the same state must come out the same too.
"""

from __future__ import annotations

import sys
from typing import Any, TypedDict

import torch
from torch.utils.data import Dataset, IterableDataset

from ddpkit.checkpoint.digest import state_digest
from ddpkit.seed import rng_state, seed_everything, set_rng_state

PROBE_SEED = 0
FIRST = 4  # samples 0..3 are probed, and the middle and last ones


class Probe(TypedDict):
    """What the probe found on one rank (plain JSON types)."""

    digest: str  # of the probed samples, each fetched from the fixed RNG state
    unseeded: int | None  # an index that came out different when fetched twice, or None


def probe_dataset(dataset: Dataset[Any]) -> Probe:
    """Fetch the first few samples of `dataset` (and its middle and last one), each from
    the same fixed RNG state, twice. Returns a digest of them, equal on every rank that
    builds the same dataset, and the first index whose two fetches differ (its
    `__getitem__` draws from a source that ddpkit does not seed), or None. This process's
    RNG states are left as they were. A dataset without indices (an IterableDataset) is
    not probed."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        return {"digest": "", "unseeded": None}
    size = len(dataset)
    indices = sorted({i for i in (*range(FIRST), size // 2, size - 1) if 0 <= i < size})
    saved = rng_state()
    try:
        if indices:
            _fetch(dataset, indices[0])  # imports that the first fetch does happen here
        digests, unseeded = [], None
        for index in indices:
            digest = _fetch(dataset, index)
            if unseeded is None and _fetch(dataset, index) != digest:
                unseeded = index
            digests.append(digest)
    finally:
        set_rng_state(saved)
    return {"digest": state_digest(digests), "unseeded": unseeded}


def _fetch(dataset: Dataset[Any], index: int) -> str:
    """The digest of `dataset[index]`, fetched with every RNG seeded alike."""
    seed_everything(PROBE_SEED)
    return sample_digest(dataset[index])


def sample_digest(sample: Any) -> str:
    """A digest of one sample (tensors, arrays, numbers, text, nested in tuples, lists
    and dicts): equal digests mean equal samples. Other objects count by type only."""
    return state_digest(_comparable(sample))


def _comparable(value: Any) -> Any:
    if isinstance(value, torch.Tensor | str | bytes | int | float | bool | None):
        return value
    if isinstance(value, dict):
        return {repr(k): _comparable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_comparable(v) for v in value]
    numpy = sys.modules.get("numpy")
    if numpy is not None and (hasattr(value, "__array__") or hasattr(value, "__array_interface__")):
        array = numpy.asarray(value)  # NumPy arrays and scalars, PIL images
        try:
            return torch.as_tensor(array)
        except (TypeError, RuntimeError):
            return repr(array.tolist())
    # Its repr may hold its address, which differs between two equal objects.
    return type(value).__qualname__
