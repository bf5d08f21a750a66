"""The (pp, dp, tp) mesh of process groups.

The mesh lays ranks out as world = pp x dp x tp with tp innermost, so that
tensor-parallel peers are neighbouring ranks (the fast links inside a node):

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from bunsan.comm.work import Group


@dataclass
class Mesh:
    """The groups a rank belongs to. Build with `Mesh.create(pp, tp)`; dp is what is left."""

    pp: int
    dp: int
    tp: int
    rank: int
    world: Group
    dp_group: Group
    tp_group: Group
    pp_group: Group

    @property
    def pp_rank(self) -> int:
        return self.pp_group.rank

    @property
    def dp_rank(self) -> int:
        return self.dp_group.rank

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank

    @staticmethod
    def coords(rank: int, pp: int, dp: int, tp: int) -> tuple[int, int, int]:
        return rank // (dp * tp), (rank // tp) % dp, rank % tp

    @classmethod
    def create(cls, pp: int = 1, tp: int = 1) -> "Mesh":
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if pp < 1 or tp < 1 or world_size % (pp * tp):
            raise ValueError(
                f"world size {world_size} is not divisible by pipeline stages {pp} x tensor-parallel size {tp} "
                f"(= {pp * tp}); launch a multiple of {pp * tp} processes or change pipeline.stages / "
                "tensor_parallel.size")
        dp = world_size // (pp * tp)
        ranks = list(range(world_size))
        world = Group("world", dist.group.WORLD if world_size > 1 else None, world_size, rank, tuple(ranks))
        mine = {}
        # Every rank must call new_group for every group, in the same order.
        for name, members in (("tp", cls._groups(pp, dp, tp, "tp")), ("dp", cls._groups(pp, dp, tp, "dp")),
                              ("pp", cls._groups(pp, dp, tp, "pp"))):
            for ranks_in in members:
                pg = dist.new_group(ranks_in) if len(ranks_in) > 1 and len(ranks_in) < world_size else None
                if len(ranks_in) == world_size and world_size > 1:
                    pg = dist.group.WORLD
                if rank in ranks_in:
                    mine[name] = Group(name, pg, len(ranks_in), ranks_in.index(rank), tuple(ranks_in))
        return cls(pp, dp, tp, rank, world, mine["dp"], mine["tp"], mine["pp"])

    def pp_subgroup(self, stages: tuple[int, ...], name: str) -> Group | None:
        """The group of the given pipeline ranks at this rank's (dp, tp) coordinates, or None if not among them.

        Collective: every rank must call it with the same arguments in the same order (new_group's rule).
        """
        if len(stages) == self.pp:
            return self.pp_group
        mine = None
        for d in range(self.dp):
            for t in range(self.tp):
                ranks_in = [s * self.dp * self.tp + d * self.tp + t for s in stages]
                pg = dist.new_group(ranks_in) if len(ranks_in) > 1 else None
                if self.rank in ranks_in:
                    mine = Group(name, pg, len(ranks_in), ranks_in.index(self.rank), tuple(ranks_in))
        return mine

    @classmethod
    def _groups(cls, pp: int, dp: int, tp: int, axis: str) -> list[list[int]]:
        """All rank lists along one axis of the mesh."""
        out: dict[tuple, list[int]] = {}
        for r in range(pp * dp * tp):
            p, d, t = cls.coords(r, pp, dp, tp)
            key = {"tp": (p, d), "dp": (p, t), "pp": (d, t)}[axis]
            out.setdefault(key, []).append(r)
        return list(out.values())
