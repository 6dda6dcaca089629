"""What this machine offers a job: whether torchrun started this process, its CPU
cores and GPUs, and the backend and number of processes that follow from them."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import socket
import subprocess

import torch

from ddpkit.errors import ConfigError
from ddpkit.processes.rehearse import REHEARSE_ENV


def under_torchrun() -> bool:
    """True when torchrun (or another elastic agent) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def cpu_count() -> int:
    """CPU cores this process may run on (respects taskset and cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def visible_gpus(value: str) -> int:
    """GPUs that CUDA_VISIBLE_DEVICES=`value` lets a process use, counted as CUDA does:
    indices or GPU-/MIG- UUIDs, up to the first entry that is neither (so "-1" hides all)."""
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        count += 1
    return count


# Set once GPUs had to be counted through the CUDA driver: a forked worker could not
# use CUDA then.
_CUDA_DRIVER_USED = False


def gpu_count() -> int:
    """GPUs this process may use, counted without initialising CUDA here.

    `torch.cuda.device_count()` and `is_available()` initialise the CUDA driver when
    NVML cannot answer, and a parent that did cannot fork GPU workers; the workers
    also need no context of the parent's on GPU 0. So: NVML, as torch reads it (it
    honours CUDA_VISIBLE_DEVICES), else CUDA_VISIBLE_DEVICES when set, else
    `nvidia-smi -L`; the driver only as a last resort (noted, so that no worker is
    forked after it).
    """
    global _CUDA_DRIVER_USED
    if os.environ.get(REHEARSE_ENV):  # a rank of `ddpkit run --cpu`: ddpkit's own code runs on CPU
        return 0
    if not torch.backends.cuda.is_built() or torch.version.hip:  # type: ignore[no-untyped-call]
        return torch.cuda.device_count()  # 0 on a CPU build; ROCm counts its own way
    nvml = getattr(torch.cuda, "_device_count_nvml", None)
    try:
        count = nvml() if nvml is not None else -1
    except Exception:  # a private helper of torch's: any failure means "NVML cannot say"
        count = -1
    if count >= 0:
        return int(count)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return visible_gpus(visible)
    count = _nvidia_smi_gpus()
    if count > 0:
        return count
    count = torch.cuda.device_count()
    # A driver that found no GPU (or none installed) leaves nothing a fork would copy.
    _CUDA_DRIVER_USED = _CUDA_DRIVER_USED or count > 0
    return count


def _nvidia_smi_gpus() -> int:
    """GPUs that `nvidia-smi -L` lists; 0 without it or when it fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def cuda_driver_used() -> bool:
    """True once `gpu_count` had to ask the CUDA driver: no worker may be forked then."""
    return _CUDA_DRIVER_USED


def resolve_backend(backend: str) -> str:
    """`auto` is nccl when a GPU is visible, gloo otherwise; an impossible choice raises."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"backend must be 'auto', 'gloo' or 'nccl' (got {backend!r})")
    if backend == "auto":
        return "nccl" if gpu_count() > 0 else "gloo"
    if backend == "nccl" and gpu_count() == 0:
        raise ConfigError(
            "backend 'nccl' needs a CUDA GPU and none is visible: pass backend='gloo'"
        )
    return backend


def resolve_nprocs(nprocs: int | str, backend: str) -> int:
    """torchrun's `auto`: one process per visible GPU, else one per CPU core."""
    if nprocs == "auto":
        return gpu_count() if backend == "nccl" else cpu_count()
    if isinstance(nprocs, str) and nprocs.isdigit():
        nprocs = int(nprocs)
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ConfigError(
            f"nprocs must be 'auto' or an integer >= 1 (got {nprocs!r}): pass --nproc 2"
        )
    if backend == "nccl" and nprocs > (gpus := gpu_count()):
        raise ConfigError(
            f"nprocs={nprocs} but only {gpus} GPU(s) are visible: "
            "pass --nproc auto (one process per GPU)"
        )
    return nprocs


def threads_per_rank(local_world_size: int) -> int:
    """A fair share of the cores, so ranks on one machine don't oversubscribe it."""
    return max(1, cpu_count() // max(1, local_world_size))


# Any address outside this machine: a UDP socket "connected" to it (no packet is sent)
# shows the source address of the default route.
_OUTSIDE = ("192.0.2.1", 9)  # TEST-NET-1 (RFC 5737): routed by the default route, never used


def advertised_address(master_addr: str, port: int) -> str | None:
    """The address this machine gives the other nodes of a job whose node 0 is
    `master_addr`: that of its interface that routes to node 0, or, where node 0 is this
    machine and the route is loopback, that of the default route. None when neither
    is known (no route out): torch's agent then gives this machine's host name.

    A host name that only this machine resolves (a pod's, a container's) is what a
    node that cannot resolve it never reaches; an address on the route to node 0 is
    reachable from it."""
    try:
        family, _, _, _, where = socket.getaddrinfo(master_addr, port, type=socket.SOCK_DGRAM)[0]
    except OSError:
        return None  # said where it is used: node 0's address itself cannot be resolved
    for kind, target in ((family, where), (socket.AF_INET, _OUTSIDE)):
        with contextlib.suppress(OSError), socket.socket(kind, socket.SOCK_DGRAM) as probe:
            probe.connect(target)
            source = str(probe.getsockname()[0])
            if not ipaddress.ip_address(source).is_loopback:
                return source
    return None


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds the IPv4 `address`
    (Linux), or None."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            for _, name in socket.if_nameindex():
                with contextlib.suppress(OSError):
                    request = struct.pack("256s", name.encode()[:15])
                    found = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
                    if socket.inet_ntoa(found[20:24]) == address:
                        return name
    except (ImportError, OSError):  # not Linux, or no interfaces to list
        pass
    return None


_SIOCGIFADDR = 0x8915  # Linux's ioctl: an interface's IPv4 address
