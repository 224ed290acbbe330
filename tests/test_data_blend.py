"""Tier 1: blending sources by weight, the group-aware rank assignment, and their index arithmetic."""

import numpy as np
import pytest

from megagenome.config import Region
from megagenome.data.blend import BlendError, BlendSampler, GroupSampler, Unit, assign_groups, period_counts
from megagenome.data.blend import smooth_round_robin as swrr
from megagenome.data.sampler import WindowSampler, batch_indices

W = 50  # window length of most tests


def unit(i, weight=1.0, group=None, lengths=(1000, 730, 260)):
    """Unit i with regions of the given lengths on contigs u{i}/chr{j} (a few windows each, with slack)."""
    regions = [Region(f"u{i}/chr{j}", 10 * j, 10 * j + n) for j, n in enumerate(lengths)]
    return Unit(f"u{i}", group if group is not None else f"g{i}", weight, regions)


def unit_name(region):
    return region.contig.split("/")[0]


def spans(windows):
    return [(w.contig, w.start, w.end) for w in windows]


# ----- period arithmetic ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "period", "expected"),
    [
        ([0.5, 0.3, 0.2], 1000, [500, 300, 200]),
        ([1, 1, 1], 1000, [334, 333, 333]),  # the remainder goes to the earliest unit on a tie
        ([2, 1], 10, [7, 3]),  # quotas 6.67 and 3.33
        ([1e-6, 1], 1000, [1, 999]),  # rounded to 0, then given one slot by the largest unit
        ([1e-6, 1e-6, 5, 3], 8, [1, 1, 4, 2]),  # the slots come from the most over-allocated units
        ([1, 1, 1], 3, [1, 1, 1]),
    ],
)
def test_period_counts(weights, period, expected):
    assert period_counts(weights, period).tolist() == expected


def test_smooth_round_robin_matches_nginx():
    # nginx's documented example: weights a=5, b=1, c=1 give a a b a c a a.
    assert "".join("abc"[u] for u in swrr(np.array([5, 1, 1]))) == "aabacaa"


def test_slots_are_spread_evenly():
    counts = np.array([500, 300, 150, 49, 1])
    slots = swrr(counts)
    assert np.bincount(slots).tolist() == counts.tolist()
    for u, k in enumerate(counts.tolist()):
        gaps = np.diff(np.flatnonzero(slots == u))
        # No gap between two slots of a unit is more than twice its average spacing.
        assert gaps.size == 0 or gaps.max() <= 2 * len(slots) / k, (u, gaps.max())


# ----- BlendSampler ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("period", [1, 7, 1000])
def test_single_unit_is_the_window_sampler(period):
    u = unit(0, weight=3.0)
    blend = BlendSampler([u], W, seed=5, period=period)
    plain = WindowSampler(u.regions, W, seed=5)
    idx = np.arange(4 * plain.num_windows + 3)  # several epochs and a partial one
    assert spans(blend.windows(idx)) == spans(plain.windows(idx))
    assert blend.num_windows == plain.num_windows and blend.slack_bases == plain.slack_bases
    assert blend.counts_per_period == [period] and blend.shares == [1.0]


def test_stream_zero_keeps_the_old_sequence_and_others_differ():
    regions = unit(0).regions
    idx = np.arange(60)
    base = spans(WindowSampler(regions, W, seed=9).windows(idx))
    assert spans(WindowSampler(regions, W, seed=9, stream=0).windows(idx)) == base
    assert spans(WindowSampler(regions, W, seed=9, stream=1).windows(idx)) != base
    assert spans(WindowSampler(regions, W, seed=9, stream=2).windows(idx)) != base


def test_shares_are_exact_per_period():
    units = [unit(0, 0.5), unit(1, 0.3), unit(2, 0.2, lengths=(400,))]
    blend = BlendSampler(units, W, seed=1, period=100)
    assert blend.counts_per_period == [50, 30, 20] and blend.shares == [0.5, 0.3, 0.2]
    which = blend.units_of(np.arange(100 * 37))
    per_period = np.stack([np.bincount(row, minlength=3) for row in which.reshape(37, 100)])
    assert (per_period == [50, 30, 20]).all()
    # The window's contig belongs to the unit the index was given to.
    names = [unit_name(w) for w in blend.windows(np.arange(300))]
    assert names == [units[u].name for u in which[:300].tolist()]


def test_unit_local_indices_have_no_gaps():
    units = [unit(0, 5), unit(1, 2), unit(2, 1, lengths=(300,))]
    blend = BlendSampler(units, W, seed=2, period=11)
    which, local = blend.unit_local(np.arange(11 * 50 + 4))
    for u in range(3):
        assert local[which == u].tolist() == list(range(int((which == u).sum())))
    # So each unit's own sampler tiles whole epochs: its windows in an epoch are disjoint and all present.
    u1 = units[1]
    n = blend.samplers[1].num_windows
    mine = [w for w, k in zip(blend.windows(np.arange(11 * 50)), which.tolist()) if k == 1][: 2 * n]
    for epoch in range(2):
        assert sorted(spans(mine[epoch * n : (epoch + 1) * n])) == sorted(
            spans(WindowSampler(u1.regions, W, seed=2, stream=1).windows(np.arange(epoch * n, (epoch + 1) * n)))
        )


