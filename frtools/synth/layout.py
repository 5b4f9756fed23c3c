"""Megatron-style parallel layout: which global ranks form which process group.

A rank's coordinates follow Megatron-LM's default order ``tp-cp-ep-dp-pp``: tensor
parallelism varies fastest, pipeline parallelism slowest. A group of one kind holds the
ranks that differ only in that coordinate. Groups are created in Megatron's order (data,
context, tensor, pipeline, expert) on *every* rank, so the NCCL-era names ``"1"``, ``"2"`` …
PyTorch gives them (a process-wide counter, ``"0"`` being the default group) are the same on
all ranks, as in a real job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# kind -> Megatron's group_desc
GROUP_DESCS = {
    "dp": "DATA_PARALLEL_GROUP",
    "cp": "CONTEXT_PARALLEL_GROUP",
    "tp": "TENSOR_MODEL_PARALLEL_GROUP",
    "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
    "ep": "EXPERT_MODEL_PARALLEL_GROUP",
    "world": "default_pg",
}
# Megatron's creation order of the groups (after the default group)
CREATION_ORDER = ("dp", "cp", "tp", "pp", "ep")
# coordinate order, fastest-varying first
AXES = ("tp", "cp", "ep", "dp", "pp")


class LayoutError(ValueError):
    """The requested parallel sizes do not describe a job."""


@dataclass
class Layout:
    """World size and parallel sizes, with each group kind's membership tables."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    # kind -> int32 array [world_size]: index of the rank's group of that kind
    group_of: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    # kind -> int32 array [n_groups, group_size]: global ranks of each group, sorted
    members: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    # kind -> name of group 0 of that kind; group i is str(first_name + i)
    first_name: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise LayoutError(f"--{axis} must be at least 1")
        n = self.world_size
        grid = np.arange(n, dtype=np.int32).reshape(self.pp, self.dp, self.ep, self.cp, self.tp)
        dims = {"pp": 0, "dp": 1, "ep": 2, "cp": 3, "tp": 4}
        next_name = 1
        for kind in CREATION_ORDER:
            d = dims[kind]
            moved = np.moveaxis(grid, d, -1).reshape(-1, getattr(self, kind))
            # order the groups by their first member, as Megatron enumerates them
            order = np.argsort(moved[:, 0], kind="stable")
            moved = np.ascontiguousarray(moved[order])
            group_of = np.empty(n, dtype=np.int32)
            group_of[moved.reshape(-1)] = np.repeat(
                np.arange(moved.shape[0], dtype=np.int32), moved.shape[1]
            )
            self.members[kind] = moved
            self.group_of[kind] = group_of
            self.first_name[kind] = next_name
            next_name += moved.shape[0]
        self.members["world"] = np.arange(n, dtype=np.int32).reshape(1, n)
        self.group_of["world"] = np.zeros(n, dtype=np.int32)
        self.first_name["world"] = 0

    @classmethod
    def from_sizes(
        cls,
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        ep: int = 1,
        cp: int = 1,
    ) -> Layout:
        """Build a layout; ``dp`` defaults to what is left of ``world_size``."""
        rest = tp * pp * ep * cp
        if dp is None:
            if rest <= 0 or world_size % rest:
                raise LayoutError(
                    f"world size {world_size} is not divisible by tp*pp*ep*cp = {rest}"
                )
            dp = world_size // rest
        if rest * dp != world_size:
            raise LayoutError(
                f"tp*cp*ep*dp*pp = {rest * dp} does not equal the world size {world_size}"
            )
        return cls(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.ep * self.dp * self.pp

    def size(self, kind: str) -> int:
        return self.world_size if kind == "world" else getattr(self, kind)

    def n_groups(self, kind: str) -> int:
        return int(self.members[kind].shape[0])

    def stage(self, rank: int) -> int:
        """Pipeline stage of a global rank (its coordinate along ``pp``)."""
        return rank // (self.world_size // self.pp)

    def stages(self) -> np.ndarray:
        return np.arange(self.world_size, dtype=np.int32) // (self.world_size // self.pp)

    def group_name(self, kind: str, index: int) -> str:
        return str(self.first_name[kind] + index)

    def rank_group(self, kind: str, rank: int) -> tuple[str, np.ndarray]:
        """Name and member ranks of ``rank``'s group of ``kind``."""
        gi = int(self.group_of[kind][rank])
        return self.group_name(kind, gi), self.members[kind][gi]

    def local_rank(self, kind: str, rank: int) -> int:
        """``rank``'s position in its group of ``kind`` (the group-local rank)."""
        gi = int(self.group_of[kind][rank])
        return int(np.searchsorted(self.members[kind][gi], rank))

    def describe(self) -> str:
        return (
            f"{self.world_size} ranks = tp {self.tp} x cp {self.cp} x ep {self.ep} "
            f"x dp {self.dp} x pp {self.pp}"
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "world_size": self.world_size,
            "tp": self.tp,
            "cp": self.cp,
            "ep": self.ep,
            "dp": self.dp,
            "pp": self.pp,
        }
