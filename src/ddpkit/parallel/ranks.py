"""Talking across ranks in a hand-written loop: print once, wait for everyone, gather
tensors, objects and per-sample metrics, reduce numbers, let rank 0 go first.

Every function here works in any process: with one process, or before any process
group exists, the collectives return their input (as a one-rank result) at once. Call
the collectives on every rank, the same number of times: a rank that skips one leaves
the others waiting.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import os
import sys
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.inrank.output import PREFIX_ENV
from ddpkit.inrank.watchdog import expect

T = TypeVar("T")

# The tensors of ddpkit's own collectives, kept alive a while after each. The backend's
# threads (gloo's) drop their references just after a collective completes; when theirs
# is the last, freeing the tensor's Python object takes Python's lock from that thread,
# and a process forked at that moment (a DataLoader worker started right after an
# epoch's reduction) can deadlock at birth on CPython before 3.11.10 (gh-112275). Holding
# the last reference here frees the tensor on the caller's thread instead.
_SENT: collections.deque[torch.Tensor] = collections.deque(maxlen=16)


def _group_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _group_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def print(  # ddpkit.print: the builtin, on rank 0
    *args: object, ctx: DistContext | None = None, all_ranks: bool = False, **print_kwargs: Any
) -> None:
    """`print` on rank 0 only, so a job of N processes prints each line once.

    With `all_ranks=True` every rank prints, each line prefixed with `[rank r] ` (under
    `ddpkit run`, which puts that prefix before every line, it is not doubled), and
    each call's whole text is written at once, so the ranks' lines never cut each
    other. The rank comes from `ctx`, else from the initialised process group; with
    neither, this is the one process and it prints. Output is flushed, so lines show
    up while the job runs. Not a collective: call it on any rank, as often as you
    like::

        ddpkit.print(f"epoch {epoch}: loss {loss:.4f}")            # once
        ddpkit.print("batches here:", len(loader), all_ranks=True)  # [rank 1] batches here: 32
    """
    rank = ctx.rank if ctx is not None else _group_rank()
    print_kwargs.setdefault("flush", True)
    if not all_ranks:
        if rank == 0:
            builtins.print(*args, **print_kwargs)
        return
    sep, end = print_kwargs.pop("sep", None), print_kwargs.pop("end", None)
    file, flush = print_kwargs.pop("file", None) or sys.stdout, print_kwargs.pop("flush")
    if print_kwargs:  # as the builtin says it
        raise TypeError(f"print() got an unexpected keyword argument {next(iter(print_kwargs))!r}")
    if file is None:  # no stdout at all (pythonw): the builtin prints nothing either
        return
    text = (" " if sep is None else sep).join(str(a) for a in args)
    prefix = "" if os.environ.get(PREFIX_ENV) == "1" else f"[rank {rank}] "
    text = "\n".join(prefix + line for line in text.split("\n")) + ("\n" if end is None else end)
    # One write of the whole text: the builtin writes `end` apart, and where output is
    # unbuffered (PYTHONUNBUFFERED, `python -u`) another rank's line, sharing the
    # terminal or pipe, landed between the two, cutting both.
    file.write(text)
    if flush:
        file.flush()


def barrier() -> None:
    """Wait here until every rank has arrived (nothing to wait for with one process).

    For example, let rank 0 write a file that the others then read::

        if ctx.is_main:
            save(path)
        ddpkit.barrier()
        data = load(path)
    """
    if _group_size() > 1:
        dist.barrier()


def _comm_device(tensor: torch.Tensor) -> torch.device:
    """Where the group's backend wants tensors: nccl the current GPU, gloo the CPU."""
    backend = str(dist.get_backend())
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    return tensor.device


