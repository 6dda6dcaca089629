"""launch(): real spawned workers, real gloo collectives on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpkit import DistContext, launch
from ddpkit.errors import ConfigError, HangError, WorkerError
from ddpkit.processes.machine import threads_per_rank
from ddpkit.versions import release
from tests.conftest import ROOT, pid_alive, run_cli, wait_for_files, wait_gone


def _identity(ctx: DistContext, tag: str) -> dict[str, object]:
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    ranks: list[object] = [None] * ctx.world_size
    dist.all_gather_object(ranks, (ctx.rank, ctx.local_rank, torch.get_num_threads()))
    return {
        "tag": tag,
        "sum": t.item(),
        "ranks": ranks,
        "world": ctx.world_size,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "main": ctx.is_main,
        "port": os.environ.get("MASTER_PORT"),
        "pid": os.getpid(),
    }


def test_launch_returns_rank0_result_and_runs_a_real_group() -> None:
    out = launch(_identity, "x", nprocs=2)
    assert out["tag"] == "x" and out["main"] is True
    assert out["sum"] == 3.0  # 1 + 2: both ranks took part in the all_reduce
    assert out["world"] == 2 and out["backend"] == "gloo" and out["device"] == "cpu"
    # every rank got its own rank and a fair share of the cores (not all of them)
    share = max(1, (len(os.sched_getaffinity(0))) // 2)
    assert out["ranks"] == [(0, 0, share), (1, 1, share)]
    assert out["pid"] != os.getpid()


def test_launch_with_a_shared_file_rendezvous() -> None:
    out = launch(_identity, "file", nprocs=2, init="file")
    assert out["sum"] == 3.0


def test_single_process_runs_in_place_with_a_real_group() -> None:
    out = launch(_identity, "one", nprocs=1)
    assert out["pid"] == os.getpid() and out["sum"] == 1.0 and out["world"] == 1
    assert not dist.is_initialized()  # destroyed again


def test_one_process_with_a_named_start_method_runs_in_a_worker() -> None:
    # How one NCCL rank goes through the real spawn path on one GPU (bench/gpu_checks.py).
    out = launch(_identity, "one", nprocs=1, start="fork")
    assert out["pid"] != os.getpid() and out["sum"] == 1.0 and out["world"] == 1
    assert not dist.is_initialized()


def test_many_single_process_launches_never_deadlock_in_teardown() -> None:
    # torch 2.6's gloo could deadlock in destroy_process_group (its worker thread
    # still releasing an all_gather's tensors needs the GIL that the destructor holds):
    # 3 launches in about 18,000 hung for good here (one of CI's 300 did), so older
    # torch gets many launches. In a child, so a deadlock fails the test.
    launches = 2000 if release(torch.__version__) < (2, 8) else 100
    code = textwrap.dedent(
        f"""
        import torch.distributed as dist
        from ddpkit import launch

        def gather(ctx, i):
            out = [None]
            dist.all_gather_object(out, i)
            return out[0]

        for i in range({launches}):
            assert launch(gather, i, nprocs=1) == i
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _slow_identity(ctx: DistContext, tag: str) -> dict[str, object]:
    time.sleep(1.5)  # so that the two jobs below overlap in time
    return _identity(ctx, tag)


