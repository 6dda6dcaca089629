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

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

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


def _result(output: str) -> dict[str, float]:
    for line in output.splitlines():
        _, found, result = line.partition("RESULT ")  # after `[rank 0] ` under ddpkit run
        if found:
            return dict(json.loads(result))
    raise RuntimeError(f"the job printed no result:\n{output[-2000:]}")


def _one_process(script: Path, steps: int, rehearsed: bool) -> float:
    """CPU seconds of the loop in one fresh process, the rehearsal installed or not."""
    prelude = "from ddpkit.processes import rehearse; rehearse.install()\n" if rehearsed else ""
    code = prelude + f"import sys; sys.argv = ['job', '{steps}']\n" + script.read_text()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return _result(out.stdout)["cpu"]


def _two_ranks(script: Path, steps: int, rehearsed: bool) -> float:
    """Wall seconds of rank 0's loop under `ddpkit run --nproc 2` (with --cpu or not)."""
    command = [sys.executable, "-m", "ddpkit", "run", "--nproc", "2"]
    if rehearsed:
        command.append("--cpu")
    out = subprocess.run(
        [*command, str(script), str(steps)],
        capture_output=True,
        text=True,
        check=True,
        cwd=script.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return _result(out.stdout)["wall"]


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
    per_step = _one_process(script, steps, rehearsed=False) / steps
    return 2 * float(out.stdout.strip()) / per_step


def _ratios(
    measure: Callable[[Path, int, bool], float], script: Path, steps: int, rounds: int
) -> list[float]:
    ratios = []
    for i in range(rounds):
        # Alternate which goes first, so that a slow spell of the machine hits both.
        order = (False, True) if i % 2 == 0 else (True, False)
        times = {rehearsed: measure(script, steps, rehearsed) for rehearsed in order}
        ratios.append(times[True] / times[False])
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=5, help="alternating pairs per row")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(JOB, encoding="utf-8")
        started = time.perf_counter()
        rows = {
            "1 process, loop CPU time": _ratios(_one_process, script, args.steps, args.rounds),
            "ddpkit run --nproc 2, loop wall time": _ratios(
                _two_ranks, script, args.steps, max(3, args.rounds // 2 + 1)
            ),
        }
        share = _call_share(script, args.steps)
    if args.markdown:
        print("| measurement | --cpu / plain CPU job, median | spread |")
        print("|---|---|---|")
        print(f"| the mapped .to calls alone, per step | {1 + share:.5f} | (timed, not noisy) |")
    else:
        print(f"{'the mapped .to calls alone, per step':40} {1 + share:.5f}")
    for name, ratios in rows.items():
        median = statistics.median(ratios)
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        if args.markdown:
            print(f"| {name} | {median:.3f} | {spread} |")
        else:
            print(f"{name:40} {median:.3f} (spread {spread}, {len(ratios)} pairs)")
    print(f"({time.perf_counter() - started:.0f} s; goal: under 1.02)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
