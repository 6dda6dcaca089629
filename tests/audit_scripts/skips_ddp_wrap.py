"""An ImageNet-style training script, shaped like pytorch/examples' imagenet/main.py.

As in the example, the model is wrapped in DistributedDataParallel only when CUDA is
available: on CPU the script prints "using CPU, this will be slow" and trains the bare
model. Each rank still reads its own DistributedSampler shard, so nothing averages the
gradients and the ranks end with different weights (the audit's DDP112).

The validation sampler does not shuffle and is never given an epoch, as in the example:
iterating it every epoch with the same epoch is fine.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training (a tiny stand-in)")
parser.add_argument("--epochs", default=2, type=int, help="number of total epochs to run")
parser.add_argument("-b", "--batch-size", default=16, type=int, help="mini-batch size per rank")
parser.add_argument("--lr", "--learning-rate", default=0.05, type=float, dest="lr")
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
parser.add_argument("-j", "--workers", default=0, type=int, help="data loading workers")
parser.add_argument("-p", "--print-freq", default=4, type=int)
parser.add_argument("--seed", default=0, type=int, help="seed for initializing training")
parser.add_argument("--dist-url", default="env://", type=str)
parser.add_argument("--dist-backend", default="gloo", type=str)


class FakeImages(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random 3x16x16 "images" in 10 classes (torchvision's FakeData, smaller), with a
    random horizontal flip as the training augmentation."""

    def __init__(self, size: int, train: bool, num_classes: int = 10, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randn(size, 3, 16, 16, generator=generator)
        self.targets = torch.randint(0, num_classes, (size,), generator=generator)
        self.train = train

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.train and torch.rand(1).item() < 0.5:
            image = image.flip(-1)  # RandomHorizontalFlip
        return image, self.targets[index]


class SmallNet(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def main() -> None:
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.distributed = args.world_size > 1
    args.rank = 0
    args.gpu = int(os.environ.get("LOCAL_RANK", "0"))
    if args.distributed:
        args.rank = int(os.environ["RANK"])
        dist.init_process_group(
            backend=args.dist_backend,
            init_method=args.dist_url,
            world_size=args.world_size,
            rank=args.rank,
        )

    print("=> creating model 'smallnet'")
    model: nn.Module = SmallNet()
    if not torch.cuda.is_available():
        print("using CPU, this will be slow")
    elif args.distributed:
        torch.cuda.set_device(args.gpu)
        model.cuda(args.gpu)
        model = nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
    device = torch.device(f"cuda:{args.gpu}" if torch.cuda.is_available() else "cpu")

    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    scheduler = StepLR(optimizer, step_size=30, gamma=0.1)

    train_dataset = FakeImages(256, train=True, seed=1)
    val_dataset = FakeImages(64, train=False, seed=2)
    if args.distributed:
        train_sampler: DistributedSampler[int] | None = DistributedSampler(train_dataset)
        val_sampler: DistributedSampler[int] | None = DistributedSampler(
            val_dataset, shuffle=False, drop_last=True
        )
    else:
        train_sampler = None
        val_sampler = None
    train_loader = DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        shuffle=(train_sampler is None),
        num_workers=args.workers,
        sampler=train_sampler,
    )
    val_loader = DataLoader(
        val_dataset,
        batch_size=args.batch_size,
        shuffle=False,
        num_workers=args.workers,
        sampler=val_sampler,
    )

    best_acc1 = 0.0
    for epoch in range(args.epochs):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, device, args)
        acc1 = validate(val_loader, model, criterion, device, args)
        scheduler.step()
        best_acc1 = max(acc1, best_acc1)
        if args.rank == 0:
            print(f"Epoch {epoch}: Acc@1 {acc1:.2f} (best {best_acc1:.2f})")

    if args.distributed:
        dist.destroy_process_group()


def train(
    train_loader: DataLoader[tuple[torch.Tensor, torch.Tensor]],
    model: nn.Module,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    epoch: int,
    device: torch.device,
    args: argparse.Namespace,
) -> None:
    model.train()
    end = time.time()
    for i, (images, target) in enumerate(train_loader):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # audit: DDP112
        if i % args.print_freq == 0:
            elapsed = time.time() - end
            progress = f"[{epoch}][{i}/{len(train_loader)}]"
            print(f"Epoch: {progress} Loss {loss.item():.4f} ({elapsed:.2f}s)")
            end = time.time()


def validate(
    val_loader: DataLoader[tuple[torch.Tensor, torch.Tensor]],
    model: nn.Module,
    criterion: nn.Module,
    device: torch.device,
    args: argparse.Namespace,
) -> float:
    model.eval()
    totals = torch.zeros(3)  # loss, correct, count
    with torch.no_grad():
        for images, target in val_loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            output = model(images)
            totals[0] += criterion(output, target).item() * target.numel()
            totals[1] += (output.argmax(1) == target).sum().item()
            totals[2] += target.numel()
    if args.distributed:
        dist.all_reduce(totals, dist.ReduceOp.SUM)
    return 100.0 * totals[1].item() / max(totals[2].item(), 1.0)


if __name__ == "__main__":
    main()
