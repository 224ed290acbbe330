"""Two-sided k-mer context baselines for masked LMs: the held-out masked bits per base a model must beat.

A masked model predicts each selected base from both flanks, so the causal order-k Markov chains of
data/markov.py are no reference for it: they see one side only. The reference here is what counting alone does
with what the masked model sees, under the same masking (data/masking.py):

    P(base at i | the 2k + 1 input symbols i-k .. i+k)

The symbols are the model's inputs, not the original bases: A, C, G, T, or "no base" for <mask>, N, a packing
separator or a position outside the window. The centre is the input at the selected position itself: <mask> for
80% of them, a random base for 10% and the original base for 10%, which a model also reads (given a base there,
the original is that base with probability 0.625). k = 0 is then base composition plus that centre; k = 4 reads
eight neighbours, 5^9 contexts.

Fitting: the training regions, on both strands with `both_strands` (as the model sees them with --data.rc_prob >
0), cut into windows of the model's length, are masked `passes` times (by default 1 / probability, so each base
is selected about once per strand) from a generator seeded by the run's --data.seed; the counts of (context,
original base) at the selected A/C/G/T positions, smoothed as the Markov chains are (Krichevsky-Trofimov, alpha =
1/2), give the probabilities.

Scoring: the held-out batches the model is evaluated on (GenomeData.eval_batch of its eval windows: the same
selected positions, the same corrupted inputs, the same soft-mask weights), every selected position at every k,
bits = sum(w * -log2 P) / sum(w).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from megagenome.data.masking import mask_windows
from megagenome.data.tokenizer import A_ID, C_ID, G_ID, N_ID, T_ID, VOCAB_SIZE, reverse_complement

MAX_K = 4  # 5^9 contexts x 4 bases; k = 5 would need 195M counts
NO_BASE = 4  # the fifth input symbol: <mask>, N, a separator, outside the window
RNG_MASKED_BASELINE = 4  # second word of its seed; data/sampler.py and data/dataset.py use 0-3
BLOCK_BASES = 1 << 22  # bases masked at once (4,096 windows of 1,024), and (context, base) codes counted at once
_SYMBOL = np.full(VOCAB_SIZE, NO_BASE, dtype=np.int64)
_SYMBOL[[A_ID, C_ID, G_ID, T_ID]] = [0, 1, 2, 3]
_TARGET = np.full(VOCAB_SIZE, -1, dtype=np.int64)
_TARGET[[A_ID, C_ID, G_ID, T_ID]] = [0, 1, 2, 3]


def _codes(inputs: np.ndarray, rows: np.ndarray, cols: np.ndarray, top: int):
    """Yield (k, context code) for k = 0..top of the positions (rows, cols) of the (B, W) input ids: the code of
    the 2k + 1 symbols around each, built outwards from the centre."""
    pad = np.full((inputs.shape[0], top), NO_BASE, dtype=np.int64)
    symbols = np.concatenate([pad, _SYMBOL[inputs], pad], axis=1)  # (B, W + 2 top)
    cols = cols + top
    code = symbols[rows, cols]
    yield 0, code
    for d in range(1, top + 1):
        code = (code * 5 + symbols[rows, cols - d]) * 5 + symbols[rows, cols + d]
        yield d, code


def _windows(tokens: np.ndarray, window: int) -> np.ndarray:
    """The token array cut into rows of `window` (the last filled with N, which is never selected)."""
    rows = -(-tokens.size // window)
    out = np.full(rows * window, N_ID, dtype=np.uint8)
    out[: tokens.size] = tokens
    return out.reshape(rows, window)


def fit_counts(
    train: Sequence[np.ndarray], window: int, probability: float, seed: int, ks: Sequence[int], both_strands: bool,
    passes: int | None = None,
) -> dict[int, np.ndarray]:  # fmt: skip
    """{k: counts (5^(2k+1) contexts x 4 bases)} of the masked training windows (module docstring). Each pass masks
    the regions in order, strand by strand, in blocks of up to BLOCK_BASES bases (whole windows) from one generator;
    the (context, base) codes are counted in batches, so many small regions cost no more than one large one."""
    passes = passes or max(1, round(1 / probability))
    counts = {k: np.zeros(5 ** (2 * k + 1) * 4, dtype=np.int64) for k in ks}
    pending: dict[int, list[np.ndarray]] = {k: [] for k in ks}
    rows_per_block = max(1, BLOCK_BASES // window)

    def flush() -> None:
        for k, codes in pending.items():
            if codes:
                counts[k] += np.bincount(np.concatenate(codes), minlength=counts[k].size)
                codes.clear()

    for p in range(passes):
        rng = np.random.default_rng([seed, RNG_MASKED_BASELINE, p])
        for tokens in train:
            tokens = np.asarray(tokens, dtype=np.uint8)
            for strand in (tokens, reverse_complement(tokens)) if both_strands else (tokens,):
                rows = _windows(strand, window)
                for start in range(0, rows.shape[0], rows_per_block):
                    block = rows[start : start + rows_per_block]
                    inputs, chosen = mask_windows(block, probability, rng)
                    target = _TARGET[block]
                    r, c = np.nonzero(chosen & (target >= 0))
                    for k, code in _codes(inputs, r, c, max(ks)):
                        if k in counts:
                            pending[k].append(code * 4 + target[r, c])
                    if sum(len(x) for x in pending[max(ks)]) >= BLOCK_BASES:
                        flush()
    flush()
    return counts


def masked_kmer_bits_per_base(
    train: Sequence[np.ndarray], heldout: Iterable[dict], window: int, probability: float, seed: int,
    ks: Iterable[int] = range(MAX_K + 1), alpha: float = 0.5, both_strands: bool = False, passes: int | None = None,
) -> dict[int, float]:  # fmt: skip
    """{k: held-out masked bits per base} of the two-sided context models fitted on the `train` token arrays, scored
    on `heldout`: batches of (B, W) input_ids, labels and loss_weight as the model is evaluated on
    (GenomeData.eval_batch); a position counts where its weight is positive and its label a base."""
    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] < 0 or ks[-1] > MAX_K:
        raise ValueError(f"masked baseline k must be within [0, {MAX_K}], got {ks}")
    if alpha <= 0:
        raise ValueError(f"smoothing alpha must be positive, got {alpha}")
    if not 0 < probability <= 1:
        raise ValueError(f"masking probability must be in (0, 1], got {probability}")
    counts = fit_counts(train, window, probability, seed, ks, both_strands, passes)
    log_prob = {}
    for k in ks:
        table = counts[k].reshape(-1, 4).astype(np.float64) + alpha  # (contexts, 4 bases)
        log_prob[k] = np.log2(table / table.sum(axis=1, keepdims=True)).reshape(-1)
    bits, mass = dict.fromkeys(ks, 0.0), 0.0
    for batch in heldout:
        inputs = np.asarray(batch["input_ids"], dtype=np.int64)
        labels = _TARGET[np.asarray(batch["labels"], dtype=np.int64)]
        weight = np.asarray(batch["loss_weight"], dtype=np.float64)
        r, c = np.nonzero((weight > 0) & (labels >= 0))
        w = weight[r, c]
        mass += float(w.sum())
        for k, code in _codes(inputs, r, c, ks[-1]):
            if k in log_prob:
                bits[k] += float(-log_prob[k][code * 4 + labels[r, c]] @ w)
    if mass == 0:
        raise ValueError("no held-out masked position with a base to score (all weights 0)")
    return {k: bits[k] / mass for k in ks}


def of_run(data, eval_chunk: int = 64) -> dict[int, float]:
    """The masked baselines of a GenomeData's run: its training regions, window length, masking rate, seed and
    strands (both when --data.rc_prob > 0), scored on its evaluation windows."""
    cfg, regions = data.cfg, data.eval_regions
    heldout = (data.eval_batch(regions[i : i + eval_chunk]) for i in range(0, len(regions), eval_chunk))
    return masked_kmer_bits_per_base(
        [t for t, _ in data.train_tokens()], heldout, window=data.window_len, probability=cfg.mlm_probability,
        seed=cfg.seed, both_strands=cfg.rc_prob > 0,
    )  # fmt: skip