def test_record_attributes():
    units = [unit(0, 1, lengths=(1000, 30)), unit(1, 1, lengths=(120, 10))]
    blend = BlendSampler(units, W, seed=0, period=4)
    assert blend.num_windows == 20 + 2 and blend.window_len == W
    assert blend.dropped_regions == 2 and blend.dropped_bases == 40 and blend.slack_bases == 20
    assert len(blend.regions) == 2 and len(blend) == 22
    record = blend.record()
    assert record["period"] == 4 and [u["windows_per_epoch"] for u in record["units"]] == [20, 2]
    assert record["units"][0] == {
        "name": "u0",
        "group": "g0",
        "weight": 1,
        "slots_per_period": 2,
        "share": 0.5,
        "bases": 1030,
        "windows_per_epoch": 20,
    }


def test_pure_function_of_seed_and_index():
    units = [unit(0, 2), unit(1, 1), unit(2, 1, lengths=(555,))]
    long = spans(BlendSampler(units, W, seed=3, period=13).windows(np.arange(2000)))
    rng = np.random.default_rng(0)
    pick = rng.choice(2000, size=300, replace=False)  # any subset, in any order, from a fresh sampler
    fresh = BlendSampler(units, W, seed=3, period=13)
    assert spans(fresh.windows(pick)) == [long[i] for i in pick.tolist()]
    assert spans([fresh.window(i) for i in pick[:20].tolist()]) == [long[i] for i in pick[:20].tolist()]
    # Resume: [n, n + m) computed fresh equals the same stretch of the long run.
    for n in (0, 1, 12, 13, 999, 1500):
        resumed = BlendSampler(units, W, seed=3, period=13).windows(np.arange(n, n + 200))
        assert spans(resumed) == long[n : n + 200]
    assert spans(BlendSampler(units, W, seed=4, period=13).windows(np.arange(2000))) != long


def test_global_batch_is_the_same_at_any_dp_size():
    blend = BlendSampler([unit(0, 3), unit(1, 1), unit(2, 2, lengths=(640,))], W, seed=8, period=6)
    global_batch = 16
    steps = {}
    for dp in (1, 2, 4):
        micro = 4 if dp < 4 else 2
        accum = global_batch // (dp * micro)
        steps[dp] = [
            sorted(
                s
                for m in range(accum)
                for r in range(dp)
                for s in spans(blend.windows(batch_indices(step * global_batch, m, r, dp, micro)))
            )
            for step in range(25)
        ]
    assert steps[1] == steps[2] == steps[4]
    assert steps[1][0] == sorted(spans(blend.windows(np.arange(global_batch))))


@pytest.mark.parametrize(
    ("units", "period", "words"),
    [
        ([unit(0, 0.0)], 10, ["'u0'", "weight", "positive"]),
        ([unit(0, -1.0)], 10, ["'u0'", "weight"]),
        ([unit(0, float("nan"))], 10, ["'u0'", "weight"]),
        ([unit(0), unit(1), unit(2)], 2, ["--data.blend_period", "period of 2", "3"]),
        ([unit(0)], 0, ["--data.blend_period"]),
        ([unit(0), unit(1, lengths=(49, 20))], 10, ["'u1'", "longest: 49", "50 bases", "--data.seq_len"]),
        ([unit(0), Unit("u0", "g", 1.0, unit(1).regions)], 10, ["two training sources", "'u0'"]),
        ([unit(0), Unit("x", "g", 1.0, unit(0).regions)], 10, ["u0/chr0", "'u0'", "'x'"]),
        ([], 10, ["no training source"]),
    ],
)
def test_blend_errors(units, period, words):
    with pytest.raises(BlendError) as e:
        BlendSampler(units, W, seed=0, period=period)
    assert isinstance(e.value, ValueError)
    for word in words:
        assert word in str(e.value), str(e.value)


# ----- group-aware ----------------------------------------------------------------------------------------


def test_assign_groups_lpt():
    tokens = {"a": 7, "b": 5, "c": 4, "d": 3, "e": 1}
    # a -> 0 (load 7), b -> 1 (5), c -> 1 (9), d -> 0 (10), e -> 1 (10).
    assert assign_groups(tokens, 2) == [["a", "d"], ["b", "c", "e"]]
    assert assign_groups(tokens, 1) == [["a", "b", "c", "d", "e"]]
    assert assign_groups(tokens, 5) == [["a"], ["b"], ["c"], ["d"], ["e"]]
    # Ties in tokens go by name, ties in load to the lowest rank.
    assert assign_groups({"z": 2, "y": 2, "x": 2}, 2) == [["x", "z"], ["y"]]
    assert assign_groups(dict(reversed(list(tokens.items()))), 2) == assign_groups(tokens, 2)


