"""ddpkit.parallel.syncbn: synchronized BatchNorm on CPU, checked on 2 real gloo processes.

The reference for every multi-rank check is plain `nn.BatchNorm*` run in one process
on the whole global batch. Workers compare against it themselves (both ranks build the
same seeded data) and return their largest deviations, gathered to rank 0.
"""

from __future__ import annotations

import copy
import inspect
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.context import DistContext
from ddpkit.errors import ConfigError
from ddpkit.parallel.syncbn import SyncBatchNorm, convert_sync_batchnorm
from ddpkit.processes.launcher import launch

TOL64 = 1e-9  # float64 math: only summation order differs from the reference
Errors = dict[str, float]

# BatchNorm without a bias exists from torch 2.13 on; older releases test the rest.
_BIAS = "bias" in inspect.signature(nn.BatchNorm2d).parameters
_NO_BIAS: dict[str, bool] = {"bias": False} if _BIAS else {}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def _record(errs: Errors, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    errs[name] = max(errs.get(name, 0.0), _err(a, b))


def _gather(errs: Any) -> list[Any]:
    """Every rank's `errs`, on every rank; the last collective of a worker."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, errs)
    # A workaround for a race in torch's gloo backend, not a wait for a result: once
    # DDP or autograd has run, a gloo thread frees each finished collective only after
    # it gets the GIL. If the worker exits within the next few milliseconds (launch
    # returns, destroys the group, finalizes Python), that thread dies mid-destructor
    # and the process aborts with SIGABRT ("terminate called without an active
    # exception") in roughly 1 run in 10. Sleeping releases the GIL so it finishes.
    time.sleep(0.1)
    return out


def _bounds(sizes: tuple[int, ...], rank: int) -> tuple[int, int]:
    lo = sum(sizes[:rank])
    return lo, lo + sizes[rank]


def _small_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 6),
        nn.BatchNorm1d(6, momentum=0.3),
        nn.ReLU(),
        nn.Linear(6, 2),
    )


def _bn_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v
        for k, v in model.state_dict().items()
        if k.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")
    }


# --- workers (module level: launch pickles them) ---------------------------------------


def _ddp_matches_global_batch(ctx: DistContext, splits: list[tuple[int, int]]) -> list[Errors]:
    """DDP over SyncBatchNorm == one process with nn.BatchNorm on the global batch."""
    errs: Errors = {}
    for sizes in splits:
        _ddp_case(ctx, sizes, errs)
    return _gather(errs)


def _ddp_case(ctx: DistContext, sizes: tuple[int, int], errs: Errors) -> None:
    torch.manual_seed(0)
    base = _small_model().double()
    ref = copy.deepcopy(base)
    converted, count = convert_sync_batchnorm(copy.deepcopy(base))
    errs["converted"] = float(count)
    ddp = DDP(converted)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    lo, hi = _bounds(sizes, ctx.rank)
    # DDP averages over ranks the gradients of each rank's mean loss, so the
    # equivalent single-process loss weights sample i by 1 / (world * n_rank(i)).
    weights = torch.cat(
        [torch.full((n,), 1.0 / (ctx.world_size * n), dtype=torch.float64) for n in sizes]
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(sum(sizes), 3, 5, 5, generator=gen, dtype=torch.float64) * 3 + 1
        y = torch.randn(sum(sizes), 2, generator=gen, dtype=torch.float64)

        ref_x = x.clone().requires_grad_()
        ref_out = ref(ref_x)
        ((ref_out - y) ** 2).mean(1).mul(weights).sum().backward()

        local_x = x[lo:hi].clone().requires_grad_()
        out = ddp(local_x)
        ((out - y[lo:hi]) ** 2).mean(1).mean().backward()

        _record(errs, "output", out, ref_out[lo:hi])
        # Input gradients are not averaged by DDP: they are those of the sum of the
        # ranks' losses, i.e. world_size times the reference's.
        assert ref_x.grad is not None and local_x.grad is not None
        _record(errs, "input_grad", local_x.grad, ctx.world_size * ref_x.grad[lo:hi])
        for (name, p), q in zip(converted.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            _record(errs, f"grad {name}", p.grad, q.grad)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    for (name, p), q in zip(converted.named_parameters(), ref.parameters(), strict=True):
        _record(errs, f"param {name}", p, q)
    ref_bn = _bn_state(ref)
    for name, buf in _bn_state(converted).items():
        _record(errs, f"buffer {name}", buf, ref_bn[name])


def _layer_case(
    ctx: DistContext,
    errs: Errors,
    tag: str,
    layer: nn.Module,
    shape: tuple[int, ...],
    sizes: tuple[int, int],
    steps: int = 3,
) -> None:
    """A bare layer on `sizes` samples per rank against the reference on the whole batch.

    The loss is a fixed weighted sum, so the reference's gradients are the sums over the
    ranks' gradients (all-reduced here by hand; there is no DDP).
    """
    ref = copy.deepcopy(layer)
    sync, _ = convert_sync_batchnorm(copy.deepcopy(layer))
    lo, hi = _bounds(sizes, ctx.rank)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(sum(sizes), *shape, generator=gen, dtype=torch.float64) * 2 - 5
        c = torch.randn(sum(sizes), *shape, generator=gen, dtype=torch.float64)
        ref_x = x.clone().requires_grad_()
        ref_out = ref(ref_x)
        (ref_out * c).sum().backward()
        local_x = x[lo:hi].clone().requires_grad_()
        out = sync(local_x)
        (out * c[lo:hi]).sum().backward()
        _record(errs, f"{tag} output", out, ref_out[lo:hi])
        assert ref_x.grad is not None and local_x.grad is not None
        _record(errs, f"{tag} input_grad", local_x.grad, ref_x.grad[lo:hi])
        for (name, p), q in zip(sync.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            dist.all_reduce(p.grad)
            _record(errs, f"{tag} grad {name}", p.grad, q.grad)
            p.grad = q.grad = None
    for name, buf in sync.state_dict().items():
        _record(errs, f"{tag} state {name}", buf, ref.state_dict()[name])

    # Eval: ranks run different numbers of forwards with different batch sizes. Any
    # collective here would leave the ranks out of step and the training forward
    # afterwards would hang or be wrong.
    sync.eval()
    ref.eval()
    for n in range(ctx.rank + 1):
        x = torch.randn(2 + n + ctx.rank, *shape, dtype=torch.float64)
        _record(errs, f"{tag} eval output", sync(x), ref(x))
    sync.train()
    ref.train()
    x = torch.randn(sum(sizes), *shape, generator=gen, dtype=torch.float64)
    _record(errs, f"{tag} train after eval", sync(x[lo:hi]), ref(x)[lo:hi])


def _variants(ctx: DistContext) -> list[Any]:
    torch.manual_seed(0)
    errs: Errors = {}
    info: dict[str, Any] = {}

    def randomized(layer: nn.modules.batchnorm._BatchNorm) -> nn.Module:
        if layer.weight is not None:
            with torch.no_grad():
                layer.weight.uniform_(0.5, 1.5)
                if layer.bias is not None:
                    layer.bias.uniform_(-1, 1)
        return layer.double()

    _layer_case(
        ctx,
        errs,
        "momentum=None",
        randomized(nn.BatchNorm1d(5, momentum=None)),
        (5, 7),
        (1, 3),
        steps=4,
    )
    _layer_case(
        ctx, errs, "affine=False", randomized(nn.BatchNorm2d(4, affine=False)), (4, 3, 3), (3, 5)
    )
    if _BIAS:
        _layer_case(
            ctx,
            errs,
            "bias=False, empty rank 0",
            randomized(nn.BatchNorm3d(2, momentum=0.3, bias=False)),
            (2, 2, 2, 2),
            (0, 4),
        )
    else:
        _layer_case(
            ctx,
            errs,
            "empty rank 0",
            randomized(nn.BatchNorm3d(2, momentum=0.3)),
            (2, 2, 2, 2),
            (0, 4),
        )
    _layer_case(ctx, errs, "BatchNorm1d 2D", randomized(nn.BatchNorm1d(3)), (3,), (1, 4))

    # Without running stats: training uses the global batch (checked by _layer_case);
    # eval normalizes with the local batch, like torch.nn.SyncBatchNorm.
    untracked = randomized(nn.BatchNorm2d(4, track_running_stats=False))
    _layer_case(ctx, errs, "untracked", untracked, (4, 3, 3), (2, 6))
    sync, _ = convert_sync_batchnorm(copy.deepcopy(untracked))
    sync.eval()
    x = torch.randn(3 + ctx.rank, 4, 3, 3, dtype=torch.float64)
    _record(errs, "untracked eval is local", sync(x), untracked.eval()(x))

    # Half precision: statistics in float32, output in the input's dtype.
    sizes = (3, 5)
    lo, hi = _bounds(sizes, ctx.rank)
    x16 = torch.randn(sum(sizes), 3, 4, 4, generator=torch.Generator().manual_seed(3)) * 4 + 2
    x16 = x16.bfloat16()
    ref = nn.BatchNorm2d(3)
    ref_out = ref(x16.float())
    sync, _ = convert_sync_batchnorm(nn.BatchNorm2d(3))
    out = sync(x16[lo:hi])
    info["bf16 output dtype"] = str(out.dtype)
    info["bf16 running dtype"] = str(sync.running_mean.dtype)
    _record(errs, "bf16 output", out.float(), ref_out[lo:hi])
    _record(errs, "bf16 running_mean", sync.running_mean, ref.running_mean)  # type: ignore[arg-type]
    _record(errs, "bf16 running_var", sync.running_var, ref.running_var)  # type: ignore[arg-type]

    # float32 data far from zero: sums of squares would cancel to noise here
    # (E[x^2] ~ 1e8 against a variance of ~1); per-rank mean/M2 combined in float64
    # keep the statistics as good as the data.
    x = torch.randn(sum(sizes), 3, 4, 4, generator=torch.Generator().manual_seed(5)) + 1e4
    ref = nn.BatchNorm2d(3).double()
    ref_out = ref(x.double())
    far = SyncBatchNorm(3)
    local = x[lo:hi].clone().requires_grad_()
    far_out = far(local)
    _record(errs, "f32 far from zero output", far_out, ref_out[lo:hi])
    # The input gradient too: its x_hat term must not cancel against the mean either.
    ref_x = x.double().requires_grad_()
    nn.BatchNorm2d(3).double()(ref_x).pow(2).mul(
        torch.arange(sum(sizes)).view(-1, 1, 1, 1)
    ).sum().backward()
    far_out.pow(2).mul(torch.arange(lo, hi).view(-1, 1, 1, 1)).sum().backward()
    assert local.grad is not None and ref_x.grad is not None
    _record(errs, "f32 far from zero input grad", local.grad, ref_x.grad[lo:hi])
    assert far.running_var is not None and ref.running_var is not None
    _record(errs, "f32 far from zero running_var", far.running_var, ref.running_var)

    # Autocast: conv runs in bfloat16, BatchNorm keeps that dtype; backward flows.
    torch.manual_seed(0)
    model, _ = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(torch.randn(2 + ctx.rank, 3, 4, 4))
    info["autocast output dtype"] = str(y.dtype)
    y.float().square().mean().backward()
    info["autocast grad finite"] = all(
        p.grad is not None and bool(p.grad.isfinite().all()) for p in model.parameters()
    )

    # One value per channel in the whole global batch: every rank raises, and the ranks
    # stay in step for the next forward.
    one = SyncBatchNorm(3).double()
    try:
        one(torch.randn(1 - ctx.rank, 3, dtype=torch.float64))
        info["global size 1"] = "no error"
    except ValueError as exc:
        info["global size 1"] = str(exc)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    _record(
        errs,
        "after size-1 error",
        one(x[2 * ctx.rank : 2 * ctx.rank + 2]),
        F.batch_norm(x, None, None, training=True)[2 * ctx.rank : 2 * ctx.rank + 2],
    )
    return _gather((errs, info))


def _in_size_one_group(ctx: DistContext) -> Errors:
    """A real process group of one rank: SyncBatchNorm is nn.BatchNorm, bit for bit."""
    errs: Errors = {"world_size": float(dist.get_world_size())}
    _compare_single_process(errs)
    return errs


def _compare_single_process(errs: Errors) -> None:
    for momentum in (0.1, None):
        torch.manual_seed(0)
        ref = nn.BatchNorm2d(3, momentum=momentum)
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-1, 1)
        sync, _ = convert_sync_batchnorm(copy.deepcopy(ref))
        for step in range(3):
            x = torch.randn(4, 3, 5, 5) * (step + 1)
            rx, sx = x.clone().requires_grad_(), x.clone().requires_grad_()
            r_out, s_out = ref(rx), sync(sx)
            errs[f"m={momentum} output exact"] = float(torch.equal(r_out, s_out))
            r_out.sum().backward()
            s_out.sum().backward()
            assert rx.grad is not None and sx.grad is not None
            errs[f"m={momentum} input grad exact"] = float(torch.equal(rx.grad, sx.grad))
        for (name, p), q in zip(sync.named_parameters(), ref.parameters(), strict=True):
            errs[f"m={momentum} grad {name} exact"] = float(torch.equal(p.grad, q.grad))  # type: ignore[arg-type]
        for name, buf in sync.state_dict().items():
            errs[f"m={momentum} {name} exact"] = float(torch.equal(buf, ref.state_dict()[name]))
        ref.eval()
        sync.eval()
        x = torch.randn(2, 3, 5, 5)
        errs[f"m={momentum} eval exact"] = float(torch.equal(ref(x), sync(x)))


# --- multi-process tests ---------------------------------------------------------------


def test_ddp_with_sync_batchnorm_equals_batchnorm_on_global_batch() -> None:
    per_rank = launch(
        _ddp_matches_global_batch, [(4, 4), (3, 5)], nprocs=2, backend="gloo", timeout=60
    )
    assert len(per_rank) == 2
    for rank, errs in enumerate(per_rank):
        assert errs.pop("converted") == 2
        assert any(k.startswith("buffer ") for k in errs)
        assert any(k.startswith("grad ") for k in errs)
        bad = {k: v for k, v in errs.items() if not v < TOL64}
        assert not bad, f"rank {rank} deviates from BatchNorm on the global batch: {bad}"


def test_variants_uneven_empty_eval_half_precision() -> None:
    per_rank = launch(_variants, nprocs=2, backend="gloo", timeout=60)
    for rank, (errs, info) in enumerate(per_rank):
        loose = {k: errs.pop(k) for k in list(errs) if k.startswith(("bf16", "f32"))}
        bad = {k: v for k, v in errs.items() if not v < TOL64}
        assert not bad, f"rank {rank} deviates from BatchNorm on the global batch: {bad}"
        # bfloat16 keeps ~3 significant digits; the statistics themselves are float32.
        assert loose["bf16 output"] < 0.05, loose
        assert loose["bf16 running_mean"] < 1e-5, loose
        assert loose["bf16 running_var"] < 1e-4, loose
        # float32 resolves 1e4 to ~5e-4; a variance from sums of squares would be off by ~1.
        assert loose["f32 far from zero output"] < 5e-3, loose
        assert loose["f32 far from zero running_var"] < 1e-3, loose
        assert loose["f32 far from zero input grad"] < 5e-3, loose
        assert info["bf16 output dtype"] == "torch.bfloat16"
        assert info["bf16 running dtype"] == "torch.float32"
        assert info["autocast output dtype"] == "torch.bfloat16"
        assert info["autocast grad finite"] is True
        assert "Expected more than 1 value per channel" in info["global size 1"], (rank, info)


def test_process_group_of_one_is_plain_batchnorm() -> None:
    errs = launch(_in_size_one_group, nprocs=1, backend="gloo")
    assert errs.pop("world_size") == 1
    assert all(v == 1.0 for v in errs.values()), errs


# --- single process ----------------------------------------------------------------------


def test_without_process_group_is_plain_batchnorm() -> None:
    assert not dist.is_initialized()
    errs: Errors = {}
    _compare_single_process(errs)
    assert errs and all(v == 1.0 for v in errs.values()), errs


def test_rejects_inputs_without_channel_dimension() -> None:
    bn = SyncBatchNorm(3)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        bn(torch.randn(3))
    with pytest.raises(ValueError, match="channels"):
        bn(torch.randn(4, 5))


def _nested_model() -> tuple[nn.Module, nn.BatchNorm2d]:
    shared = nn.BatchNorm2d(4)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        shared,
        nn.Sequential(nn.ReLU(), nn.Sequential(nn.BatchNorm2d(4, **_NO_BIAS), shared)),
        nn.Sequential(nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2, affine=False)),
        nn.Flatten(),
        nn.BatchNorm1d(2 * 3 * 3, track_running_stats=False),
        nn.Unflatten(1, (2, 3, 3, 1)),
        nn.BatchNorm3d(2, momentum=None),
    )
    return model, shared


def _fill(model: nn.Module) -> None:
    torch.manual_seed(5)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.uniform_(0.5, 1.5)
            else:
                t.fill_(7)


def test_convert_keeps_parameters_buffers_and_modes() -> None:
    model, shared = _nested_model()
    _fill(model)
    model[2][1][0].weight.requires_grad_(False)  # type: ignore[index]
    model[3][1].eval()  # type: ignore[index]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    old = {id(m): m for m in model.modules()}
    old_params = {id(p) for p in model.parameters()}
    x = torch.randn(4, 3, 3, 1).expand(4, 3, 3, 3).contiguous()
    model.eval()
    expected = model(x)
    model.train()
    model[3][1].eval()  # type: ignore[index]

    converted, count = convert_sync_batchnorm(model)
    assert converted is model
    assert count == 5  # the shared layer is one layer, converted once
    sync = [m for m in converted.modules() if isinstance(m, SyncBatchNorm)]
    assert len(sync) == 5
    assert not any(type(m).__name__.startswith("BatchNorm") for m in converted.modules())
    assert converted[1] is converted[2][1][1]  # type: ignore[index]
    assert converted[1] is not shared  # type: ignore[index]
    assert all(id(m) not in old for m in sync)
    # Same parameter objects: an optimizer built before conversion still works.
    assert {id(p) for p in converted.parameters()} == old_params
    after = converted.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert converted[2][1][0].weight.requires_grad is False  # type: ignore[index]
    assert (converted[2][1][0].bias is None) == _BIAS  # type: ignore[index]
    assert converted[3][1].training is False  # type: ignore[index]
    assert converted[1].training is True  # type: ignore[index]
    assert converted[3][1].affine is False  # type: ignore[index]
    assert converted[5].running_mean is None  # type: ignore[index]
    assert converted[7].momentum is None  # type: ignore[index]
    converted.eval()
    assert torch.equal(converted(x), expected)

    again, count = convert_sync_batchnorm(converted)
    assert again is converted and count == 0


def test_convert_bare_batchnorm_root_and_model_without_batchnorm() -> None:
    bn = nn.BatchNorm1d(3, eps=1e-3, momentum=0.2)
    _fill(bn)
    new, count = convert_sync_batchnorm(bn)
    assert count == 1 and isinstance(new, SyncBatchNorm)
    assert (new.eps, new.momentum, new.num_features) == (1e-3, 0.2, 3)
    assert new.weight is bn.weight and new.running_var is bn.running_var

    plain = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.LayerNorm(3), nn.ReLU()))
    state = copy.deepcopy(plain.state_dict())
    same, count = convert_sync_batchnorm(plain)
    assert same is plain and count == 0
    assert all(torch.equal(v, state[k]) for k, v in same.state_dict().items())


def test_convert_replaces_torch_syncbatchnorm_on_cpu_and_uses_it_on_cuda() -> None:
    # torch's SyncBatchNorm cannot run under DDP on CPU, so it is replaced there too.
    model = nn.Sequential(nn.SyncBatchNorm(3), nn.BatchNorm2d(3))
    converted, count = convert_sync_batchnorm(model, "cpu")
    assert count == 2
    assert all(isinstance(m, SyncBatchNorm) for m in converted.children())

    # Converting for CUDA is pure module surgery: it needs no GPU.
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Sequential(nn.BatchNorm1d(2), nn.SyncBatchNorm(2)))
    weight = model[0].weight
    converted, count = convert_sync_batchnorm(model, "cuda")
    assert count == 2
    layers = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(layers) == 3 and all(type(m) is nn.SyncBatchNorm for m in layers)
    assert layers[0].weight is weight

    root, count = convert_sync_batchnorm(nn.BatchNorm3d(2), "cuda")
    assert count == 1 and type(root) is nn.SyncBatchNorm


def test_convert_rejects_uninitialised_lazy_batchnorm() -> None:
    with pytest.raises(ConfigError, match="forward pass"):
        convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))
