"""The PyTorch DDP tutorial's multigpu_torchrun.py, run on CPU ranks.

Its Trainer calls `set_epoch` every epoch, rank 0 alone writes the snapshot of
`model.module.state_dict()` (to one path, every epoch), and the group is destroyed at
the end: the audit must find nothing. As in the tutorial, `_run_epoch` first peeks at
one batch with `next(iter(...))` before `set_epoch`, which is not a second epoch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        source, target = self.data[index]
        return source + 0.01 * torch.randn_like(source), target  # a little jitter


def ddp_setup() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        init_process_group(backend="nccl")
    else:
        init_process_group(backend="gloo")


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader[tuple[torch.Tensor, torch.Tensor]],
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
    ) -> None:
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.device = torch.device(f"cuda:{self.gpu_id}" if torch.cuda.is_available() else "cpu")
        self.model: torch.nn.Module = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)

        device_ids = [self.gpu_id] if torch.cuda.is_available() else None
        self.model = DDP(self.model, device_ids=device_ids)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        steps = len(self.train_data)
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {steps}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            source = source.to(self.device)
            targets = targets.to(self.device)
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "EPOCHS_RUN": epoch,
        }
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs() -> tuple[MyTrainDataset, torch.nn.Module, torch.optim.Optimizer]:
    train_set = MyTrainDataset(1024)  # load your dataset
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(
    dataset: Dataset[tuple[torch.Tensor, torch.Tensor]], batch_size: int
) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=torch.cuda.is_available(),
        shuffle=False,
        sampler=DistributedSampler(dataset),
    )


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str) -> None:
    ddp_setup()
    torch.manual_seed(0)
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, nargs="?", default=3, help="Total epochs")
    parser.add_argument("save_every", type=int, nargs="?", default=1, help="Snapshot every N")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size per rank")
    parser.add_argument("--snapshot_dir", default=os.environ.get("AUDIT_OUT", "."))
    args = parser.parse_args()

    torch.set_num_threads(1)
    path = os.path.join(args.snapshot_dir, "snapshot.pt")
    main(args.save_every, args.total_epochs, args.batch_size, path)
