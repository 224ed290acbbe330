"""Tier 1: tokenizer lookup tables, soft-mask, IUPAC handling and reverse complement on real sequence."""

import numpy as np
import pytest

from megagenome.data import tokenizer as tk
from megagenome.data.fasta import Genome


def _records(path: str) -> bytes:
    """Sequence of a one-record FASTA, joined by plain Python (an independent reference for the tokenizer)."""
    with open(path, "rb") as fh:
        return b"".join(line.strip() for line in fh if not line.startswith(b">"))


def test_vocab_ids():
    assert tk.VOCAB_SIZE == len(tk.VOCAB) == 8
    assert [tk.PAD_ID, tk.MASK_ID, tk.SEP_ID, tk.A_ID, tk.C_ID, tk.G_ID, tk.T_ID, tk.N_ID] == list(range(8))
    assert tk.VOCAB[tk.A_ID] == "A" and tk.VOCAB[tk.N_ID] == "N" and tk.VOCAB[tk.MASK_ID] == "<mask>"


def test_round_trip_phix(genome_copy):
    seq = _records(genome_copy("phiX174_NC_001422.1.fna"))
    assert len(seq) == 5386
    tokens, soft = tk.encode(seq)
    assert tokens.dtype == np.uint8 and soft.dtype == bool and tokens.shape == soft.shape == (5386,)
    assert not soft.any()
    assert tk.decode(tokens) == seq.decode()
    assert tk.encode(seq.decode())[0].tolist() == tokens.tolist()  # str and bytes agree
    counts = np.bincount(tokens, minlength=tk.VOCAB_SIZE)
    assert counts[tk.A_ID] == seq.count(b"A") and counts[tk.G_ID] == seq.count(b"G")
    assert counts[tk.N_ID] == 0


def test_softmask_chr17(genome_copy):
    path = genome_copy("hg19_chr17_1-40000_softmasked.fa")
    with Genome(path) as genome:
        seq = genome.read_contig("chr17")
    tokens, soft = tk.encode(seq)
    assert int(soft.sum()) == 17_395  # counted independently with grep -o '[a-z]'
    raw = np.frombuffer(seq, dtype=np.uint8)
    assert np.array_equal(soft, (raw >= ord("a")) & (raw <= ord("z")))
    # Case does not change the token: the uppercased sequence encodes to the same ids.
    assert np.array_equal(tk.encode(seq.upper())[0], tokens)
    assert tk.decode(tokens) == seq.decode().upper()


def test_iupac_codes_are_n():
    tokens, soft = tk.encode(b"RYSWKMBDHVNryswkmbdhvn")
    assert (tokens == tk.N_ID).all()
    assert soft.tolist() == [False] * 11 + [True] * 11
    assert tk.encode("acgtACGT")[0].tolist() == [3, 4, 5, 6, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("seq", "chars", "offset"),
    [(b"ACGT-ACGT", "'-'", 4), (b"ACGU", "'U'", 3), (b"AC*GxT", "'*', 'x'", 2), (b"ACG T", "' '", 3)],
)
def test_bad_characters(seq, chars, offset):
    with pytest.raises(ValueError) as e:
        tk.encode(seq)
    assert chars in str(e.value) and f"first at offset {offset}" in str(e.value)


def test_decode_specials_and_range():
    assert tk.decode(np.array([tk.MASK_ID, tk.A_ID, tk.PAD_ID, tk.N_ID])) == "<mask>A<pad>N"
    assert tk.decode(np.array([], dtype=np.int64)) == ""
    with pytest.raises(ValueError):
        tk.decode(np.array([8]))


def test_reverse_complement_known_case():
    tokens, _ = tk.encode(b"AACGTN")
    assert tk.decode(tk.reverse_complement(tokens)) == "NACGTT"
    assert tk.decode(tk.reverse_complement(tk.encode(b"GATTACA")[0])) == "TGTAATC"
    specials = np.array([tk.PAD_ID, tk.A_ID, tk.MASK_ID, tk.C_ID, tk.SEP_ID])
    assert tk.reverse_complement(specials).tolist() == [tk.SEP_ID, tk.G_ID, tk.MASK_ID, tk.T_ID, tk.PAD_ID]


def test_reverse_complement_involution(genome_copy):
    tokens, _ = tk.encode(_records(genome_copy("GRCh37_chr22_20000001-21000000.fa")))
    rc = tk.reverse_complement(tokens)
    assert rc.dtype == tokens.dtype and rc.shape == tokens.shape
    assert not np.array_equal(rc, tokens)
    assert np.array_equal(tk.reverse_complement(rc), tokens)
    # Complementing swaps base counts pairwise: #A(rc) = #T, #C(rc) = #G.
    counts, rc_counts = np.bincount(tokens, minlength=8), np.bincount(rc, minlength=8)
    assert rc_counts[tk.A_ID] == counts[tk.T_ID] and rc_counts[tk.C_ID] == counts[tk.G_ID]
    assert rc_counts[tk.N_ID] == counts[tk.N_ID] == 100_000
    # Batched: reverses along the last axis only.
    batch = np.stack([tokens[:10], tokens[10:20]])
    assert np.array_equal(tk.reverse_complement(batch)[1], tk.reverse_complement(tokens[10:20]))
