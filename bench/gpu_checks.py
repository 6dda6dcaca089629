"""What only a GPU can answer, in checks that need torch alone: no pytest, no network and
no installed ddpkit (`PYTHONPATH=src`), as on the GPU machine.

NCCL refuses two ranks on one GPU, so one GPU verifies what it can:

- `nccl_spawn`: one NCCL rank through the real spawn path (TCP store, eager init,
  watchdog, teardown): the worker ends, its GPU memory is freed, and the parent never
  creates a CUDA context; NCCL's own timeout sits below ddpkit's hang timeout.
- `forced_ddp`: one rank that takes every multi-rank path (DDP wrap, SyncBatchNorm,
  checkpoint and resume, eval, `accumulate=2`, `torch.compile` on CUDA): the resumed run
  equals the straight one bit for bit (`deterministic=True`), Adam's `step` stays on the
  CPU after the resume, and a host-sync audit (`torch.cuda.set_sync_debug_mode`) counts
  the syncs per step before and after it.
- `gloo_two_ranks`: two gloo ranks sharing the GPU with CUDA tensors: real two-rank DDP
  and synchronised BatchNorm, equal digests on both ranks, and float64 equivalence with
  one process of double the batch.
- `fsdp_one_rank`: strategy "fsdp" on one rank, a save and a resume.
- `mixed_precision`, `pinned_loader`: bf16 and fp16 (with a GradScaler) learn; pinned
  batches and non-blocking copies are exact.

Each check runs in a fresh interpreter (so that one's CUDA state cannot help or hurt
the next) under its own time limit, and writes OUT/<name>.json; the summary goes to
OUT/checks.json and to stdout:

    PYTHONPATH=src python3 bench/gpu_checks.py --out DIR               # on the GPU
    PYTHONPATH=src python3 bench/gpu_checks.py --out DIR --device cpu  # the same code, CPU
    PYTHONPATH=src python3 bench/gpu_checks.py --out DIR --only nccl_spawn,forced_ddp

With `--device cpu` each check runs its code on the CPU with gloo (and without
`torch.compile`): that is how the tests check this script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.checkpoint.digest import model_digest
from ddpkit.parallel.model import find_ddp, unwrap

Facts = dict[str, Any]


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[str], Facts]  # device type ("cuda" or "cpu") -> facts; raises if wrong
    limit_s: int  # on the GPU, first compile and NCCL start included


def _backend(device: str) -> Literal["nccl", "gloo"]:
    return "nccl" if device == "cuda" else "gloo"


def _gpu_pids() -> list[int] | None:
    """The pids that hold GPU memory now (nvidia-smi), or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return [int(p) for p in out.stdout.split() if p.strip().isdigit()]


def _kind(module: nn.Module) -> str:
    """A BatchNorm layer's class with its module: torch's SyncBatchNorm or ddpkit's."""
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- one NCCL rank through the real spawn path ----------------------------------------
def _spawned_rank(ctx: ddpkit.DistContext) -> Facts:
    t = torch.full((1,), 3.0, device=ctx.device)
    dist.all_reduce(t)
    model = ddpkit.prepare_model(nn.Linear(8, 2), ctx)
    return {
        "pid": os.getpid(),
        "backend": str(dist.get_backend()),
        "device": str(ctx.device),
        "current_device": torch.cuda.current_device() if ctx.device.type == "cuda" else None,
        "sum": t.item(),
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "NCCL_"))},
    }


def check_nccl_spawn(device: str) -> Facts:
    hang_timeout = 60.0
    out = ddpkit.launch(
        _spawned_rank,
        nprocs=1,
        backend=_backend(device),
        start="spawn",
        hang_timeout=hang_timeout,
        timeout=120.0,
    )
    assert out["pid"] != os.getpid(), "nprocs=1 with start='spawn' ran in the parent"
    assert out["sum"] == 3.0 and out["backend"] == _backend(device), out
    assert out["param_devices"] == [out["device"]], out
    assert not _alive(out["pid"]), "the worker still runs after launch returned"
    facts: Facts = {**out, "parent_cuda_initialised": torch.cuda.is_initialized()}  # type: ignore[no-untyped-call]
    assert not facts["parent_cuda_initialised"], "launch created a CUDA context in the parent"
    if device == "cuda":  # NCCL's watchdog dumps its flight recorder on a timeout
        assert out["nccl_env"].get("TORCH_NCCL_DUMP_ON_TIMEOUT") == "1", out["nccl_env"]
    pids = _gpu_pids()
    if device == "cuda" and pids is not None:
        facts["gpu_pids_after"] = pids
        assert out["pid"] not in pids, "the worker's GPU memory was not freed"
    return facts


