"""`ddpkit info`: what this machine offers for distributed training, and what would
stop a job before it starts."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
from typing import Any

from ddpkit.versions import release

HELP = "show what this machine offers for distributed training (devices, backends, problems)"
# The torch releases CI tests: the oldest that pyproject.toml admits, and the newest tried.
TORCH_TESTED = ((2, 6), (2, 15))
# A GPU with less than this share of its memory free is probably busy with another job.
_BUSY_FREE_SHARE = 0.5
# nvidia-smi asks the driver (NVML), which answers in well under a second, unless the
# driver must first load (no persistence daemon): then a few seconds.
_SMI_TIMEOUT_S = 10


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("info", help=HELP, description=HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def torch_problem(version: str) -> str | None:
    """Why torch `version` ("2.6.0+cu124") may not work with ddpkit, or None."""
    if TORCH_TESTED[0] <= release(version) <= TORCH_TESTED[1]:
        return None
    low, high = (".".join(map(str, v)) for v in TORCH_TESTED)
    return (
        f"torch {version} is outside the range ddpkit is tested on ({low} to {high}): "
        f"install a release in it, e.g. pip install 'torch>={low},<={high}.*'"
    )


def gather() -> dict[str, Any]:
    """Facts about this machine; `problems` lists what would stop or slow a job."""
    import torch
    import torch.distributed as dist

    from ddpkit import __version__
    from ddpkit.processes.machine import cpu_count, resolve_backend, resolve_nprocs

    problems: list[str] = []
    gpus = []
    if torch.cuda.is_available():
        # Free memory comes from the driver, not torch.cuda.mem_get_info: that creates a
        # CUDA context on every GPU (memory taken from other jobs) and fails on a GPU in
        # exclusive mode that another process holds, which is just what info should find.
        memory = _driver_memory()
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            # torch numbers the visible GPUs, the driver all of them: match by UUID.
            free_total = memory.get(_uuid_key(str(getattr(props, "uuid", ""))))
            gpus.append(
                {
                    "index": i,
                    "name": props.name,
                    "memory_gib": round(props.total_memory / 2**30, 1),
                    "free_gib": None if free_total is None else round(free_total[0] / 2**30, 1),
                }
            )
            if free_total is not None and free_total[0] < _BUSY_FREE_SHARE * free_total[1]:
                free, total = free_total
                problems.append(
                    f"GPU {i} has only {free / 2**30:.1f} of {total / 2**30:.1f} GiB free: another "
                    "job may be using it (see nvidia-smi), or hide it with CUDA_VISIBLE_DEVICES"
                )
    untested = torch_problem(torch.__version__)
    if untested:
        problems.append(untested)
    backends = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
    }
    if not dist.is_available():
        problems.append("this torch build has no torch.distributed: install another build")
    if gpus and not backends["nccl"]:
        problems.append("GPUs are visible but this torch has no nccl: install a CUDA build")
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
        port_ok = True
    except OSError as exc:
        port_ok = False
        problems.append(
            f"cannot bind a free port on 127.0.0.1 ({exc.strerror}): no local "
            "rendezvous is possible"
        )
    backend = resolve_backend("auto")
    return {
        "ddpkit": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_cores": cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "backends": backends,
        "default_backend": backend,
        "default_nproc": resolve_nprocs("auto", backend),
        "free_loopback_port": port_ok,
        "problems": problems,
    }


def _uuid_key(uuid: str) -> str:
    """A GPU's UUID as torch and the driver both give it ("GPU-" prefix or not)."""
    uuid = uuid.strip().lower()
    return uuid.removeprefix("gpu-")


def _driver_memory() -> dict[str, tuple[int, int]]:
    """(free, total) bytes of each GPU by `_uuid_key`, as the driver tells it without a
    CUDA context: nvidia-smi if it is on PATH, else NVML through pynvml if installed;
    {} when neither answers (free memory is then unknown)."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        memory: dict[str, tuple[int, int]] = {}
        try:
            out = subprocess.run(
                [smi, "--query-gpu=uuid,memory.total,memory.free", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=_SMI_TIMEOUT_S,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""  # a driver that does not answer: try NVML
        for line in out.splitlines():
            fields = [f.strip() for f in line.split(",")]
            # A GPU the driver cannot read reports "[N/A]" or "[Unknown Error]".
            if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                memory[_uuid_key(fields[0])] = (int(fields[2]) * 2**20, int(fields[1]) * 2**20)
        if memory:
            return memory
    return _nvml_memory()


def _nvml_memory() -> dict[str, tuple[int, int]]:
    try:
        import pynvml  # type: ignore[import-not-found]  # nvidia-ml-py, not a dependency
    except ImportError:
        return {}
    memory: dict[str, tuple[int, int]] = {}
    try:
        pynvml.nvmlInit()
        try:
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = pynvml.nvmlDeviceGetUUID(handle)  # bytes in older releases
                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                key = _uuid_key(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
                memory[key] = (int(info.free), int(info.total))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml.NVMLError and its kin: no driver, a GPU that fell off the bus
        return memory
    return memory


def run(args: argparse.Namespace) -> int:
    facts = gather()
    if args.json:
        print(json.dumps(facts))
    else:
        print(f"ddpkit {facts['ddpkit']}, torch {facts['torch']}, Python {facts['python']}")
        print(
            f"CPU cores: {facts['cpu_cores']} (OMP_NUM_THREADS: "
            f"{facts['omp_num_threads'] or 'unset; ddpkit gives each rank cores // nproc'})"
        )
        if facts["gpus"]:
            for gpu in facts["gpus"]:
                free = (
                    "free memory unknown"
                    if gpu["free_gib"] is None
                    else f"{gpu['free_gib']} GiB free"
                )
                print(f"GPU {gpu['index']}: {gpu['name']}, {gpu['memory_gib']} GiB ({free})")
        else:
            print("GPUs: none visible (ranks run on the CPU with gloo)")
        usable = [name for name, ok in facts["backends"].items() if ok]
        print(f"backends: {', '.join(usable) or 'none'}")
        print(f"default: {facts['default_nproc']} process(es) with {facts['default_backend']}")
        print(f"free port on 127.0.0.1: {'yes' if facts['free_loopback_port'] else 'NO'}")
        for problem in facts["problems"]:
            print(f"problem: {problem}")
        if not facts["problems"]:
            print("no problems found")
    return 1 if facts["problems"] else 0
