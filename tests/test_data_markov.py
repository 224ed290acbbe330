"""Tier 1: order-k Markov baselines against hand computations, a known chain, and E. coli."""

import math

import numpy as np
import pytest

from megagenome.config import DataConfig
from megagenome.data.dataset import build_genome_data
from megagenome.data.markov import markov_bits_per_base
from megagenome.data.tokenizer import A_ID, encode, reverse_complement


def tok(seq: str) -> np.ndarray:
    return encode(seq)[0]


def test_hand_computation():
    # train "AAC": order 0 counts A=2, C=1 -> P(A) = 2.5/5, P(C) = 1.5/5 (alpha = 1/2 on 4 bases);
    # order 1: context A saw A once and C once -> P(C|A) = 1.5/4. Held-out "AC" scores A and C at order 0,
    # and only C (the one position with a full context) at order 1.
    bits = markov_bits_per_base([tok("AAC")], [tok("AC")], orders=[0, 1])
    assert bits[0] == pytest.approx((-math.log2(0.5) - math.log2(0.3)) / 2)
    assert bits[1] == pytest.approx(-math.log2(1.5 / 4))
    # alpha = 1 (Laplace): P(C|A) = 2/6.
    assert markov_bits_per_base([tok("AAC")], [tok("AC")], orders=[1], alpha=1.0)[1] == pytest.approx(-math.log2(2 / 6))


def test_no_transitions_across_regions_or_n():
    # Split into two arrays, or broken by N, "AA" + "C" has no A->C transition: P(C|A) = 0.5/3.
    expected = -math.log2(0.5 / 3)
    assert markov_bits_per_base([tok("AA"), tok("C")], [tok("AC")], orders=[1])[1] == pytest.approx(expected)
    assert markov_bits_per_base([tok("AANC")], [tok("AC")], orders=[1])[1] == pytest.approx(expected)
    # Held-out positions whose context holds an N are not scored: only "GT" -> T counts here.
    got = markov_bits_per_base([tok("GT")], [tok("ANGT")], orders=[1])[1]
    assert got == pytest.approx(-math.log2(1.5 / 3))
    # "ANCGT" also scores G after C, a context never seen in training: 2 bits, the mean is 1.5.
    assert markov_bits_per_base([tok("GT")], [tok("ANCGT")], orders=[1])[1] == pytest.approx(1.5)


def test_weights():
    train, heldout = [tok("ACGTTGCAAC" * 20)], [tok("ACGTAAACCG")]
    weights = np.array([1, 1, 0, 0, 2, 1, 1, 0, 1, 1], dtype=np.float64)
    weighted = markov_bits_per_base(train, heldout, orders=[2], heldout_weights=[weights])[2]
    # Reference: score positions 2..9 one by one from the unweighted per-position bits.
    per_position = [markov_bits_per_base(train, [heldout[0][i - 2 : i + 1]], orders=[2])[2] for i in range(2, 10)]
    assert weighted == pytest.approx(np.dot(per_position, weights[2:]) / weights[2:].sum())
    with pytest.raises(ValueError, match="weight"):
        markov_bits_per_base(train, heldout, orders=[2], heldout_weights=[weights[:5]])
    with pytest.raises(ValueError, match="all weights 0"):
        markov_bits_per_base(train, heldout, orders=[2], heldout_weights=[np.zeros(10)])


def test_known_order1_chain():
    # A strongly order-1 chain: the order-1 model reaches its entropy rate, the order-0 model cannot.
    p = np.array([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.7, 0.1], [0.1, 0.1, 0.1, 0.7], [0.4, 0.4, 0.1, 0.1]])
    rng = np.random.default_rng(0)
    n = 300_000
    x = np.empty(n, dtype=np.int64)
    x[0] = 0
    u = rng.random(n)
    cdf = np.cumsum(p, axis=1)
    for i in range(1, n):  # sequential by nature: each base depends on the previous one
        x[i] = np.searchsorted(cdf[x[i - 1]], u[i], side="right")
    tokens = (x + A_ID).astype(np.uint8)
    bits = markov_bits_per_base([tokens[:200_000]], [tokens[200_000:]], orders=range(4))
    # Stationary distribution and entropy rate by hand.
    w, v = np.linalg.eig(p.T)
    pi = np.real(v[:, np.argmin(abs(w - 1))])
    pi /= pi.sum()
    rate = -np.sum(pi[:, None] * p * np.log2(p))
    marginal = -np.sum(pi * np.log2(pi))
    assert bits[1] == pytest.approx(rate, abs=0.01)
    assert bits[0] == pytest.approx(marginal, abs=0.01)
    assert bits[1] < bits[0] - 0.3
    assert bits[2] == pytest.approx(bits[1], abs=0.01) and bits[3] == pytest.approx(bits[1], abs=0.01)


