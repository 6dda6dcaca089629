"""A small classifier trained with DDP, whose final weights every rank saves.

Each rank writes the same file at the end (the audit's DDP103): the ranks race on one
path, and on shared storage the file can come out torn.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_data(n: int, features: int, classes: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    centers = 2.0 * torch.randn(classes, features, generator=generator)
    labels = torch.randint(0, classes, (n,), generator=generator)
    points = centers[labels] + torch.randn(n, features, generator=generator)
    return TensorDataset(points, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default=os.environ.get("AUDIT_OUT", "."))
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(1234)

    dataset = make_data(384, features=8, classes=4)
    sampler = DistributedSampler(dataset, shuffle=True, seed=1234)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        correct = 0
        for x, y in loader:
            optimizer.zero_grad()
            logits = model(x)
            loss = criterion(logits, y)
            loss.backward()
            optimizer.step()
            correct += int((logits.argmax(1) == y).sum())
        print(f"rank {rank} epoch {epoch}: train accuracy {correct / len(sampler):.2f}")

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "model.pt")
    torch.save(model.module.state_dict(), path)  # audit: DDP103
    print(f"rank {rank}: saved {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
