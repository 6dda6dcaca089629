"""Hang diagnosis with real processes: what is certainly stuck is stopped within
`hang_timeout` (+ 10 s), and a rank that works is never stopped, only reported. What
counts as work, and the waits the watch sees: tests/test_hang_watch.py."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit import Callback, DistContext, TrainConfig, Trainer, launch
from ddpkit.errors import ConfigError, HangError
from ddpkit.inrank.watchdog import _user_frame, describe
from ddpkit.parallel.fsdp import cpu_supported
from tests.conftest import ROOT, run_cli
from tests.test_launch import _barrier_on_rank0_only  # a mismatch of collectives

HANG_TIMEOUT = 5.0


def _matmuls(seconds: float) -> None:
    """Work in C: large matrix products for `seconds`."""
    a = torch.randn(256, 256)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


def _compute_first(ctx: DistContext) -> str:
    with ddpkit.rank_zero_first(ctx):
        if ctx.rank == 0:
            _matmuls(20)
    dist.barrier()
    return "done"


@pytest.mark.slow
def test_a_long_computation_in_rank_zero_first_completes(capfd: pytest.CaptureFixture[str]) -> None:
    assert launch(_compute_first, nprocs=2, hang_timeout=HANG_TIMEOUT) == "done"
    assert "notice" not in capfd.readouterr().err  # the wait is expected: no notice


# A rank waiting on a child process (busy: working; idle: uncertain, never stopped before
# the collective timeout): tests/test_hang_watch.py.


def _recv_never_sent(ctx: DistContext) -> None:
    if ctx.rank == 0:
        dist.recv(torch.zeros(1), src=1)
    dist.barrier()


def _irecv_never_sent(ctx: DistContext) -> None:
    if ctx.rank == 0:
        work = dist.irecv(torch.zeros(3), src=1)  # isend and irecv are left unwrapped
        assert work is not None
        work.wait()
    else:
        threading.Event().wait()


def _sleep_forever(ctx: DistContext) -> None:
    if ctx.rank == 0:
        time.sleep(10**6)
    dist.barrier()


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (_barrier_on_rank0_only, ["rank 0 waits in barrier #4; rank 1 never reached it"]),
        pytest.param(
            _recv_never_sent, ["rank 0: in recv", "rank 1: in barrier"], marks=pytest.mark.slow
        ),
        (
            _sleep_forever,
            ["rank 1: in barrier", "rank 0: not in a collective: idle (no CPU", "time.sleep"],
        ),
        (
            _irecv_never_sent,
            [
                "rank 0: in wait() of an isend/irecv (collective #",
                "rank 1: not in a collective: idle (no CPU",
            ],
        ),
    ],
)
def test_a_true_hang_is_stopped_within_the_hang_timeout(fn: object, words: list[str]) -> None:
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        # The collective timeout bounds a hang that the watch would miss.
        launch(fn, nprocs=2, hang_timeout=HANG_TIMEOUT, timeout=30)  # type: ignore[arg-type]
    assert time.monotonic() - start < HANG_TIMEOUT + 10 + 5  # + start-up
    text = f"{info.value.summary}\n{info.value.stacks}"
    for word in words:
        assert word in text, text


def _sleep_in_one_call(ctx: DistContext) -> None:
    if ctx.rank == 0:
        time.sleep(4 * HANG_TIMEOUT)  # it would end, but no CPU: parked, like a deadlock
    dist.barrier()


@pytest.mark.slow
def test_a_call_that_blocks_without_cpu_longer_than_the_hang_timeout_is_stopped() -> None:
    # The README: a rank parked at one line (no CPU, no reading) is stopped, even in a
    # call that would have returned later; raise hang_timeout above such waits.
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        launch(_sleep_in_one_call, nprocs=2, hang_timeout=HANG_TIMEOUT)
    assert time.monotonic() - start < 4 * HANG_TIMEOUT
    assert "rank 0 stayed at one line without using the CPU" in info.value.summary
    assert "if that call would have returned, raise the hang timeout" in info.value.summary


def _hold_the_gil(ctx: DistContext, items: int) -> str:
    if ctx.rank == 0:
        sum(range(items))  # one C call that never lets the watch's thread run
    dist.barrier()
    return "done"


@pytest.mark.slow
def test_one_long_call_that_holds_the_gil_is_never_stopped(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # Its watch cannot report, so nothing says whether it works: uncertain (notices;
    # the collective timeout), never "parked" (it was stopped after the hang timeout).
    hang_timeout = 8.0
    start = time.perf_counter()
    sum(range(10**7))
    items = int(10**7 * (2.5 * hang_timeout) / (time.perf_counter() - start))
    assert launch(_hold_the_gil, items, nprocs=2, hang_timeout=hang_timeout) == "done"
    assert "holds Python's lock" in capfd.readouterr().err


def _return_early(ctx: DistContext) -> None:
    if ctx.rank == 1:
        return  # rank 0 waits in the barrier below for a rank that has left
    dist.barrier()


def test_a_rank_that_returns_while_another_waits_is_named_as_a_hang() -> None:
    # gloo fails rank 0's barrier at once ("Connection closed by peer"): the report
    # names the rank that left and where the other waited, not rank 0 as the culprit.
    with pytest.raises(HangError) as info:
        launch(_return_early, nprocs=2, hang_timeout=0)
    summary = info.value.summary
    assert "rank 1 ended while rank 0 waited in a collective" in summary, summary
    assert f"rank 0: in barrier at {__file__}:" in summary, summary
    assert "rank 1: ended" in summary


class _SleepAtTheEnd(Callback):
    def on_fit_end(self, trainer: Trainer, result: object) -> None:
        if trainer.ctx.rank == 1:
            time.sleep(10**6)


def _fit_then_sleep(ctx: DistContext) -> None:
    ddpkit.seed_everything(0)
    model = nn.Linear(4, 1)
    x = torch.randn(32, 4)
    Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TensorDataset(x, x.sum(1, keepdim=True)),
        ctx,
        TrainConfig(epochs=1, batch_size=8),
        loss_fn=nn.functional.mse_loss,
        callbacks=[_SleepAtTheEnd()],
        log_fn=lambda s: None,
    ).fit()


def test_a_rank_that_never_finishes_after_another_returned_is_stopped() -> None:
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        launch(_fit_then_sleep, nprocs=2, hang_timeout=HANG_TIMEOUT)
    assert time.monotonic() - start < HANG_TIMEOUT + 10 + 5
    assert "rank 0: finished" in info.value.summary
    assert "on_fit_end" in info.value.stacks


def _poll(ctx: DistContext) -> None:
    if ctx.rank == 0:
        while True:  # waits for a file that never comes
            time.sleep(0.2)
    dist.barrier()


@pytest.mark.slow
def test_a_polling_rank_gets_notices_then_stops_at_the_collective_timeout(
    capfd: pytest.CaptureFixture[str],
) -> None:
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        launch(_poll, nprocs=2, hang_timeout=HANG_TIMEOUT, timeout=20)
    elapsed = time.monotonic() - start
    assert 20 - 3 <= elapsed < 20 + 10 + 5
    stopped = "which stayed polling (it wakes up, but uses no CPU); stopped at the collective "
    assert stopped + "timeout (20 s)" in info.value.summary
    err = capfd.readouterr().err
    assert "rank 0 is polling (it wakes up, but uses no CPU)" in err
    assert "If rank 0 is waiting for something that never comes, the job is stopped at" in err


def test_hang_timeout_may_not_exceed_the_collective_timeout() -> None:
    with pytest.raises(ConfigError) as info:
        launch(_poll, nprocs=2, hang_timeout=60, timeout=30)
    assert str(info.value) == (
        "the hang timeout (60 s) must not exceed the collective timeout (30 s), when the "
        "collectives fail anyway: pass --hang-timeout 30 or less, or in Python "
        "hang_timeout=30 or less (or a larger timeout=)"
    )


# -- smaller defects ---------------------------------------------------------------------
def _socket_env(ctx: DistContext) -> dict[str, str | None]:
    import os

    return {name: os.environ.get(name) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


def test_nccl_and_gloo_sockets_stay_on_loopback() -> None:
    assert launch(_socket_env, nprocs=2) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_a_worker_whose_parent_is_not_the_launcher_exits() -> None:
    # A worker adopted by a subreaper (or init) before it asked to die with its parent
    # must notice: its parent is no longer the process that started it.
    code = (
        "from ddpkit.processes.workers import die_with_parent; die_with_parent(1); print('alive')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1 and "alive" not in out.stdout and out.stderr == ""


LAST_WORDS = """
import sys
import ddpkit

