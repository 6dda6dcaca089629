"""A DDP training job whose rank 0 saves the wrapper's state dict.

`model.state_dict()` of a DistributedDataParallel model names every tensor
`module.<name>`: the file then loads into nothing but another DDP wrapper (the audit's
DDP104). Saving `model.module.state_dict()` would be right.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Sines(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of noisy sine waves; the target is the next value. A random amplitude
    scale is the augmentation."""

    def __init__(self, size: int, window: int = 24, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        phase = 6.28 * torch.rand(size, 1, generator=generator)
        freq = 0.1 + 0.4 * torch.rand(size, 1, generator=generator)
        t = torch.arange(window + 1, dtype=torch.float32)
        self.series = torch.sin(phase + freq * t)

    def __len__(self) -> int:
        return len(self.series)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        scale = 0.8 + 0.4 * torch.rand(1)
        series = scale * self.series[index]
        return series[:-1], series[-1:]


class Forecaster(nn.Module):
    def __init__(self, window: int = 24, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(window, hidden), nn.Tanh(), nn.Linear(hidden, hidden))
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--checkpoint-dir", default=os.environ.get("AUDIT_OUT", "."))
    args = parser.parse_args()

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group(backend="gloo", init_method="env://")
    torch.manual_seed(0)

    dataset = Sines(320)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=20, sampler=sampler, num_workers=0)
    model = DistributedDataParallel(Forecaster())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.smooth_l1_loss(model(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}")

    if rank == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        path = os.path.join(args.checkpoint_dir, "forecaster.pt")
        torch.save(model.state_dict(), path)  # audit: DDP104
        print(f"saved {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