def test_two_jobs_at_once_get_different_ports() -> None:
    results: dict[str, dict[str, object]] = {}

    def job(tag: str) -> None:
        results[tag] = launch(_slow_identity, tag, nprocs=2)

    threads = [threading.Thread(target=job, args=(t,)) for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(results) == {"a", "b"}
    assert results["a"]["port"] != results["b"]["port"]
    assert results["a"]["sum"] == results["b"]["sum"] == 3.0


def _fail_on_rank1(ctx: DistContext, pid_dir: str) -> None:
    Path(pid_dir, f"{ctx.rank}.pid").write_text(str(os.getpid()))
    if ctx.rank == 1:
        time.sleep(0.5)
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait here forever if nobody stopped it


def test_failing_rank_is_named_with_its_traceback_and_nothing_is_left(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(_fail_on_rank1, str(tmp_path), nprocs=2)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "rank one is broken" in str(err)
    assert "_fail_on_rank1" in err.traceback and 'raise ValueError("rank one is broken")' in str(
        err
    )
    # The user's frames only: not those of the machinery that started the worker.
    assert "ddpkit/processes/" not in err.traceback, err.traceback
    assert "ddpkit/inrank/" not in err.traceback, err.traceback
    assert elapsed < 20, f"the blocked rank 0 was not stopped in time ({elapsed:.1f}s)"
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and wait_gone(pids, within=1.0) == []


def _killed(ctx: DistContext) -> None:
    if ctx.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_reported() -> None:
    with pytest.raises(WorkerError, match="rank 0 was killed by SIGKILL") as info:
        launch(_killed, nprocs=2)
    assert info.value.rank == 0 and info.value.exitcode == -signal.SIGKILL


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="nprocs must be"):
        launch(_identity, "x", nprocs=0)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        launch(_identity, "x", nprocs=2, backend="nccl")
    with pytest.raises(ConfigError, match="init must be"):
        launch(_identity, "x", nprocs=2, init="udp")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="module level"):
        launch(lambda ctx: 1, nprocs=2)
    with pytest.raises(ConfigError, match="start must be"):
        launch(_identity, "x", nprocs=2, start="thread")  # type: ignore[arg-type]


def test_launch_takes_its_settings_as_one_launch_config() -> None:
    from ddpkit.processes.config import LaunchConfig

    # Whole, as ddpkit train passes it.
    out = launch(_identity, "whole", config=LaunchConfig(nprocs=1))
    assert out["pid"] == os.getpid() and out["world"] == 1
    # A keyword fills a field the config leaves at its default (a worker, forked) ...
    out = launch(_identity, "both", config=LaunchConfig(nprocs=1), start="fork", nprocs=1)
    assert out["pid"] != os.getpid() and out["sum"] == 1.0
    # ... the config's resolved hang timeout (300 s) is no obstacle to a shorter timeout ...
    assert launch(_identity, "t", config=LaunchConfig(nprocs=1), timeout=60)["world"] == 1
    # ... and one that contradicts a field the config sets is refused, in one line.
    refused = {
        "nprocs=3 disagrees with the LaunchConfig's nprocs=2": ({"nprocs": 2}, {"nprocs": 3}),
        "audit=False disagrees with the LaunchConfig's audit=True": (
            {"audit": True},
            {"audit": False},
        ),
        # a hang timeout the config sets is checked against the timeout given beside it
        "the hang timeout (120 s) must not exceed the collective timeout (60 s)": (
            {"hang_timeout": 120},
            {"timeout": 60},
        ),
        # what only ddpkit run uses means nothing to launch: refused, not ignored
        "launch does not use log_dir='logs'": ({"log_dir": "logs"}, {}),
        "launch does not use cpu=True": ({"cpu": True}, {}),
    }
    for message, (fields, keywords) in refused.items():
        with pytest.raises(ConfigError, match=re.escape(message)) as err:
            launch(_identity, "x", config=LaunchConfig(**fields), **keywords)  # type: ignore[arg-type]
        assert "\n" not in str(err.value), message
    # Each keyword of launch is a field of the config: declared once, there.
    import dataclasses
    import inspect

    keywords = [
        p.name
        for p in inspect.signature(launch).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.name != "config"
    ]
    assert set(keywords) <= {f.name for f in dataclasses.fields(LaunchConfig)}


_START_SCRIPT = textwrap.dedent(
    """
    import threading, time
    import torch
    import ddpkit
    from ddpkit.processes.start import start_method

    def module_name(ctx):
        # A spawned worker re-imports the script as __mp_main__; a forked one is a copy.
        return __name__, torch.get_num_threads()

    if __name__ == "__main__":
        print(start_method(), *ddpkit.launch(module_name, nprocs=2))
        print("forced", *ddpkit.launch(module_name, nprocs=2, start="spawn"))
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        print(start_method(), *ddpkit.launch(module_name, nprocs=2))
    """
)