def main(ctx):
    sys.stdout.write(f"last words of rank {ctx.rank}")  # no newline, no flush

if __name__ == "__main__":
    ddpkit.launch(main, nprocs=2)
"""


def test_a_workers_last_print_survives(tmp_path: Path) -> None:
    script = tmp_path / "last.py"
    script.write_text(LAST_WORDS)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "last words of rank 0" in out.stdout and "last words of rank 1" in out.stdout


def test_hang_error_is_importable_from_errors() -> None:
    import ddpkit.errors

    assert ddpkit.errors.HangError is HangError
    assert issubclass(HangError, ddpkit.DdpkitError)


def test_info_warns_about_a_torch_outside_the_tested_range() -> None:
    from ddpkit.cli.info import torch_problem

    assert torch_problem("2.6.0+cu124") is None and torch_problem("2.13.0+cpu") is None
    assert "outside the range ddpkit is tested on (2.6 to 2.15)" in str(torch_problem("2.5.1"))
    assert torch_problem("3.0.0") is not None


def test_a_rank_inside_backward_is_shown_at_the_users_backward_line() -> None:
    # DDP's gradient all-reduce blocks inside torch's autograd engine; the report used
    # to name torch/autograd/graph.py instead of the line that called backward().
    seen: list[str] = []
    weight = torch.ones(3, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        # Called from C++ in the engine: the next Python frame is torch's own, where a
        # sample of the blocked main thread finds it.
        seen.append(describe(_user_frame(sys._getframe().f_back)))
        return grad

    weight.register_hook(hook)  # type: ignore[no-untyped-call]
    line = sys._getframe().f_lineno + 1
    (weight * 2).sum().backward()  # type: ignore[no-untyped-call]
    assert seen == [f"{__file__}:{line} in {sys._getframe().f_code.co_name}"]


# -- DDP's gradient all-reduce, which torch launches and waits on from C++ in backward() --
def _stuck_before_backward(ctx: DistContext, marker: str) -> None:
    ddpkit.seed_everything(0)
    net = nn.Sequential(nn.Linear(6, 24), nn.GELU(), nn.Dropout(0.2), nn.Linear(24, 2))
    model = ddpkit.prepare_model(net, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"x": torch.randn(12, 6), "y": torch.randn(12, 2)}
    for step in range(3):
        loss = nn.functional.smooth_l1_loss(model(batch["x"]), batch["y"])
        if ctx.rank == 1 and step == 2:
            Path(marker).write_text(str(time.time()))
            threading.Event().wait()  # rank 1 never calls backward
        loss.backward()  # type: ignore[no-untyped-call]  # rank 0 waits here, in DDP's all-reduce
        opt.step()
        opt.zero_grad()


@pytest.mark.slow
def test_a_rank_stuck_before_backward_while_another_waits_in_ddps_all_reduce_is_stopped(
    tmp_path: Path,
) -> None:
    # The most common DDP hang. The collective timeout (30 s) bounds the test: without a
    # watch that sees the wait, the job ended there with gloo's error, blamed on rank 0.
    marker = tmp_path / "blocked"
    with pytest.raises(HangError) as info:
        launch(_stuck_before_backward, str(marker), nprocs=2, hang_timeout=HANG_TIMEOUT, timeout=30)
    assert time.time() - float(marker.read_text()) < HANG_TIMEOUT + 10
    summary, stacks = info.value.summary, info.value.stacks
    backward = _line_of(Path(__file__), "# rank 0 waits here, in DDP")
    stuck = _line_of(Path(__file__), "threading.Event().wait()  # rank 1 never")
    _assert_ddp_wait_named(summary, f"{__file__}:{backward}", f"{__file__}:{stuck}")
    assert "rank 1 stayed at one line without using the CPU" in summary
    assert "threading.Event().wait()" in stacks.split("Python stack of rank 1")[-1], stacks


def _assert_ddp_wait_named(summary: str, backward: str, stuck: str) -> None:
    """Rank 0 is shown in DDP's gradient all-reduce at its backward() line, and rank 1,
    which never reached that collective, at the line where it is stuck."""
    wait = re.search(
        rf"rank 0: in DDP's gradient all-reduce in backward\(\) \(collective #(\d+)\) at "
        rf"{re.escape(backward)} in ",
        summary,
    )
    assert wait is not None, summary
    missing = f"rank 0 waits in DDP's gradient all-reduce in backward() #{wait[1]}; rank 1 never"
    assert missing in summary, summary
    assert f"rank 1: not in a collective: idle (no CPU, no data read) at {stuck} in " in summary


def _line_of(path: Path, text: str) -> int:
    """The line of `path` that holds `text`."""
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and "_line_of" not in line)


def _long_backward_on_rank_1(ctx: DistContext, seconds: float) -> str:
    ddpkit.seed_everything(1)
    model = ddpkit.prepare_model(nn.Linear(8, 1), ctx)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    loss = nn.functional.mse_loss(model(x), y)
    if ctx.rank == 1:
        # A backward that works in C++ inside the engine for `seconds`: matrix products.
        # Large ones, so that few (and little memory) are kept for the backward.
        size, start = 2048, time.monotonic()
        chain = weight = torch.randn(size, size, requires_grad=True)
        while time.monotonic() - start < seconds / 2:  # the backward costs twice the forward
            chain = (chain @ weight) / size**0.5
        loss = loss + 0 * chain.sum()
    loss.backward()  # type: ignore[no-untyped-call]  # rank 0 waits for rank 1's
    digest = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(digest) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, digest)
    assert torch.equal(gathered[0], gathered[1])
    return "done"


@pytest.mark.slow
def test_a_long_backward_that_computes_is_never_stopped(capfd: pytest.CaptureFixture[str]) -> None:
    hang_timeout = 4.0
    result = launch(_long_backward_on_rank_1, 4 * hang_timeout, nprocs=2, hang_timeout=hang_timeout)
    assert result == "done"
    err = capfd.readouterr().err
    assert "for rank 1: rank 1 is busy (using the CPU or reading data)" in err, err
    assert "rank 0: in DDP's gradient all-reduce in backward()" in err, err


STUCK_BEFORE_BACKWARD = """
import os, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", timeout=timedelta(seconds=int(sys.argv[2])))
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(4):
    out = model(torch.randn(10, 5))
    loss = out.square().mean()
    if rank == 1 and step == 3:
        open(sys.argv[1], "w").write(str(time.time()))
        threading.Event().wait()  # rank 1 never calls backward
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_hang_in_ddps_all_reduce_of_a_scripts_own_ddp_is_stopped_under_run(
    tmp_path: Path,
) -> None:
    script = tmp_path / "own_ddp.py"
    script.write_text(STUCK_BEFORE_BACKWARD)
    marker = tmp_path / "blocked"
    # The script's collective timeout (60 s) bounds the test: without a watch that sees
    # the wait, the job failed there with gloo's error, blamed on rank 0.
    out = run_cli("run", "--nproc", "2", "--hang-timeout", "10", str(script), str(marker), "60")
    ended = time.time()
    assert out.returncode == 124, out.stderr
    assert ended - float(marker.read_text()) < 10 + 10
    summary = out.stderr[out.stderr.index("ddpkit: the job is hung") :]
    backward = _line_of(script, "loss.backward()")
    stuck = _line_of(script, "threading.Event().wait()")
    _assert_ddp_wait_named(summary, f"{script}:{backward}", f"{script}:{stuck}")
    assert "threading.Event().wait()" in summary.split("Python stack of rank 1")[-1]


