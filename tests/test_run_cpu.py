"""`ddpkit run --cpu`: GPU scripts shaped like the public ones (tests/gpu_scripts/) run
unedited on 2 CPU ranks over gloo, and end with the same weights, buffers and optimizer
state on every rank; what cannot be rehearsed is refused in one line."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ROOT, run_cli

SCRIPTS = ROOT / "tests" / "gpu_scripts"


def _leaves(obj: Any, path: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {
            k: v for key, value in obj.items() for k, v in _leaves(value, f"{path}/{key}").items()
        }
    if isinstance(obj, (list, tuple)):
        return {
            k: v for i, value in enumerate(obj) for k, v in _leaves(value, f"{path}/{i}").items()
        }
    return {path: obj}


def _same_on_every_rank(folder: Path, ranks: int = 2) -> None:
    """Every rank's saved model (parameters and buffers) and optimizer state are equal,
    bit for bit, and training moved them."""
    states = [_leaves(torch.load(folder / f"rank{r}.pt")) for r in range(ranks)]
    assert states[0].keys() == states[1].keys()
    tensors = [k for k, v in states[0].items() if isinstance(v, torch.Tensor)]
    assert any("/optim/state/" in k for k in tensors), "no optimizer state was saved"
    for other in states[1:]:
        differ = [
            k
            for k, v in states[0].items()
            if not (torch.equal(v, other[k]) if isinstance(v, torch.Tensor) else v == other[k])
        ]
        assert differ == []


def _run_cpu(tmp_path: Path, script: str, *args: str, audit: bool = False) -> str:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    flags = ["--cpu", "--nproc", "2", *(["--audit"] if audit else [])]
    done = run_cli(
        "run", *flags, str(SCRIPTS / script), *args, cwd=tmp_path, env={"STATE_DIR": str(state)}
    )
    assert done.returncode == 0, done.stderr
    _same_on_every_rank(state)
    return done.stdout + done.stderr


@pytest.mark.slow
def test_the_tutorial_multigpu_torchrun_runs_unedited_and_resumes_under_audit(
    tmp_path: Path,
) -> None:
    out = _run_cpu(tmp_path, "multigpu_torchrun.py", "2", "1")
    assert "[GPU1] Epoch 1" in out and (tmp_path / "snapshot.pt").exists()
    # The snapshot is loaded with map_location="cuda:{gpu_id}"; the audit finds nothing.
    out = _run_cpu(tmp_path, "multigpu_torchrun.py", "3", "1", audit=True)
    assert "Resuming training from snapshot at Epoch 2" in out
    assert "ddpkit audit: no findings" in out


@pytest.mark.slow
def test_nanogpt_train_runs_unedited(tmp_path: Path) -> None:
    out = _run_cpu(tmp_path, "nanogpt_train.py", "--compile=False")
    assert "step 8:" in out and (tmp_path / "out" / "ckpt.pt").exists()


@pytest.mark.slow
def test_imagenet_main_runs_unedited(tmp_path: Path) -> None:
    args = ("--dist-url", "env://", "--dummy", "--epochs", "2", "-b", "32", "-j", "1")
    out = _run_cpu(tmp_path, "imagenet_main.py", *args)
    assert "Use GPU: 1 for training" in out and (tmp_path / "model_best.pth.tar").exists()


@pytest.mark.slow
def test_timm_train_runs_unedited_with_amp_and_audit(tmp_path: Path) -> None:
    args = ("--amp", "--channels-last", "--clip-grad", "1.0")
    out = _run_cpu(tmp_path, "timm_train.py", *args, audit=True)
    assert "epoch 1 loss" in out and "DDP112" not in out


def test_a_cuda_stream_is_refused_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "streams.py"
    script.write_text(
        textwrap.dedent(
            """\
            import os
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl")
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            x = torch.ones(4).cuda()
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                y = x * 2
            dist.destroy_process_group()
            """
        )
    )
    done = run_cli("run", "--cpu", "--nproc", "2", "streams.py", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("ddpkit: torch.cuda.Stream() at streams.py:8 cannot be rehearsed")
    # A refusal is no failure to retry: --max-restarts would only meet it again.
    again = run_cli(
        "run", "--cpu", "--max-restarts", "2", "--nproc", "2", "streams.py", cwd=tmp_path
    )
    assert (again.returncode, again.stderr.strip().splitlines()) == (2, lines), again.stderr


# What the rehearsal maps, checked in a fresh interpreter (it patches torch for good).
MAPPED = """
import warnings
import torch
from torch.cuda.amp.common import amp_definitely_not_available
from ddpkit.processes import rehearse
real = torch.cuda.is_available()
rehearse.install()
assert torch.cuda.is_available() and torch.cuda.device_count() == 2
assert amp_definitely_not_available() == (not real)  # torch's own code sees the truth
for device in (1, "cuda", "cuda:1", torch.device("cuda", 1)):
    assert torch.ones(2).to(device).device.type == "cpu", device
    assert torch.zeros(2, device=device).device.type == "cpu", device
    assert torch.nn.Linear(2, 2).to(device).weight.device.type == "cpu", device
