"""What `ddpkit run --audit` costs a training loop.

Two measurements, each contestant launched on its own process and alternating:

- one process, CPU time of the training loop of an MLP, with and without the audit's
  hooks installed (`ddpkit.inrank.audit.install`): the per-step cost, free of
  machine noise;
- `ddpkit run --nproc 2`, the loop's wall time as the script measures it, with and
  without `--audit` (the hooks, and the weights hashed once at the end, outside the
  loop).

    .venv/bin/python bench/audit_cost.py            # about 2 minutes on 2 cores
    .venv/bin/python bench/audit_cost.py --markdown

The goal: the audit costs at most 1 % of the loop.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from flag_cost import main, one_process

JOB = """
import os, sys, time, json
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)
steps = int(sys.argv[1])
distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 10),
)
if distributed:
    model = torch.nn.parallel.DistributedDataParallel(model)
data = TensorDataset(torch.randn(steps * 32, 256), torch.randint(0, 10, (steps * 32,)))
sampler = DistributedSampler(data) if distributed else None
loader = DataLoader(data, batch_size=32, sampler=sampler)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
wall, cpu = time.perf_counter(), time.process_time()
for x, y in loader:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
if not distributed or dist.get_rank() == 0:
    print("RESULT " + json.dumps({"wall": wall, "cpu": cpu}), flush=True)
if distributed:
    dist.destroy_process_group()
"""


def _hook_share(script: Path, steps: int) -> float:
    """The audit's work per optimizer step (its step hook, timed over 100,000 calls)
    as a share of one plain step of the job: the cost the noise of whole runs hides."""
    import torch

    from ddpkit.inrank.audit import _Recorder

    recorder = _Recorder(0)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    recorder.on_step(optimizer, (), {})  # the first step records; the others look up
    calls = 100_000
    start = time.process_time()
    for _ in range(calls):
        recorder.on_step(optimizer, (), {})
    per_call = (time.process_time() - start) / calls
    return per_call / (one_process(script, steps) / steps)


if __name__ == "__main__":
    sys.exit(
        main(
            sys.argv[1:],
            doc=__doc__ or "",
            job=JOB,
            prelude="from ddpkit.inrank import audit; audit.install(0)\n",
            flag="--audit",
            share=_hook_share,
            share_name="the step hook alone, per step",
            header="audited / plain",
            goal="at most 1.01",
        )
    )
