"""Shaped like karpathy/nanoGPT's train.py: a top-level script configured by globals that
`--key=value` overrides, DDP when torchrun's RANK is set, a per-rank seed offset for the
random windows drawn from a uint16 token file (np.memmap), gradient accumulation that
skips the all-reduce until the last micro-step, a warmup-then-cosine learning rate by
iteration, AdamW with decayed and undecayed groups, clipping, an eval of a few batches,
a checkpoint from the master process, destroy_process_group. Ours: a tiny bigram-plus-MLP
language model."""

import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

data_dir = "data"
out_dir = "out"
block_size = 16
batch_size = 4
gradient_accumulation_steps = 4
max_iters = 6
eval_interval = 3
eval_iters = 2
learning_rate = 3e-3
warmup_iters = 2
min_lr = 3e-4
weight_decay = 0.1
grad_clip = 1.0
backend = "gloo"
for arg in sys.argv[1:]:  # nanoGPT's configurator, in short
    key, value = arg[2:].split("=", 1)
    globals()[key] = type(globals()[key])(value)

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_process, seed_offset = rank == 0, rank
    assert gradient_accumulation_steps % world == 0
    gradient_accumulation_steps //= world
else:
    master_process, seed_offset = True, 0
torch.manual_seed(1337 + seed_offset)
vocab = int(np.fromfile(os.path.join(data_dir, "vocab.txt"), sep=" ")[0])


def get_batch(split):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack(
        [torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix]
    )
    return x, y


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(vocab, 24)
        self.mlp = nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 48), nn.GELU(), nn.Dropout(0.1))
        self.head = nn.Linear(48, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(self.mlp(self.emb(idx)))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, vocab), targets.view(-1))


torch.manual_seed(1337)  # the same initial weights on every rank
model = Tiny()
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
    lr=learning_rate,
    betas=(0.9, 0.95),
)
torch.manual_seed(1337 + seed_offset)
raw_model = model
if ddp:
    model = DDP(model)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            x, y = get_batch(split)
            losses[k] = model(x, y)[1].item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / max(1, max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


x, y = get_batch("train")
for iter_num in range(max_iters + 1):
    for group in optimizer.param_groups:
        group["lr"] = get_lr(iter_num)
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if iter_num > 0:
            os.makedirs(out_dir, exist_ok=True)
            checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    if iter_num == max_iters:
        break
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        loss = model(x, y)[1] / gradient_accumulation_steps
        x, y = get_batch("train")
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

if ddp:
    torch.save(
        {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()},
        os.path.join(out_dir, f"final-rank{rank}.pt"),
    )
    destroy_process_group()
