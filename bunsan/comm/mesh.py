"""The (pp, dp, cp, tp) mesh of process groups.

The mesh lays ranks out as world = pp x dp x cp x tp with tp innermost, so that
tensor-parallel peers are neighbouring ranks (the fast links inside a node), and
context-parallel peers, which exchange K/V in every layer, are the next closest:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

Context-parallel ranks hold the same weights and see different tokens of the same
rows, so for gradients they are data parallel: `grad_group` (dp x cp) is the group
gradients are reduced over and ZeRO shards are spread over, while `dp_group` (and
`dp`, `dp_rank`) is the data coordinate: which rows of the global batch a rank reads.
Without context parallelism the two are the same group.

Expert parallelism is folded over the gradient group (Megatron's parallel folding, torchtitan's efsdp): the
grad_group's ranks, in order, are cut into blocks of `ep` consecutive ranks. An `ep_group` (one block) holds
the experts between them, each rank its 1/ep, and routes tokens to them by all-to-all; the ranks at the same
place in every block form the `edp_group`, the replicas of one expert shard, over which the experts'
gradients are reduced and their ZeRO shards spread (DeepSpeed's expert-data-parallel group). Attention and
every other weight stay data parallel over the whole grad_group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from bunsan.comm.work import Group

# What stays fixed along each axis's groups: the other coordinates (p, d, c, t).
_FIXED = {"tp": (0, 1, 2), "cp": (0, 1, 3), "dp": (0, 2, 3), "pp": (1, 2, 3), "dpcp": (0, 3)}


@dataclass
class Mesh:
    """The groups a rank belongs to. Build with `Mesh.create(pp, tp, cp)`; dp is what is left."""

    pp: int
    dp: int
    tp: int
    rank: int
    world: Group
    dp_group: Group
    tp_group: Group
    pp_group: Group
    cp: int = 1
    cp_group: Group | None = None
    grad_group: Group | None = None     # dp x cp: gradients and ZeRO shards (dp_group when cp is 1)
    ep: int = 1
    ep_group: Group | None = None       # ranks that split the experts between them (a block of grad_group)
    edp_group: Group | None = None      # replicas of this rank's experts: their gradients and ZeRO shards

    def __post_init__(self) -> None:
        if self.cp_group is None:
            self.cp_group = Group("cp", None, 1, 0, (self.rank,))
        if self.grad_group is None:
            self.grad_group = self.dp_group
        if self.ep_group is None:
            self.ep_group = Group("ep", None, 1, 0, (self.rank,))
        if self.edp_group is None:
            self.edp_group = self.grad_group

    @property
    def ep_rank(self) -> int:
        return self.ep_group.rank

    @property
    def pp_rank(self) -> int:
        return self.pp_group.rank

    @property
    def dp_rank(self) -> int:
        return self.dp_group.rank

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank

    @property
    def cp_rank(self) -> int:
        return self.cp_group.rank

    @staticmethod
    def coords(rank: int, pp: int, dp: int, tp: int, cp: int = 1) -> tuple[int, ...]:
        """(pp, dp, tp) coordinates of a rank; with cp > 1, (pp, dp, cp, tp)."""
        p, d, c, t = rank // (dp * cp * tp), (rank // (cp * tp)) % dp, (rank // tp) % cp, rank % tp
        return (p, d, t) if cp == 1 else (p, d, c, t)

    @classmethod
    def create(cls, pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1) -> "Mesh":
        world_size, rank = dist.get_world_size(), dist.get_rank()
        fixed = pp * tp * cp
        if pp < 1 or tp < 1 or cp < 1 or world_size % fixed:
            raise ValueError(
                f"world size {world_size} is not divisible by pipeline stages {pp} x tensor-parallel size {tp} "
                f"x context-parallel size {cp} (= {fixed}); launch a multiple of {fixed} processes or change "
                "pipeline.stages / tensor_parallel.size / context_parallel.size")
        dp = world_size // fixed
        world = Group("world", dist.group.WORLD if world_size > 1 else None, world_size, rank,
                      tuple(range(world_size)))
        mine = {}
        axes = ["tp", "dp", "pp"] + (["cp"] if cp > 1 else []) + (["dpcp"] if cp > 1 and dp > 1 else [])
        # Every rank must call new_group for every group, in the same order.
        for name in axes:
            for ranks_in in cls._groups(pp, dp, cp, tp, name):
                pg = dist.new_group(ranks_in) if 1 < len(ranks_in) < world_size else None
                if len(ranks_in) == world_size and world_size > 1:
                    pg = dist.group.WORLD
                if rank in ranks_in:
                    mine[name] = Group(name, pg, len(ranks_in), ranks_in.index(rank), tuple(ranks_in))
        cp_group = mine.get("cp")
        grad = mine["dp"] if cp == 1 else mine["dpcp"] if dp > 1 else cp_group
        mesh = cls(pp, dp, tp, rank, world, mine["dp"], mine["tp"], mine["pp"], cp, cp_group, grad)
        if ep > 1:
            mesh.fold_experts(ep)
        return mesh

    def fold_experts(self, ep: int) -> None:
        """Cut every gradient group into expert-parallel blocks of `ep` ranks (see the module docstring).

        Collective: every rank calls it with the same `ep` (new_group's rule)."""
        folded = self.dp * self.cp
        if ep < 1 or folded % ep:
            raise ValueError(
                f"expert parallel size {ep} does not divide the {folded} data-parallel ranks it is folded over "
                f"(data {self.dp} x context {self.cp}; tensor {self.tp} and pipeline {self.pp} ranks hold the same "
                f"experts); set expert_parallel.autoep_size to a divisor of {folded}, or launch more processes")
        grad_axis = "dp" if self.cp == 1 else "dpcp" if self.dp > 1 else "cp"
        mine = {}
        for ranks_in in self._groups(self.pp, self.dp, self.cp, self.tp, grad_axis):
            blocks = [ranks_in[i:i + ep] for i in range(0, folded, ep)]
            for name, cut in (("ep", blocks), ("edp", [list(r) for r in zip(*blocks)])):
                for members in cut:
                    pg = dist.new_group(members) if 1 < len(members) < self.world.size else None
                    if len(members) == self.world.size and self.world.size > 1:
                        pg = dist.group.WORLD
                    if self.rank in members:
                        mine[name] = Group(name, pg, len(members), members.index(self.rank), tuple(members))
        self.ep, self.ep_group, self.edp_group = ep, mine["ep"], mine["edp"]

    def pp_subgroup(self, stages: tuple[int, ...], name: str) -> Group | None:
        """The group of the given pipeline ranks at this rank's (dp, cp, tp) coordinates, or None if not among
        them.

        Collective: every rank must call it with the same arguments in the same order (new_group's rule).
        """
        if len(stages) == self.pp:
            return self.pp_group
        mine = None
        per_stage = self.dp * self.cp * self.tp
        for inner in range(per_stage):
            ranks_in = [s * per_stage + inner for s in stages]
            pg = dist.new_group(ranks_in) if len(ranks_in) > 1 else None
            if self.rank in ranks_in:
                mine = Group(name, pg, len(ranks_in), ranks_in.index(self.rank), tuple(ranks_in))
        return mine

    @classmethod
    def _groups(cls, pp: int, dp: int, cp: int, tp: int, axis: str) -> list[list[int]]:
        """All rank lists along one axis of the mesh ("dpcp": the dp and cp axes together)."""
        out: dict[tuple, list[int]] = {}
        for r in range(pp * dp * cp * tp):
            at = (r // (dp * cp * tp), (r // (cp * tp)) % dp, (r // tp) % cp, r % tp)
            out.setdefault(tuple(at[i] for i in _FIXED[axis]), []).append(r)
        return list(out.values())
