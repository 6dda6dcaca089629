"""Shaped like the DDP tutorial's multigpu_torchrun.py (and LLMs-from-scratch's torchrun
script): its own process group from torchrun's environment, a one-batch peek at the loader
before set_epoch, a rank-0 snapshot it resumes from, destroy_process_group at the end.
Ours: an MLP with dropout, AdamW and a step schedule, class targets."""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Points(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, 0] > 0).long() + (self.x[:, 1] > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Runner:
    def __init__(self, model, loader, optimizer, scheduler, save_every, snapshot):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.model, self.loader = model, loader
        self.optimizer, self.scheduler = optimizer, scheduler
        self.save_every, self.snapshot, self.epochs_run = save_every, snapshot, 0
        if os.path.exists(snapshot):
            state = torch.load(snapshot, map_location="cpu")
            self.model.load_state_dict(state["MODEL_STATE"])
            self.epochs_run = state["EPOCHS_RUN"]
        self.model = DDP(self.model)

    def epoch(self, epoch):
        size = len(next(iter(self.loader))[0])  # the tutorial's peek, before set_epoch
        print(f"[rank{self.local_rank}] epoch {epoch} | batch {size} | steps {len(self.loader)}")
        self.loader.sampler.set_epoch(epoch)
        for x, y in self.loader:
            self.optimizer.zero_grad()
            F.cross_entropy(self.model(x), y).backward()
            self.optimizer.step()
        self.scheduler.step()

    def train(self, epochs):
        for epoch in range(self.epochs_run, epochs):
            self.epoch(epoch)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                state = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
                torch.save(state, self.snapshot)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch_size", default=8, type=int)
    parser.add_argument("--dump", default="", help="write each rank's final state here")
    args = parser.parse_args()
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data = Points(96)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(data))
    runner = Runner(model, loader, optimizer, scheduler, args.save_every, "snapshot.pt")
    runner.train(args.total_epochs)
    if args.dump:
        rank = int(os.environ["RANK"])
        state = {"model": runner.model.module.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(state, os.path.join(args.dump, f"final-rank{rank}.pt"))
    destroy_process_group()


if __name__ == "__main__":
    main()
