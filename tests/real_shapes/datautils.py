"""Shaped like the DDP tutorial's datautils.py (pytorch/examples,
distributed/ddp-tutorial-series), which single_gpu.py imports: a dataset of `size`
pairs (20 features, 1 target) drawn once from the global RNG, unseeded."""

import torch
from torch.utils.data import Dataset


class MyTrainDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, size: int) -> None:
        self.size = size
        # Drawn here, when the script builds the dataset: each process that builds it
        # unseeded holds different data (the port seeds first).
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]
