"""What `ddpkit run --cpu` costs a CPU job.

The job is written for GPUs as torchrun scripts are (`device = f"cuda:{local_rank}"`
when CUDA is there, else the CPU; every batch moved with `.to(device,
non_blocking=True)`; `DDP(device_ids=...)` on the GPU path; `torch.cuda.synchronize()`
after each step), and the CPU job it is compared with is the same file on its CPU path.
Each contestant runs in its own process, the two alternating:

- one process, CPU time of the training loop, with and without the rehearsal installed
  (`ddpkit.processes.rehearse.install`): the per-step cost, free of machine noise;
- `ddpkit run --nproc 2`, the loop's wall time as the script measures it, with and
  without `--cpu`.

    .venv/bin/python bench/rehearse_cost.py            # about 2 minutes on 2 cores
    .venv/bin/python bench/rehearse_cost.py --markdown

The goal: the rehearsal costs under 2 % of the loop.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flag_cost import ROOT, main, one_process

JOB = """
import os, sys, time, json
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

torch.set_num_threads(1)
steps = int(sys.argv[1])
distributed = "RANK" in os.environ
local_rank = int(os.environ.get("LOCAL_RANK", "0"))
cuda = torch.cuda.is_available()
device = f"cuda:{local_rank}" if cuda else "cpu"
if distributed:
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 10),
).to(device)
if distributed:
    model = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[local_rank] if cuda else None
    )
data = TensorDataset(torch.randn(steps * 32, 256), torch.randint(0, 10, (steps * 32,)))
sampler = DistributedSampler(data) if distributed else None
loader = DataLoader(data, batch_size=32, sampler=sampler, pin_memory=cuda)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
wall, cpu = time.perf_counter(), time.process_time()
for x, y in loader:
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    if cuda:
        torch.cuda.synchronize()
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
if not distributed or dist.get_rank() == 0:
    print("RESULT " + json.dumps({"wall": wall, "cpu": cpu}), flush=True)
if distributed:
    dist.destroy_process_group()
"""


# Per call, what the rehearsal adds to a batch's `.to(device)`: timed over many calls.
CALLS = """
import time, torch
x, calls = torch.ones(32, 256), 100_000
def per_call(device):
    start = time.process_time()
    for _ in range(calls):
        x.to(device, non_blocking=True)
    return (time.process_time() - start) / calls
plain = per_call("cpu")
from ddpkit.processes import rehearse
rehearse.install()
print(per_call("cuda:0") - plain)
"""


def _call_share(script: Path, steps: int) -> float:
    """The rehearsal's work in one step (its two mapped `.to` calls, timed over 100,000
    calls) as a share of one plain step of the job: the cost the noise of whole runs
    hides."""
    out = subprocess.run(
        [sys.executable, "-c", CALLS], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return 2 * float(out.stdout.strip()) / (one_process(script, steps) / steps)


if __name__ == "__main__":
    sys.exit(
        main(
            sys.argv[1:],
            doc=__doc__ or "",
            job=JOB,
            prelude="from ddpkit.processes import rehearse; rehearse.install()\n",
            flag="--cpu",
            share=_call_share,
            share_name="the mapped .to calls alone, per step",
            header="--cpu / plain CPU job",
            goal="under 1.02",
        )
    )
