"""Issue 31's CUDA defects, checked on the CPU: checkpoints load to the CPU, a rank saves
only its own GPU's RNG state, `ddpkit info` creates no CUDA context, and batches that
are already on a GPU are not pinned. `meta` tensors stand in for CUDA tensors, and
monkeypatched `torch.cuda` functions for a GPU."""

from __future__ import annotations

import argparse
import os
import random
import stat
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ddpkit import DistContext
from ddpkit.checkpoint.pt import load_checkpoint, save_checkpoint
from ddpkit.checkpoint.state import load_state, save_state
from ddpkit.cli import info
from ddpkit.errors import ConfigError
from ddpkit.parallel.data import prepare_loader
from ddpkit.seed import rng_state, set_rng_state
from ddpkit.training.config import TrainConfig
from ddpkit.training.trainer import Trainer

CPU = DistContext()
GPU = DistContext(device=torch.device("cuda", 0), backend="nccl")  # never touches a GPU here


# -- 1. checkpoints load to the CPU -------------------------------------------------------
def _adamw_state() -> dict[str, Any]:
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}


def test_a_checkpoint_loads_to_the_cpu_whatever_the_rank_device(tmp_path: Path) -> None:
    path = save_checkpoint(_adamw_state(), tmp_path, CPU, step=1)
    # `meta` stands in for cuda:N: what was mapped onto the rank's device would be there.
    state = load_checkpoint(path, DistContext(device=torch.device("meta")))
    assert {t.device.type for t in state["model"].values()} == {"cpu"}
    assert state["rng"][0]["torch"].device.type == "cpu"  # every rank's, on every rank
    steps = [s["step"] for s in state["optimizer"]["state"].values()]
    assert {t.device.type for t in steps} == {"cpu"}
    # load_state_dict places the state: the step stays on the CPU (no host sync per
    # parameter in foreach Adam), the moments go to the parameters' device.
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    for p in model.parameters():
        assert opt.state[p]["step"].device.type == "cpu"
        assert opt.state[p]["exp_avg"].device == p.device


def test_load_state_gives_your_extra_tensors_on_this_ranks_device(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    extra = {"best": torch.ones(2), "seen": [torch.zeros(1)], "note": "hi"}
    save_state(tmp_path, CPU, model=model, optimizer=opt, epoch=1, step=1, extra=extra)
    # The model and optimizer are on the CPU; the caller's own tensors go to ctx.device.
    got = load_state(tmp_path, DistContext(device=torch.device("meta")), model=model, optimizer=opt)
    assert got is not None and got["note"] == "hi"
    assert got["best"].device.type == "meta" and got["seen"][0].device.type == "meta"


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def _fit(folder: Path, epochs: int, resume: bool) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = TrainConfig(epochs=epochs, batch_size=4, checkpoint_dir=str(folder), resume=resume)
    trainer = Trainer(model, opt, _data(16), CPU, config, log_fn=lambda s: None)
    trainer.fit()
    return trainer


def test_a_resumed_adamw_keeps_its_step_on_the_cpu(tmp_path: Path) -> None:
    _fit(tmp_path, 1, resume=False)
    trainer = _fit(tmp_path, 2, resume=True)
    assert trainer.global_step == 8
    for p in trainer.model.parameters():
        state = trainer.optimizer.state[p]
        assert state["step"].device.type == "cpu" and int(state["step"]) == 8


# -- 2. a rank saves its own GPU's RNG state ----------------------------------------------
def _fake_gpus(monkeypatch: pytest.MonkeyPatch, current: int, count: int) -> list[Any]:
    """A GPU job as `torch.cuda` tells it; returns the (state, device) restored."""
    restored: list[Any] = []

    def everyone(*args: Any) -> Any:
        raise AssertionError("the RNG states of every visible GPU were asked for")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(
        torch.cuda,
        "get_rng_state",
        lambda device="cuda": torch.full((4,), int(torch.device("cuda", device).index or 0)),
    )
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", everyone)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", everyone)
    monkeypatch.setattr(
        torch.cuda,
        "set_rng_state",
        lambda state, device="cuda": restored.append((state.clone(), device)),
    )
    return restored


