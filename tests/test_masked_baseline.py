"""Tier 1: the masked LMs' baseline (data/masked_baseline.py), two-sided k-mer context models under the model's own
masking: against an independent count-by-dictionary reference on a real run's data, against what the centre symbol
alone tells on uniform bases (worked out by hand), on a sequence whose bases its neighbours fix, and on E. coli
(what the tiny masked configs are compared with)."""

import functools
import math
from collections import Counter

import numpy as np
import pytest
from support.helpers import copy_genome

from megagenome.config import DataConfig
from megagenome.data import masked_baseline
from megagenome.data.dataset import build_genome_data
from megagenome.data.masking import mask_window, mask_windows
from megagenome.data.tokenizer import A_ID, N_ID, encode, reverse_complement

BASES = "ACGT"


def _symbol(token: int) -> str:
    return BASES[token - A_ID] if A_ID <= token < A_ID + 4 else "."  # <mask>, N, a separator: no base


def reference(train, heldout, window, probability, seed, ks, passes, both_strands, alpha=0.5):
    """The module docstring's rule in plain Python: windows of `window` bases, masked pass by pass with the generator
    [seed, 4, pass] in blocks of BLOCK_BASES bases; (context string, base) counted in a dictionary, where the context is
    the 2k + 1 input symbols around a selected base and "." stands for no base or outside the window."""
    counts = {k: Counter() for k in ks}
    strands = [s for t in train for s in ((t, reverse_complement(t)) if both_strands else (t,))]
    for p in range(passes):
        rng = np.random.default_rng([seed, masked_baseline.RNG_MASKED_BASELINE, p])
        for tokens in strands:
            rows = -(-tokens.size // window)
            padded = np.full(rows * window, N_ID, dtype=np.uint8)
            padded[: tokens.size] = tokens
            block = padded.reshape(rows, window)
            step = masked_baseline.BLOCK_BASES // window
            for start in range(0, rows, step):
                inputs, chosen = mask_windows(block[start : start + step], probability, rng)
                for r, c in zip(*np.nonzero(chosen)):
                    base = _symbol(int(block[start + r, c]))
                    if base != ".":
                        for k in ks:
                            counts[k][_context(inputs[r], c, k), base] += 1
    bits, mass = dict.fromkeys(ks, 0.0), 0.0
    for batch in heldout:
        for row, labels, weights in zip(batch["input_ids"].numpy(), batch["labels"].numpy(), batch["loss_weight"]):
            for c in np.flatnonzero(weights.numpy() > 0):
                base, w = _symbol(int(labels[c])), float(weights[c])
                mass += w
                for k in ks:
                    context = _context(row, c, k)
                    total = sum(counts[k][context, b] for b in BASES) + 4 * alpha
                    bits[k] -= w * math.log2((counts[k][context, base] + alpha) / total)
    return {k: bits[k] / mass for k in ks}


def _context(row, c: int, k: int) -> str:
    return "".join(_symbol(int(row[i])) if 0 <= i < len(row) else "." for i in range(c - k, c + k + 1))


def test_equals_the_reference_on_a_real_runs_windows(tmp_path):
    """phiX174 as an mlm run sees it (the held-out range scored as evaluation masks it, training on both strands):
    of_run is the dictionary reference, k = 0..2, to float rounding."""
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path)
    cfg = DataConfig(fasta=fasta, seq_len=128, val_ranges=["NC_001422.1:4801-5386"], eval_windows=4, rc_prob=0.5)
    with build_genome_data(cfg, "mlm") as data:
        train = [t for t, _ in data.train_tokens()]
        heldout = [data.eval_batch(data.eval_regions)]
        got = masked_baseline.masked_kmer_bits_per_base(train, heldout, 128, 0.15, cfg.seed, ks=[0, 1, 2],
                                                        both_strands=True)  # fmt: skip
        assert masked_baseline.of_run(data)[2] == got[2]  # of_run: the run's own windows, rate, seed and strands
    expected = reference(train, heldout, 128, 0.15, cfg.seed, [0, 1, 2], passes=7, both_strands=True)
    assert got == pytest.approx(expected, abs=1e-12), (got, expected)
    assert got[1] < got[0]  # phiX's neighbours say something about a base


