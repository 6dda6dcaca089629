"""Shaped like the DDP tutorial's multigpu.py (and LLMs-from-scratch's DDP-script.py): the
script is its own launcher, mp.spawn(main, nprocs=world_size), each child sets
MASTER_ADDR/MASTER_PORT and joins with an explicit rank, DistributedSampler with
set_epoch, a rank-0 save, destroy_process_group. Ours: gloo, the port from argv (the
tutorial hard-codes one), a regression MLP with Adam."""

import os
import sys
from datetime import timedelta

import torch
import torch.multiprocessing as mp
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main(rank, world_size, port, epochs):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    # A timeout of our own (the tutorial has none) so that a failed rendezvous ends in
    # seconds instead of the default 30 minutes.
    init_process_group(
        backend="gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30)
    )
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.linspace(-1, 1, 64).repeat(4, 1).t()
    data = TensorDataset(x, x.sum(1, keepdim=True) ** 2)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            optimizer.step()
    torch.save(model.module.state_dict(), f"spawned-rank{rank}.pt")
    destroy_process_group()


if __name__ == "__main__":
    world_size = 2
    mp.spawn(main, args=(world_size, int(sys.argv[1]), int(sys.argv[2])), nprocs=world_size)