def test_bad_arguments():
    with pytest.raises(ValueError, match="orders"):
        markov_bits_per_base([tok("ACGT")], [tok("ACGT")], orders=[13])
    with pytest.raises(ValueError, match="alpha"):
        markov_bits_per_base([tok("ACGT")], [tok("ACGT")], alpha=0)


# Order 7, measured: 1.9999 1.9833 1.9661 1.9538 1.9462 1.9398 1.9360 1.9353 1.9430. These hold on every machine:
# the baselines are counts and float64 logarithms (data/markov.py), no bf16 kernel that differs between processors.
BOTH_STRANDS_BEST = 1.9353


def test_ecoli_baselines(ecoli_fasta):
    # Hold out the last ~240 kb, as the example config does.
    cfg = DataConfig(fasta=ecoli_fasta, seq_len=512, val_ranges=["K-12-MG1655:4400001-4639675"])
    with build_genome_data(cfg, "clm") as d:
        train = [t for t, _ in d.train_tokens()]
        heldout = [t for t, _ in d.heldout_tokens()]
    assert sum(t.size for t in heldout) == 239_675
    bits = markov_bits_per_base(train, heldout, orders=range(9))
    # Measured: 2.0000 1.9834 1.9661 1.9539 1.9464 1.9401 1.9371 1.9395 1.9592 (k = 0..8).
    # Order 0 is slightly above 2 bits: the held-out composition differs a little from the training one.
    assert bits[0] == pytest.approx(2.0, abs=1e-4)
    assert all(1.85 < bits[k] < 2.0 for k in range(1, 9)), bits
    assert all(bits[k + 1] < bits[k] for k in range(6)), bits  # more context helps up to k = 6 ...
    assert bits[8] > bits[6]  # ... then 4^k contexts outgrow 4.4 Mb of training data
    assert bits[6] == pytest.approx(1.937, abs=0.002)
    # Fitted on both strands (what the summary uses when --data.rc_prob > 0): the long contexts, short of data, gain
    # most (order 7 becomes the best: 1.9353 vs 1.9371 forward-only at order 6).
    both = markov_bits_per_base(train, heldout, orders=range(9), both_strands=True)
    assert all(both[k] < bits[k] for k in range(3, 9)), (both, bits)
    assert min(both.values()) == pytest.approx(BOTH_STRANDS_BEST, abs=0.002), both


def test_both_strands_counts_the_reverse_complement():
    # Fitted on "AC" and its reverse complement "GT": with both strands, order-1 sees A->C and G->T.
    one = markov_bits_per_base([tok("AC")], [tok("GT")], orders=[1], alpha=1.0)[1]
    both = markov_bits_per_base([tok("AC")], [tok("GT")], orders=[1], alpha=1.0, both_strands=True)[1]
    assert one == pytest.approx(2.0)  # context G unseen: uniform
    assert both == pytest.approx(-math.log2(2 / 5))  # (1 + 1) / (1 + 4)
    # Explicitly adding the reverse-complement arrays is the same thing.
    train = [tok("AACGTTGCA"), tok("CCGA")]
    explicit = markov_bits_per_base(train + [reverse_complement(t) for t in train], [tok("ACGTACGGT")], orders=[0, 2])
    assert markov_bits_per_base(train, [tok("ACGTACGGT")], orders=[0, 2], both_strands=True) == explicit