def _masked_batches(tokens: np.ndarray, window: int, seed: int) -> list[dict]:
    """Held-out batches as GenomeData.eval_batch builds them: one generator per window, weight 1."""
    rows = tokens[: tokens.size // window * window].reshape(-1, window)
    masked = [mask_window(r, np.ones(window, np.float32), 0.15, np.random.default_rng([seed, i])) for i, r in
              enumerate(rows)]  # fmt: skip
    import torch

    return [{key: torch.from_numpy(np.stack(part)) for key, part in zip(("input_ids", "labels", "loss_weight"),
                                                                         zip(*masked))}]  # fmt: skip


def test_uniform_bases_carry_only_the_centre_symbol():
    """On i.i.d. uniform bases no context helps; what a selected position's own input tells does. 80% are <mask>:
    2 bits. 20% show a base, the original one with probability (0.1 + 0.1 / 4) / 0.2 = 0.625, each other one
    0.125: -(0.625 log2 0.625 + 3 x 0.125 log2 0.125) = 1.5488 bits. In all 0.8 x 2 + 0.2 x 1.5488 = 1.9098."""
    rng = np.random.default_rng(7)
    train = (rng.integers(0, 4, 600_000) + A_ID).astype(np.uint8)
    heldout = _masked_batches((rng.integers(0, 4, 400_000) + A_ID).astype(np.uint8), 512, 11)
    bits = masked_baseline.masked_kmer_bits_per_base([train], heldout, 512, 0.15, seed=3, ks=[0, 1, 2])
    centre = -(0.625 * math.log2(0.625) + 3 * 0.125 * math.log2(0.125))
    assert bits[0] == pytest.approx(0.8 * 2 + 0.2 * centre, abs=0.01), bits
    assert bits[1] == pytest.approx(bits[0], abs=0.01) and bits[2] == pytest.approx(bits[0], abs=0.02), bits


def test_two_sided_context_finds_a_base_its_neighbours_fix():
    """Every odd base is (left + right) mod 4, every even one free: with k = 1 the model reads the odd bases off their
    neighbours where both show their base (~75% of them), which no left-only context could (the right neighbour is
    free), and the centre alone (k = 0) stays at 1.91. The counts cannot tell odd from even positions, so a context
    that fixes an odd base costs the even ones that share it: measured 1.00 bits on the odd positions, 2.20 on the
    even, 1.60 in all."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 4, 800_001)
    x[1::2] = (x[0:-1:2] + x[2::2]) % 4
    tokens = (x + A_ID).astype(np.uint8)
    (heldout,) = _masked_batches(tokens[600_000:], 512, 13)
    weights = heldout["loss_weight"].clone()
    fit = functools.partial(masked_baseline.masked_kmer_bits_per_base, [tokens[:600_000]], window=512,
                            probability=0.15, seed=3, ks=[0, 1])  # fmt: skip
    bits = fit([heldout])
    heldout["loss_weight"] = weights.clone()
    heldout["loss_weight"][:, 0::2] = 0  # the odd positions alone
    odd = fit([heldout])
    assert bits[0] == pytest.approx(1.91, abs=0.01) and odd[0] == pytest.approx(1.91, abs=0.01), (bits, odd)
    assert odd[1] == pytest.approx(1.0, abs=0.05) and bits[1] == pytest.approx(1.6, abs=0.05), (bits, odd)


def test_the_masking_draws_as_before_the_rule_moved():
    """data/masking.py took BERT's masking out of data/dataset.py: one window with one seed gives what the earlier
    code gave (its outputs, recorded at commit fd41d99), so mlm training and evaluation batches are unchanged."""
    tokens = encode("ACGTNACGGTTACCAGTNNACGTA")[0]
    inputs, labels, weight = mask_window(
        tokens, np.ones(tokens.size, np.float32), 0.3, np.random.default_rng([1234, 2, 5])
    )
    assert inputs.tolist() == [3, 4, 1, 6, 7, 3, 4, 5, 1, 1, 6, 3, 1, 4, 3, 5, 1, 7, 7, 1, 1, 5, 6, 3]
    assert labels.tolist() == [3, 0, 5, 0, 0, 0, 0, 0, 5, 6, 0, 0, 4, 0, 3, 0, 6, 0, 0, 3, 4, 0, 0, 0]
    assert weight.tolist() == [float(v) for v in labels != 0]


def test_rejects_what_it_cannot_fit():
    train, heldout = [np.full(10, A_ID, np.uint8)], _masked_batches(np.full(512, A_ID, np.uint8), 512, 1)
    with pytest.raises(ValueError, match=r"within \[0, 4\]"):
        masked_baseline.masked_kmer_bits_per_base(train, heldout, 512, 0.15, 0, ks=[5])
    with pytest.raises(ValueError, match="masking probability"):
        masked_baseline.masked_kmer_bits_per_base(train, heldout, 512, 0.0, 0)


# What configs/tiny_gpn.yaml's data (E. coli, the last ~240 kb held out, 1024-base windows, both strands) gives,
# k = 0..4, measured: 1.9130 1.8789 1.8466 1.8377 1.9495. Counts and float64 logarithms: the same on every machine.
ECOLI_BEST_MASKED = 1.8377


@pytest.mark.slow
def test_ecoli_masked_baselines(ecoli_fasta):
    cfg = DataConfig(fasta=ecoli_fasta, seq_len=1024, val_ranges=["K-12-MG1655:4400001-4639675"], eval_windows=256)
    with build_genome_data(cfg, "mlm") as data:
        bits = masked_baseline.of_run(data)
    assert list(bits) == [0, 1, 2, 3, 4]
    assert bits[3] == pytest.approx(ECOLI_BEST_MASKED, abs=1e-4) and min(bits, key=bits.get) == 3, bits
    assert bits[4] > bits[3]  # 5^9 contexts outgrow 4.4 Mb of training data on two strands
