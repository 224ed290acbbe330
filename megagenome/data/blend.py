"""Blending: a global sample index -> a window of one of several sources, as a pure function of (seed, index).

A `Unit` is one source of training windows (a genome, a haplotype, a species) with a sampling weight and a
group (the individual or species it belongs to). `BlendSampler` interleaves the units deterministically: each
period of P samples holds k_u samples of unit u (the weights rounded to P slots by largest remainder, at least
one each), in an order spread evenly by smooth weighted round-robin (nginx's algorithm). Sample i lies in slot
p = i % P of period q = i // P and takes unit-local index q * k_u + (rank of p among unit u's slots), so each
unit's local indices run 0, 1, 2, ... without gaps and its own WindowSampler tiles every epoch completely.
As with WindowSampler, any process can compute any sample, and resuming from a sample cursor continues the
same sequence at any data-parallel size.

`GroupSampler` is the group-aware mode: whole groups go to data-parallel ranks (balanced by bases, longest
processing time first), each rank blends only its own units, and a global sample index is mapped to the rank
that `batch_indices` gives it to and to that rank's local index. The assignment depends on the data-parallel
size, so a group-aware run can only be resumed at the same size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from megagenome.config import Region
from megagenome.data.sampler import WindowSampler

PERIOD_FLAG = "--data.blend_period"
GROUP_FLAG = "--data.group_aware"


class BlendError(ValueError):
    """The sources, weights, period or group assignment cannot be blended as asked."""


@dataclass(frozen=True)
class Unit:
    """One source of training windows: `regions` (contig names unique across units) sampled with `weight`."""

    name: str
    group: str
    weight: float
    regions: list[Region]

    @property
    def bases(self) -> int:
        """Bases in this unit's training regions (its token count: one base per token)."""
        return sum(r.end - r.start for r in self.regions)


def period_counts(weights: Sequence[float], period: int) -> np.ndarray:
    """Slots per period of each weight: largest-remainder rounding of the shares to `period`, at least 1 each.

    A unit rounded to 0 takes its slot from the unit most over-allocated relative to its exact quota.
    """
    w = np.asarray(weights, dtype=np.float64)
    if period < len(w):
        raise BlendError(
            f"the blend period of {period} samples ({PERIOD_FLAG}) is smaller than the number of sources "
            f"({len(w)}); every source needs a slot in each period, so raise the period"
        )
    quota = period * w / w.sum()
    counts = np.floor(quota).astype(np.int64)
    # Ties in the remainder go to the earlier unit, so the rounding is deterministic.
    order = np.lexsort((np.arange(len(w)), -(quota - counts)))
    counts[order[: period - int(counts.sum())]] += 1
    for u in np.flatnonzero(counts == 0).tolist():
        donor = int(np.argmax(np.where(counts > 1, counts - quota, -np.inf)))
        counts[donor] -= 1
        counts[u] = 1
    return counts


def smooth_round_robin(counts: np.ndarray) -> np.ndarray:
    """Unit of each slot of one period: nginx's smooth weighted round-robin over `counts` (ties: lower unit).

    Unit u fills exactly counts[u] of the sum(counts) slots, and its slots are spread evenly over the period.
    """
    total = int(counts.sum())
    current = np.zeros(len(counts), dtype=np.int64)
    slots = np.empty(total, dtype=np.int64)
    for p in range(total):  # once per sampler, over the period's slots (not per sample)
        current += counts
        u = int(np.argmax(current))
        slots[p] = u
        current[u] -= total
    return slots


