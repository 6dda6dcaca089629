"""Shaped like pytorch/examples' imagenet main.py on a machine without an accelerator:
rank and world size from torchrun's environment (--dist-url env://), a process group,
but the DDP wrap sits in the accelerator branch, so on CPU each rank trains alone; an
AverageMeter whose totals are all-reduced; the group is never destroyed. Ours: an MLP on
synthetic data with BatchNorm, SGD with momentum and cosine decay."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class AverageMeter:
    def __init__(self):
        self.sum, self.count = 0.0, 0

    def update(self, value, n):
        self.sum += value * n
        self.count += n

    def all_reduce(self):
        total = torch.tensor([self.sum, self.count], dtype=torch.float32)
        dist.all_reduce(total, dist.ReduceOp.SUM)
        self.sum, self.count = total.tolist()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dist-url", default="tcp://224.66.41.62:23456")
    parser.add_argument("--world-size", default=-1, type=int)
    parser.add_argument("--rank", default=-1, type=int)
    parser.add_argument("--epochs", default=2, type=int)
    args = parser.parse_args()
    if args.dist_url == "env://" and args.world_size == -1:
        args.world_size = int(os.environ["WORLD_SIZE"])
    if args.dist_url == "env://" and args.rank == -1:
        args.rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo", init_method=args.dist_url, world_size=args.world_size, rank=args.rank
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 5))
    use_accel = torch.accelerator.is_available()
    if not use_accel:
        print("using CPU, this will be slow")
    else:
        model = nn.parallel.DistributedDataParallel(model.to("cuda"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(80, 10, generator=g), torch.randint(0, 5, (80,), generator=g))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=10, sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        losses = AverageMeter()
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.update(loss.item(), len(y))
        losses.all_reduce()
        scheduler.step()
        if args.rank == 0:
            print(f"epoch {epoch}: loss {losses.sum / losses.count:.3f}")


if __name__ == "__main__":
    main()
