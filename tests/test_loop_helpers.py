"""The helpers of a hand-written loop (ddpkit.print, the collectives, gather_for_metrics,
no_backward_sync, accumulate, Precision) on 2 gloo ranks and on one process.

Real groups and collectives, no mocks. Spawning is slow on a busy machine, so each
world size is launched once (a module-scoped fixture) and runs every check; the tests
then read its results.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ddpkit
from ddpkit import DistContext, launch
from ddpkit.errors import ConfigError
from ddpkit.parallel.model import find_ddp
from ddpkit.parallel.precision import Precision, _autocast_or_problem
from ddpkit.parallel.ranks import all_gather, all_gather_object, broadcast_object
from ddpkit.parallel.sync import no_backward_sync

FP16_ON_CPU = not isinstance(_autocast_or_problem("cpu", torch.float16), str)


# -- what each rank runs ----------------------------------------------------------------
def _prints(ctx: DistContext) -> list[str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ddpkit.print("hello", 1, ctx=ctx)
        ddpkit.print("each", ctx=ctx, all_ranks=True)
        ddpkit.print("a\nb", all_ranks=True, end="!\n")  # rank from the group
        ddpkit.print("no", "ctx", sep="-")
    return all_gather_object(buf.getvalue())


def _collectives(ctx: DistContext) -> dict[str, Any]:
    ddpkit.barrier()
    r = ctx.rank
    return {
        "rows": all_gather(torch.tensor([r, 10.0 * r])).tolist(),
        "scalars": all_gather(torch.tensor(r)).tolist(),
        "bools": all_gather(torch.tensor([r == 0, True])).tolist(),
        "objects": all_gather_object({"rank": r}),
        "broadcast": all_gather_object(broadcast_object(f"from {r}", src=ctx.world_size - 1)),
    }


def _pass(loader: Any, tuples: bool = False) -> list[int]:
    """One pass over `loader`, each batch gathered with it: the global indices in order."""
    out: list[int] = []
    for batch in loader:
        if tuples:
            idx, tens = ddpkit.gather_for_metrics((batch, batch * 10), loader)
            assert torch.equal(tens, idx * 10)
        else:
            idx = ddpkit.gather_for_metrics(batch, loader)
        out += idx.tolist()
    return out


class _Indices(Dataset[int]):
    """Samples 0, 1, ..., n - 1: each sample is its own index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def _gathers(ctx: DistContext) -> dict[str, Any]:
    w, r = ctx.world_size, ctx.rank
    out: dict[str, Any] = {}
    for n in (7, 11):
        data = _Indices(n)
        for b in (2, 3):
            sampler: DistributedSampler[int] = DistributedSampler(data, w, r, shuffle=False)
            loader: DataLoader[int] = DataLoader(data, batch_size=b, sampler=sampler)
            out[f"plain {n} {b}"] = [_pass(loader, tuples=b == 3), _pass(loader)]  # 2 passes
            evaluation = ddpkit.prepare_loader(data, ctx, b, evaluation=True)
            if n == 7 and b == 3 and w == 2:  # rank 0 gets 2 batches, rank 1 only 1
                try:
                    _pass(evaluation)
                    out["uneven batches"] = "no error"
                except ConfigError as exc:
                    out["uneven batches"] = str(exc)
            else:
                out[f"eval {n} {b}"] = _pass(evaluation)
    data = _Indices(7)
    sampler = DistributedSampler(data, num_replicas=w, rank=r, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    sampler.set_epoch(0)
    out["shuffled 0"] = _pass(loader)
    sampler.set_epoch(1)  # a pass broken off after one batch...
    ddpkit.gather_for_metrics(next(iter(loader)), loader)
    sampler.set_epoch(2)  # ...and set_epoch starts the count again
    out["shuffled 2"] = _pass(loader)
    train = ddpkit.prepare_loader(data, ctx, 3, shuffle=False)  # ddpkit's, for training
    out["ddpkit train"] = _pass(train)
    out["after a break"] = all_gather_object(_after_a_break(ctx, data))
    whole: DataLoader[int] = DataLoader(
        data, batch_size=2, sampler=DistributedSampler(data, w, r, shuffle=False)
    )
    mine = torch.cat(list(whole))  # the whole pass in one call
    out["one call"] = ddpkit.gather_for_metrics(mine, whole).tolist()
    ragged = torch.full((r + 1, 2), r)  # no loader: ranks hold different counts
    out["ragged"] = ddpkit.gather_for_metrics(ragged).tolist()
    out["scalar"] = ddpkit.gather_for_metrics(torch.tensor(r)).tolist()
    return out


def _after_a_break(ctx: DistContext, data: _Indices) -> dict[str, list[int]]:
    """A pass broken off after its first batch, without set_epoch, then a whole pass."""
    w, r = ctx.world_size, ctx.rank
    loaders: dict[str, Any] = {
        f"plain {b}": DataLoader(
            data, batch_size=b, sampler=DistributedSampler(data, w, r, shuffle=False)
        )
        for b in (2, 3)
    }
    loaders["workers"] = DataLoader(  # the same iterator, reset for each pass
        data,
        batch_size=2,
        sampler=DistributedSampler(data, w, r, shuffle=False),
        num_workers=1,
        persistent_workers=True,
    )
    loaders["ddpkit train"] = ddpkit.prepare_loader(data, ctx, 2, shuffle=False)
    out = {}
    for name, loader in loaders.items():
        for batch in loader:
            ddpkit.gather_for_metrics(batch, loader)
            break
        out[name] = _pass(loader)
    return out


def _flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in ddpkit.unwrap(model).parameters()])  # type: ignore[union-attr]


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in ddpkit.unwrap(model).parameters()])


