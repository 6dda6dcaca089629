"""Loader workers draw each sample's randomness from a seed of its own: on 2 real ranks,
no two (rank, epoch, position) share a stream, and a rerun draws the same."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpkit import DistContext, launch, prepare_loader


class _Noisy(torch.utils.data.Dataset[tuple[int, torch.Tensor]]):
    """A random augmentation: each fetch draws fresh noise from torch's stream."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.rand(())


def _draws(ctx: DistContext) -> list[Any]:
    loader = prepare_loader(_Noisy(), ctx, batch_size=2, shuffle=False, num_workers=2)
    mine = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for index, noise in loader:
            mine += [
                (ctx.rank, epoch, i, x) for i, x in zip(index.tolist(), noise.tolist(), strict=True)
            ]
    ranks: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(ranks, mine)
    return [draw for rank in ranks for draw in rank]


@pytest.mark.slow
def test_no_two_samples_of_any_rank_or_epoch_draw_the_same_noise() -> None:
    draws = launch(_draws, nprocs=2)
    assert len(draws) == 2 * 16  # each rank 8 samples a epoch, 2 epochs
    noises = [x for *_, x in draws]
    # Before the seeds were mixed, position p of epoch 1 drew what p+1 of epoch 0 drew.
    assert len(set(noises)) == len(noises)
    assert launch(_draws, nprocs=2) == draws  # and a rerun draws exactly the same