def _gather_same_shape(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` (same shape everywhere), stacked: (world_size, *shape)."""
    device = _comm_device(tensor)
    bool_ = tensor.dtype == torch.bool  # not every backend sends bools
    local = (tensor.to(torch.uint8) if bool_ else tensor).detach().to(device).contiguous()
    parts = [torch.empty_like(local) for _ in range(_group_size())]
    _SENT.extend([local, *parts])
    dist.all_gather(parts, local)
    out = torch.stack(parts).to(tensor.device)
    return out.bool() if bool_ else out


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor`, stacked along a new first dimension (as Fabric's
    `all_gather`): the result has shape `(world_size, *tensor.shape)`, row r from rank r.

    The tensor must have the same shape and dtype on every rank (for per-sample values
    whose count differs between ranks, use `gather_for_metrics`). With one process the
    result is `tensor.unsqueeze(0)`. The result is on `tensor`'s device and carries no
    gradient. A collective: call it on every rank::

        correct = all_gather(torch.tensor(hits, device=ctx.device))  # (world_size,)
        ddpkit.print(f"accuracy per rank: {correct.tolist()}")
    """
    if _group_size() == 1:
        return tensor.unsqueeze(0)
    return _gather_same_shape(tensor)


def all_gather_object(obj: T) -> list[T]:
    """Every rank's `obj` (anything that pickles), as a list indexed by rank.

    With one process: `[obj]`. A collective: call it on every rank::

        names = all_gather_object(socket.gethostname())  # ['node-a', 'node-a', ...]
    """
    size = _group_size()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank `src`'s `obj` (anything that pickles), returned on every rank.

    What the other ranks pass is ignored (pass None). With one process: `obj` itself.
    A collective: call it on every rank::

        run_id = broadcast_object(make_run_id() if ctx.is_main else None)
    """
    if _group_size() == 1:
        return obj
    box: list[Any] = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]  # type: ignore[no-any-return]


class _CountedPasses(Sampler[Any]):
    """A loader's sampler, counting the passes over it: the DataLoader iterates its
    sampler once per pass, before the pass's first batch, however the last one ended."""

    def __init__(self, inner: Sampler[Any]) -> None:
        self.inner = inner
        self.passes = 0

    def __iter__(self) -> Iterator[Any]:
        self.passes += 1
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # Code that reaches the sampler through the batch sampler (set_epoch) gets it.
        if name == "inner":  # not set yet: being unpickled or copied
            raise AttributeError(name)
        return getattr(self.inner, name)


def _count_passes(loader: Any) -> _CountedPasses | None:
    """The counter of `loader`'s passes, put between its batch sampler and its sampler
    (the one place a DataLoader lets it in); None where it has no such batch sampler."""
    batches, sampler = getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)
    inner = getattr(batches, "sampler", None)
    if isinstance(inner, _CountedPasses) and inner.inner is sampler:
        return inner  # a copy of a loader already counted
    if batches is None or inner is not sampler or not isinstance(inner, Sampler):
        return None  # no batch sampler (batch_size=None), or one of the user's
    counter = _CountedPasses(inner)
    batches.sampler = counter
    return counter


@dataclass
class _Pass:
    """How far a loader's pass has got, in samples per rank (see gather_for_metrics)."""

    counter: _CountedPasses | None  # where the loader's passes are counted
    passes: int | None = None  # the counter when this pass was seen first
    done: int = 0
    epoch: int | None = None


# One entry per loader that gather_for_metrics has seen; gone with the loader.
_passes: weakref.WeakKeyDictionary[Any, _Pass] = weakref.WeakKeyDictionary()


@overload
def gather_for_metrics(values: torch.Tensor, loader: Any = None) -> torch.Tensor: ...
@overload
def gather_for_metrics(
    values: tuple[torch.Tensor, ...], loader: Any = None
) -> tuple[torch.Tensor, ...]: ...
@overload
def gather_for_metrics(values: list[torch.Tensor], loader: Any = None) -> list[torch.Tensor]: ...