def _clip_while_a_rank_is_stuck(ctx: DistContext) -> None:
    ddpkit.seed_everything(3)
    net = nn.Sequential(nn.Linear(16, 16), nn.SiLU(), nn.Linear(16, 16), nn.Linear(16, 1))
    model = ddpkit.prepare_model(net, ctx, strategy="fsdp", fsdp={"min_params": 100})
    loss = nn.functional.l1_loss(model(torch.randn(8, 16)), torch.zeros(8, 1))
    loss.backward()  # type: ignore[no-untyped-call]
    if ctx.rank == 1:
        threading.Event().wait()  # rank 1 never clips
    # The total norm of DTensor gradients: an all-reduce from C++, waited on from C++.
    nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # rank 0 waits here


@pytest.mark.slow
@pytest.mark.skipif(not cpu_supported(), reason="FSDP2 on CPU ranks needs torch >= 2.7")
def test_a_rank_waiting_in_fsdps_gradient_clipping_is_seen_there() -> None:
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        launch(_clip_while_a_rank_is_stuck, nprocs=2, hang_timeout=HANG_TIMEOUT, timeout=30)
    assert time.monotonic() - start < HANG_TIMEOUT + 10 + 5
    summary = info.value.summary
    line = _line_of(Path(__file__), "0.5)  # rank 0 waits here")
    assert "rank 0: in a DTensor collective (functional collectives: FSDP's gradient " in summary
    assert f"at {__file__}:{line} in _clip_while" in summary, summary
    assert "rank 1 stayed at one line without using the CPU" in summary


def test_a_main_thread_blocked_in_autograds_engine_is_in_ddps_all_reduce() -> None:
    # The frame a sample finds while the engine waits on DDP's all-reduce from C++; a
    # Python hook of the backward (the user's code) is not such a wait.
    from ddpkit.inrank.watchdog import GRADIENT_ALL_REDUCE, native_wait

    seen: list[str | None] = []
    weight = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.extend([native_wait(sys._getframe().f_back), native_wait(sys._getframe())])
        return grad

    weight.register_hook(hook)  # type: ignore[no-untyped-call]
    (weight * 3).sum().backward()  # type: ignore[no-untyped-call]
    assert seen == [GRADIENT_ALL_REDUCE, None]
    assert native_wait(sys._getframe()) is None