assert torch.ones(2).cuda(1).device.type == "cpu"
assert torch.ones(2).pin_memory().device.type == "cpu"
torch.cuda.set_device("cuda:1")
assert torch.cuda.current_device() == 1
torch.cuda.synchronize(); torch.cuda.manual_seed_all(0); torch.cuda.empty_cache()
assert torch.cuda.max_memory_allocated() == 0 == torch.cuda.memory_allocated()
with torch.autocast("cuda", dtype=torch.bfloat16):
    assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
with torch.cuda.amp.autocast():  # float16 asked for: float32 on the CPU
    assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    scaler = torch.cuda.amp.GradScaler()
assert not scaler.is_enabled() and scaler.get_scale() == 1.0
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record(); end.record(); end.synchronize()
assert start.elapsed_time(end) >= 0
loader = torch.utils.data.DataLoader([torch.ones(2)], pin_memory=True)
assert not loader.pin_memory
"""


def test_what_the_rehearsal_maps(tmp_path: Path) -> None:
    # From a file of the user's own (in the current folder): the GPU is shown to it.
    (tmp_path / "mapped.py").write_text(MAPPED)
    done = subprocess.run(
        [sys.executable, "mapped.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"LOCAL_WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


# A script that is its own launcher, shaped like the tutorial's multigpu.py: run under
# ddpkit run, its children would inherit torchrun's TORCHELASTIC_USE_AGENT_STORE and wait
# for a store that nobody serves.
SPAWNS = """\
import os
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dist.all_reduce(torch.ones(3))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1]), nprocs=2)
"""


@pytest.mark.slow
@pytest.mark.parametrize("cpu", [False, True], ids=["run", "run_cpu"])
def test_a_script_that_spawns_its_own_ranks_is_refused_in_one_line(
    tmp_path: Path, cpu: bool
) -> None:
    (tmp_path / "own_ranks.py").write_text(SPAWNS)
    flags = ["--cpu"] if cpu else []
    args = ("run", *flags, "--max-restarts", "1", "--nproc", "2", "own_ranks.py", "29999")
    done = run_cli(*args, cwd=tmp_path, timeout=90)
    lines = done.stderr.strip().splitlines()
    assert (done.returncode, len(lines)) == (2, 1), done.stderr
    assert lines[0].startswith(
        "ddpkit: own_ranks.py:16 starts its own ranks with torch.multiprocessing.spawn(), "
        "inside each rank of ddpkit run: run it as `python own_ranks.py`"
    ), lines[0]
    assert "docs/port.md" in lines[0]


# Who sees the GPU under the rehearsal: the user's own files (here, the current folder)
# do; a library, installed in a venv inside that folder, sees the machine as it is, so
# that one with a CPU path of its own (Accelerate, Fabric) takes it.
WHO_SEES = """
import os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "venv", "lib", "site-packages"))
import torch
import library
from ddpkit.processes import rehearse
real = (torch.cuda.is_available(), torch.cuda.device_count())
rehearse.install()
assert library.sees() == real, library.sees()
sys.path.insert(0, os.getcwd())
import own
assert own.sees() == (True, 2), own.sees()
"""


def test_only_the_users_own_files_see_the_rehearsed_gpu(tmp_path: Path) -> None:
    installed = tmp_path / "venv" / "lib" / "site-packages"
    installed.mkdir(parents=True)
    sees = "import torch\n\n\ndef sees():\n    cuda = torch.cuda\n"
    sees += "    return cuda.is_available(), cuda.device_count()\n"
    (installed / "library.py").write_text(sees)
    (tmp_path / "own.py").write_text(sees)
    done = subprocess.run(
        [sys.executable, "-c", WHO_SEES],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"LOCAL_WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_a_library_that_needs_the_gpu_is_refused_with_the_fix(tmp_path: Path) -> None:
    # A library (installed: it sees the machine as it is) asserting CUDA, as timm's
    # init_distributed_device does for --device cuda; and timm's prefetcher, whose side
    # stream is refused with the option that turns it off.
    installed = tmp_path / "venv" / "lib" / "site-packages"
    (installed / "timm" / "data").mkdir(parents=True)
    (installed / "checks.py").write_text(
        "import torch\n\n\ndef init(device):\n"
        "    assert torch.cuda.is_available(), f'CUDA is not available but {device} was asked'\n"
    )
    (installed / "timm" / "data" / "loader.py").write_text(
        "import torch\n\n\ndef prefetch():\n    return torch.cuda.Stream()\n"
    )
    (tmp_path / "train.py").write_text(
        "import sys\nimport checks\nfrom timm.data import loader\n\n"
        "if sys.argv[1] == 'init':\n    checks.init('cuda')\nelse:\n    loader.prefetch()\n"
    )
    env = {"PYTHONPATH": str(installed)}
    said = []
    for step in ("init", "prefetch"):
        done = run_cli("run", "--cpu", "--nproc", "2", "train.py", step, cwd=tmp_path, env=env)
        lines = done.stderr.strip().splitlines()
        assert (done.returncode, len(lines)) == (2, 1), done.stderr
        said.append(lines[0])
    assert said[0].startswith("ddpkit: a CUDA call at train.py:6 (in checks.py:5) cannot be"), said
    assert "only the script's own files see the rehearsed GPU" in said[0]
    assert said[1].startswith(
        "ddpkit: torch.cuda.Stream() at train.py:8 (in timm/data/loader.py:5) cannot be"
    ), said
    assert said[1].endswith("pass --no-prefetcher (timm's train.py: its loader's prefetch stream)")