def _no_sync(ctx: DistContext) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Linear(3, 1), ctx)
    bare = copy.deepcopy(ddpkit.unwrap(model))
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(ctx.rank))
    with no_backward_sync(model):
        model(x).square().mean().backward()
    skipped = all_gather(_flat_grad(model))
    bare(x).square().mean().backward()
    local = _flat_grad(bare)
    model.zero_grad()
    with no_backward_sync(model, enabled=False):
        model(x).square().mean().backward()
    synced = all_gather(_flat_grad(model))
    locals_ = all_gather(local)
    return {
        "wrapped": find_ddp(model) is not None,
        "skipped is local": torch.equal(skipped[ctx.rank], local),
        "skipped differ": not torch.equal(skipped[0], skipped[-1]),
        "synced same": all(torch.equal(g, synced[0]) for g in synced),
        "synced is mean": torch.allclose(synced[0], locals_.mean(0), atol=1e-6),
    }


# Gradient accumulation: 5 micro-batches in groups of 3 (the last group has 2); each
# micro-batch is a global batch of 4 rows, split between the ranks.
_K, _MICRO, _ROWS = 3, 5, 4


def _accumulation_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(_MICRO * _ROWS, 4, generator=g), torch.randn(_MICRO * _ROWS, 1, generator=g)


def _accumulate(ctx: DistContext) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    reference = copy.deepcopy(net)
    model = ddpkit.prepare_model(net, ctx)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _accumulation_data()
    share = _ROWS // ctx.world_size
    acc = ddpkit.accumulate(model, _K, length=_MICRO)
    steps, grads_before_sync, grads_at_sync = [], [], []
    for i in range(_MICRO):
        rows = slice(i * _ROWS + ctx.rank * share, i * _ROWS + (ctx.rank + 1) * share)
        with acc.step(i):
            loss = nn.functional.mse_loss(model(x[rows]), y[rows]) / acc.group_size(i)
            loss.backward()  # type: ignore[no-untyped-call]
        gathered = all_gather(_flat_grad(model))
        if acc.should_step(i):
            grads_at_sync.append(all(torch.equal(g, gathered[0]) for g in gathered))
            opt.step()
            opt.zero_grad()
            steps.append(i)
        else:
            grads_before_sync.append(not torch.equal(gathered[0], gathered[-1]))
    # One process, no accumulation: each group's rows as one batch.
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for start, end in ((0, _K), (_K, _MICRO)):
        rows = slice(start * _ROWS, end * _ROWS)
        nn.functional.mse_loss(reference(x[rows]), y[rows]).backward()  # type: ignore[no-untyped-call]
        ref_opt.step()
        ref_opt.zero_grad()
    params = all_gather(_flat_params(model))
    return {
        "steps": steps,
        "differ before sync": grads_before_sync,
        "same at sync": grads_at_sync,
        "ranks identical": all(torch.equal(p, params[0]) for p in params),
        "max diff to reference": float((params - _flat_params(reference)).abs().max()),
        "params": params[0].tolist(),
    }


