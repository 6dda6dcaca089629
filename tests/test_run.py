"""`ddpkit run`: scripts under torchrun's elastic agent, crash reports, hang diagnosis."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddpkit.errors import ConfigError
from tests.conftest import ROOT, run_cli, wait_for_files, wait_gone

PIDS = """
import os
from pathlib import Path
rank = int(os.environ["RANK"])
Path(os.environ["PID_DIR"], f"{rank}.pid").write_text(str(os.getpid()))
"""

CRASH = (
    PIDS
    + """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if rank == 1:
    raise ValueError("rank one is broken")
dist.barrier()  # rank 0 would wait here forever
dist.destroy_process_group()
"""
)

# A collective under a rank check (`ddpkit check`'s DDP106). Rank 0 waits in the barrier,
# rank 1 in the next all_reduce; neither ever returns.
HANG = (
    PIDS
    + """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
for step in range(10**9):
    dist.all_reduce(t)  # line 11
    if rank == 0 and step == 3:
        dist.barrier()  # line 13
"""
)

SLEEP = (
    PIDS
    + """
import time
time.sleep(300)
"""
)

# A Trainer job that resumes from its checkpoints; on the first attempt rank 1 kills
# itself with SIGKILL in the middle of epoch 4 (after 3 checkpoints).
ELASTIC = """
import os, signal, sys
import torch
from torch import nn
import ddpkit
from ddpkit.checkpoint.digest import model_digest
from ddpkit.examples.linear import dataset

