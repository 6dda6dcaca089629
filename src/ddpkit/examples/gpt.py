"""`ddpkit train --example gpt`: a tiny GPT trained by steps, in the shape of nanoGPT's
`train.py`: windows of a token stream as samples, AdamW with a warm-up then a cosine
decay per step, an evaluation every few steps, and (with `--keep-best eval_loss`) the
best checkpoint kept.

The stream is synthetic and made from a fixed seed, so every rank holds the same one:
a walk over 32 tokens in which each token has 3 possible successors, so a model that
learns them reaches a loss of about ln 3 (1.1) from ln 32 (3.5).
"""

from __future__ import annotations

import math
import random

import torch
from torch import nn
from torch.utils.data import Dataset

from ddpkit.context import DistContext
from ddpkit.training.config import TrainConfig
from ddpkit.training.job import Job

DEFAULTS = {
    "max_steps": 200,
    "batch_size": 16,
    "eval_every_steps": 50,
    "log_every": 10,
    "scheduler_interval": "step",
    "replacement": True,  # random windows, as nanoGPT's get_batch draws them
}
VOCAB, BLOCK, WIDTH, HEADS, LAYERS = 32, 32, 64, 4, 2


def token_stream(length: int = 8192, seed: int = 1234) -> torch.Tensor:
    """`length` tokens of a walk in which each token has 3 successors, drawn evenly."""
    rng = random.Random(seed)
    successors = [[rng.randrange(VOCAB) for _ in range(3)] for _ in range(VOCAB)]
    tokens = [0]
    for _ in range(length - 1):
        tokens.append(rng.choice(successors[tokens[-1]]))
    return torch.tensor(tokens)


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every window of `block` tokens, with the window one token on as its target."""

    def __init__(self, tokens: torch.Tensor, block: int = BLOCK) -> None:
        self.tokens, self.block = tokens, block

    def __len__(self) -> int:
        return len(self.tokens) - self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i : i + self.block], self.tokens[i + 1 : i + 1 + self.block]


class _Block(nn.Module):
    """Causal self-attention, then an MLP, each on a layer-normed residual."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2) for z in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, WIDTH))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(*(_Block() for _ in range(LAYERS)))
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tokens(idx) + self.positions(positions))
        logits: torch.Tensor = self.head(self.ln(self.blocks(x)))
        return logits


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(ctx: DistContext, config: TrainConfig) -> Job:
    stream = token_stream()
    cut = len(stream) * 9 // 10
    train = Windows(stream[:cut])
    total = config.total_steps(len(train), ctx.world_size)
    warmup = max(1, total // 10)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (
            1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup)))
        )

    return Job(
        model=GPT(),
        # Factories: built on the prepared model's parameters (needed with --strategy fsdp).
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1),
        train_set=train,
        loss_fn=next_token_loss,
        eval_set=Windows(stream[cut:]),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_factor),
    )