def _precisions(ctx: DistContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = ["32", "32-true", "bf16", "bf16-mixed"] + (["16-mixed"] if FP16_ON_CPU else [])
    for name in names:
        torch.manual_seed(0)
        model = ddpkit.prepare_model(
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), ctx
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        prec = ddpkit.Precision(name, ctx)
        g = torch.Generator().manual_seed(10 + ctx.rank)  # each rank its own data
        losses, norms, dtypes = [], [], set()
        for _ in range(3):
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)
            with prec.autocast():
                pred = model(x)
                loss = nn.functional.mse_loss(pred.float(), y)
            dtypes.add(str(pred.dtype))
            prec.backward(loss)
            norms.append(float(prec.clip_gradients(model, opt, max_norm=0.5)))
            prec.step(opt)
            opt.zero_grad()
            losses.append(float(loss.detach()))
        params = all_gather(_flat_params(model))
        state = prec.state_dict()
        prec.load_state_dict(state)
        out[name] = {
            "precision": prec.precision,
            "dtypes": sorted(dtypes),
            "losses finite": all(math.isfinite(v) for v in losses),
            # fp16 may skip a step whose scaled gradients overflowed: an inf norm then
            "norms finite": all(math.isfinite(v) for v in norms),
            "ranks identical": all(torch.equal(p, params[0]) for p in params),
            "state": sorted(state),
            "state after load": prec.state_dict() == state,
        }
    return out


def _all_checks(ctx: DistContext) -> dict[str, Any]:
    return {
        "world": ctx.world_size,
        "prints": _prints(ctx),
        "collectives": _collectives(ctx),
        "gathers": _gathers(ctx),
        "no_sync": _no_sync(ctx),
        "accumulate": _accumulate(ctx),
        "precision": _precisions(ctx),
    }


@pytest.fixture(scope="module")
def two() -> dict[str, Any]:
    return launch(_all_checks, nprocs=2, timeout=120, hang_timeout=60)


@pytest.fixture(scope="module")
def one() -> dict[str, Any]:
    return launch(_all_checks, nprocs=1)


# -- ddpkit.print -------------------------------------------------------------------------
def test_print_once_or_on_every_rank_with_its_prefix(two: dict[str, Any]) -> None:
    rank0, rank1 = two["prints"]
    assert rank0 == "hello 1\n[rank 0] each\n[rank 0] a\n[rank 0] b!\nno-ctx\n"
    assert rank1 == "[rank 1] each\n[rank 1] a\n[rank 1] b!\n"


