"""What synchronising BatchNorm costs on CPU ranks: ddpkit's exact `SyncBatchNorm`
against plain (per-rank) BatchNorm and against the usual hand-written alternative,
one all-reduce of sums and sums of squares per layer.

Two gloo ranks (one thread each) train the `cnn` workload's model (two conv+BatchNorm
blocks) on the same batch of 32 per rank, DDP-wrapped, in three variants that take
turns in the same processes: `plain` (nn.BatchNorm2d, no synchronisation), `ddpkit`
(SyncBatchNorm: per-rank count, mean and M2 gathered and combined exactly in
float64) and `sums` (the hand-written way: one all_reduce of count, sum and sum of
squares in the forward, one of the two gradient sums in the backward, built on the
same fused ATen kernels as ddpkit's, so only the collective and the arithmetic of the
statistics differ). Medians of interleaved rounds; the result is the time per step and
its ratio to `plain`.

    .venv/bin/python bench/syncbn_cost.py                 # about 1 minute
    .venv/bin/python bench/syncbn_cost.py --rounds 20 --out bench/results/syncbn.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tutorial import cnn_model, ddp_setup, loopback_store

from ddpkit.parallel.syncbn import convert_sync_batchnorm
from ddpkit.processes.workers import exit_now

HERE = Path(__file__).resolve().parent
VARIANTS = ("plain", "ddpkit", "sums")
STEPS = 20  # optimizer steps per round


class _SumsFunction(torch.autograd.Function):
    """BatchNorm over the global batch from all-reduced sums (the hand-written way)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        channels = x.size(1)
        count = x.numel() // channels
        dims = [0, *range(2, x.dim())]
        sums = torch.cat([torch.tensor([float(count)]), x.sum(dims), x.square().sum(dims)])
        dist.all_reduce(sums)
        total = float(sums[0])
        mean = sums[1 : channels + 1] / total
        var = sums[channels + 1 :] / total - mean.square()  # E[x^2] - E[x]^2
        ctx.save_for_backward(x, weight, mean, var)
        ctx.total, ctx.eps = total, eps
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, mean, var = ctx.saved_tensors
        invstd = torch.rsqrt(var + ctx.eps)
        _, sum_gx, sum_g = torch.ops.aten.native_batch_norm_backward(
            grad, x, None, None, None, mean, invstd, True, ctx.eps, [False, True, True]
        )
        both = torch.cat([sum_g, sum_gx])
        dist.all_reduce(both)
        channels = x.size(1)
        mean_g, mean_gx = both[:channels] / ctx.total, both[channels:] / ctx.total
        scale = invstd * weight
        grad_in = F.batch_norm(x, mean, var, -mean_gx * scale, -mean_g * scale, False, 0.0, ctx.eps)
        grad_in.addcmul_(grad, scale.view(1, -1, 1, 1))
        return grad_in, sum_gx, sum_g, None


class _SumsBatchNorm(nn.BatchNorm2d):
    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = _SumsFunction.apply(x, self.weight, self.bias, self.eps)  # type: ignore[no-untyped-call]
        return out


def _model(variant: str) -> nn.Module:
    torch.manual_seed(0)
    model = cnn_model()
    if variant == "ddpkit":
        model, _ = convert_sync_batchnorm(model)
    elif variant == "sums":
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.__class__ = _SumsBatchNorm
    return DDP(model)


def _worker(rank: int, world: int, port: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    ddp_setup(rank, world, port)
    try:
        models = {v: _model(v) for v in VARIANTS}
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(rounds + 1):  # round 0 warms up
            k = r % len(VARIANTS)
            for variant in [*VARIANTS[k:], *VARIANTS[:k]]:
                model = models[variant]
                optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(STEPS):
                    optimizer.zero_grad()
                    F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                    optimizer.step()
                if r:
                    times[variant].append((time.perf_counter() - start) / STEPS)
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's shutdown: gloo's threads can abort it (SIGABRT, "terminate
    # called without an active exception") after a clean run.
    exit_now(0)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench/syncbn_cost.py", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="measured rounds (default 10)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "syncbn.json")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    store = loopback_store(2)
    tmp = args.out.with_suffix(".part")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(2, store.port, args.rounds, str(tmp)), nprocs=2)  # type: ignore[attr-defined,no-untyped-call]
    times = json.loads(tmp.read_text())
    tmp.unlink()
    ms = {v: statistics.median(t) * 1e3 for v, t in times.items()}
    result = {
        "torch": torch.__version__,
        "rounds": args.rounds,
        "steps_per_round": STEPS,
        "ms_per_step": ms,
        "ratio_to_plain": {v: ms[v] / ms["plain"] for v in VARIANTS},
        "ddpkit_over_sums": ms["ddpkit"] / ms["sums"],
        "raw_s_per_step": times,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("variant  ms/step  x plain")
    for v in VARIANTS:
        print(f"{v:<7}  {ms[v]:7.2f}  {ms[v] / ms['plain']:7.2f}")
    print(f"ddpkit / sums: {result['ddpkit_over_sums']:.2f}  (wrote {args.out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