_EXIT_HOOK_SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys, tempfile
    from pathlib import Path
    import ddpkit

    def write(ctx, folder):
        Path(folder, f"rank{ctx.rank}").write_text("ok")  # the folder must still exist

    if __name__ == "__main__":
        out = Path(sys.argv[1])
        atexit.register(lambda: (out / f"exit-hook-{os.getpid()}").write_text(""))
        with tempfile.TemporaryDirectory() as tmp:
            ddpkit.launch(write, tmp, nprocs=2)  # forked: copies of this process
            ddpkit.launch(write, tmp, nprocs=2)
            print(sorted(os.listdir(tmp)), os.getpid())
    """
)


def test_forked_workers_leave_the_parents_exit_hooks_alone(tmp_path: Path) -> None:
    # A forked worker once ran the parent's exit hooks as it exited, among them the
    # cleanup of the parent's temporary folders: `ddpkit verify` lost its folder.
    script = tmp_path / "job.py"
    script.write_text(_EXIT_HOOK_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    names, pid = out.stdout.rsplit(" ", 1)
    assert names == "['rank0', 'rank1']"
    assert [p.name for p in tmp_path.glob("exit-hook-*")] == [f"exit-hook-{pid.strip()}"]


def test_workers_are_forked_while_that_is_safe_and_spawned_otherwise(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(_START_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    threads = str(threads_per_rank(2))
    # A fresh script that imported torch and started no thread: fork, torch not
    # imported again, and each worker still gets its share of the cores.
    assert out.stdout.splitlines() == [
        f"fork __main__ {threads}",
        f"forced __mp_main__ {threads}",
        # A thread of the user's may hold a lock that a forked copy never gets back:
        # forked from a server that has imported torch and started no thread.
        f"forkserver __mp_main__ {threads}",
    ]


_QUICK_JOBS = textwrap.dedent(
    """
    import sys
    import ddpkit
    from ddpkit.errors import WorkerError

    def at_once(ctx):
        return ctx.rank

    if __name__ == "__main__":
        failed = []
        for _ in range(int(sys.argv[1])):
            try:
                ddpkit.launch(at_once, nprocs=2)
            except WorkerError as exc:
                failed.append(str(exc).splitlines()[0])
        print(len(failed), *failed[:1], sep="\\n")
    """
)


@pytest.mark.slow
def test_a_rank_that_returns_at_once_never_breaks_the_others_join(tmp_path: Path) -> None:
    # gloo's group constructor is no barrier: a rank whose function returned at once
    # could exit while the other rank was still finishing its handshake with it, and
    # that rank then failed with "Connection closed by peer" (once in a CI run; here 8
    # launches in 200 with the CPUs busy). Busy CPUs widen the window.
    script = tmp_path / "quick.py"
    script.write_text(_QUICK_JOBS)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(6)]
    try:
        out = subprocess.run(
            [sys.executable, str(script), "200"], capture_output=True, text=True, timeout=300
        )
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[0] == "0", out.stdout


_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import ddpkit

    def work(ctx, pid_dir):
        Path(pid_dir, f"{ctx.rank}.pid").write_text(str(os.getpid()))
        time.sleep(300)

    if __name__ == "__main__":
        ddpkit.launch(work, sys.argv[1], nprocs=2)
    """
)


def _start_sleeping_job(tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=ROOT)
    files = [tmp_path / "0.pid", tmp_path / "1.pid"]
    wait_for_files(files)
    return proc, [int(f.read_text()) for f in files]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_parent_stops_every_worker(tmp_path: Path, sig: signal.Signals) -> None:
    # SIGINT (Ctrl-C) raises KeyboardInterrupt in the parent, which stops the workers;
    # a bare script has no SIGTERM handler, so there the parent just dies and the
    # kernel must take the workers with it.
    proc, pids = _start_sleeping_job(tmp_path)
    proc.send_signal(sig)
    proc.wait(30)
    assert wait_gone(pids) == []


def test_parent_killed_hard_leaves_no_orphan(tmp_path: Path) -> None:
    proc, pids = _start_sleeping_job(tmp_path)
    proc.kill()
    proc.wait(30)
    assert wait_gone(pids) == []
    assert not any(pid_alive(p) for p in pids)


