"""Order-k Markov chain baselines: the bits per base a model must beat on the held-out split.

A DNA language model's held-out loss in bits per base means little without a reference: about 2 bits is
chance for four bases, and short-context statistics (GC content, codon usage, CpG depletion) already buy
a few hundredths to tenths of a bit. These chains give that reference for k = 0..8 in a few seconds.

Counting is vectorised: for each token array the (k+1)-mer code of every position, sum_j 4^(k-j) x[i+j]
over bases x in {A:0, C:1, G:2, T:3}, is built incrementally from the k-mer codes, and np.bincount does
the counting. A (k+1)-mer is used only when all its bases are A, C, G or T, and never spans two arrays
(regions), so N runs and held-out gaps do not invent transitions.

With `both_strands` the chains are also fitted on the reverse complement of every training array: a model trained
with reverse-complement augmentation (--data.rc_prob > 0) sees both strands, so its baseline should too (on E. coli
that makes the best chain ~0.004 bits/base stronger). The held-out split is scored as given (forward strand).

Smoothing is additive with alpha = 0.5 by default, the Krichevsky-Trofimov (Jeffreys prior) estimator:
P(b | context) = (count(context, b) + 1/2) / (count(context) + 2). It is the standard choice for
sequential coding of Markov sources (regret ~ (1/2) log n per parameter) and is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from megagenome.data.tokenizer import A_ID, C_ID, G_ID, T_ID, VOCAB_SIZE, reverse_complement

MAX_ORDER = 12  # 4^13 counts (~540 MB as int64) is the most one would want in memory
_BASE4 = np.full(VOCAB_SIZE, -1, dtype=np.int64)
_BASE4[[A_ID, C_ID, G_ID, T_ID]] = [0, 1, 2, 3]


def _kmers(tokens: np.ndarray, max_order: int):
    """Yield (k, codes, valid) for k = 0..max_order: codes[i] is the (k+1)-mer code of tokens[i:i+k+1],
    valid[i] whether all of those k+1 tokens are bases. The target base of codes[i] is tokens[i+k]."""
    x = _BASE4[np.asarray(tokens, dtype=np.intp)]
    is_base = x >= 0
    x = np.where(is_base, x, 0)
    codes, valid = x, is_base
    for k in range(max_order + 1):
        if codes.size == 0:
            return
        yield k, codes, valid
        codes = codes[:-1] * 4 + x[k + 1 :]
        valid = valid[:-1] & is_base[k + 1 :]


def markov_bits_per_base(
    train: Sequence[np.ndarray],
    heldout: Sequence[np.ndarray],
    orders: Iterable[int] = range(9),
    alpha: float = 0.5,
    heldout_weights: Sequence[np.ndarray] | None = None,
    both_strands: bool = False,
) -> dict[int, float]:
    """{k: held-out bits per base} of order-k Markov chains fitted on `train` token arrays.

    Scored positions are those whose base and preceding k bases are all A, C, G or T; `heldout_weights`
    (one float array per held-out array, e.g. soft-mask evaluation weights) weights each target position.
    Higher orders score slightly fewer positions (the first k of every array have no full context).
    `both_strands` also counts the reverse complement of every training array (module docstring).
    """
    orders = sorted(set(int(k) for k in orders))
    if not orders or orders[0] < 0 or orders[-1] > MAX_ORDER:
        raise ValueError(f"Markov orders must be within [0, {MAX_ORDER}], got {orders}")
    if alpha <= 0:
        raise ValueError(f"smoothing alpha must be positive, got {alpha}")
    if heldout_weights is not None:
        if len(heldout_weights) != len(heldout):
            raise ValueError(f"{len(heldout_weights)} weight arrays for {len(heldout)} held-out arrays")
        for tokens, weights in zip(heldout, heldout_weights):
            if np.shape(weights) != np.shape(tokens):
                raise ValueError(f"weight array of shape {np.shape(weights)} for tokens of shape {np.shape(tokens)}")
    wanted, top = set(orders), orders[-1]

    counts = {k: np.zeros(4 ** (k + 1), dtype=np.int64) for k in orders}
    strands = (lambda t: (t, reverse_complement(np.asarray(t)))) if both_strands else (lambda t: (t,))
    for tokens in (strand for t in train for strand in strands(t)):
        for k, codes, valid in _kmers(tokens, top):
            if k in wanted:
                counts[k] += np.bincount(codes[valid], minlength=4 ** (k + 1))

    log_prob = {}
    for k in orders:
        table = counts[k].reshape(-1, 4).astype(np.float64) + alpha  # (4^k contexts, 4 next bases)
        log_prob[k] = np.log2(table / table.sum(axis=1, keepdims=True)).reshape(-1)

    bits = dict.fromkeys(orders, 0.0)
    mass = dict.fromkeys(orders, 0.0)
    for i, tokens in enumerate(heldout):
        weights = None if heldout_weights is None else np.asarray(heldout_weights[i], dtype=np.float64)
        for k, codes, valid in _kmers(tokens, top):
            if k not in wanted:
                continue
            nll = -log_prob[k][codes[valid]]
            if weights is None:
                bits[k] += float(nll.sum())
                mass[k] += float(nll.size)
            else:
                w = weights[k:][valid]  # weight of the target base tokens[i + k]
                bits[k] += float(nll @ w)
                mass[k] += float(w.sum())
    empty = [k for k in orders if mass[k] == 0]
    if empty:
        raise ValueError(f"no held-out position with a full A/C/G/T context (or all weights 0) for orders {empty}")
    return {k: bits[k] / mass[k] for k in orders}
