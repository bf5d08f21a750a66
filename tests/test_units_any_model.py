"""ZeRO-3 units, activation checkpointing and the pipeline's blocks are found in any model: a hand-written GPT
that keeps its blocks in `self.blocks` (not `model.layers`) is sharded block by block, not as one unit."""

from __future__ import annotations

import torch
import torch.nn as nn

from bunsan.models.blocks import repeated_blocks

VOCAB, WIDTH, BLOCKS = 64, 32, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class HandWrittenGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_repeated_blocks_of_any_module_list():
    model = HandWrittenGPT()
    assert repeated_blocks(model) == list(model.blocks)


def _train(rank, world, stage):
    import bunsan
    torch.manual_seed(0)
    engine = bunsan.initialize(HandWrittenGPT(), {
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (4, 8), generator=g)
        mine = ids[rank * 2:(rank + 1) * 2]
        losses.append(engine.train_batch({"input_ids": mine[:, :-1], "labels": mine[:, 1:]}))
    units = len(engine.strategy.units) - 1 if stage == 3 else None
    return losses, engine.consolidated_state_dict(), units


def test_zero3_shards_a_hand_written_gpt_block_by_block(pools):
    plain = pools.run(2, _train, 2, 0)
    sharded = pools.run(2, _train, 2, 3)
    for (l0, s0, _), (l3, s3, units) in zip(plain, sharded):
        assert units == BLOCKS
        torch.testing.assert_close(torch.tensor(l3), torch.tensor(l0), rtol=1e-5, atol=0)
        for k in s0:
            torch.testing.assert_close(s3[k], s0[k], rtol=1e-5, atol=1e-7, msg=k)
