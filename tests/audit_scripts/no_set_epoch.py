"""A regression model trained with DDP for a few epochs, launched with torchrun.

The DistributedSampler shuffles, but the loop never calls `sampler.set_epoch(epoch)`:
every epoch visits the data in the same order as the first (the audit's DDP101).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class NoisyRegression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """y = x @ w + b, with Gaussian jitter on the inputs as augmentation."""

    def __init__(self, size: int, features: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=generator)
        w = torch.randn(features, 1, generator=generator)
        self.y = self.x @ w + 0.5

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[index]
        return x + 0.05 * torch.randn_like(x), self.y[index]


def build_model(features: int) -> nn.Module:
    return nn.Sequential(nn.Linear(features, 32), nn.GELU(), nn.Linear(32, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend="gloo")
    torch.manual_seed(0)

    dataset = NoisyRegression(512)
    sampler = DistributedSampler(dataset, shuffle=True)  # audit: DDP101
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = DDP(build_model(16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    for epoch in range(args.epochs):
        model.train()
        total = torch.zeros(2)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(x), len(x)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch}: loss {total[0].item() / total[1].item():.4f}", flush=True)
    if rank == 0:
        print(f"trained on {world_size} ranks (local rank {local_rank} printing)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
