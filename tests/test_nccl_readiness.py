"""GPU readiness shown on the CPU (issue 31): what ddpkit gives an NCCL job that needs no
GPU to check. Each part says what a GPU run still has to prove."""

from __future__ import annotations

import json
import os
import pickle
import stat
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

import ddpkit.processes.group as ddist
from ddpkit import DistContext, launch
from ddpkit.errors import ConfigError, WorkerError
from ddpkit.processes import launcher as ln
from ddpkit.processes import machine, workers
from ddpkit.processes.start import start_method

# -- helpers for launches that believe they run NCCL ---------------------------------------
# The workers are forked, so they keep these patches; the group underneath is gloo.
_SEEN: dict[str, Any] = {}
_RECORDS: list[Path] = []
_REAL_INIT = ddist.init_group
_REAL_DESTROY = ddist.destroy_group


def _init_as_if_nccl(
    backend: str, rank: int, world: int, device: Any, timeout_s: float, **how: Any
) -> None:
    _SEEN.update(backend=backend, timeout=timeout_s)
    _REAL_INIT("gloo", rank, world, torch.device("cpu"), timeout_s, **how)


def _recording_destroy(**kwargs: Any) -> None:
    rank = os.environ.get("RANK", "?")
    (_RECORDS[0] / f"teardown{rank}.json").write_text(json.dumps(kwargs))
    _REAL_DESTROY()  # the real group is gloo: destroying it is always right


_FR = (
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
)


def _what_the_worker_got(ctx: DistContext) -> dict[str, Any]:
    return {**_SEEN, "env": {k: os.environ.get(k) for k in _FR}, "ctx_backend": ctx.backend}


def _raise_everywhere(ctx: DistContext) -> None:
    raise ValueError(f"rank {ctx.rank} fails")


def _as_if_nccl(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ln, "resolve_backend", lambda backend: "nccl")
    monkeypatch.setattr(ln, "resolve_nprocs", lambda nprocs, backend: 2)
    for module in (ln, workers):  # a rank in place, a worker
        monkeypatch.setattr(module, "device_for", lambda backend, rank: torch.device("cpu"))
        monkeypatch.setattr(module, "init_group", _init_as_if_nccl)
        monkeypatch.setattr(module, "destroy_group", _recording_destroy)
    for name in _FR:
        monkeypatch.delenv(name, raising=False)
    _RECORDS[:] = [tmp_path]


# -- 1. NCCL's watchdog speaks before ddpkit's hang timeout --------------------------------
def test_a_gpu_workers_group_times_out_below_the_hang_timeout_with_the_flight_recorder_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Proves the worker applies nccl_watch; that NCCL then prints its WorkNCCL timeout and
    # dumps its flight recorder needs a GPU.
    _as_if_nccl(monkeypatch, tmp_path)
    got = launch(_what_the_worker_got, timeout=60, hang_timeout=20, start="fork")
    assert got["backend"] == "nccl" and got["ctx_backend"] == "nccl"
    assert 0 < got["timeout"] < 20, got  # NCCL's collectives fail before ddpkit's timer
    env = got["env"]
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    dump = env["TORCH_FR_DUMP_TEMP_FILE"] or env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    assert dump is not None and "ddpkit-job-" in dump  # in the job's own folder


def test_nccl_watch_sets_the_timeout_and_the_recorder_and_leaves_gloo_alone(
    tmp_path: Path,
) -> None:
    from ddpkit.processes.nccl import nccl_watch

    assert nccl_watch("gloo", 300, 1800, tmp_path, {}) == ({}, 1800)
    env, timeout = nccl_watch("nccl", 300, 1800, tmp_path, {})
    assert 240 <= timeout < 300
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    names = set(env)
    assert names & {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}
    (dump,) = [
        env[n] for n in names & {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
    ]
    assert Path(dump).parent == tmp_path
    # A short hang timeout still leaves NCCL a share of it.
    assert nccl_watch("nccl", 4, 1800, tmp_path, {})[1] == 2
    # ddpkit's timer off: NCCL keeps the collective timeout, the recorder stays on.
    env, timeout = nccl_watch("nccl", 0, 1800, tmp_path, {})
    assert timeout == 1800 and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    # No folder (torchrun): only the timeout.
    assert nccl_watch("nccl", 300, 1800, None, {})[0] == {}


def test_nccl_watch_keeps_what_the_user_set(tmp_path: Path) -> None:
    from ddpkit.processes.nccl import nccl_watch

    mine = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "77",  # the old name of the new TORCH_FR_BUFFER_SIZE
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_",
    }
    env, _ = nccl_watch("nccl", 300, 1800, tmp_path, mine)
    assert env == {}