def main(ctx, folder, kill):
    ddpkit.seed_everything(0)
    model = nn.Linear(20, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    calls = 0

    def loss_fn(out, target):
        nonlocal calls
        calls += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if kill and first_attempt and ctx.rank == 1 and calls == 3 * 32 + 10:
            os.kill(os.getpid(), signal.SIGKILL)
        return nn.functional.mse_loss(out, target)

    config = ddpkit.TrainConfig(epochs=6, checkpoint_dir=folder, resume=True)
    trainer = ddpkit.Trainer(model, opt, dataset(), ctx, config, loss_fn=loss_fn,
                             log_fn=lambda s: None)
    fit = trainer.fit()
    return model_digest(trainer.model), fit.global_step

if __name__ == "__main__":
    digest, steps = ddpkit.launch(main, sys.argv[1], sys.argv[2] == "kill")
    if os.environ["RANK"] == "0":
        print(json.dumps({"digest": digest, "steps": steps}))
""".replace("import os, signal, sys", "import json, os, signal, sys")


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _bare_lines(stdout: str) -> list[str]:
    """The lines the ranks printed, without the `[rank N] ` that ddpkit run puts first."""
    return [re.sub(r"^\[rank \d+\] ", "", line) for line in stdout.splitlines()]


def _pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in tmp_path.glob("*.pid")]


def test_a_crashing_rank_is_named_with_its_traceback(tmp_path: Path) -> None:
    script = _script(tmp_path, "crash.py", CRASH)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    start = time.monotonic()
    out = run_cli(
        "run", "--nproc", "2", str(script), env={"PID_DIR": str(tmp_path), "TMPDIR": str(scratch)}
    )
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    tail = out.stderr.strip().splitlines()[-7:]
    text = "\n".join(tail)
    assert "rank 1 failed first: ValueError: rank one is broken" in text
    assert 'raise ValueError("rank one is broken")' in text
    assert tail[-2].startswith(
        "ddpkit: the job failed: rank 1 raised ValueError and exited with code 1"
    )
    # One traceback, the user's frames only, and none of torch's agent log lines.
    assert out.stderr.count("Traceback") == 1, out.stderr
    for plumbing in ("shim.py", "runpy", "watchdog.py", "Sending process", "exitcode"):
        assert plumbing not in out.stderr, out.stderr
    # Every rank's whole output is kept, in a folder the last line names.
    (kept,) = scratch.glob("ddpkit-failed-run-*")
    assert tail[-1] == f"ddpkit: every rank's output, with its whole traceback: {kept}/rank<N>.log"
    assert sorted(p.name for p in kept.iterdir()) == ["rank0.log", "rank1.log"]
    assert "shim.py" in (kept / "rank1.log").read_text()  # whole: ddpkit's frames too
    assert "ValueError: rank one is broken" in (kept / "rank1.log").read_text()
    assert elapsed < 60
    pids = _pids(tmp_path)
    assert len(pids) == 2 and wait_gone(pids, within=5) == []


# Rank 1 fails while it starts; torchrun then stops rank 0 with SIGTERM.
EARLY_CRASH = """
import os, time
if os.environ["RANK"] == "1":
    raise ValueError("rank one is broken")
time.sleep(30)
"""


def test_the_rank_that_failed_is_blamed_not_the_rank_torchrun_stopped(tmp_path: Path) -> None:
    # torch stamps the stopped rank's failure in whole seconds, which used to sort it
    # before the real error (4 runs in 5 blamed rank 0).
    script = _script(tmp_path, "early.py", EARLY_CRASH)
    for _ in range(2):  # the logs it keeps go to TMPDIR
        out = run_cli("run", "--nproc", "2", str(script), env={"TMPDIR": str(tmp_path)})
        assert out.returncode == 1, out.stderr
        last = out.stderr.strip().splitlines()[-2]
        assert last.startswith("ddpkit: the job failed: rank 1 raised ValueError"), last


# A torchrun-style hand loop, no ddpkit code: DDP with dropout, dict batches, AdamW and
# a scheduler. After its step 3, rank 1 gets a SIGTERM that no supervisor sent (here it
# sends it itself); rank 0 then loses its peer in DDP's gradient all-reduce.
SELF_SIGTERM = (
    PIDS
    + """
import signal
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
torch.manual_seed(3)
net = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.3), nn.Tanh(), nn.Linear(12, 2))
model = nn.parallel.DistributedDataParallel(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
g = torch.Generator().manual_seed(rank)
for step in range(100_000):
    batch = {"x": torch.randn(8, 6, generator=g), "y": torch.randn(8, 2, generator=g)}
    loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    if step == 3 and rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
"""
)


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_nobody_in_ddpkit_sent_is_blamed_first(tmp_path: Path) -> None:
    # Rank 0's "Connection closed by peer" is a consequence; the SIGTERM that ended rank
    # 1 is the cause, though SIGTERM is also how the agent stops the other ranks.
    script = _script(tmp_path, "selfterm.py", SELF_SIGTERM)
    out = run_cli(
        "run", "--nproc", "2", str(script), env={"PID_DIR": str(tmp_path), "TMPDIR": str(tmp_path)}
    )
    assert out.returncode == 1, out.stderr  # as under torchrun: nothing was saved
    said = [line for line in out.stderr.splitlines() if line.startswith("ddpkit: ")]
    assert said and "rank 1" in said[0] and "SIGTERM" in said[0], out.stderr
    assert "rank 0 failed first" not in out.stderr, out.stderr
    assert wait_gone(_pids(tmp_path)) == []


def test_blame_puts_a_signal_the_supervisor_did_not_send_before_a_lost_peer() -> None:
    from ddpkit.processes.report import blame_key

    lost_peer = blame_key(1, "RuntimeError: Connection closed by peer [127.0.0.1]:1", 10.0)
    theirs = blame_key(-signal.SIGTERM, "", 11.0, stopped_by_supervisor=False)
    ours = blame_key(-signal.SIGTERM, "", 9.0, stopped_by_supervisor=True)
    assert theirs < lost_peer < ours
    # Killed by SIGKILL after the supervisor's grace: still the supervisor's doing.
    assert lost_peer < blame_key(-signal.SIGKILL, "", 9.0, stopped_by_supervisor=True)
    # Unknown (launch's supervisor): a stop signal counts as the supervisor's, as before.
    assert lost_peer < blame_key(-signal.SIGTERM, "", 9.0)


def _node(
    rank: int, port: int, script: Path, tmp_path: Path, timeout: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "ddpkit", "run", "--nnodes", "2", "--node-rank", str(rank)),
            *("--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc", "1"),
            *("--rdzv-timeout", timeout, str(script)),
        ],
        env={**os.environ, "PID_DIR": str(tmp_path)},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err and "frame #" not in err, err[-3000:]


def test_node_0_whose_peers_never_join_says_so_in_one_line(tmp_path: Path) -> None:
    script = _script(tmp_path, "sleep.py", SLEEP)
    node = _node(0, _free_port(), script, tmp_path, "3")
    _, err = node.communicate(timeout=60)
    assert node.returncode == 2, err
    _no_traceback(err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("ddpkit: error: the other nodes did not join within 3 s"), last
    assert "--rdzv-timeout" in last


def test_a_node_that_loses_node_0_mid_run_says_so_in_one_line(tmp_path: Path) -> None:
    script = _script(tmp_path, "sleep.py", SLEEP)
    port = _free_port()
    nodes = [_node(r, port, script, tmp_path, "30") for r in (0, 1)]
    try:
        wait_for_files([tmp_path / "0.pid", tmp_path / "1.pid"])
        nodes[0].kill()  # node 0 and its rendezvous store vanish
        _, err = nodes[1].communicate(timeout=90)
    finally:
        for n in nodes:
            n.kill()
            n.communicate()
    assert nodes[1].returncode == 1, err
    _no_traceback(err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("ddpkit: the job failed: lost the rendezvous on node 0"), last
    assert wait_gone(_pids(tmp_path), within=10) == []


@pytest.mark.slow
def test_a_collective_under_a_rank_check_is_diagnosed_as_a_hang(tmp_path: Path) -> None:
    script = _script(tmp_path, "hang.py", HANG)
    start = time.monotonic()
    out = run_cli(
        "run", "--nproc", "2", "--hang-timeout", "10", str(script), env={"PID_DIR": str(tmp_path)}
    )
    elapsed = time.monotonic() - start
    assert out.returncode == 124, out.stderr
    err = out.stderr
    summary = err[err.index("ddpkit: the job is hung") :]
    assert f"rank 0: in barrier (collective #5) at {script}:13" in summary
    assert f"rank 1: in all_reduce (collective #5) at {script}:11" in summary
    assert "rank 0 waits in barrier #5; rank 1 never reached it" in summary
    assert summary.index("Where each rank is") < summary.index("Python stack of rank 0")
    assert elapsed < 10 + 30, f"took {elapsed:.0f}s"
    assert wait_gone(_pids(tmp_path), within=5) == []


@pytest.mark.slow
def test_a_rank_that_ended_its_script_is_described_as_finished(tmp_path: Path) -> None:
    # It used to be shown "at .../ddpkit/_shim.py:40 in main", where the shim waited.
    script = _script(
        tmp_path,
        "ends.py",
        PIDS + "import time\nif rank == 1:\n    time.sleep(10**6)  # never ends\n",
    )
    out = run_cli(
        "run", "--nproc", "2", "--hang-timeout", "5", str(script), env={"PID_DIR": str(tmp_path)}
    )
    assert out.returncode == 124, out.stderr
    summary = out.stderr[out.stderr.index("ddpkit: the job is hung") :]
    assert "rank 0: finished" in summary and "shim.py" not in summary, summary
    idle = f"rank 1: not in a collective: idle (no CPU, no data read) at {script}:8"
    assert idle in summary, summary
    assert wait_gone(_pids(tmp_path), within=5) == []


def test_a_hang_in_a_script_that_saves_on_signals_is_stopped_as_quickly(tmp_path: Path) -> None:
    # Under `ddpkit run`, `launch` runs fn in place and handles SIGTERM to save; a rank
    # blocked in a collective never runs that handler, so the agent's SIGTERM and its
    # 30 s of grace held the job (40 s after the ranks blocked, and silent until then).
    script = _script(
        tmp_path,
        "mismatch.py",
        PIDS
        + """
import torch, torch.distributed as dist, ddpkit
def main(ctx):
    if ctx.rank == 0:
        dist.barrier()
    else:
        dist.all_reduce(torch.ones(1))
ddpkit.launch(main)
""",
    )
    start = time.monotonic()
    out = run_cli(
        "run", "--nproc", "2", "--hang-timeout", "5", str(script), env={"PID_DIR": str(tmp_path)}
    )
    elapsed = time.monotonic() - start
    assert out.returncode == 124, out.stderr
    assert "s in different collectives" in out.stderr, out.stderr
    assert elapsed < 5 + 15, f"took {elapsed:.0f}s"
    assert wait_gone(_pids(tmp_path), within=5) == []


def test_a_rank_that_exits_0_while_another_waits_is_named(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "leaves.py",
        PIDS
        + """
import sys, torch.distributed as dist
dist.init_process_group("gloo")
if rank == 1:
    sys.exit(0)
dist.barrier()  # line 11
""",
    )
    out = run_cli("run", "--nproc", "2", str(script), env={"PID_DIR": str(tmp_path)})
    assert out.returncode == 124, out.stderr
    summary = out.stderr[out.stderr.index("ddpkit: the job is hung") :]
    assert "rank 1 ended while rank 0 waited in a collective" in summary, summary
    assert f"rank 0: in barrier at {script}:11 in <module>" in summary, summary
    assert "rank 1: ended" in summary
    assert "failed first" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("ddpkit: stopped the hung job")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_together(tmp_path: Path) -> None:
    port = str(_free_port())
    common = [
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--nproc",
        "1",
        "-m",
        "ddpkit",
        "train",
        "--example",
        "linear",
        "--epochs",
        "2",
        "--json",
    ]
    cmd = [sys.executable, "-m", "ddpkit", "run"]
    nodes = [
        subprocess.Popen(
            [*cmd, "--node-rank", str(r), *common],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [n.communicate(timeout=180) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    results = [
        json.loads(line) for out, _ in outs for line in _bare_lines(out) if line.startswith("{")
    ]
    assert len(results) == 1  # one job, one result
    alone = json.loads(
        run_cli(
            "train", "--example", "linear", "--epochs", "2", "--nproc", "2", "--json"
        ).stdout.splitlines()[-1]
    )
    assert results[0]["nproc"] == 2
    assert results[0]["model_digest"] == alone["model_digest"]


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_restarted_and_resumes_exactly(tmp_path: Path) -> None:
    script = _script(tmp_path, "elastic.py", ELASTIC)

    def job(folder: str, kill: str) -> dict[str, object]:
        out = run_cli(
            "run", "--nproc", "2", "--max-restarts", "1", str(script), str(tmp_path / folder), kill
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(_bare_lines(out.stdout)[-1])  # type: ignore[no-any-return]

    straight = job("a", "no")
    killed = job("b", "kill")
    assert killed == straight  # same digest, same number of steps
    assert straight["steps"] == 6 * 32


def test_a_finished_run_leaves_nothing_in_the_temp_folder(tmp_path: Path) -> None:
    script = _script(tmp_path, "ok.py", "print('hi')\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = run_cli("run", "--nproc", "2", str(script), env={"TMPDIR": str(scratch)})
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in scratch.iterdir()) == []  # no torchelastic_*/ tree


def test_a_killed_jobs_scratch_folder_is_swept_by_the_next_job(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "PID_DIR": str(tmp_path)}
    job = _script(
        tmp_path,
        "job.py",
        """
        import os, sys, time
        from pathlib import Path
        from ddpkit import launch

        def work(ctx, seconds):
            Path(os.environ["PID_DIR"], f"{ctx.rank}.pid").write_text(str(os.getpid()))
            time.sleep(seconds)

        if __name__ == "__main__":
            launch(work, float(sys.argv[1]), nprocs=2)
        """,
    )
    killed = subprocess.Popen([sys.executable, str(job), "300"], env=env, cwd=ROOT)
    wait_for_files([tmp_path / "0.pid", tmp_path / "1.pid"])
    killed.kill()  # SIGKILL: the parent cannot remove its folder
    killed.wait()
    assert wait_gone(_pids(tmp_path), within=10) == []  # the workers die with it
    assert [p.name for p in scratch.iterdir() if p.name.startswith("ddpkit-")] != []
    subprocess.run([sys.executable, str(job), "0"], env=env, cwd=ROOT, timeout=120, check=True)
    assert sorted(p.name for p in scratch.iterdir()) == []


def _sleeping_job(tmp_path: Path, *, own_group: bool = False) -> subprocess.Popen[str]:
    """`ddpkit run` of SLEEP on 2 ranks, returned once both ranks have started;
    `own_group`: in a process group of its own, as a terminal's job is."""
    script = _script(tmp_path, "sleep.py", SLEEP)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "run", "--nproc", "2", str(script)],
        env={**os.environ, "PID_DIR": str(tmp_path)},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )
    wait_for_files([tmp_path / "0.pid", tmp_path / "1.pid"])
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_ddpkit_run_leaves_no_process(tmp_path: Path, sig: signal.Signals) -> None:
    proc = _sleeping_job(tmp_path)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert wait_gone(_pids(tmp_path)) == []


