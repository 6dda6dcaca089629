"""What `ddpkit run`'s control plane costs as ranks grow: 2, 8 and 32 ranks on this
machine (oversubscribed past its cores, as `--allow-oversubscribe` allows).

For each rank count, a torchrun-style script (DDP over a Linear(8, 1), 200 steps) runs
under `ddpkit run` with the hang watch on (the default) and off (`--hang-timeout 0`),
alternating, `--rounds` times each. Measured:

- time to first step: from just before the command starts to rank 0's first
  `optimizer.step()`;
- the control plane's seconds per step: (the loop's wall time with the watch, minus
  without) / steps, on rank 0: each rank's watch thread samples its main thread and
  writes its report every second;
- the hang watch's report: bytes per rank per second (its JSON, written once a second),
  and what the rendezvous store carries on several nodes, where every rank publishes its
  report there and every node's watch reads every rank's: computed for 1,024 and 8,192
  ranks, 8 per node, from the measured size.

    .venv/bin/python bench/many_ranks.py            # about 8 minutes on 2 cores
    .venv/bin/python bench/many_ranks.py --ranks 2,8,32 --rounds 2   # the tables, markdown
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 200
JOB = """
import json, os, sys, time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
first = None
start = time.perf_counter()
for step in range(int(sys.argv[1])):
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    if first is None:
        first = time.time() - float(os.environ["BENCH_T0"])
        start = time.perf_counter()  # the loop's time: after the first step
wall = time.perf_counter() - start
report = Path(os.environ.get("DDPKIT_STATUS_DIR", "/nonexistent")) / "attempt0" / "rank0.json"
size = report.stat().st_size if report.exists() else 0
if rank == 0:
    print("RESULT " + json.dumps({"first": first, "wall": wall, "report": size}), flush=True)
dist.destroy_process_group()
"""


def _once(script: Path, ranks: int, watch: bool) -> dict[str, float]:
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc", str(ranks)]
    command += ["--allow-oversubscribe"] + ([] if watch else ["--hang-timeout", "0"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_T0": str(time.time())}
    out = subprocess.run(
        [*command, str(script), str(STEPS)], capture_output=True, text=True, env=env, check=True
    )
    for line in out.stdout.splitlines():
        _, found, text = line.partition("RESULT ")
        if found:
            return dict(json.loads(text))
    raise RuntimeError(f"no result:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", default="2,8,32", help="rank counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, watch on and off")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(JOB)
        for ranks in (int(r) for r in args.ranks.split(",")):
            runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
            for i in range(args.rounds):
                for watch in (True, False) if i % 2 == 0 else (False, True):
                    runs[watch].append(_once(script, ranks, watch))
                    print(f"  {ranks} ranks, watch {'on' if watch else 'off'}: {runs[watch][-1]}")
            first = statistics.median(r["first"] for r in runs[True])
            on = statistics.median(r["wall"] for r in runs[True])
            off = statistics.median(r["wall"] for r in runs[False])
            size = max(r["report"] for r in runs[True])
            rows.append((ranks, first, on / STEPS, (on - off) / STEPS, size))
    print("| ranks | to first step, s | s per step | control plane, ms/step | report B/rank/s |")
    print("|--:|--:|--:|--:|--:|")
    for ranks, first, step, plane, size in rows:
        print(f"| {ranks} | {first:.1f} | {step:.4f} | {1000 * plane:.2f} | {size} |")
    size = max(row[4] for row in rows)
    print("\nThe rendezvous store with several nodes (8 ranks per node), from the report size:")
    print("| ranks | nodes | written, MB/s | read by every node's watch, MB/s |")
    print("|--:|--:|--:|--:|")
    for ranks in (1024, 8192):
        nodes = ranks // 8
        print(
            f"| {ranks} | {nodes} | {ranks * size / 1e6:.1f} | {nodes * ranks * size / 1e6:,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
