"""Shaped like the DDP tutorial's single_gpu.py, run on 2 ranks as it is: no process
group, a Trainer class, an unseeded random dataset, a shuffling DataLoader and
torch.save("checkpoint.pt") on every process. Ours: a small CNN on random images."""

import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Trainer:
    def __init__(self, model, data, optimizer, save_every):
        self.model, self.data, self.optimizer = model, data, optimizer
        self.save_every = save_every

    def run_epoch(self):
        for images, labels in self.data:
            self.optimizer.zero_grad()
            F.cross_entropy(self.model(images), labels).backward()
            self.optimizer.step()

    def train(self, epochs):
        for epoch in range(epochs):
            self.run_epoch()
            if epoch % self.save_every == 0:
                torch.save(self.model.state_dict(), "checkpoint.pt")


def main(epochs, save_every):
    images, labels = torch.rand(64, 1, 8, 8), torch.randint(0, 4, (64,))  # unseeded
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 4)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(TensorDataset(images, labels), batch_size=16, shuffle=True)
    Trainer(model, loader, optimizer, save_every).train(epochs)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