# -- one rank that takes every multi-rank path ------------------------------------------
@dataclass(frozen=True)
class _Forced(ddpkit.DistContext):
    """A one-rank context that says it is distributed, so that the Trainer wraps the
    model in DDP, converts BatchNorm and runs every collective, on one GPU."""

    @property
    def distributed(self) -> bool:
        return dist.is_initialized()


def _small_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    )


def _images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
    )


def _forced_fit(ctx: ddpkit.DistContext, folder: str, epochs: int, resume: bool) -> Facts:
    forced = _Forced(**{k: getattr(ctx, k) for k in ctx.__dataclass_fields__})
    ddpkit.seed_everything(0)
    model = _small_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ddpkit.TrainConfig(
        epochs=epochs,
        batch_size=16,
        accumulate=2,
        checkpoint_dir=folder,
        resume=resume,
        deterministic=True,
        compile=ctx.device.type == "cuda",
        progress=False,
    )
    syncs: list[int] = []
    caught: list[warnings.WarningMessage] = []

    class Audit(ddpkit.Callback):
        """Every host sync inside a step warns (on CUDA): counted per step."""

        def on_step_end(self, trainer: Any, step: int) -> None:
            syncs.append(len(caught))
            caught.clear()

    trainer = ddpkit.Trainer(
        model,
        opt,
        _images(256, 1),
        forced,
        config,
        eval_set=_images(64, 2),
        callbacks=[Audit()] if ctx.device.type == "cuda" else [],
        log_fn=lambda s: None,
    )
    if ctx.device.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        caught = recorded
        trainer.fit()
    if ctx.device.type == "cuda":
        torch.cuda.set_sync_debug_mode("default")
    steps_on = sorted(
        {str(s["step"].device) for s in trainer.optimizer.state.values() if "step" in s}
    )
    bn = sorted(
        {_kind(m) for m in unwrap(trainer.model).modules() if "BatchNorm" in type(m).__name__}
    )
    return {
        "digest": model_digest(trainer.model),
        "ddp": find_ddp(trainer.model) is not None,
        "batchnorm": bn,
        "step_devices": steps_on,
        "syncs_per_step": syncs,
    }


def check_forced_ddp(device: str) -> Facts:
    backend = _backend(device)
    with tempfile.TemporaryDirectory(prefix="ddpkit-gpu-check-") as tmp:
        straight = ddpkit.launch(_forced_fit, f"{tmp}/a", 4, False, nprocs=1, backend=backend)
        ddpkit.launch(_forced_fit, f"{tmp}/b", 2, False, nprocs=1, backend=backend)
        resumed = ddpkit.launch(_forced_fit, f"{tmp}/b", 4, True, nprocs=1, backend=backend)
    facts = {"straight": straight, "resumed": resumed}
    assert straight["ddp"] and resumed["ddp"], "one forced rank was not wrapped in DDP"
    assert straight["digest"] == resumed["digest"], "the resumed run differs from the straight one"
    assert resumed["step_devices"] in ([], ["cpu"]), "Adam's step left the CPU on resume"
    if straight["syncs_per_step"] and resumed["syncs_per_step"]:
        # The resumed steps may not sync more often than the straight run's last steps.
        assert max(resumed["syncs_per_step"][1:] or [0]) <= max(
            straight["syncs_per_step"][1:] or [0]
        ), facts
    return facts


# -- two gloo ranks sharing one GPU -------------------------------------------------------
_STEPS, _BATCH = 3, 8  # optimizer steps; samples per rank and step


def _tabular(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 12, generator=g, dtype=torch.float64)
    return x, (x[:, :3].sum(dim=1, keepdim=True) > 0).to(torch.float64)


def _mlp() -> nn.Module:
    torch.manual_seed(0)  # the same weights in every process
    return nn.Sequential(
        nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)
    ).double()