def test_a_rank_saves_and_restores_only_its_own_gpus_rng_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    restored = _fake_gpus(monkeypatch, current=3, count=8)
    state = rng_state()
    assert torch.equal(state["cuda"], torch.full((4,), 3))  # one tensor: device 3's
    set_rng_state(state)
    assert len(restored) == 1 and torch.equal(restored[0][0], torch.full((4,), 3))


def test_an_old_checkpoints_list_of_every_gpus_state_restores_the_current_devices_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old = {**rng_state(), "cuda": [torch.full((4,), i) for i in range(8)]}  # 8 GPUs saved
    restored = _fake_gpus(monkeypatch, current=0, count=1)  # resumed with 1 visible
    set_rng_state(old)
    assert len(restored) == 1 and torch.equal(restored[0][0], torch.full((4,), 0))
    restored.clear()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 9)  # not in the list: skipped
    set_rng_state(old)
    assert restored == []


# -- 3. ddpkit info creates no CUDA context -----------------------------------------------
_UUIDS = ("GPU-11111111-2222-3333-4444-555555555555", "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee")


def _gpus_without_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two GPUs that torch can describe; anything that would create a context raises."""

    def context(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("ddpkit info created a CUDA context")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: SimpleNamespace(
            name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30, uuid=_UUIDS[i][4:]
        ),
    )
    for name in ("mem_get_info", "init", "set_device", "current_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, context)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import raises


def test_info_reads_free_memory_from_nvidia_smi_without_a_cuda_context(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _gpus_without_contexts(monkeypatch)
    smi = tmp_path / "nvidia-smi"
    # Listed in another order than torch's, as CUDA_VISIBLE_DEVICES may make it.
    smi.write_text(
        f"#!/bin/sh\necho '{_UUIDS[1]}, 81559, 10240'\necho '{_UUIDS[0]}, 81559, 71680'\n"
    )
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    facts = info.gather()
    assert [(g["index"], g["name"], g["memory_gib"]) for g in facts["gpus"]] == [
        (0, "NVIDIA H100 80GB HBM3", 80.0),
        (1, "NVIDIA H100 80GB HBM3", 80.0),
    ]
    assert [g["free_gib"] for g in facts["gpus"]] == [70.0, 10.0]
    busy = [p for p in facts["problems"] if "free" in p]
    assert len(busy) == 1 and busy[0].startswith("GPU 1 has only 10.0 of")


def test_info_without_nvidia_smi_lists_the_gpus_with_free_memory_unknown(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _gpus_without_contexts(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    facts = info.gather()
    assert [(g["index"], g["free_gib"]) for g in facts["gpus"]] == [(0, None), (1, None)]
    assert not [p for p in facts["problems"] if "free" in p]
    info.run(argparse.Namespace(json=False))
    assert "GPU 1: NVIDIA H100 80GB HBM3, 80.0 GiB (free memory unknown)" in capsys.readouterr().out


# -- 4. batches already on the GPU are not pinned -----------------------------------------
class _Augmented(Dataset[Any]):
    """Samples on `device`, with a random augmentation drawn from every RNG."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        noise = torch.rand(1).item() + random.random() + np.random.rand()
        return {"x": torch.full((2,), noise, device=self.device), "y": torch.tensor(i)}


def _draws() -> list[float]:
    return [torch.rand(1).item(), random.random(), float(np.random.rand())]


def test_the_default_pins_only_samples_on_the_cpu_and_draws_nothing() -> None:
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = _draws()
    for device, pinned in (("meta", False), ("cpu", True)):
        torch.manual_seed(1), random.seed(1), np.random.seed(1)
        assert prepare_loader(_Augmented(device), GPU, batch_size=2).pin_memory is pinned
        assert _draws() == expected  # reading the first sample left the streams alone
    meta = TensorDataset(torch.zeros(4, 2, device="meta"))
    assert prepare_loader(meta, GPU, batch_size=2).pin_memory is False
    assert prepare_loader(_Augmented("meta"), CPU, batch_size=2).pin_memory is False


def test_pin_memory_asked_for_samples_on_a_gpu_is_one_line_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"pin_memory=True .* meta .* drop pin_memory=True"):
        prepare_loader(_Augmented("meta"), GPU, batch_size=2, pin_memory=True)
    unpinned = prepare_loader(_Augmented("meta"), GPU, batch_size=2, pin_memory=False)
    assert unpinned.pin_memory is False
