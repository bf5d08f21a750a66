"""The load-balanced causal split of a sequence over context-parallel ranks (Megatron's and torchtitan's).

The sequence is cut into 2 x cp equal chunks and rank r holds chunks r and 2cp-1-r, so every rank holds one
light chunk (few keys before it under the causal mask) and one heavy one, and all ranks do the same attention
work. Inputs and pre-shifted targets are cut alike (the target of a token travels with it); each rank's tokens
keep their global positions for the rotary embedding and the causal mask.

A length that is not a multiple of 2 x cp is refused rather than padded: padding would change what the model
sees at the end of each row (and the token count of the loss), so choose data.seq_len a multiple instead.
"""

from __future__ import annotations

import torch


def check_length(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        lo = seq_len // (2 * cp) * (2 * cp)
        fix = f"{lo} or {lo + 2 * cp}" if lo else f"{2 * cp}"
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context_parallel.size = {2 * cp}: "
                         f"context parallelism cuts each row into 2 x {cp} equal chunks (rank r holds chunks r and "
                         f"{2 * cp - 1}-r, for balanced causal work); use a sequence length of {fix} "
                         "(data.seq_len), or pad the rows yourself")


def shard_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions of rank `rank`'s tokens, in the order the rank holds them (int64)."""
    check_length(seq_len, cp)
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of x along `dim` (the sequence), side by side."""
    check_length(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def shard_batch(mb: dict, cp: int, rank: int) -> dict:
    """A language-model micro-batch {"input_ids", "labels" (shifted)} cut to this rank's tokens; a value of one
    number per row (a preference batch's ref_logps) has no sequence to cut and stays whole."""
    return {k: shard_sequence(v, cp, rank) if v.dim() > 1 else v for k, v in mb.items()}