def test_under_torchrun_env_it_runs_in_place(tmp_path: Path) -> None:
    script = tmp_path / "inplace.py"
    script.write_text(
        textwrap.dedent(
            """
        import os, ddpkit
        def f(ctx):
            return (os.getpid(), ctx.rank, ctx.world_size, ctx.backend)
        if __name__ == "__main__":
            pid, rank, world, backend = ddpkit.launch(f, nprocs=4)
            assert pid == os.getpid(), "spawned instead of running in place"
            print(rank, world, backend)
        """
        )
    )
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
    }
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "gloo"]


def _listening(pids: list[int]) -> list[str]:
    """Local addresses on which any of `pids` listens (from /proc, no tools needed)."""
    inodes: set[str] = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        for fd in fd_dir.iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.append(cols[1])
    return found


def _listeners(ctx: DistContext, parent: int) -> list[str]:
    pids: list[object] = [None] * ctx.world_size
    dist.all_gather_object(pids, os.getpid())
    return _listening([parent, *pids]) if ctx.is_main else []  # type: ignore[list-item]


def test_every_server_of_a_job_listens_on_loopback_only() -> None:
    addresses = launch(_listeners, os.getpid(), nprocs=2)
    assert addresses, "expected the store and gloo to listen somewhere"
    # 0100007F is 127.0.0.1 in /proc's byte order; "*" would be 00000000 / ::.
    assert all(a.split(":")[0] == "0100007F" for a in addresses), addresses


def test_public_names_stay_what_they_are_after_submodules_load() -> None:
    # A submodule named like a function would replace it on the package once imported.
    import importlib
    import pkgutil

    import ddpkit

    for info in pkgutil.walk_packages(ddpkit.__path__, "ddpkit."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    for name in ddpkit.__all__:
        assert not isinstance(getattr(ddpkit, name), type(ddpkit)), name
    assert callable(ddpkit.launch)


def _barrier_on_rank0_only(ctx: DistContext) -> None:
    t = torch.ones(1)
    for step in range(10**9):
        dist.all_reduce(t)
        if ctx.rank == 0 and step == 2:
            dist.barrier()


@pytest.mark.slow
def test_a_hang_is_diagnosed_and_stopped() -> None:
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        launch(_barrier_on_rank0_only, nprocs=2, hang_timeout=5)
    elapsed = time.monotonic() - start
    summary = info.value.summary
    assert "rank 0: in barrier (collective #4)" in summary
    assert "rank 1: in all_reduce (collective #4)" in summary
    assert "rank 0 waits in barrier #4; rank 1 never reached it" in summary
    assert "dist.barrier()" in info.value.stacks and "dist.all_reduce(t)" in info.value.stacks
    assert elapsed < 5 + 25


def _tensor_result(ctx: DistContext) -> torch.Tensor:
    return torch.arange(100_000, dtype=torch.float32) * (ctx.rank + 1)


def test_tensors_come_back_from_rank0_intact() -> None:
    # Workers exit right after sending: the result must not depend on them staying alive.
    out = launch(_tensor_result, nprocs=2)
    assert torch.equal(out, torch.arange(100_000, dtype=torch.float32))


_AFTER_LAUNCH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    import ddpkit
    from ddpkit.errors import ConfigError

    def total(ctx):
        t = torch.tensor([ctx.rank + 1])
        dist.all_reduce(t)
        return ctx.rank, int(t.item())

    if __name__ == "__main__":
        # The ranks share one pipe: print writes the newline apart, so lines could mix.
        sys.stdout.write("before " + os.environ["RANK"] + chr(10))  # one write
        sys.stdout.flush()
        print("result", ddpkit.launch(total, nprocs=2), flush=True)
        try:
            ddpkit.launch(total, nprocs=2)  # the other ranks have ended
        except ConfigError as exc:
            print("again:", exc, flush=True)
    """
)


def test_under_ddpkit_run_code_after_launch_runs_once(tmp_path: Path) -> None:
    # As under `python script.py`: every rank runs fn, rank 0 alone goes on with its
    # result (the README: launch returns rank 0's result), the others end quietly.
    script = tmp_path / "job.py"
    script.write_text(_AFTER_LAUNCH_SCRIPT)
    out = run_cli("run", "--nproc", "2", str(script))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()  # each after its rank, as ddpkit run shows it
    assert sorted(line for line in lines if "before" in line) == [
        "[rank 0] before 0",
        "[rank 1] before 1",
    ]
    assert [line for line in lines if "result" in line] == ["[rank 0] result (0, 3)"]
    again = [line for line in lines if line.startswith("[rank 0] again:")]
    assert len(again) == 1 and "launch once" in again[0], out.stdout


_FORKSERVER_SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, sys, threading, time
    from multiprocessing import forkserver
    import ddpkit

    def report(ctx):
        preloaded = "colorsys" in sys.modules  # the program's own preload is kept
        print(f"rank {ctx.rank} sees {os.environ.get('STAGE')} {preloaded}", flush=True)
        return os.getppid()

    if __name__ == "__main__":
        multiprocessing.set_forkserver_preload(["colorsys"])
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # no fork
        os.environ["STAGE"] = "first"
        server = ddpkit.launch(report, nprocs=2)
        os.environ["STAGE"] = "second"  # after the server started: still seen
        out = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)
        os.dup2(out, 1)  # redirected after the server started: still followed
        assert ddpkit.launch(report, nprocs=2) == server
        print(server, file=sys.stderr)
    """
)