def _steps(model: nn.Module, device: torch.device, rows: Callable[[int], slice]) -> None:
    x, y = _tabular(_STEPS * 2 * _BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(_STEPS):
        part = rows(step)
        loss = nn.functional.binary_cross_entropy_with_logits(
            model(x[part].to(device)), y[part].to(device)
        )
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()


def _gloo_rank(ctx: ddpkit.DistContext, device: str) -> Facts:
    here = ddpkit.DistContext(
        ctx.rank,
        ctx.local_rank,
        ctx.world_size,
        ctx.local_world_size,
        torch.device(device, 0) if device == "cuda" else torch.device("cpu"),
        "gloo",
    )
    model = ddpkit.prepare_model(_mlp(), here)  # DDP over gloo, BatchNorm synchronised
    r = ctx.rank
    _steps(
        model,
        here.device,
        lambda s: slice(s * 2 * _BATCH + r * _BATCH, s * 2 * _BATCH + (r + 1) * _BATCH),
    )
    bare = unwrap(model)
    digests: list[str] = [""] * ctx.world_size
    dist.all_gather_object(digests, model_digest(bare))
    return {
        "digests": digests,
        "batchnorm": sorted({_kind(m) for m in bare.modules() if "BatchNorm" in type(m).__name__}),
        "param_device": str(next(bare.parameters()).device),
        "state": {k: v.cpu() for k, v in bare.state_dict().items()},
    }


def check_gloo_two_ranks(device: str) -> Facts:
    out = ddpkit.launch(_gloo_rank, device, nprocs=2, backend="gloo")
    one = _mlp().to("cuda:0" if device == "cuda" else "cpu")
    _steps(
        one, next(one.parameters()).device, lambda s: slice(s * 2 * _BATCH, (s + 1) * 2 * _BATCH)
    )
    worst = 0.0
    for name, value in one.state_dict().items():
        if value.is_floating_point():
            worst = max(worst, (value.cpu() - out["state"][name]).abs().max().item())
    facts = {k: v for k, v in out.items() if k != "state"}
    facts["max_abs_diff_vs_one_process"] = worst
    assert len(set(out["digests"])) == 1, "the two ranks' models differ"
    assert out["param_device"].startswith(device), out["param_device"]
    assert worst < 1e-10, f"two ranks differ from one process of double the batch by {worst}"
    return facts


# -- FSDP on one rank ----------------------------------------------------------------------
def _fsdp_fit(ctx: ddpkit.DistContext, folder: str, epochs: int, resume: bool) -> Facts:
    ddpkit.seed_everything(0)
    model = nn.Sequential(
        nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2)
    )
    x, y = _tabular(256)
    config = ddpkit.TrainConfig(
        epochs=epochs,
        batch_size=32,
        strategy="fsdp",
        checkpoint_dir=folder,
        resume=resume,
        progress=False,
    )
    trainer = ddpkit.Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=1e-3),
        TensorDataset(x.float(), y.long().squeeze(1)),
        ctx,
        config,
        log_fn=lambda s: None,
    )
    result = trainer.fit()
    return {"digest": model_digest(trainer.model), "loss": result.final_loss}


def check_fsdp_one_rank(device: str) -> Facts:
    from ddpkit.parallel.fsdp import cpu_supported

    if device == "cpu" and not cpu_supported():
        return {"skipped": f"FSDP2 does not run on CPU with torch {torch.__version__}"}
    backend = _backend(device)
    with tempfile.TemporaryDirectory(prefix="ddpkit-gpu-check-") as tmp:
        straight = ddpkit.launch(_fsdp_fit, f"{tmp}/a", 3, False, nprocs=1, backend=backend)
        ddpkit.launch(_fsdp_fit, f"{tmp}/b", 1, False, nprocs=1, backend=backend)
        resumed = ddpkit.launch(_fsdp_fit, f"{tmp}/b", 3, True, nprocs=1, backend=backend)
    assert torch.isfinite(torch.tensor(straight["loss"])), straight
    assert straight["digest"] == resumed["digest"], "the resumed FSDP run differs"
    return {"straight": straight, "resumed": resumed}


# -- precision and pinned memory -----------------------------------------------------------
def _precision_fit(ctx: ddpkit.DistContext, precision: str) -> Facts:
    ddpkit.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=g)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    losses: list[float] = []

    class Losses(ddpkit.Callback):
        def on_epoch_end(self, trainer: Any, epoch: int, metrics: dict[str, float]) -> None:
            losses.append(metrics["loss"])

    trainer = ddpkit.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True)),
        ctx,
        ddpkit.TrainConfig(epochs=6, batch_size=32, precision=precision, progress=False),  # type: ignore[arg-type]
        loss_fn=nn.functional.mse_loss,
        callbacks=[Losses()],
        log_fn=lambda s: None,
    )
    trainer.fit()
    return {
        "losses": losses,
        "device": str(next(trainer.model.parameters()).device),
        "scale": trainer.precision.scaler.get_scale() if trainer.precision.scaler else None,
    }


