"""The DDP tutorial's `multigpu.py`, ported to gloo on CPU, and the benchmarks' workloads.

The hand-written contestant of `overhead.py` and `peers.py`: its `Trainer` with
`_run_batch` and `_run_epoch`, `DistributedSampler` + `shuffle=False` + `set_epoch`,
`DDP(model)` and `init_process_group`, changed only where the tutorial cannot run here:
MSE loss (its `cross_entropy` on one logit never learns), a seeded dataset identical on
every rank, a rendezvous store on a port the OS picked instead of 12355, and no per-epoch
print. It checkpoints only when a workload asks for it (`Workload.checkpoint_dir`, the
short runs of `peers.py`), as the tutorial does: rank 0 `torch.save`s the model's state
dict after each epoch, to one file it overwrites.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddpkit.examples.linear import dataset as linear_dataset

# Public in torch.distributed, but not re-exported in its type stubs.
TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]
LOOPBACK = "127.0.0.1"


# -- workloads --------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One training job; `epochs` sizes a measured run (seconds, not minutes)."""

    name: str
    description: str
    samples: int
    batch_size: int  # per rank
    epochs: int
    lr: float
    classify: bool = False  # cross-entropy over class labels instead of MSE
    # A checkpoint after each epoch into this folder (the same on every rank); None: none.
    # Set by the launch that runs it (a temporary folder), never in WORKLOADS.
    checkpoint_dir: str | None = None


WORKLOADS: dict[str, Workload] = {
    "linear": Workload(
        "linear", "2,048 (20->1) pairs, Linear(20,1), SGD lr 1e-3", 2048, 32, epochs=40, lr=1e-3
    ),
    "mlp": Workload(
        "mlp",
        "4,096 (512->1) pairs, MLP 512-1024-1024-1 (ReLU), SGD lr 1e-3",
        4096,
        64,
        epochs=3,
        lr=1e-3,
    ),
    "cnn": Workload(
        "cnn",
        "2,048 synthetic 3x32x32 images, 10 classes, 2 conv+BatchNorm blocks, SGD lr 1e-2",
        2048,
        32,
        epochs=2,
        lr=1e-2,
        classify=True,
    ),
}
MLP_FEATURES, MLP_HIDDEN = 512, 1024


def mlp_dataset(size: int, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, MLP_FEATURES, generator=g)
    return TensorDataset(x, x[:, :8].sum(dim=1, keepdim=True) + 0.1 * torch.randn(size, 1))


def image_dataset(size: int, seed: int = 1234) -> TensorDataset:
    """Random images whose class shifts their mean, so the CNN has something to learn."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (size,), generator=g)
    images = torch.randn(size, 3, 32, 32, generator=g) + labels.view(-1, 1, 1, 1) / 10
    return TensorDataset(images, labels)


def cnn_model() -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 16),
        nn.MaxPool2d(2),
        *block(16, 32),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def load_train_objs(
    workload: Workload,
) -> tuple[Dataset[Any], nn.Module, torch.optim.Optimizer]:
    """The tutorial's `load_train_objs`: the same seeded data and model on every rank."""
    torch.manual_seed(0)
    model: nn.Module
    if workload.name == "linear":
        train_set: Dataset[Any] = linear_dataset(workload.samples)
        model = nn.Linear(20, 1)
    elif workload.name == "mlp":
        train_set = mlp_dataset(workload.samples)
        model = nn.Sequential(
            nn.Linear(MLP_FEATURES, MLP_HIDDEN),
            nn.ReLU(),
            nn.Linear(MLP_HIDDEN, MLP_HIDDEN),
            nn.ReLU(),
            nn.Linear(MLP_HIDDEN, 1),
        )
    elif workload.name == "cnn":
        train_set = image_dataset(workload.samples)
        model = cnn_model()
    else:
        raise ValueError(f"unknown workload {workload.name!r}: pick one of {sorted(WORKLOADS)}")
    optimizer = torch.optim.SGD(model.parameters(), lr=workload.lr)
    return train_set, model, optimizer


def loss_fn(workload: Workload) -> Any:
    return F.cross_entropy if workload.classify else F.mse_loss


def threads_for(world_size: int) -> int:
    """What `ddpkit.launch` gives each rank: a fair share of the usable cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, world_size))


def digest(model: nn.Module) -> str:
    """sha256 over the parameters: contestants that agree end with the same model."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# -- the tutorial -----------------------------------------------------------------------
def loopback_store(world_size: int) -> Any:
    """The rendezvous store, at a free port, listening on 127.0.0.1 only.

    TCPStore listens on every interface when it opens its own socket, so it gets one
    already bound to loopback (as `ddpkit.processes.store.serve_store` does; not imported here,
    so that the hand-written contestant's start-up does not load ddpkit).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    options = {"is_master": True, "wait_for_workers": False, "master_listen_fd": sock.detach()}
    if (2, 4) <= tuple(map(int, torch.__version__.split(".")[:2])) < (2, 8):
        options["use_libuv"] = False  # its libuv store refuses a socket handed to it
    return TCPStore(LOOPBACK, port, world_size, **options)


def ddp_setup(rank: int, world_size: int, store_port: int, backend: str = "gloo") -> None:
    # The tutorial sets MASTER_ADDR=localhost, MASTER_PORT=12355 and uses env://; a fixed
    # port collides with any other job, so the parent holds a store on a port the OS
    # picked and every rank joins it.
    store = TCPStore(LOOPBACK, store_port, world_size, is_master=False)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)


class TutorialTrainer:
    """The tutorial's `Trainer`; `DDP(model, device_ids=[rank])` on a GPU, as there."""

    def __init__(
        self,
        model: nn.Module,
        train_data: DataLoader[Any],
        optimizer: torch.optim.Optimizer,
        rank: int,
        device: torch.device,
        loss: Any = F.mse_loss,
        checkpoint: Path | None = None,
    ) -> None:
        self.rank = rank
        self.checkpoint = checkpoint  # the tutorial's "checkpoint.pt", saved every epoch
        self.device = device
        model = model.to(device)
        self.model = DDP(model, device_ids=[rank]) if device.type == "cuda" else DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.loss = loss

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = self.loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> float:
        sampler = self.train_data.sampler
        assert isinstance(sampler, DistributedSampler)
        sampler.set_epoch(epoch)
        start = time.perf_counter()  # timed like ddpkit's Trainer: the batch loop only
        for source, targets in self.train_data:
            source = source.to(self.device)
            targets = targets.to(self.device)
            self._run_batch(source, targets)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def _save_checkpoint(self, path: Path) -> None:
        """The tutorial's: the bare model's state dict, by `torch.save` (no optimizer, no
        fsync, no temporary file: a crash mid-write leaves it damaged)."""
        torch.save(self.model.module.state_dict(), path)

    def train(self, max_epochs: int) -> float:
        """Trains; returns the summed time of the epochs' batch loops."""
        train_s = 0.0
        for epoch in range(max_epochs):
            train_s += self._run_epoch(epoch)
            if self.rank == 0 and self.checkpoint is not None:  # save_every = 1
                self._save_checkpoint(self.checkpoint)
        return train_s


def prepare_dataloader(dataset: Dataset[Any], batch_size: int, pin: bool) -> DataLoader[Any]:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=pin,  # the tutorial pins for its GPU
        shuffle=False,
        sampler=DistributedSampler(dataset),
    )
