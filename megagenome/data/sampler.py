"""Window sampling: a global sample index -> a genome window, as a pure function of (seed, index).

Each epoch tiles every training region into non-overlapping windows, shifted by a seeded random phase
within the region's slack (so that window boundaries move between epochs and every base is seen at every
offset over time), and visits the tiles in a seeded random order. Because the window of sample i depends
on nothing but the seed and i, any rank can compute any sample: ranks take disjoint slices of the global
sample sequence (`batch_indices`), and a run resumed from a sample cursor continues the same sequence,
even with a different number of data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megagenome.config import Region

# First word after the seed in every np.random.default_rng([seed, purpose, ...]) of the data layer, so
# that the streams for window order, reverse complement and masking never coincide.
RNG_WINDOWS = 0


class WindowSampler:
    """Seeded epoch-wise tiling of `regions` into windows of `window_len` bases; see the module docstring."""

    def __init__(self, regions: Sequence[Region], window_len: int, seed: int, *, stream: int = 0):
        # stream > 0 gives an independent window order for the same seed (one per source of a blend);
        # stream 0 keeps the original rng key, so single-source runs are unchanged.
        if window_len <= 0:
            raise ValueError(f"window length must be positive, got {window_len}")
        self.window_len = int(window_len)
        self.seed = int(seed)
        self.stream = int(stream)
        lengths = np.array([r.end - r.start for r in regions], dtype=np.int64)
        counts = lengths // self.window_len
        used = counts > 0
        # Regions too short for one window are skipped; report how much that loses (see split.json).
        self.dropped_regions = int((~used).sum())
        self.dropped_bases = int(lengths[~used].sum())
        self.regions = [r for r, u in zip(regions, used) if u]
        self._contigs = [r.contig for r in self.regions]
        self._starts = np.array([r.start for r in self.regions], dtype=np.int64)
        self._counts = counts[used]
        self._slack = lengths[used] - self._counts * self.window_len
        self._first = np.concatenate(([0], np.cumsum(self._counts)))  # first window id of each region
        self.num_windows = int(self._first[-1])
        # Bases of usable regions that fall outside this epoch's windows (the slack, re-drawn every epoch).
        self.slack_bases = int(self._slack.sum())
        if self.num_windows == 0:
            longest = int(lengths.max()) if lengths.size else 0
            raise ValueError(
                f"no training region is long enough for one window of {self.window_len} bases (longest: "
                f"{longest} of {len(lengths)} region(s)); lower --data.seq_len or hold out less of the genome "
                f"(--data.val_contigs/--data.val_ranges/--data.test_contigs/--data.test_ranges)"
            )
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(phase per region, permutation of window ids) of one epoch; the last two epochs are cached."""
        state = self._cache.get(epoch)
        if state is None:
            key = [self.seed, RNG_WINDOWS, epoch] + ([self.stream] if self.stream else [])
            rng = np.random.default_rng(key)
            phases = rng.integers(0, self._slack + 1)  # one draw per region, each in [0, slack]
            order = rng.permutation(self.num_windows)
            state = (phases.astype(np.int64), order)
            # Two entries: a batch that straddles an epoch boundary alternates between them.
            while len(self._cache) >= 2:
                self._cache.pop(next(iter(self._cache)))
            self._cache[epoch] = state
        return state

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(region position in `self.regions`, window start) of each global sample index, vectorised."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and indices.min() < 0:
            raise ValueError(f"sample indices must be non-negative, got {int(indices.min())}")
        epochs = indices // self.num_windows
        region = np.empty(indices.shape, dtype=np.int64)
        start = np.empty(indices.shape, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            sel = epochs == epoch
            phases, order = self._epoch(epoch)
            window_id = order[indices[sel] - epoch * self.num_windows]
            r = np.searchsorted(self._first, window_id, side="right") - 1
            region[sel] = r
            start[sel] = self._starts[r] + phases[r] + (window_id - self._first[r]) * self.window_len
        return region, start

    def windows(self, indices: np.ndarray) -> list[Region]:
        """The windows of several global sample indices."""
        region, start = self.locate(indices)
        w = self.window_len
        return [Region(self._contigs[r], s, s + w) for r, s in zip(region.tolist(), start.tolist())]

    def window(self, index: int) -> Region:
        """The window of one global sample index (epoch = index // num_windows)."""
        return self.windows(np.array([index]))[0]

    def __len__(self) -> int:
        return self.num_windows


def batch_indices(cursor: int, micro_step: int, rank: int, dp_size: int, micro_batch: int) -> np.ndarray:
    """Global sample indices of `rank` in micro step `micro_step` of the optimizer step starting at `cursor`.

    The optimizer step consumes samples [cursor, cursor + accum * dp_size * micro_batch); micro step m of
    rank r takes the slice starting at cursor + (m * dp_size + r) * micro_batch. Slices are disjoint, and the
    set a step consumes depends only on the cursor and the global batch, not on how it is divided.
    """
    if not 0 <= rank < dp_size:
        raise ValueError(f"rank {rank} is outside the data-parallel group of size {dp_size}")
    if micro_batch <= 0 or micro_step < 0 or cursor < 0:
        raise ValueError(
            f"need micro_batch > 0, micro_step >= 0 and cursor >= 0; got {micro_batch}, {micro_step}, {cursor}"
        )
    first = cursor + (micro_step * dp_size + rank) * micro_batch
    return first + np.arange(micro_batch, dtype=np.int64)


def eval_windows(regions: Sequence[Region], window_len: int, count: int) -> list[Region]:
    """`count` non-overlapping windows spread evenly over `regions` (all windows if fewer fit); deterministic.

    Each region is tiled from its start; the chosen tiles are evenly spaced over the concatenated tiling,
    so evaluation covers the whole held-out split in proportion to its length.
    """
    if window_len <= 0 or count < 0:
        raise ValueError(f"need window_len > 0 and count >= 0, got {window_len} and {count}")
    counts = np.array([(r.end - r.start) // window_len for r in regions], dtype=np.int64)
    first = np.concatenate(([0], np.cumsum(counts)))
    total = int(first[-1])
    if total == 0 or count == 0:
        return []
    if count >= total:
        picks = np.arange(total, dtype=np.int64)
    else:
        # Centres of `count` equal slices of [0, total); distinct because total / count > 1.
        picks = ((2 * np.arange(count, dtype=np.int64) + 1) * total) // (2 * count)
    r = np.searchsorted(first, picks, side="right") - 1
    starts = np.array([regions[i].start for i in r.tolist()], dtype=np.int64) + (picks - first[r]) * window_len
    return [Region(regions[i].contig, s, s + window_len) for i, s in zip(r.tolist(), starts.tolist())]