def check_mixed_precision(device: str) -> Facts:
    facts: Facts = {}
    for precision in ("bf16", "fp16"):
        if device == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
            facts[precision] = "skipped: this GPU has no bf16"
            continue
        if device == "cpu" and precision == "fp16":
            continue  # fp16 autocast with a GradScaler is a GPU feature
        out = ddpkit.launch(_precision_fit, precision, nprocs=1, backend=_backend(device))
        losses = out["losses"]
        assert all(torch.isfinite(torch.tensor(losses))), out
        assert losses[-1] < 0.5 * losses[0], f"{precision} did not learn: {losses}"
        if precision == "fp16":
            assert out["scale"] is not None and 0 < out["scale"] < float("inf"), out
        facts[precision] = out
    return facts


def check_pinned_loader(device: str) -> Facts:
    ctx = ddpkit.DistContext.single("cuda:0" if device == "cuda" else "cpu")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    loader = ddpkit.prepare_loader(data, ctx, batch_size=16)
    assert loader.pin_memory == (device == "cuda"), loader.pin_memory
    for x, y in loader:
        xg, yg = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        if device == "cuda":
            assert x.is_pinned() and y.is_pinned()
            torch.cuda.synchronize()
        assert torch.equal(xg.cpu(), x) and torch.equal(yg.cpu(), y)
    return {"pin_memory": loader.pin_memory}


CHECKS = [
    Check("nccl_spawn", check_nccl_spawn, 120),
    Check("forced_ddp", check_forced_ddp, 180),
    Check("gloo_two_ranks", check_gloo_two_ranks, 120),
    Check("fsdp_one_rank", check_fsdp_one_rank, 120),
    Check("mixed_precision", check_mixed_precision, 90),
    Check("pinned_loader", check_pinned_loader, 60),
]


# -- running them -------------------------------------------------------------------------
def run_one(name: str, device: str, out: Path) -> int:
    """Run check `name` in this process and write OUT/<name>.json; 0 if it passed."""
    check = next(c for c in CHECKS if c.name == name)
    start = time.perf_counter()
    try:
        record: Facts = {"ok": True, "facts": check.run(device)}
    except Exception as exc:
        record = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "trace": traceback.format_exc(),
        }
    record.update(name=name, device=device, seconds=round(time.perf_counter() - start, 1))
    (out / f"{name}.json").write_text(json.dumps(record, indent=2, default=str))
    return 0 if record["ok"] else 1


def run_all(names: list[str], device: str, out: Path, budget_s: float) -> Facts:
    """Each check in a fresh interpreter, under its time limit and the overall budget."""
    results: Facts = {}
    deadline = time.monotonic() + budget_s
    for check in (c for c in CHECKS if c.name in names):
        left = deadline - time.monotonic()
        if left < 10:
            results[check.name] = {"ok": False, "error": "not run: the time budget was spent"}
            continue
        limit = min(check.limit_s, left)
        start = time.perf_counter()
        cmd = [sys.executable, __file__, "--device", device, "--out", str(out), "--run", check.name]
        try:
            with open(out / f"{check.name}.log", "w") as log:
                subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit, check=False
                )
        except subprocess.TimeoutExpired:
            results[check.name] = {"ok": False, "error": f"timed out after {limit:.0f} s"}
            continue
        path = out / f"{check.name}.json"
        if path.exists():
            record = json.loads(path.read_text())
            results[check.name] = {k: record[k] for k in ("ok", "seconds", "error") if k in record}
        else:
            results[check.name] = {
                "ok": False,
                "error": f"ended without a report after {time.perf_counter() - start:.0f} s "
                f"(see {check.name}.log)",
            }
        print(
            f"gpu_checks: {check.name}: {'ok' if results[check.name]['ok'] else 'FAILED'}",
            file=sys.stderr,
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON reports")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--only", help="comma-separated check names (default: all)")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all checks")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one check, in this process
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run:
        return run_one(args.run, args.device, args.out)
    known = [c.name for c in CHECKS]
    names = known if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown check {', '.join(unknown)}: choose from {', '.join(known)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_checks: torch {torch.__version__} sees no CUDA GPU: pass --device cpu",
            file=sys.stderr,
        )
        return 2
    results = run_all(names, args.device, args.out, args.budget)
    summary = {
        "device": args.device,
        "ok": all(r["ok"] for r in results.values()),
        "checks": results,
    }
    (args.out / "checks.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
