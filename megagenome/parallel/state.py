"""ParallelState: tensor x sequence x data x pipeline layout of the ranks, and DeepSpeed's mpu (layer L1).

The rank -> group math is a pure function (`group_ranks`), unit-tested without processes. Ranks are laid
out Megatron-style with tensor parallelism fastest (neighbouring ranks, the fastest links), then
sequence, then data, then pipeline:

    rank = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank,   world = tp * sp * dp * pp

With sp = 1 this is Megatron's tp x dp x pp = world. The degrees come from a validated ParallelLayout
(parallel/layout.py); `ParallelState.build` creates every process group once (all ranks must create all
groups, in the same order) and its methods are the duck-typed `mpu` that `deepspeed.initialize(mpu=...)` and
`deepspeed.checkpointing.configure` expect. Nothing here is a module global: the state is passed explicitly to
whatever needs it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from megagenome.parallel.layout import ParallelLayout

AXES = ("tp", "sp", "dp", "pp")  # fastest-varying first


def coords(rank: int, tp: int, sp: int, dp: int, pp: int) -> dict[str, int]:
    """The (tp, sp, dp, pp) coordinates of a rank."""
    out = {}
    for axis, size in zip(AXES, (tp, sp, dp, pp)):
        out[axis] = rank % size
        rank //= size
    return out


def rank_of(c: dict[str, int], tp: int, sp: int, dp: int) -> int:
    return ((c["pp"] * dp + c["dp"]) * sp + c["sp"]) * tp + c["tp"]


def group_ranks(world_size: int, tp: int, pp: int, sp: int = 1) -> dict[str, list[list[int]]]:
    """Every group of every kind, as sorted rank lists.

    tp, sp, dp, pp: ranks that differ only along that axis. "model": tp x pp (one model replica's shards,
    the unit DeepSpeed calls model parallel). "sdp": sp x dp (the ranks that hold the same weights and
    reduce gradients together when sequence parallelism splits a sample across sp ranks).
    """
    if min(tp, pp, sp) < 1 or world_size % (tp * pp * sp):
        raise ValueError(f"world size {world_size} does not split into tensor {tp} x sequence {sp} x pipeline {pp}")
    dp = world_size // (tp * pp * sp)
    sizes = {"tp": tp, "sp": sp, "dp": dp, "pp": pp}
    kinds = {"tp": ("tp",), "sp": ("sp",), "dp": ("dp",), "pp": ("pp",), "model": ("tp", "pp"), "sdp": ("sp", "dp")}
    out: dict[str, list[list[int]]] = {}
    for kind, varying in kinds.items():
        fixed = [a for a in AXES if a not in varying]
        groups = []
        for fixed_values in itertools.product(*(range(sizes[a]) for a in fixed)):
            members = []
            for varying_values in itertools.product(*(range(sizes[a]) for a in varying)):
                c = dict(zip(fixed, fixed_values)) | dict(zip(varying, varying_values))
                members.append(rank_of(c, tp, sp, dp))
            groups.append(sorted(members))
        out[kind] = sorted(groups)
    return out


@dataclass
class ParallelState:
    """This rank's place in the layout and its process groups; also DeepSpeed's mpu."""

    rank: int
    world_size: int
    tp: int
    pp: int
    sp: int
    dp: int
    groups: dict[str, Any] = field(default_factory=dict)  # kind -> this rank's torch ProcessGroup
    members: dict[str, list[int]] = field(default_factory=dict)  # kind -> this rank's group members

    @classmethod
    def build(cls, rank: int, layout: ParallelLayout, new_group=None) -> ParallelState:
        """Create every group of `layout` (collectively, on every rank) and keep this rank's. new_group defaults to
        torch.distributed.new_group; tests pass a stand-in to check the bookkeeping without processes."""
        if new_group is None:
            import torch.distributed as dist

            new_group = dist.new_group
        tp, pp, sp = layout.tensor, layout.pipeline, layout.sequence
        state = cls(rank, layout.world_size, tp, pp, sp, layout.data_parallel)
        for kind, groups in group_ranks(layout.world_size, tp, pp, sp).items():
            for ranks in groups:
                handle = new_group(ranks)
                if rank in ranks:
                    state.groups[kind] = handle
                    state.members[kind] = ranks
        return state

    def coords(self) -> dict[str, int]:
        return coords(self.rank, self.tp, self.sp, self.dp, self.pp)

    def _index(self, kind: str) -> int:
        return self.members[kind].index(self.rank)

    # --- the mpu interface (names as Megatron and DeepSpeed call them) ---------------------------------
    def get_tensor_model_parallel_rank(self) -> int:
        return self._index("tp")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_group(self):
        return self.groups["tp"]

    # DeepSpeed's "model parallel" is the tensor-parallel dimension: it names checkpoint shards
    # (mp_rank_XX) and reduces gradient norms over it.
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._index("pp")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp

    def get_pipeline_model_parallel_group(self):
        return self.groups["pp"]

    def get_data_parallel_rank(self) -> int:
        return self._index("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self):
        return self.groups["dp"]

    def get_sequence_parallel_rank(self) -> int:
        return self._index("sp")

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp

    def get_sequence_parallel_group(self):
        return self.groups["sp"]

    def get_sequence_data_parallel_rank(self) -> int:
        return self._index("sdp")

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.sp * self.dp

    def get_sequence_data_parallel_group(self):
        return self.groups["sdp"]