def test_the_flight_recorders_dumps_outlive_the_job_and_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddpkit.processes.nccl import TRACE_PREFIX

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    job = tmp_path / "ddpkit-job-x" / "nccl-trace"
    job.mkdir(parents=True)
    ln._keep_traces(job)  # nothing dumped: nothing said
    assert capsys.readouterr().err == ""
    (job / f"{TRACE_PREFIX}1").write_bytes(b"dump")
    ln._keep_traces(job)
    (kept,) = tmp_path.glob("ddpkit-nccl-trace-*")
    assert (kept / f"{TRACE_PREFIX}1").read_bytes() == b"dump"
    err = capsys.readouterr().err
    assert str(kept) in err and "torchfrtrace" in err and err.count("\n") == 1


def test_a_rank_that_nccls_watchdog_ended_is_described_so() -> None:
    assert "NCCL's watchdog" in ln._describe_exit(1, -6, nccl=True)
    assert ln._describe_exit(1, -6) == "rank 1 was killed by SIGABRT"


# -- 2. an error with an NCCL collective pending aborts the group --------------------------
def test_the_error_path_aborts_nccl_and_destroys_everything_else() -> None:
    # The decision only: that abort returns while a kernel waits needs a GPU.
    assert ddist.teardown("nccl", failed=True) == "abort"
    assert ddist.teardown("nccl", failed=False) == "destroy"
    assert ddist.teardown("gloo", failed=True) == "destroy"
    assert ddist.teardown("gloo", failed=False) == "destroy"


class _World:
    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1


def _no_destroy() -> None:
    raise AssertionError("destroy_process_group waits for every NCCL kernel")


def test_destroy_group_aborts_a_failed_nccl_group_with_whatever_torch_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "destroy_process_group", _no_destroy)
    world = _World()
    monkeypatch.setattr(dist.distributed_c10d._world, "default_pg", world)
    calls: list[Any] = []
    monkeypatch.setattr(
        dist.distributed_c10d, "_abort_process_group", lambda group=None: calls.append(group)
    )
    ddist.destroy_group(failed=True)
    assert calls == [world] and world.aborted == 0  # WORLD by name: every group
    # A torch without _abort_process_group: the group's own abort.
    monkeypatch.delattr(dist.distributed_c10d, "_abort_process_group")
    ddist.destroy_group(failed=True)
    assert world.aborted == 1


def test_a_failed_gpu_worker_aborts_its_group_and_a_finished_one_destroys_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _as_if_nccl(monkeypatch, tmp_path)
    with pytest.raises(WorkerError):
        launch(_raise_everywhere, start="fork")
    seen = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("teardown*.json")}
    assert seen == {f"teardown{r}.json": {"failed": True} for r in (0, 1)}
    for p in tmp_path.glob("teardown*.json"):
        p.unlink()
    launch(_what_the_worker_got, start="fork")
    seen = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("teardown*.json")}
    assert seen == {f"teardown{r}.json": {"failed": False} for r in (0, 1)}


def test_an_error_under_torchrun_aborts_the_nccl_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # In place, as under torchrun (ddpkit run passes its hang timeout); no group is made.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("DDPKIT_HANG_TIMEOUT", "20")
    _as_if_nccl(monkeypatch, tmp_path)
    monkeypatch.setattr(
        ln, "init_group", lambda b, r, w, d, timeout_s, **how: _SEEN.update(timeout=timeout_s)
    )
    monkeypatch.setattr(
        ln, "destroy_group", lambda **kw: (tmp_path / "teardown.json").write_text(json.dumps(kw))
    )
    with pytest.raises(ValueError, match="rank 0 fails"):
        ln._run_in_place(_raise_everywhere, (), "nccl", 60)
    assert json.loads((tmp_path / "teardown.json").read_text()) == {"failed": True}
    assert 0 < _SEEN["timeout"] < 20  # ddpkit run's hang timeout reaches NCCL too


# -- 3. rank 0's result comes back on the CPU ------------------------------------------------
class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on GPU 0; moving it to the CPU gives a plain tensor."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    def to(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override, unused-ignore]
        return self.as_subclass(torch.Tensor).to(*args, **kwargs)


def _gpu(*values: float) -> torch.Tensor:
    return torch.tensor(values).as_subclass(_OnGpu)