def test_ctrl_c_stops_every_rank_in_one_line(tmp_path: Path) -> None:
    proc = _sleeping_job(tmp_path, own_group=True)  # the terminal's Ctrl-C reaches all of it
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == "ddpkit: interrupted (Ctrl-C); every worker was stopped\n"
    assert wait_gone(_pids(tmp_path)) == []


def _one_line_error(out: subprocess.CompletedProcess[str], needle: str) -> None:
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddpkit: error:"), out.stderr
    assert needle in lines[0]


def test_bad_input_is_one_clear_line(tmp_path: Path) -> None:
    _one_line_error(run_cli("run", str(tmp_path / "missing.py")), "does not exist")
    _one_line_error(run_cli("run", "-m", "no_such_module_xyz"), "no module named")
    script = _script(tmp_path, "ok.py", "print('hi')\n")
    _one_line_error(run_cli("run", "--nproc", "0", str(script)), "nprocs must be")
    _one_line_error(
        run_cli(
            "run", "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", str(script)
        ),
        "--node-rank must be in [0, 2)",
    )
    start = time.monotonic()
    _one_line_error(
        run_cli(
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            "--rdzv-timeout",
            "2",
            str(script),
        ),
        "cannot reach the master",
    )
    assert time.monotonic() - start < 30


