"""Shaped like facebookresearch/moco's main_moco.py (and timm's BatchNorm models) under
torchrun: the save is guarded for mp.spawn (`not multiprocessing_distributed or rank %
ngpus == 0`), which every rank passes when torchrun starts them; a BatchNorm model
wrapped in DDP without SyncBatchNorm; the group is never destroyed. Ours: a small
conv net on random images, a momentum-updated key encoder as in MoCo."""

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--multiprocessing-distributed", action="store_true")
    parser.add_argument("--epochs", default=1, type=int)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, ngpus_per_node = dist.get_rank(), 1
    torch.manual_seed(0)
    query = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    )
    key = copy.deepcopy(query).requires_grad_(False)
    model = nn.parallel.DistributedDataParallel(query)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    g = torch.Generator().manual_seed(rank)
    for epoch in range(args.epochs):
        for _ in range(3):
            images = torch.rand(4, 3, 12, 12, generator=g)
            q = F.normalize(model(images + 0.1 * torch.randn_like(images)), dim=1)
            with torch.no_grad():
                for pk, pq in zip(key.parameters(), query.parameters(), strict=True):
                    pk.mul_(0.99).add_(pq.detach(), alpha=0.01)
                k = F.normalize(key(images), dim=1)
            loss = F.cross_entropy(q @ k.t() / 0.2, torch.arange(len(q)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if not args.multiprocessing_distributed or (
            args.multiprocessing_distributed and rank % ngpus_per_node == 0
        ):
            torch.save(
                {"epoch": epoch + 1, "state_dict": model.state_dict()},
                f"checkpoint_{epoch:04d}.pth.tar",
            )
    print(f"rank {rank} done in {os.getcwd() and 'the run folder'}")


if __name__ == "__main__":
    main()