def test_a_forkserver_worker_gets_the_launchers_environment_and_output_of_the_moment(
    tmp_path: Path,
) -> None:
    script = tmp_path / "job.py"
    script.write_text(_FORKSERVER_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out.txt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    # (two processes write to one pipe: their lines may interleave)
    said = sorted(re.findall(r"rank \d sees (?:first|second) (?:True|False)", out.stdout))
    assert said == ["rank 0 sees first True", "rank 1 sees first True"], out.stdout
    later = sorted(re.findall(r"rank \d sees (?:first|second)", (tmp_path / "out.txt").read_text()))
    assert later == ["rank 0 sees second", "rank 1 sees second"]
    server = int(out.stderr.strip().splitlines()[-1])
    assert wait_gone([server]) == []  # it ends with the process that started it


def test_launch_config_is_the_one_home_of_the_launch_settings() -> None:
    from ddpkit.processes.config import LOOPBACK, LaunchConfig

    assert LaunchConfig().hang_timeout == 300  # the default, resolved
    assert LaunchConfig(timeout=100).hang_timeout == 100  # never above the collective timeout
    assert LaunchConfig().store_host == LOOPBACK and LaunchConfig().local
    two = LaunchConfig(nnodes=2, node_rank=1, master_addr="10.0.0.7")
    assert two.store_host == "10.0.0.7" and not two.local
    bad = {
        "backend": ({"backend": "mpi"}, "backend must be one of 'auto', 'gloo', 'nccl'"),
        "hang": ({"hang_timeout": -1}, "pass --hang-timeout 300, or hang_timeout=300 in Python"),
        "grace": ({"signal_grace": 0}, "pass --signal-grace 60, or signal_grace=60 in Python"),
        "nodes": ({"nnodes": 2}, "--nnodes > 1 needs --master-addr"),
        "port": ({"master_port": 0}, "--master-port must be a port number from 1 to 65535"),
    }
    for name, (kwargs, message) in bad.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            LaunchConfig(**kwargs)  # type: ignore[arg-type]
        assert name


def test_run_and_train_declare_the_process_flags_once() -> None:
    for command in ("run", "train"):
        out = subprocess.run(
            [sys.executable, "-m", "ddpkit", command, "--help"], capture_output=True, text=True
        ).stdout
        declared = [line.split()[0] for line in out.splitlines() if line.startswith("  --")]
        assert declared.count("--hang-timeout") == declared.count("--nproc") == 1, command
        assert "stop the job and show every rank's stack" in out, command


# -- a script's own destroy_process_group (issue 42, item 1) -----------------------------

# The DDP tutorial's multigpu.py as a user ports it: mp.spawn(main, ...) becomes
# ddpkit.launch(main, ...), ddp_setup() goes (the group exists), and main still ends with
# destroy_process_group(). The job: dict batches, dropout, AdamW and a scheduler; the data
# is made under rank_zero_first, whose own group the script's destroy ends too.
_TUTORIAL_SCRIPT = textwrap.dedent(
    """
    import argparse
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import Dataset, DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed import destroy_process_group
    import ddpkit
    from ddpkit.checkpoint.digest import model_digest, state_digest


    class MyTrainDataset(Dataset):
        def __init__(self, size):
            g = torch.Generator().manual_seed(3)
            self.rows = [{"x": torch.rand(12, generator=g), "y": torch.rand(2, generator=g)}
                         for _ in range(size)]
        def __len__(self):
            return len(self.rows)
        def __getitem__(self, index):
            return self.rows[index]


    class Trainer:
        def __init__(self, model, train_data, optimizer, scheduler, gpu_id, save_every):
            self.gpu_id = gpu_id
            self.model = DDP(model)
            self.train_data = train_data
            self.optimizer = optimizer
            self.scheduler = scheduler
            self.save_every = save_every

        def _run_batch(self, batch):
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(batch["x"]), batch["y"])
            loss.backward()
            self.optimizer.step()

        def _run_epoch(self, epoch):
            b_sz = len(next(iter(self.train_data))["x"])
            steps = len(self.train_data)
            print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {steps}")
            self.train_data.sampler.set_epoch(epoch)
            for batch in self.train_data:
                self._run_batch(batch)
            self.scheduler.step()

        def train(self, max_epochs):
            for epoch in range(max_epochs):
                self._run_epoch(epoch)


    def main(ctx, save_every, total_epochs, batch_size):
        torch.manual_seed(0)
        with ddpkit.rank_zero_first(ctx):
            dataset = MyTrainDataset(48)
        model = torch.nn.Sequential(
            torch.nn.Linear(12, 16), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        )
        torch.manual_seed(100 + ctx.rank)  # each rank its own dropout
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False,
                            sampler=DistributedSampler(dataset))
        trainer = Trainer(model, loader, optimizer, scheduler, ctx.rank, save_every)
        trainer.train(total_epochs)
        mine = (model_digest(model), state_digest(optimizer.state_dict()),
                state_digest(scheduler.state_dict()))
        every = [None] * ctx.world_size
        dist.all_gather_object(every, mine)
        destroy_process_group()
        return every


    if __name__ == "__main__":
        parser = argparse.ArgumentParser(description="simple distributed training job")
        parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
        parser.add_argument("save_every", type=int, help="How often to save a snapshot")
        parser.add_argument("--batch_size", default=32, type=int)
        args = parser.parse_args()
        every = ddpkit.launch(main, args.save_every, args.total_epochs, args.batch_size, nprocs=2)
        print("ranks agree:", len(every) == 2 and len(set(every)) == 1)
    """
)


def test_a_script_that_destroys_its_process_group_itself_ends_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "multigpu.py"
    script.write_text(_TUTORIAL_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), "2", "1", "--batch_size", "6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "ranks agree: True" in out.stdout  # trained, and every rank ends alike
    assert out.stdout.count("Epoch 1 | Batchsize: 6 | Steps: 4") == 2


def _destroys_its_group(ctx: DistContext, value: int) -> int:
    dist.destroy_process_group()
    return value


def test_a_function_that_destroys_its_group_in_the_callers_process_returns() -> None:
    # One process runs in the caller's: ddpkit's teardown there, and the next launch.
    assert launch(_destroys_its_group, 7, nprocs=1) == 7
    assert not dist.is_initialized()
    assert launch(_identity, "again", nprocs=1)["sum"] == 1.0


@pytest.mark.slow
def test_a_script_that_destroys_its_process_group_itself_ends_cleanly_under_run(
    tmp_path: Path,
) -> None:
    # launch runs in place there, and the audit hooks destroy_process_group.
    script = tmp_path / "multigpu.py"
    script.write_text(_TUTORIAL_SCRIPT)
    out = run_cli("run", "--nproc", "2", "--audit", "--", str(script), "2", "1", "--batch_size=6")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "[rank 0] ranks agree: True" in out.stdout
    assert "still alive" not in out.stderr  # the script's destroy is the teardown