def gather_for_metrics(values: Any, loader: Any = None) -> Any:
    """Every rank's per-sample values of one batch, concatenated over the ranks.

    `values` is a tensor whose dimension 0 is the batch's samples (a 0-d tensor counts
    as one sample), or a tuple or list of such tensors with as many samples each (say
    predictions and labels), gathered together. The ranks may hold different numbers of
    samples; the other dimensions must agree. Call it once per batch, on every rank (it
    is a collective); what it returns is the same on every rank::

        preds, labels = [], []
        for x, y in loader:
            logits = model(x.to(ctx.device))
            p, t = ddpkit.gather_for_metrics((logits.argmax(1), y.to(ctx.device)), loader)
            preds.append(p)
            labels.append(t)
        accuracy = (torch.cat(preds) == torch.cat(labels)).float().mean().item()

    Pass the `loader` to count each sample exactly once. torch's `DistributedSampler`
    pads the dataset to a multiple of the world size by repeating samples; given the
    loader, those repeats are dropped and the samples come back in the sampler's order
    (the dataset's order without shuffling). For that, ddpkit follows the loader's pass
    call by call: gather every batch of the pass, each in one call. A new pass starts
    each time the loader starts one, also after a pass that broke off early (a `break`
    out of the loop): ddpkit counts the passes between the loader's batch sampler and
    its sampler (`loader.batch_sampler.sampler`, which passes everything else on).
    ddpkit's evaluation loader (`prepare_loader(..., evaluation=True)`) pads nothing,
    so its batches are simply concatenated, as are those of any other sampler and
    those gathered without `loader`.
    """
    tensors: list[torch.Tensor] = [values] if isinstance(values, torch.Tensor) else list(values)
    if not tensors:
        raise ConfigError("gather_for_metrics got no tensor: pass a tensor or a tuple of them")
    tensors = [t.unsqueeze(0) if t.dim() == 0 else t for t in tensors]
    if len({t.shape[0] for t in tensors}) > 1:
        raise ConfigError(
            "gather_for_metrics got tensors with different numbers of samples "
            f"({[t.shape[0] for t in tensors]} along dimension 0): pass one batch's values"
        )
    gathered = _gather_batch(tensors, loader)
    if isinstance(values, torch.Tensor):
        return gathered[0]
    return tuple(gathered) if isinstance(values, tuple) else gathered


def _gather_batch(tensors: list[torch.Tensor], loader: Any) -> list[torch.Tensor]:
    from ddpkit.parallel.data import epoch_length

    world = _group_size()
    if world == 1:
        return tensors
    # ddpkit's training loader wraps its DistributedSampler; base_sampler unwraps it.
    sampler = getattr(loader, "base_sampler", getattr(loader, "sampler", None))
    _check_batch_counts(sampler, loader, world)
    device = tensors[0].device
    sizes = _gather_same_shape(torch.tensor(tensors[0].shape[0], device=device)).tolist()
    longest = max(sizes)
    stacks = []  # each (world, longest, *rest)
    for t in tensors:
        if t.shape[0] < longest:
            t = torch.cat([t, t.new_zeros((longest - t.shape[0], *t.shape[1:]))])
        stacks.append(_gather_same_shape(t))
    if not isinstance(sampler, DistributedSampler):
        return [torch.cat([s[r, : sizes[r]] for r in range(world)]) for s in stacks]
    if sampler.num_replicas != world:
        raise ConfigError(
            f"the loader's DistributedSampler is for {sampler.num_replicas} ranks but the job "
            f"has {world}: build it with num_replicas={world} (or use ddpkit.prepare_loader)"
        )
    state = _passes.get(loader)
    if state is None:
        state = _passes[loader] = _Pass(_count_passes(loader))
    epoch = getattr(sampler, "epoch", None)
    passes = state.counter.passes if state.counter is not None else None
    if state.epoch != epoch or state.passes != passes:
        # A new pass (set_epoch was called, or the loader started over), even if the
        # last one broke off before its end.
        state.done, state.epoch, state.passes = 0, epoch, passes
    # Rank r's j-th sample of the pass sits at position first + r + world * j of the
    # sampler's padded order, where a pass resumed mid-epoch starts `first` samples in
    # (ddpkit's loader says where); positions past the epoch's end are the padding's
    # repeats.
    first = getattr(loader, "pass_start", 0) + world * getattr(loader, "pass_skipped", 0)
    j = torch.arange(longest, device=device).unsqueeze(1)  # (longest, 1)
    r = torch.arange(world, device=device).unsqueeze(0)  # (1, world)
    position = first + r + world * (j + state.done)  # (longest, world): sample-major
    present = j < torch.tensor(sizes, device=device)
    keep = present & (position < epoch_length(sampler))
    state.done += longest
    if state.done >= _samples_per_pass(sampler, loader):
        state.done = 0
    # Row-major over (j, r) is the sampler's order.
    return [s.transpose(0, 1)[keep] for s in stacks]


def _samples_per_pass(sampler: DistributedSampler[Any], loader: Any) -> int:
    # A pass of ddpkit's loader may start mid-epoch (a resume): it says its length.
    per_rank = getattr(loader, "pass_length", None) or len(sampler)
    batch = getattr(loader, "batch_size", None)
    if getattr(loader, "drop_last", False) and batch:
        per_rank -= per_rank % batch  # the loader drops each rank's short last batch
    return per_rank