def test_a_clean_script_with_arguments_runs_on_every_rank(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "hello.py",
        """
        import os, sys
        # one write per line, so that the ranks' lines cannot interleave
        line = f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} {sys.argv[1:]}"
        print(f"{line} threads {os.environ['OMP_NUM_THREADS']}", flush=True)
    """,
    )
    out = run_cli("run", "--nproc", "2", str(script), "--lr", "0.1")
    assert out.returncode == 0, out.stderr
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    for rank in (0, 1):
        assert f"rank {rank} of 2 ['--lr', '0.1'] threads {threads}" in out.stdout
    # No process group: N copies of a one-process script. Said, not silent.
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith("ddpkit: warning: no rank called torch.distributed.init_process_group")
    )
    assert "ran as 2 independent copies" in out.stderr


def test_a_script_that_starts_and_ends_its_group_gets_no_warning(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "group.py",
        """
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        dist.destroy_process_group()  # torch forgets the group: the warning must not
        """,
    )
    out = run_cli("run", "--nproc", "2", str(script))
    assert out.returncode == 0, out.stderr
    assert "warning" not in out.stderr, out.stderr


def test_info_describes_this_machine() -> None:
    out = run_cli("info", "--json")
    assert out.returncode == 0, out.stdout
    facts = json.loads(out.stdout)
    assert facts["backends"]["gloo"] is True
    assert facts["default_nproc"] == (
        facts["cpu_cores"] if not facts["gpus"] else len(facts["gpus"])
    )
    assert facts["free_loopback_port"] is True and facts["problems"] == []
    text = run_cli("info").stdout
    assert "backends: gloo" in text and "no problems found" in text


