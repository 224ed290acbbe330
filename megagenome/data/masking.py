"""BERT-style masking, one rule for the mlm objective's training and evaluation batches and the masked baseline.

In each window, every base (any token but N) is selected with `probability`, at least one per window that has a
base; of the selected positions 80% become <mask>, 10% a random base and 10% stay unchanged. The labels are the
original tokens at the selected positions and <pad> elsewhere.

`mask_windows` masks a (B, W) block with one generator, drawing in the order one window's masking does (its
selection, the at-least-one pick, the 80/10/10 split, the random bases), so that a single window masked here is
the window data/dataset.py masks with the same generator: training and evaluation draw window by window from
per-sample seeds, the masked baseline (data/masked_baseline.py) draws a whole block at once.
"""

from __future__ import annotations

import numpy as np

from megagenome.data.tokenizer import A_ID, MASK_ID, N_ID, PAD_ID, T_ID

# BERT's split of the selected positions: 80% become <mask>, 10% a random base, 10% stay unchanged.
MASK_FRACTION, RANDOM_FRACTION = 0.8, 0.1


def mask_windows(tokens: np.ndarray, probability: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(inputs int64 (B, W), chosen bool (B, W)) of the (B, W) token windows `tokens` (module docstring)."""
    tokens = np.asarray(tokens)
    eligible = tokens != N_ID
    chosen = eligible & (rng.random(tokens.shape) < probability)
    for row in np.flatnonzero(~chosen.any(axis=1) & eligible.any(axis=1)):
        # A window with no target would contribute nothing but still cost a forward pass.
        chosen[row, rng.choice(np.flatnonzero(eligible[row]))] = True
    action = rng.random(tokens.shape)
    random_bases = rng.integers(A_ID, T_ID + 1, size=tokens.shape, dtype=np.int64)
    inputs = tokens.astype(np.int64)
    inputs[chosen & (action < MASK_FRACTION)] = MASK_ID
    swap = chosen & (action >= MASK_FRACTION) & (action < MASK_FRACTION + RANDOM_FRACTION)
    inputs[swap] = random_bases[swap]
    return inputs, chosen


def mask_window(
    tokens: np.ndarray, weight: np.ndarray, probability: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, labels, loss_weight), each (W,), of one window: the loss weight kept at the selected positions."""
    inputs, chosen = mask_windows(np.asarray(tokens)[None, :], probability, rng)
    inputs, chosen = inputs[0], chosen[0]
    labels = np.where(chosen, tokens, PAD_ID)
    return inputs, labels, np.where(chosen, weight, np.float32(0.0)).astype(np.float32)