def _check_batch_counts(sampler: Any, loader: Any, world: int) -> None:
    """ddpkit's evaluation loader gives ranks shards that differ by one sample, which
    can mean a different number of batches: a per-batch collective would then wait
    forever on the rank with more. Every rank works this out alike, so all refuse."""
    from ddpkit.parallel.data import ShardSampler

    if not isinstance(sampler, ShardSampler) or not getattr(loader, "batch_size", None):
        return
    batch = int(loader.batch_size)
    drop = bool(getattr(loader, "drop_last", False))
    shards = [len(range(rank, sampler.length, world)) for rank in range(world)]
    counts = [n // batch if drop else -(-n // batch) for n in shards]
    if len(set(counts)) > 1:
        raise ConfigError(
            f"ddpkit's evaluation loader gives rank 0 {counts[0]} batch(es) but rank "
            f"{world - 1} only {counts[-1]} ({sampler.length} samples in batches of {batch} "
            f"on {world} ranks), so gathering every batch would leave the ranks waiting "
            "for each other forever: collect this rank's values over the loop and call "
            "gather_for_metrics(torch.cat(values)) once after it, without the loader"
        )


@contextlib.contextmanager
def rank_zero_first(ctx: DistContext | None = None) -> Iterator[None]:
    """Run the body on rank 0 first, while the other ranks wait; then on the others.

    For work that must happen once before the others may start, such as downloading,
    unpacking or tokenising a data set into a cache that every rank then reads::

        with ddpkit.rank_zero_first():
            data = load_or_prepare("data/")  # rank 0 prepares, the others read its cache

    Call it on every rank (it holds a barrier). The others' wait is expected, so the
    hang diagnosis prints no notice about it, however long rank 0 takes, and it has no
    deadline: a download longer than the collective timeout (`launch(timeout=...)`, or
    NCCL's, which is below the hang timeout) fails nothing. With one process it just
    runs the body. `ctx` is accepted as everywhere in ddpkit, and not needed: the
    process group knows which rank is 0.
    """
    if _group_size() == 1:
        yield
        return
    waits = _untimed_group()
    if _group_rank() == 0:
        with expect("work"):
            yield
        dist.barrier(group=waits)
    else:
        with expect("wait"):
            dist.barrier(group=waits)
        yield


# The process group `rank_zero_first` waits in: gloo (a barrier on the CPU, whatever
# the devices) with a timeout no download reaches, beside the default group it was
# made for (a group destroyed with it is never reused for the next one).
_UNTIMED: list[Any] = []
_NO_DEADLINE = timedelta(days=365)


def _untimed_group() -> Any:
    """A group of every rank whose collectives wait `_NO_DEADLINE`. Making it is a
    collective of its own, quick here, where every rank enters `rank_zero_first`."""
    world = dist.distributed_c10d._get_default_group()
    if not _UNTIMED or _UNTIMED[0] is not world:
        _UNTIMED[:] = [world, dist.new_group(backend="gloo", timeout=_NO_DEADLINE)]
    return _UNTIMED[1]


Number = float | int | torch.Tensor


def _double(value: Number) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).double()
    return torch.tensor(float(value), dtype=torch.float64)


def reduce_sums(values: Sequence[Number], ctx: DistContext | None = None) -> list[float]:
    """Sum each value over all ranks in one collective; returns Python floats."""
    ctx = ctx or DistContext.current()
    if not values:
        return []
    # nccl only reduces tensors on the GPU; gloo wants them on the CPU.
    packed = torch.stack([_double(v).to(ctx.device) for v in values])
    if ctx.distributed:
        _SENT.append(packed)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return [float(x) for x in packed.cpu().tolist()]


def reduce_sum(value: Number, ctx: DistContext | None = None) -> float:
    """The sum of `value` over all ranks (a Python float, the same on every rank)."""
    return reduce_sums([value], ctx)[0]


def reduce_mean(value: Number, ctx: DistContext | None = None) -> float:
    """The mean of `value` over all ranks (each rank weighs the same)."""
    ctx = ctx or DistContext.current()
    return reduce_sum(value, ctx) / ctx.world_size