class _Pair(NamedTuple):
    weight: torch.Tensor
    steps: int


class _Opaque:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_rank0s_result_is_sent_with_its_tensors_on_the_cpu() -> None:
    # What a real CUDA tensor does in `.to("cpu")` (and that the parent then creates no
    # context) needs a GPU; here a tensor that reports GPU 0 stands in for it.
    sent: list[bytes] = []

    class Conn:
        def send_bytes(self, data: bytes) -> None:
            sent.append(data)

    workers._send(Conn(), ("ok", {"loss": _gpu(0.5), "per_rank": [_gpu(1.0, 2.0)]}))  # type: ignore[arg-type]
    kind, result = pickle.loads(sent[0])
    assert kind == "ok"
    for t in (result["loss"], result["per_rank"][0]):
        assert type(t) is torch.Tensor and t.device.type == "cpu"
    assert result["per_rank"][0].tolist() == [1.0, 2.0]


def test_the_result_walk_keeps_structure_and_leaves_other_objects_alone() -> None:
    opaque, cpu = _Opaque(_gpu(9.0)), torch.tensor([3.0])
    meta = torch.empty(2, device="meta")  # no data to copy: left as it is
    weight = torch.tensor([1.0]).as_subclass(_OnGpu)
    result = {
        "state": OrderedDict(w=_gpu(1.0), b=_gpu(2.0)),
        "pairs": [_Pair(_gpu(4.0), 7), (_gpu(5.0), "x")],
        "opaque": opaque,
        "cpu": cpu,
        "meta": meta,
        "grad": weight.requires_grad_(),
    }
    out = workers.result_on_cpu(result)
    assert type(out["state"]) is OrderedDict and list(out["state"]) == ["w", "b"]
    assert [type(t) for t in out["state"].values()] == [torch.Tensor, torch.Tensor]
    assert type(out["pairs"][0]) is _Pair and out["pairs"][0].steps == 7
    assert out["pairs"][0].weight.device.type == "cpu" and out["pairs"][1][1] == "x"
    assert type(out["pairs"][1]) is tuple and out["pairs"][1][0].item() == 5.0
    assert out["opaque"] is opaque  # not a container ddpkit walks: left alone
    assert out["cpu"] is cpu and out["meta"] is meta  # nothing to move
    assert out["grad"].requires_grad and out["grad"].is_leaf
    pickle.dumps(out)  # a copy that kept requires_grad still pickles


# -- 4. counting GPUs creates no CUDA context in the parent ---------------------------------
def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def context(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the parent called a CUDA API")

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)  # a CUDA build of torch
    for name in ("is_available", "device_count", "init", "current_device", "set_device"):
        monkeypatch.setattr(torch.cuda, name, context)
    monkeypatch.setattr(torch.cuda, "mem_get_info", context)
    monkeypatch.setattr(torch.cuda, "_lazy_init", context)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", context, raising=False)


def test_resolving_a_gpu_job_in_the_parent_touches_no_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The resolution only: that the workers then start on 2 real GPUs needs a GPU.
    _no_cuda(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert machine.resolve_backend("auto") == "nccl"
    assert machine.resolve_backend("nccl") == "nccl"
    assert machine.resolve_nprocs("auto", "nccl") == 2
    assert machine.resolve_nprocs(2, "nccl") == 2
    with pytest.raises(ConfigError, match=r"only 2 GPU\(s\) are visible"):
        machine.resolve_nprocs(3, "nccl")
    assert start_method("auto", "nccl") in ("forkserver", "spawn")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert machine.resolve_backend("auto") == "gloo"


@pytest.mark.parametrize(
    ("visible", "count"),
    [("0,1", 2), ("", 0), ("3", 1), ("GPU-8d2f,MIG-1a2b", 2), ("0,-1,2", 1), (" 1 , 2 ", 2)],
)
def test_cuda_visible_devices_is_counted_as_cuda_counts_it(visible: str, count: int) -> None:
    assert machine.visible_gpus(visible) == count


def test_without_cuda_visible_devices_gpus_are_counted_by_nvml_or_nvidia_smi(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _no_cuda(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 3, raising=False)
    assert machine.gpu_count() == 3
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1, raising=False)  # no NVML
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        "echo 'GPU 0: NVIDIA H100 (UUID: GPU-a)'\n"
        "echo 'GPU 1: NVIDIA H100 (UUID: GPU-b)'\n"
    )
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert machine.gpu_count() == 2