class _Composite:
    """Shared by BlendSampler and GroupSampler: windows of sample indices dispatched to parts (units, ranks).

    Each part has `regions`, `locate`, `num_windows` and the drop/slack records; `regions` of the composite
    is the parts' usable regions in part order, and `locate` returns positions in it.
    """

    window_len: int

    def _collect(self, parts: Sequence) -> None:
        self._parts = list(parts)
        self.regions = [r for p in parts for r in p.regions]
        self._region_offset = np.concatenate(([0], np.cumsum([len(p.regions) for p in parts])))
        self.num_windows = sum(p.num_windows for p in parts)
        self.dropped_regions = sum(p.dropped_regions for p in parts)
        self.dropped_bases = sum(p.dropped_bases for p in parts)
        self.slack_bases = sum(p.slack_bases for p in parts)

    def _split(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(region position in `self.regions`, window start) of each sample index, vectorised."""
        part, local = self._split(indices)
        region = np.empty(part.shape, dtype=np.int64)
        start = np.empty(part.shape, dtype=np.int64)
        for k in np.unique(part).tolist():  # one vectorised call per part, not per sample
            sel = part == k
            r, s = self._parts[k].locate(local[sel])
            region[sel] = r + self._region_offset[k]
            start[sel] = s
        return region, start

    def windows(self, indices: np.ndarray) -> list[Region]:
        """The windows of several sample indices."""
        region, start = self.locate(indices)
        w = self.window_len
        return [Region(self.regions[r].contig, s, s + w) for r, s in zip(region.tolist(), start.tolist())]

    def window(self, index: int) -> Region:
        """The window of one sample index."""
        return self.windows(np.array([index]))[0]

    def __len__(self) -> int:
        return self.num_windows


class BlendSampler(_Composite):
    """Deterministic weighted interleave of several units' WindowSamplers; see the module docstring.

    Unit u's WindowSampler uses rng stream `streams[u]` (default u), so unit 0 keeps stream 0 and a single
    unit gives exactly `WindowSampler(unit.regions, window_len, seed)`.
    """

    def __init__(
        self,
        units: Sequence[Unit],
        window_len: int,
        seed: int,
        period: int = 1000,
        *,
        streams: Sequence[int] | None = None,
    ):
        if not units:
            raise BlendError("no training source to sample from")
        if window_len <= 0:
            raise BlendError(f"window length must be positive, got {window_len} (--data.seq_len)")
        if period <= 0:
            raise BlendError(f"the blend period must be positive, got {period} ({PERIOD_FLAG})")
        _check_units(units, window_len)
        self.units = list(units)
        self.window_len = int(window_len)
        self.seed = int(seed)
        self.period = int(period)
        # WindowSampler rng stream of each unit (GroupSampler passes global unit positions).
        self.streams = list(range(len(units))) if streams is None else [int(s) for s in streams]
        self.samplers = [WindowSampler(u.regions, window_len, seed, stream=s) for u, s in zip(self.units, self.streams)]
        counts = period_counts([u.weight for u in self.units], self.period)
        self.counts_per_period = counts.tolist()
        self.shares = (counts / self.period).tolist()  # effective share of samples per unit
        self._counts = counts
        self._slot_unit = smooth_round_robin(counts)
        # Rank of each slot among its unit's slots: a stable sort groups the slots of each unit in order.
        by_unit = np.argsort(self._slot_unit, kind="stable")
        first_slot = np.concatenate(([0], np.cumsum(counts)[:-1]))
        self._slot_rank = np.empty(self.period, dtype=np.int64)
        self._slot_rank[by_unit] = np.arange(self.period) - first_slot[self._slot_unit[by_unit]]
        self.windows_per_unit = [s.num_windows for s in self.samplers]
        self._collect(self.samplers)

    def unit_local(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(unit, unit-local sample index) of each sample index, vectorised."""
        indices = _as_indices(indices)
        q, p = np.divmod(indices, self.period)
        unit = self._slot_unit[p]
        return unit, q * self._counts[unit] + self._slot_rank[p]

    _split = unit_local

    def units_of(self, indices: np.ndarray) -> np.ndarray:
        """Unit position (in `self.units`) of each sample index."""
        return self.unit_local(indices)[0]

    def record(self) -> dict:
        """Per-unit sampling facts for the run record (split.json)."""
        return {
            "period": self.period,
            "units": [
                {
                    "name": u.name,
                    "group": u.group,
                    "weight": u.weight,
                    "slots_per_period": k,
                    "share": share,
                    "bases": u.bases,
                    "windows_per_epoch": n,
                }
                for u, k, share, n in zip(self.units, self.counts_per_period, self.shares, self.windows_per_unit)
            ],
        }


def assign_groups(group_tokens: Mapping[str, int], dp_size: int) -> list[list[str]]:
    """Whole groups to `dp_size` ranks, balanced by tokens: longest processing time first, deterministic.

    Groups in order of tokens (descending, ties by name) each go to the least-loaded rank (ties: lowest rank).
    """
    if dp_size <= 0:
        raise BlendError(f"the data-parallel size must be positive, got {dp_size}")
    if len(group_tokens) < dp_size:
        raise BlendError(
            f"{GROUP_FLAG} needs at least one group per data-parallel rank, but there are {len(group_tokens)} "
            f"group(s) for {dp_size} ranks; add groups, use fewer data-parallel ranks or turn off {GROUP_FLAG}"
        )
    empty = sorted(g for g, t in group_tokens.items() if t <= 0)
    if empty:
        raise BlendError(f"{GROUP_FLAG}: group(s) without training bases: {', '.join(empty)}")
    ranks: list[list[str]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for group in sorted(group_tokens, key=lambda g: (-group_tokens[g], g)):
        r = min(range(dp_size), key=lambda i: (load[i], i))
        ranks[r].append(group)
        load[r] += int(group_tokens[group])
    return ranks


class GroupSampler(_Composite):
    """Group-aware blending: rank r samples only its own groups' units; see the module docstring.

    A global sample index g (from `batch_indices`) lies in micro-batch block b = g // micro_batch, which rank
    b % dp_size consumes as its local index (b // dp_size) * micro_batch + g % micro_batch; that rank's
    BlendSampler gives the window. Unit u (position in `units`) uses WindowSampler rng stream u on whichever
    rank it lands, so streams are distinct across all units and ranks. The group assignment changes with
    dp_size: resume a group-aware run only at the same data-parallel size.
    """

    def __init__(
        self, units: Sequence[Unit], window_len: int, seed: int, dp_size: int, micro_batch: int, period: int = 1000
    ):
        if micro_batch <= 0:
            raise BlendError(f"micro batch size must be positive, got {micro_batch} (--train.micro_batch_size)")
        _check_units(units, window_len)
        self.units = list(units)
        self.window_len = int(window_len)
        self.seed = int(seed)
        self.dp_size = int(dp_size)
        self.micro_batch = int(micro_batch)
        group_tokens: dict[str, int] = {}
        for u in self.units:
            group_tokens[u.group] = group_tokens.get(u.group, 0) + u.bases
        self.groups_by_rank = assign_groups(group_tokens, self.dp_size)
        self.tokens_by_rank = [sum(group_tokens[g] for g in groups) for groups in self.groups_by_rank]
        rank_of_group = {g: r for r, groups in enumerate(self.groups_by_rank) for g in groups}
        # Global unit positions of each rank's units, in the order they were given.
        self.units_by_rank = [
            [i for i, u in enumerate(self.units) if rank_of_group[u.group] == r] for r in range(dp_size)
        ]
        self.rank_samplers = [
            BlendSampler([self.units[i] for i in ids], window_len, seed, period, streams=ids)
            for ids in self.units_by_rank
        ]
        self.period = int(period)
        self._collect(self.rank_samplers)

    def rank_local(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(data-parallel rank, rank-local sample index) of each global sample index, vectorised."""
        indices = _as_indices(indices)
        block, within = np.divmod(indices, self.micro_batch)
        rounds, rank = np.divmod(block, self.dp_size)
        return rank, rounds * self.micro_batch + within

    _split = rank_local

    def units_of(self, indices: np.ndarray) -> np.ndarray:
        """Global unit position (in `self.units`) of each global sample index."""
        rank, local = self.rank_local(indices)
        unit = np.empty(rank.shape, dtype=np.int64)
        for r in np.unique(rank).tolist():
            sel = rank == r
            unit[sel] = np.array(self.units_by_rank[r])[self.rank_samplers[r].units_of(local[sel])]
        return unit

    def record(self) -> dict:
        """Which groups (and units) each rank trains on, for the run record (split.json)."""
        return {
            "dp_size": self.dp_size,
            "groups_by_rank": self.groups_by_rank,
            "tokens_by_rank": self.tokens_by_rank,
            "ranks": [s.record() for s in self.rank_samplers],
        }


def _as_indices(indices: np.ndarray) -> np.ndarray:
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    if indices.size and indices.min() < 0:
        raise BlendError(f"sample indices must be non-negative, got {int(indices.min())}")
    return indices


def _check_units(units: Sequence[Unit], window_len: int) -> None:
    """Fail on duplicate names, shared contigs, bad weights and units without one full window."""
    seen: dict[str, str] = {}
    names: set[str] = set()
    for u in units:
        if u.name in names:
            raise BlendError(f"two training sources are named {u.name!r}")
        names.add(u.name)
        if not (np.isfinite(u.weight) and u.weight > 0):
            raise BlendError(f"source {u.name!r}: sampling weight must be a positive number, got {u.weight}")
        for r in u.regions:
            other = seen.setdefault(r.contig, u.name)
            if other != u.name:
                raise BlendError(f"contig {r.contig!r} is in sources {other!r} and {u.name!r}; qualify the names")
        longest = max((r.end - r.start for r in u.regions), default=0)
        if longest < window_len:
            raise BlendError(
                f"source {u.name!r} has no training region of {window_len} bases (longest: {longest} of "
                f"{len(u.regions)} region(s)); lower --data.seq_len or drop the source"
            )
