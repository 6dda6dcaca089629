"""Shaped like LLMs-from-scratch's DDP-script-torchrun.py: a toy dataset in the script,
DistributedSampler with set_epoch each epoch, and after training an accuracy pass over the
training loader (same sampler, same last epoch) and the test loader, then
destroy_process_group. Ours: three classes in 3-D, a GELU MLP, SGD with Nesterov."""

import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def accuracy(model, loader):
    model.eval()
    correct = total = 0
    for x, y in loader:
        with torch.no_grad():
            correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
    return correct / total


def main(rank, world_size, epochs):
    init_process_group(backend="gloo", rank=rank, world_size=world_size)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(24, 3, generator=g)
    y = x.argmax(1)
    train = TensorDataset(x, y)
    train_loader = DataLoader(
        train, batch_size=4, drop_last=True, sampler=DistributedSampler(train)
    )
    test_loader = DataLoader(TensorDataset(x[:6], y[:6]), batch_size=3)
    torch.manual_seed(123)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(3, 12), torch.nn.GELU(), torch.nn.Linear(12, 3))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, nesterov=True)
    for epoch in range(epochs):
        train_loader.sampler.set_epoch(epoch)
        model.train()
        for xb, yb in train_loader:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    print(f"[rank {rank}] train accuracy {accuracy(model, train_loader):.2f}")
    print(f"[rank {rank}] test accuracy {accuracy(model, test_loader):.2f}")
    destroy_process_group()


if __name__ == "__main__":
    main(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]), 3)
