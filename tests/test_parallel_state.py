"""Tier 1: rank -> group math, without processes."""

import pytest

from megagenome.parallel.layout import ParallelLayout
from megagenome.parallel.state import ParallelState, coords, group_ranks


def test_megatron_layout_tp2_pp2_dp2():
    g = group_ranks(8, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["model"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["sp"] == [[r] for r in range(8)]


@pytest.mark.parametrize("world,tp,pp,sp", [(8, 2, 2, 1), (16, 2, 2, 2), (12, 3, 1, 2), (4, 1, 4, 1), (6, 1, 1, 3)])
def test_every_kind_partitions_the_world(world, tp, pp, sp):
    g = group_ranks(world, tp, pp, sp)
    dp = world // (tp * pp * sp)
    expected = {"tp": tp, "sp": sp, "dp": dp, "pp": pp, "model": tp * pp, "sdp": sp * dp}
    for kind, groups in g.items():
        assert sorted(r for grp in groups for r in grp) == list(range(world)), kind
        assert all(len(grp) == expected[kind] for grp in groups), kind
    # ranks in one tp group share every other coordinate
    for grp in g["tp"]:
        cs = [coords(r, tp, sp, dp, pp) for r in grp]
        assert len({(c["sp"], c["dp"], c["pp"]) for c in cs}) == 1


def test_state_keeps_this_ranks_groups_and_serves_as_mpu():
    created = []
    layout = ParallelLayout(world_size=8, tensor=2, pipeline=2)
    state = ParallelState.build(5, layout, new_group=lambda ranks: created.append(ranks) or tuple(ranks))
    assert len(created) == sum(len(v) for v in group_ranks(8, 2, 2).values())  # every group, on every rank
    assert state.get_tensor_model_parallel_group() == (4, 5)
    assert state.get_tensor_model_parallel_rank() == 1 and state.get_model_parallel_world_size() == 2
    assert state.get_data_parallel_group() == (5, 7) and state.get_data_parallel_rank() == 0
    assert state.get_pipeline_model_parallel_group() == (1, 5) and state.get_pipeline_model_parallel_rank() == 1
    assert state.dp == 2
