"""timm's train.py (huggingface/pytorch-image-models), its device, AMP and DDP lines as
written, for `ddpkit run --cpu`: `init_distributed_device` (timm.utils.distributed:
nccl for a 'cuda' device, `torch.cuda.set_device`, `torch.device('cuda', local_rank)`),
`model.to(device=device)` and channels_last, native AMP as `partial(torch.autocast,
device_type=device.type, dtype=amp_dtype)` in float16 with timm's `NativeScaler`
(GradScaler, unscale_ and clipping), `DDP(model, device_ids=[device])`,
`torch.cuda.synchronize()` after each step, a per-update LR schedule, BatchNorm
statistics averaged at each epoch's end (`distribute_bn`) and a rank-0 checkpoint
holding the scaler's state. No prefetcher (timm's uses CUDA streams, which `--cpu`
refuses: run timm with --no-prefetcher). The model and data are small.
"""

# ruff: noqa: RUF059  (as the public script is written)

import argparse
import logging
import os
from contextlib import suppress
from functools import partial

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as NativeDDP

_logger = logging.getLogger("train")
parser = argparse.ArgumentParser(description="PyTorch ImageNet Training")
parser.add_argument("--device", default="cuda", type=str)
parser.add_argument("--dist-backend", default=None, type=str)
parser.add_argument("--amp", action="store_true", default=False)
parser.add_argument("--amp-dtype", default="float16", type=str)
parser.add_argument("--channels-last", action="store_true", default=False)
parser.add_argument("--clip-grad", type=float, default=None)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("-b", "--batch-size", type=int, default=8)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--output", default="output", type=str)


class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self, device="cuda"):
        try:
            self._scaler = torch.amp.GradScaler(device=device)
        except (AttributeError, TypeError):
            self._scaler = torch.cuda.amp.GradScaler()

    def __call__(
        self, loss, optimizer, clip_grad=None, parameters=None, create_graph=False, need_update=True
    ):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()


def distribute_bn(model, world_size, reduce=False):
    for bn_name, bn_buf in model.module.named_buffers(recurse=True):
        if ("running_mean" in bn_name) or ("running_var" in bn_name):
            if reduce:
                torch.distributed.all_reduce(bn_buf, op=torch.distributed.ReduceOp.SUM)
                bn_buf /= float(world_size)
            else:
                torch.distributed.broadcast(bn_buf, 0)


def is_distributed_env():
    return "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def init_distributed_device(args):
    args.distributed, args.world_size, args.rank, args.local_rank = False, 1, 0, 0
    device_type, *device_idx = args.device.split(":", maxsplit=1)
    dist_backend = args.dist_backend
    if dist_backend is None:
        dist_backend = {"xpu": "ccl", "hpu": "hccl", "cuda": "nccl", "npu": "hccl"}.get(
            device_type, "gloo"
        )
    if is_distributed_env():
        args.local_rank = int(os.environ["LOCAL_RANK"])
        torch.distributed.init_process_group(backend=dist_backend, init_method="env://")
        args.world_size = torch.distributed.get_world_size()
        args.rank = torch.distributed.get_rank()
        args.distributed = True
    if device_type == "cuda":
        assert torch.cuda.is_available(), f"CUDA is not available but {args.device} was specified."
    device = (
        torch.device(device_type, args.local_rank)
        if args.distributed
        else torch.device(args.device)
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


class SmallNet(nn.Module):
    def __init__(self, num_classes=5):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        x = torch.relu(self.bn(self.stem(x))).mean((2, 3))
        return self.head(self.drop(x))


def main():
    args = parser.parse_args()
    device = init_distributed_device(args)
    torch.manual_seed(42 + args.rank)
    amp_dtype = torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16
    model = SmallNet()
    model.to(device=device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    amp_autocast = suppress
    loss_scaler = None
    if args.amp:
        amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype)
        if device.type == "cuda" and amp_dtype == torch.float16:
            loss_scaler = NativeScaler(device=device.type)
    if args.distributed:
        model = NativeDDP(model, device_ids=[device], broadcast_buffers=True)
    g = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(64, 3, 16, 16, generator=g), torch.randint(5, (64,), generator=g)
    dataset = torch.utils.data.TensorDataset(inputs, targets)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset) if args.distributed else None
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, pin_memory=True
    )
    total = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1 - n / total)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1).to(device=device)
    for epoch in range(args.epochs):
        if args.distributed:
            sampler.set_epoch(epoch)
        model.train()
        for input, target in loader:
            input, target = input.to(device), target.to(device)
            if args.channels_last:
                input = input.contiguous(memory_format=torch.channels_last)
            with amp_autocast():
                output = model(input)
                loss = loss_fn(output, target)
            optimizer.zero_grad()
            if loss_scaler is not None:
                loss_scaler(
                    loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters()
                )
            else:
                loss.backward()
                optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            scheduler.step()
        if args.distributed:
            distribute_bn(model, args.world_size, True)
        if args.rank == 0:
            _logger.warning("epoch %d loss %.4f", epoch, loss.item())
            os.makedirs(args.output, exist_ok=True)
            state = {
                "epoch": epoch,
                "state_dict": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
            }
            if loss_scaler is not None:
                state[loss_scaler.state_dict_key] = loss_scaler.state_dict()
            torch.save(state, os.path.join(args.output, "last.pth.tar"))
    if os.environ.get("STATE_DIR"):  # the test's: every rank's weights and optimizer
        state = {"model": model.module.state_dict(), "optim": optimizer.state_dict()}
        torch.save(state, os.path.join(os.environ["STATE_DIR"], f"rank{os.environ['RANK']}.pt"))
    if args.distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
