"""What does strategy "fsdp" save against "ddp"? Per-rank memory of parameters, gradients
and optimizer state for a model of over 100 M parameters on 2 CPU ranks, and the
FSDP/DDP throughput ratio on the MLP of `bench/peers.py` (256-1024-1024-1024-10).

Memory is counted from the tensors each rank holds after one AdamW step (its local
shards under FSDP), so it is exact and the same on every run: the peak a rank needs
for its training state, without the activations and the one block that FSDP gathers
at a time. Throughput: both strategies train the MLP in the same launch, taking turns
(`--rounds`), so that a noisy machine hits both alike.

    .venv/bin/python bench/fsdp_memory.py            # ~2 min on 2 cores, 3.5 GB RAM
    .venv/bin/python bench/fsdp_memory.py --quick    # a smaller model, seconds

Writes bench/results/fsdp_memory.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ddpkit
from ddpkit import DistContext
from ddpkit.parallel.ranks import all_gather_object

RESULTS = Path(__file__).parent / "results" / "fsdp_memory.json"


def big_model(width: int, depth: int) -> nn.Module:
    """`depth` Linear(width, width) blocks: 4096 x 6 is 100.7 M parameters."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10),
    )  # fmt: skip


def _local_bytes(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "to_local", None)  # a shard of FSDP: what this rank holds
    t = local() if callable(local) else tensor
    return t.numel() * t.element_size()


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(
        _local_bytes(v)
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.ndim > 0
    )
    return {"params": params, "grads": grads, "optimizer": states}


def _prepared(ctx: DistContext, net: nn.Module, strategy: str) -> nn.Module:
    fsdp = {"min_params": 100_000}
    return ddpkit.prepare_model(net, ctx, strategy=strategy, fsdp=fsdp)


def _memory(ctx: DistContext, strategy: str, width: int, depth: int) -> dict[str, Any]:
    model = _prepared(ctx, big_model(width, depth), strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4, width)
    model(x).square().mean().backward()
    opt.step()
    counted = _state_bytes(model, opt)
    total = sum(p.numel() for p in big_model(width, depth).parameters())
    return {"rank": ctx.rank, "model_params": total, **counted}


def _throughput(ctx: DistContext, rounds: int, steps: int) -> dict[str, list[float]]:
    g = torch.Generator().manual_seed(ctx.rank)
    data = [(torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g))]
    contestants = {s: _prepared(ctx, mlp(), s) for s in ("ddp", "fsdp")}
    opts = {s: torch.optim.AdamW(m.parameters(), lr=1e-3) for s, m in contestants.items()}
    rates: dict[str, list[float]] = {"ddp": [], "fsdp": []}
    order = ["ddp", "fsdp"]
    for r in range(rounds + 1):  # round 0 warms up
        for name in order if r % 2 else reversed(order):
            model, opt = contestants[name], opts[name]
            ddpkit.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                x, y = data[0]
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
            ddpkit.barrier()
            if r:
                rates[name].append(steps * 32 * ctx.world_size / (time.perf_counter() - start))
    return rates


def _run(ctx: DistContext, width: int, depth: int, rounds: int, steps: int) -> dict[str, Any]:
    memory = {s: all_gather_object(_memory(ctx, s, width, depth)) for s in ("ddp", "fsdp")}
    return {"memory": memory, "throughput": _throughput(ctx, rounds, steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 6 M-parameter model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    width, depth = (1024, 6) if args.quick else (4096, 6)
    out = ddpkit.launch(_run, width, depth, args.rounds, args.steps, nprocs=2, backend="gloo")
    mib = 2**20
    rows = []
    for strategy in ("ddp", "fsdp"):
        worst = max(out["memory"][strategy], key=lambda r: r["params"] + r["optimizer"])
        rows.append(
            {
                "strategy": strategy,
                "model_params": worst["model_params"],
                "params_mib": worst["params"] / mib,
                "grads_mib": worst["grads"] / mib,
                "optimizer_mib": worst["optimizer"] / mib,
                "params_plus_optimizer_mib": (worst["params"] + worst["optimizer"]) / mib,
            }
        )
    rates = out["throughput"]
    result = {
        "ranks": 2,
        "memory_per_rank": rows,
        "fsdp_over_ddp_memory": rows[1]["params_plus_optimizer_mib"]
        / rows[0]["params_plus_optimizer_mib"],
        "mlp_samples_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "mlp_fsdp_over_ddp_throughput": statistics.median(
            f / d for f, d in zip(rates["fsdp"], rates["ddp"], strict=True)
        ),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"per rank, 2 CPU ranks, a {rows[0]['model_params'] / 1e6:.1f} M-parameter model, AdamW:")
    print("| strategy | parameters | gradients | optimizer state | parameters + optimizer |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['strategy']} | {r['params_mib']:,.0f} MiB | {r['grads_mib']:,.0f} MiB | "
            f"{r['optimizer_mib']:,.0f} MiB | {r['params_plus_optimizer_mib']:,.0f} MiB |"
        )
    print(f"fsdp / ddp memory: {result['fsdp_over_ddp_memory']:.2f}")
    speeds = result["mlp_samples_per_s"]
    print(
        f"MLP throughput: ddp {speeds['ddp']:,.0f}, fsdp {speeds['fsdp']:,.0f} samples/s; "
        f"fsdp / ddp (median of paired rounds): {result['mlp_fsdp_over_ddp_throughput']:.2f}"
    )


if __name__ == "__main__":
    main()
