"""Whole parameters for a while, outside the step: to read them, or, with DeepSpeed's `modifier_rank`, to
change them on one rank and have the change kept everywhere.

A strategy keeps a parameter in pieces that outlive any view of it: fp32 master weights (16-bit models,
every ZeRO stage), shards (stages 1-3), gathered copies that are released (stage 3). A write into the
gathered values alone would be overwritten at the next step or dropped at release, so here it is either
carried into the masters and shards (a modifier rank is named) or refused (none is): never silently lost.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from bunsan.comm.collectives import Comm, Group


def _fingerprint(params: list[torch.Tensor]) -> torch.Tensor:
    """Per parameter its sum and sum of squares, in fp64: any write worth making changes one of them."""
    if not params:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                        for p in params])


@contextlib.contextmanager
def gathered_parameters(strategy, comm: Comm, group: Group, module: nn.Module, modifier_rank: int | None = None):
    """Every parameter of `module` whole inside the context. `modifier_rank` (a rank of the data-parallel
    `group`): on exit its values are broadcast and written into every rank's masters and shards. Without
    one the parameters are read-only: a change is an error naming the parameter."""
    if modifier_rank is not None and not 0 <= modifier_rank < group.size:
        raise ValueError(f"modifier_rank {modifier_rank} is not a data-parallel rank (0..{group.size - 1})")
    names = {id(p): n for n, p in module.named_parameters()}
    trained = {id(p) for p in strategy.params}
    frozen = [p for p in module.parameters() if id(p) not in trained]
    with strategy.gathered():
        before = _fingerprint(strategy.params), _fingerprint(frozen)
        yield
        after = _fingerprint(strategy.params), _fingerprint(frozen)
        moved = [names[id(p)] for p, b, a in zip(strategy.params, before[0], after[0]) if not torch.equal(a, b)]
        moved_frozen = [names[id(p)] for p, b, a in zip(frozen, before[1], after[1]) if not torch.equal(a, b)]
        if moved_frozen:
            raise RuntimeError(f"frozen parameters {moved_frozen[:3]} were changed inside gathered_parameters; "
                               "bunsan keeps no write to a frozen weight: change it before bunsan.initialize")
        if modifier_rank is None:
            if moved:
                raise RuntimeError(f"parameters {moved[:3]} were changed inside gathered_parameters() without a "
                                   "modifier_rank, and would be lost (masters and shards keep the old values): "
                                   "pass modifier_rank=R to keep what rank R writes, on every rank")
            return
        for p in strategy.params:    # the modifier's values, everywhere
            comm.broadcast(p.data, modifier_rank, group)
        params = strategy.params
        strategy.visit_state(lambda i, lo, master, state: master.copy_(
            params[i].detach().reshape(-1)[lo:lo + master.numel()]))
    strategy.sync_params_from_master()      # the model's weights (and shards) from the masters written above
