"""The learning rate of each of the user's optimizer groups, across ranks, for a checkpoint to carry.

Without a configured `scheduler` the engine never writes a learning rate: whoever built the optimizer owns
it (a client scheduler, transformers' Trainer, the script itself), as with DeepSpeed. A checkpoint then has to
carry the rates, as DeepSpeed's optimizer state_dict carries its param_groups: a scheduler's own state_dict
holds its step but not the rate it last wrote. ZeRO 1-3 step each rank's shard with sub-groups of their own,
and a rank's shard may hold no piece of some group, so the rates are gathered over every rank.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("bunsan.optim")


def group_sources(optimizer) -> list[int]:
    """For each of the optimizer's param_groups, the user's group it is part of."""
    return getattr(optimizer, "group_sources", None) or list(range(len(optimizer.param_groups)))


def user_group_count(optimizer) -> int:
    groups = getattr(optimizer, "groups", None)      # ZeRO 1-3's ShardedOptimizer keeps the user's groups
    return len(groups) if groups is not None else len(optimizer.param_groups)


def gathered_lrs(optimizer, built_lrs: list[float], comm, world) -> dict:
    """Every rank calls it (a collective). For each user group, the lr it has now and the lr it was built
    with (None for a group no rank steps): every rank that holds a piece of a group holds the same rates."""
    n = user_group_count(optimizer)
    held = torch.full((2, n), -1.0, dtype=torch.float64, device=comm.device)
    for group, built, source in zip(optimizer.param_groups, built_lrs, group_sources(optimizer)):
        held[0, source], held[1, source] = float(group["lr"]), float(built)
    comm.all_reduce(held, world, op="max")
    now, built = ([lr if lr >= 0 else None for lr in row] for row in held.tolist())   # host: for the JSON
    return {"now": now, "built": built}


def restore_lrs(optimizer, built_lrs: list[float], saved: dict) -> None:
    """The saved rates, into groups built with the rates they were saved with. A group built with another lr
    keeps it, with a warning: the script changed its learning rate for the resumed run."""
    if len(saved["now"]) != user_group_count(optimizer):
        raise ValueError(f"the checkpoint holds learning rates for {len(saved['now'])} optimizer groups, the "
                         f"optimizer has {user_group_count(optimizer)}: build it with the groups it was saved with")
    changed = {}
    for group, built, source in zip(optimizer.param_groups, built_lrs, group_sources(optimizer)):
        lr = saved["now"][source]
        if lr is None:
            continue
        if saved["built"][source] != float(built):
            changed[source] = (saved["built"][source], float(built))
        elif isinstance(group["lr"], torch.Tensor):   # a tensor lr (capturable optimizers) stays that tensor
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    for source, (then, now) in changed.items():
        log.warning("optimizer group %d was saved built with lr %g and is now built with lr %g: it starts the "
                    "resumed run at %g, not at the checkpoint's %g", source, then, now, now,
                    saved["now"][source])
