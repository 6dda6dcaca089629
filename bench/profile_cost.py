"""What `--profile` costs a training loop (`ddpkit run --profile`, `TrainConfig(profile=True)`).

Two measurements, each contestant launched on its own process and alternating (the
harness of `flag_cost.py`, on the MLP job of `audit_cost.py`):

- one process, CPU time of the training loop, with and without the profiler's hooks
  (`ddpkit.inrank.profile.start`): the per-step cost, free of machine noise;
- `ddpkit run --nproc 2`, the loop's wall time as the script measures it, with and
  without `--profile` (the hooks, and each rank's file written every 5 s);

and the hooks' work in one step (a batch fetched, a backward, an optimizer step),
timed over many steps, as a share of one plain step of the job. Off, nothing is
installed: a job without `--profile` runs no code of the profiler.

    .venv/bin/python bench/profile_cost.py            # about 2 minutes on 2 cores
    .venv/bin/python bench/profile_cost.py --markdown

The goal: the profiler costs at most 3 % of the loop.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from audit_cost import JOB
from flag_cost import main, one_process


def _hook_share(script: Path, steps: int) -> float:
    """The profiler's work in one step (timed over 20,000 steps of what its hooks do) as a
    share of one plain step of the job: the cost the noise of whole runs hides."""
    import torch

    from ddpkit.inrank.profile import Profiler

    profiler = Profiler(cuda=False)
    batch = (torch.zeros(32, 256), torch.zeros(32, dtype=torch.long))
    calls = 20_000
    start = time.process_time()
    for _ in range(calls):
        profiler.fetch_ended(profiler.fetch_started(), batch)  # a batch fetched
        profiler.gradients_ready()  # the multi-grad hook, then the end of backward()
        profiler.backward_ended()
        profiler.optimizer_started()  # optimizer.step()'s pre and post hooks
        profiler.optimizer_ended()
    per_step = (time.process_time() - start) / calls
    return per_step / (one_process(script, steps) / steps)


if __name__ == "__main__":
    sys.exit(
        main(
            sys.argv[1:],
            doc=__doc__ or "",
            job=JOB,
            prelude="from ddpkit.inrank import profile; profile.start(cuda=False)\n",
            flag="--profile",
            share=_hook_share,
            share_name="the hooks alone, per step",
            header="profiled / plain",
            goal="at most 1.03",
        )
    )