def test_print_with_one_process(one: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert one["prints"] == ["hello 1\n[rank 0] each\n[rank 0] a\n[rank 0] b!\nno-ctx\n"]
    ddpkit.print("outside", "a job")  # no group at all: the one process prints
    ddpkit.print("too", all_ranks=True)
    assert capsys.readouterr().out == "outside a job\n[rank 0] too\n"


# -- collectives ----------------------------------------------------------------------------
def test_collectives_on_two_ranks(two: dict[str, Any]) -> None:
    c = two["collectives"]
    assert c["rows"] == [[0.0, 0.0], [1.0, 10.0]]  # (world_size, *shape), row r from rank r
    assert c["scalars"] == [0, 1]
    assert c["bools"] == [[True, True], [False, True]]
    assert c["objects"] == [{"rank": 0}, {"rank": 1}]
    assert c["broadcast"] == ["from 1", "from 1"]  # every rank got src's object


def test_collectives_with_one_process_and_without_a_group(one: dict[str, Any]) -> None:
    c = one["collectives"]
    assert c["rows"] == [[0.0, 0.0]] and c["scalars"] == [0]
    assert c["objects"] == [{"rank": 0}] and c["broadcast"] == ["from 0"]
    t = torch.arange(6.0).reshape(2, 3)
    ddpkit.barrier()
    assert torch.equal(all_gather(t), t.unsqueeze(0))
    assert all_gather_object("x") == ["x"]
    sentinel = object()
    assert broadcast_object(sentinel) is sentinel
    assert ddpkit.gather_for_metrics(t) is t
    assert ddpkit.gather_for_metrics((t, t)) == (t, t)


# -- gather_for_metrics -------------------------------------------------------------------
def test_gather_for_metrics_drops_the_samplers_padding_in_order(two: dict[str, Any]) -> None:
    g = two["gathers"]
    for n in (7, 11):
        for b in (2, 3):
            first, second = g[f"plain {n} {b}"]
            assert first == list(range(n)), (n, b)  # each index once, in dataset order
            assert second == list(range(n)), (n, b)  # the count restarts every pass
    # A shuffled sampler: each index once, in the sampler's (seeded) global order.
    for epoch in (0, 2):
        order = torch.randperm(7, generator=torch.Generator().manual_seed(3 + epoch)).tolist()
        assert g[f"shuffled {epoch}"] == order
    assert g["ddpkit train"] == list(range(7))
    assert g["one call"] == list(range(7))


def test_gather_for_metrics_after_a_pass_that_broke_off(two: dict[str, Any]) -> None:
    # No set_epoch between the passes: the new pass is the loader's new iterator.
    for rank, seen in enumerate(two["gathers"]["after a break"]):
        assert set(seen) == {"plain 2", "plain 3", "workers", "ddpkit train"}, rank
        for name, indices in seen.items():
            assert indices == list(range(7)), (rank, name)


def test_gather_for_metrics_with_ddpkits_evaluation_loader(two: dict[str, Any]) -> None:
    g = two["gathers"]
    for key in ("eval 7 2", "eval 11 2", "eval 11 3"):
        n = int(key.split()[1])
        assert sorted(g[key]) == list(range(n)) and len(g[key]) == n, key
    # Shards of 4 and 3 in batches of 3: 2 batches on rank 0, 1 on rank 1. A per-batch
    # gather would wait forever; every rank refuses instead, before any collective.
    assert "rank 0 2 batch(es) but rank 1 only 1" in g["uneven batches"]
    assert "once after it" in g["uneven batches"]
    assert g["ragged"] == [[0, 0], [1, 1], [1, 1]]
    assert g["scalar"] == [0, 1]


def test_gather_for_metrics_with_one_process(one: dict[str, Any]) -> None:
    g = one["gathers"]
    for key, value in g.items():
        if key.startswith(("plain", "eval")):
            passes = value if key.startswith("plain") else [value]
            n = int(key.split()[1])
            assert all(p == list(range(n)) for p in passes), key
    assert g["ddpkit train"] == list(range(7)) and g["one call"] == list(range(7))
    (seen,) = g["after a break"]
    assert len(seen) == 4 and all(v == list(range(7)) for v in seen.values()), seen
    assert g["ragged"] == [[0, 0]] and g["scalar"] == [0]


# -- no_backward_sync and accumulate ------------------------------------------------------
def test_no_backward_sync_skips_the_all_reduce(two: dict[str, Any]) -> None:
    s = two["no_sync"]
    assert s["wrapped"]
    assert s["skipped is local"] and s["skipped differ"]
    assert s["synced same"] and s["synced is mean"]


def test_no_backward_sync_on_a_bare_module(one: dict[str, Any]) -> None:
    s = one["no_sync"]
    assert not s["wrapped"]  # one process: prepare_model returns the bare module
    assert s["skipped is local"] and s["synced same"]
    with no_backward_sync(nn.Linear(2, 1)):  # no DDP, no group: nothing to skip
        pass


def test_accumulate_syncs_once_per_group_and_matches_one_process(
    two: dict[str, Any], one: dict[str, Any]
) -> None:
    a = two["accumulate"]
    assert a["steps"] == [2, 4]  # every 3rd micro-batch, and the short last group
    assert a["differ before sync"] == [True, True, True]  # micro-batches 0, 1, 3 skipped it
    assert a["same at sync"] == [True, True]
    assert a["ranks identical"]
    assert a["max diff to reference"] < 1e-6  # one process, each group as one batch
    b = one["accumulate"]
    assert b["steps"] == [2, 4] and b["max diff to reference"] < 1e-6
    assert torch.allclose(torch.tensor(a["params"]), torch.tensor(b["params"]), atol=1e-6)


def test_accumulation_groups() -> None:
    acc = ddpkit.accumulate(nn.Linear(2, 1), 3, length=7)
    assert [acc.should_step(i) for i in range(7)] == [False, False, True] * 2 + [True]
    assert [acc.group_size(i) for i in range(7)] == [3] * 6 + [1]
    endless = ddpkit.accumulate(nn.Linear(2, 1), 2)
    assert [endless.should_step(i) for i in range(5)] == [False, True, False, True, False]
    assert endless.group_size(4) == 2
    with pytest.raises(ConfigError, match="k >= 1"):
        ddpkit.accumulate(nn.Linear(2, 1), 0)


# -- Precision ------------------------------------------------------------------------------
def _check_precisions(result: dict[str, Any]) -> None:
    expected = {"32": "float32", "32-true": "float32", "bf16": "bfloat16"}
    expected |= {"bf16-mixed": "bfloat16", "16-mixed": "float16"}
    for name, r in result.items():
        assert r["dtypes"] == [f"torch.{expected[name]}"], name
        assert r["losses finite"] and r["ranks identical"], name
        assert r["norms finite"] or r["precision"] == "fp16", name
        assert r["state after load"], name
        assert ("scale" in r["state"]) if r["precision"] == "fp16" else r["state"] == [], name
    assert result["bf16-mixed"]["precision"] == "bf16" and result["32-true"]["precision"] == "32"


def test_precision_on_two_ranks(two: dict[str, Any]) -> None:
    _check_precisions(two["precision"])


def test_precision_with_one_process(one: dict[str, Any]) -> None:
    _check_precisions(one["precision"])


def test_fp16_on_cpu_runs_where_torch_can_and_is_refused_where_it_cannot() -> None:
    cpu = DistContext.single("cpu")
    if FP16_ON_CPU:
        prec = ddpkit.Precision("fp16", cpu)
        assert prec.dtype == torch.float16 and prec.scaler is not None
    else:
        with pytest.raises(ConfigError, match=r"use precision='bf16' on CPU") as info:
            ddpkit.Precision("fp16", cpu)
        assert "\n" not in str(info.value)
    # A device type torch cannot autocast on at all is refused the same way.
    with pytest.raises(ConfigError, match=r"does not work on meta .*use precision='32'"):
        ddpkit.Precision("bf16", DistContext(device=torch.device("meta")))


def test_an_unknown_precision_names_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as info:
        ddpkit.Precision("fp8", DistContext.single("cpu"))
    text = str(info.value)
    assert all(f"'{p}'" in text for p in ("32", "bf16", "fp16", "bf16-mixed", "16-mixed"))
    assert "'fp8'" in text and "\n" not in text


def test_precision_autocast_nests_and_restores() -> None:
    """Precision reuses one torch.autocast across steps; entered twice at once it must
    still leave autocast as it found it."""
    prec = Precision("bf16", DistContext.single("cpu"))
    assert not torch.is_autocast_enabled("cpu")
    with prec.autocast():
        with prec.autocast():
            assert torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")  # the outer one is still open
    assert not torch.is_autocast_enabled("cpu")
    for _ in range(3):  # and again, one after another
        with prec.autocast():
            assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


# -- one rule for ctx ----------------------------------------------------------------------
def test_no_public_helper_needs_ctx() -> None:
    """Every public name that takes `ctx` takes it as an optional argument, with
    DistContext.current() as the default."""
    import inspect

    taking = []
    for name in ddpkit.__all__:
        obj = getattr(ddpkit, name)
        if not callable(obj) or name in ("Trainer", "Job", "DistContext"):
            continue  # the Trainer is given its ctx once; Job is data
        target = obj.__init__ if inspect.isclass(obj) else obj
        params = inspect.signature(target).parameters
        if "ctx" in params:
            taking.append(name)
            assert params["ctx"].default is None, name
    assert len(taking) >= 8, taking


def _without_ctx(ctx: DistContext, folder: str) -> dict[str, Any]:
    """The helpers called without ctx on every rank; they find it themselves."""
    torch.manual_seed(0)
    model = ddpkit.prepare_model(torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.rand(16, 3), torch.rand(16, 1))
    loader = ddpkit.prepare_loader(data, batch_size=4)
    prec = ddpkit.Precision("32")
    with ddpkit.rank_zero_first():
        pass
    for x, y in loader:
        with prec.autocast():
            loss = torch.nn.functional.mse_loss(model(x), y)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad()
    ddpkit.barrier()
    ddpkit.save_state(folder, model=model, optimizer=opt, epoch=1, step=2)
    back = ddpkit.load_state(folder, model=model, optimizer=opt)
    return {
        "sum": ddpkit.reduce_sum(ctx.rank + 1),
        "mean": ddpkit.reduce_mean(float(ctx.rank)),
        "batches": len(loader),
        "wrapped": find_ddp(model) is not None,
        "step": None if back is None else back["step"],
    }


def test_the_helpers_find_ctx_themselves_on_two_ranks(tmp_path: Path) -> None:
    out = launch(_without_ctx, str(tmp_path), nprocs=2)
    assert out == {"sum": 3.0, "mean": 0.5, "batches": 2, "wrapped": True, "step": 2}


# -- gather_for_metrics after a mid-epoch resume --------------------------------------------
def _resumed_gathers(ctx: DistContext, folder: str, stop: int | None, batch: int) -> Any:
    """One epoch over 15 indexed samples in batches of `batch` (DistributedSampler pads
    16 - 15 = 1 repeat), each batch's indices gathered with the loader; saves and stops
    after step `stop`. Then gathers the indices of a 7-sample padded eval loader.
    Returns (trained indices gathered in this run, eval indices), or None when stopped."""
    ddpkit.seed_everything(0)
    model: nn.Module = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.2), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model = ddpkit.prepare_model(model, ctx)
    data = TensorDataset(torch.randn(15, 3), torch.arange(15))
    loader = ddpkit.prepare_loader(data, ctx, batch_size=batch, seed=2)
    eval_set = TensorDataset(torch.randn(7, 3), torch.arange(7))
    evaluation = ddpkit.prepare_loader(DataLoader(eval_set, batch_size=2), ctx)  # padded
    start = ddpkit.load_state(folder, model=model, optimizer=opt, loader=loader)
    start = start or {"epoch": 0, "batch": 0, "step": 0}
    step, trained = start["step"], []
    loader.set_epoch(0)
    for done, (x, index) in enumerate(loader, start=start["batch"] + 1):
        trained += ddpkit.gather_for_metrics(index, loader).tolist()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        step += 1
        if step == stop:
            ddpkit.save_state(folder, model=model, optimizer=opt, loader=loader, epoch=0,
                              batch=done, step=step)  # fmt: skip
            return trained
    seen = [i for _, index in evaluation for i in ddpkit.gather_for_metrics(index, evaluation)]
    return trained, [int(i) for i in seen]


@pytest.mark.parametrize("batch_after", [2, 3])  # the saved batch size, and another
def test_gather_for_metrics_after_a_mid_epoch_resume_drops_the_padding(
    tmp_path: Path, batch_after: int
) -> None:
    _, straight_eval = launch(_resumed_gathers, str(tmp_path / "straight"), None, 2, nprocs=2)
    assert sorted(straight_eval) == list(range(7))
    folder = str(tmp_path / "resumed")
    before = launch(_resumed_gathers, folder, 2, 2, nprocs=2)  # 8 of the 15 samples
    after, resumed_eval = launch(_resumed_gathers, folder, None, batch_after, nprocs=2)
    assert len(before) == 8
    assert sorted(before + after) == list(range(15))  # each once: the padding's repeat dropped
    assert resumed_eval == straight_eval  # the eval set: 7 samples, as without the resume