@pytest.mark.slow
def test_rank_0_idle_after_launch_while_the_others_ended_is_not_a_hang(tmp_path: Path) -> None:
    # Under `ddpkit run` ranks 1.. end after `launch`; rank 0 then idles (an upload, a
    # wait) longer than --hang-timeout, with no rank in a collective: nothing is stuck.
    script = _script(
        tmp_path,
        "after.py",
        """
        import time
        import ddpkit

        def work(ctx):
            return ctx.world_size

        if __name__ == "__main__":
            world = ddpkit.launch(work)
            time.sleep(12)
            print("done", world, flush=True)
        """,
    )
    out = run_cli("run", "--nproc", "2", "--hang-timeout", "3", str(script))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[rank 0] done 2"], out.stdout


# -- the script's own flags (issue 42, item 2) ---------------------------------------------

# The DDP tutorial's multigpu_torchrun.py as its author wrote it (CPU ranks: gloo, no
# .to(gpu_id)): ddp_setup(), a Trainer that snapshots, destroy_process_group() at the end,
# and argparse flags; one of them is named like run's own (--nproc: its loader workers).
TORCHRUN_TUTORIAL = """
import argparse, os, sys
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group


def ddp_setup():
    init_process_group(backend="gloo")


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(1)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]
    def __len__(self):
        return len(self.data)
    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self.optimizer.zero_grad()
            F.mse_loss(self.model(source), targets).backward()
            self.optimizer.step()

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                torch.save({"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch},
                           self.snapshot_path)


def main(save_every, total_epochs, batch_size, workers, snapshot_path="snapshot.pt"):
    ddp_setup()
    dataset = MyTrainDataset(32)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers,
                        sampler=DistributedSampler(dataset))
    Trainer(model, loader, optimizer, save_every, snapshot_path).train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int)
    parser.add_argument("--nproc", default=0, type=int, help="data loader workers")
    args = parser.parse_args()
    print(f"rank {os.environ['RANK']} got {sys.argv[1:]}", flush=True)
    main(args.save_every, args.total_epochs, args.batch_size, args.nproc,
         os.path.join(os.path.dirname(__file__), "snapshot.pt"))
"""


