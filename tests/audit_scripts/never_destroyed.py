"""A DDP training job that saves properly on rank 0 but never ends its process group.

`setup()` starts the group and nothing calls `dist.destroy_process_group()`: the
group is still alive when the processes exit (the audit's DDP111).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EPOCHS = 3
BATCH_SIZE = 16


def setup() -> tuple[int, int, int]:
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend="gloo", rank=rank, world_size=world_size)  # audit: DDP111
    return rank, local_rank, world_size


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.rand(256, 10, generator=generator)
    y = (x.sum(dim=1, keepdim=True) > 5.0).float()
    return TensorDataset(x, y)


def main() -> None:
    torch.set_num_threads(1)
    rank, local_rank, world_size = setup()
    out_dir = os.environ.get("AUDIT_OUT", ".")
    torch.manual_seed(42)

    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f} (local rank {local_rank})")

    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(out_dir, "classifier.pt"))
        print("saved the model")


if __name__ == "__main__":
    main()
