"""AUROC and its bootstrap interval (layer L4, numpy only): how score-variants (variant_scoring.py) reports a
score's ranking of labelled variants."""

from __future__ import annotations

import numpy as np


def auroc(predictor: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve of `predictor` for the boolean `positive`: the Mann-Whitney U of the positives' average
    ranks (ties share their mean rank, so a tie counts one half) over n_positive x n_negative."""
    predictor, positive = np.asarray(predictor, dtype=np.float64), np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if not n_pos or not n_neg:
        raise ValueError(f"AUROC needs positives and negatives, got {n_pos} and {n_neg}")
    _, inverse, counts = np.unique(predictor, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts + 1  # 1-based rank of each distinct value's first occurrence
    ranks = (first + (counts - 1) / 2)[inverse]  # average rank of each item
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def bootstrap_interval(
    predictor: np.ndarray, positive: np.ndarray, n: int, seed: int, level: float = 0.95
) -> tuple[float, float]:
    """Percentile interval of the AUROC over `n` stratified resamples (positives and negatives drawn apart, with
    replacement, each in its own number) from numpy's default_rng(seed)."""
    predictor, positive = np.asarray(predictor, dtype=np.float64), np.asarray(positive, dtype=bool)
    rng = np.random.default_rng(seed)
    pos, neg = np.flatnonzero(positive), np.flatnonzero(~positive)
    stats = np.empty(n)
    for b in range(n):
        idx = np.concatenate([rng.choice(pos, len(pos)), rng.choice(neg, len(neg))])
        stats[b] = auroc(predictor[idx], positive[idx])
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