@pytest.mark.slow
def test_the_scripts_own_flags_after_audit_go_to_the_script(tmp_path: Path) -> None:
    script = _script(tmp_path, "multigpu_torchrun.py", TORCHRUN_TUTORIAL)
    # --audit takes an optional value: the script's name is not it, nor are the script's
    # flags run's, a flag named like run's own (--nproc) included.
    argv = ["--nproc", "1", "--batch_size", "4", "2", "1"]
    out = run_cli("run", "--nproc", "2", "--audit", str(script), *argv)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):  # 2 ranks: run's --nproc
        assert f"rank {rank} got {argv}" in out.stdout
    assert (tmp_path / "snapshot.pt").is_file()


def test_run_reads_its_options_up_to_the_script_and_gives_the_rest_to_it() -> None:
    from ddpkit.cli.run import parse_options

    def read(*argv: str) -> tuple[object, ...]:
        a = parse_options(list(argv))
        return a.script, a.module, a.args, a.audit, a.nproc

    assert read("--audit", "train.py", "--flag", "x") == (
        "train.py",
        None,
        ["--flag", "x"],
        "report",
        None,  # not given: the platform's (PET_NPROC_PER_NODE), else auto
    )
    assert read("--audit=strict", "train.py", "--lr", "1")[2:4] == (["--lr", "1"], "strict")
    assert read("--audit", "--", "train.py", "--lr", "1")[:4] == (
        "train.py",
        None,
        ["--lr", "1"],
        "report",
    )
    assert read("--npr", "2", "train.py", "--nproc", "3", "-h") == (  # a prefix, as argparse
        "train.py",
        None,
        ["--nproc", "3", "-h"],
        None,
        "2",
    )
    assert read("--audit", "-m", "pkg.train", "--nproc", "3") == (
        None,
        "pkg.train",
        ["--nproc", "3"],
        "report",
        None,  # not given: the platform's (PET_NPROC_PER_NODE), else auto
    )
    assert read("-mpkg.train", "--x")[1:3] == ("pkg.train", ["--x"])
    assert read("train.py", "--", "--x")[2] == ["--", "--x"]  # as python train.py -- --x
    with pytest.raises(ConfigError, match="write --audit=strict"):
        read("--audit", "strict", "train.py")
    with pytest.raises(ConfigError, match="unknown mode"):
        read("--audit=loud", "train.py")


def test_help_and_docs_say_which_port_one_machine_uses() -> None:
    # One machine serves the rendezvous on a port the OS picks (agent.run_script); the
    # help said "default 29500" for it.
    out = run_cli("run", "--help").stdout
    assert "on one machine the OS picks a free port" in " ".join(out.split())
    assert "on one machine the port is the OS's pick" in " ".join(
        (ROOT / "docs" / "run.md").read_text().split()
    )


# -- restarts are said (issue 42, item 6) ------------------------------------------------


@pytest.mark.slow
def test_each_restart_is_said_with_the_failed_rank_and_its_traceback(tmp_path: Path) -> None:
    # A torchrun-style script whose rank 1 fails in the first attempt only (a flaky
    # node): the job recovers, and the console says what failed and where.
    script = _script(
        tmp_path,
        "flaky.py",
        """
        import os
        import torch.distributed as dist

        def load_shard(rank):
            if rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
                raise ValueError("shard 1 is unreadable")
            return rank

        dist.init_process_group("gloo")
        load_shard(dist.get_rank())
        dist.barrier()
        dist.destroy_process_group()
        print("trained", flush=True)
        """,
    )
    out = run_cli("run", "--nproc", "2", "--max-restarts", "2", str(script))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("trained") == 2
    lines = out.stderr.splitlines()
    said = [ln for ln in lines if ln.startswith("ddpkit: attempt")]
    assert said == [
        "ddpkit: attempt 1 failed: rank 1 raised ValueError: shard 1 is unreadable (restart 1 of 2)"
    ], out.stderr
    # The traceback follows the line: the script's frames, down to the raise.
    after = "\n".join(lines[lines.index(said[0]) + 1 :])
    assert "Traceback (most recent call last):" in after
    assert 'raise ValueError("shard 1 is unreadable")' in after
    assert "in load_shard" in after and "shim.py" not in after