@pytest.mark.parametrize(
    ("tokens", "dp", "words"),
    [
        ({"a": 1, "b": 2}, 4, ["--data.group_aware", "2 group(s) for 4 ranks"]),
        ({}, 1, ["--data.group_aware", "0 group(s)"]),
        ({"a": 1, "b": 0}, 2, ["without training bases", "b"]),
        ({"a": 1}, 0, ["data-parallel size"]),
    ],
)
def test_assign_groups_errors(tokens, dp, words):
    with pytest.raises(BlendError) as e:
        assign_groups(tokens, dp)
    for word in words:
        assert word in str(e.value), str(e.value)


def group_units():
    """9 units in 8 groups of unequal sizes (g2 holds two units)."""
    sizes = [(3000,), (2500, 400), (900,), (1200, 800), (600,), (350,), (2000,), (150, 120), (700, 700)]
    groups = ["g0", "g1", "g2", "g3", "g4", "g5", "g6", "g7", "g2"]
    return [unit(i, 1.0 + i % 3, groups[i], s) for i, s in enumerate(sizes)]


@pytest.mark.parametrize(("dp", "micro", "accum", "steps"), [(1, 3, 2, 5), (2, 2, 3, 6), (4, 1, 2, 9), (3, 5, 1, 4)])
def test_rank_mapping_matches_batch_indices(dp, micro, accum, steps):
    sampler = GroupSampler(group_units(), W, seed=0, dp_size=dp, micro_batch=micro, period=20)
    seen = {r: [] for r in range(dp)}
    for step in range(steps):
        for m in range(accum):
            for r in range(dp):
                rank, local = sampler.rank_local(batch_indices(step * micro * accum * dp, m, r, dp, micro))
                assert (rank == r).all()
                seen[r].extend(local.tolist())
    # Each rank's local indices run 0, 1, 2, ... in the order it consumes them.
    for r in range(dp):
        assert seen[r] == list(range(steps * accum * micro))


@pytest.mark.parametrize("dp", [2, 4])
def test_groups_stay_on_their_rank(dp):
    units = group_units()
    micro, accum = 3, 2
    sampler = GroupSampler(units, W, seed=4, dp_size=dp, micro_batch=micro, period=20)
    groups = sampler.groups_by_rank
    assert sorted(g for gs in groups for g in gs) == [f"g{i}" for i in range(8)]  # each group on one rank
    group_of = {u.name: u.group for u in units}
    local = {r: [] for r in range(dp)}
    for step in range(40):
        for m in range(accum):
            for r in range(dp):
                windows = sampler.windows(batch_indices(step * micro * accum * dp, m, r, dp, micro))
                assert {group_of[unit_name(w)] for w in windows} <= set(groups[r])
                local[r].extend(spans(windows))
    for r in range(dp):
        # A rank's sequence is its own BlendSampler's, read from local index 0 on.
        assert local[r] == spans(sampler.rank_samplers[r].windows(np.arange(len(local[r]))))
        # Every one of the rank's units is reached.
        assert {group_of[c.split("/")[0]] for c, _, _ in local[r]} == set(groups[r])
    assert sum(sampler.tokens_by_rank) == sum(u.bases for u in units)
    assert sampler.num_windows == sum(s.num_windows for s in sampler.rank_samplers)
    record = sampler.record()
    assert record["groups_by_rank"] == groups and record["dp_size"] == dp and len(record["ranks"]) == dp


def test_group_sampler_resume_and_units():
    units = group_units()
    dp, micro = 2, 4
    sampler = GroupSampler(units, W, seed=6, dp_size=dp, micro_batch=micro, period=20)
    long = spans(sampler.windows(np.arange(3000)))
    fresh = GroupSampler(units, W, seed=6, dp_size=dp, micro_batch=micro, period=20)
    for cursor in (0, 8, 1000, 2400):
        assert spans(fresh.windows(np.arange(cursor, cursor + 500))) == long[cursor : cursor + 500]
    which = sampler.units_of(np.arange(3000))
    assert [units[u].name for u in which.tolist()] == [c.split("/")[0] for c, _, _ in long]
    # Unit streams are global: unit 0's windows are those of WindowSampler stream 0 wherever it lands.
    u0 = [s for s, u in zip(long, which.tolist()) if u == 0]
    assert u0 == spans(WindowSampler(units[0].regions, W, seed=6).windows(np.arange(len(u0))))


def test_group_sampler_one_rank_is_the_blend():
    units = group_units()
    idx = np.arange(1500)
    blend = BlendSampler(units, W, seed=2, period=30)
    group = GroupSampler(units, W, seed=2, dp_size=1, micro_batch=7, period=30)
    assert spans(group.windows(idx)) == spans(blend.windows(idx))
    # One rank takes every group, in LPT order (bases descending, ties by name).
    assert group.groups_by_rank == [["g0", "g1", "g2", "g3", "g6", "g4", "g5", "g7"]]
    assert group.tokens_by_rank == [sum(u.bases for u in units)]


def test_group_sampler_errors():
    with pytest.raises(BlendError, match="--data.group_aware"):
        GroupSampler(group_units()[:3], W, seed=0, dp_size=4, micro_batch=2)
    with pytest.raises(BlendError, match="--train.micro_batch_size"):
        GroupSampler(group_units(), W, seed=0, dp_size=2, micro_batch=0)
