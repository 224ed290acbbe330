"""Tier 1: N-free intervals, the held-out split (and its errors), window sampling and rank slicing."""

import json

import numpy as np
import pytest

from megagenome.config import Region
from megagenome.data.fasta import Genome
from megagenome.data.intervals import SplitError, build_split, n_free_intervals, restrict, split_record
from megagenome.data.sampler import WindowSampler, batch_indices, eval_windows
from megagenome.data.tokenizer import N_ID, encode

CHR22 = "22:20000001-21000000"  # the excerpt's contig name is itself a region string
N_BLOCK = (509_431, 609_431)  # the 100 kb N block of the chr22 excerpt, 0-based half-open


@pytest.fixture
def chr22(genome_copy):
    with Genome(genome_copy("GRCh37_chr22_20000001-21000000.fa")) as genome:
        tokens, _ = encode(genome.read_contig(CHR22))
        yield genome.lengths, tokens


def covered(regions, contig, length):
    """Boolean coverage of one contig by regions (a reference independent of the interval arithmetic)."""
    mask = np.zeros(length, dtype=np.int64)
    for r in regions:
        if r.contig == contig:
            mask[r.start : r.end] += 1
    return mask


# ----- N-free intervals ---------------------------------------------------------------------------------


def test_n_free_chr22_excludes_the_block(chr22):
    lengths, tokens = chr22
    assert (tokens[N_BLOCK[0] : N_BLOCK[1]] == N_ID).all() and (tokens == N_ID).sum() == 100_000
    intervals = n_free_intervals(tokens, max_n_run=50)
    assert intervals.dtype == np.int64 and intervals.tolist() == [[0, N_BLOCK[0]], [N_BLOCK[1], 1_000_000]]
    # A threshold above the block length keeps it inside one interval.
    assert n_free_intervals(tokens, max_n_run=100_000).tolist() == [[0, 1_000_000]]


def test_n_free_short_runs_stay(chr22):
    _, tokens = chr22
    tokens = tokens.copy()
    tokens[1000:1030] = N_ID  # 30 N: shorter than max_n_run, kept
    tokens[2000:2050] = N_ID  # exactly max_n_run: kept
    tokens[3000:3051] = N_ID  # max_n_run + 1: cut
    intervals = n_free_intervals(tokens, max_n_run=50)
    assert intervals.tolist() == [[0, 3000], [3051, N_BLOCK[0]], [N_BLOCK[1], 1_000_000]]


@pytest.mark.parametrize(
    ("seq", "max_n_run", "expected"),
    [
        ("NNNACGTNNN", 2, [[3, 7]]),
        ("NNNACGTNNN", 3, [[0, 10]]),
        ("NNNN", 1, []),
        ("ACNGT", 0, [[0, 2], [3, 5]]),
        ("", 5, []),
    ],
)
def test_n_free_edges(seq, max_n_run, expected):
    assert n_free_intervals(encode(seq)[0], max_n_run).tolist() == expected
    assert n_free_intervals(encode(seq)[0], max_n_run).shape == (len(expected), 2)


# ----- split ----------------------------------------------------------------------------------------------

LENGTHS = {"chr1": 1000, "chr2": 500, "chrM": 100}


def test_split_complement():
    split = build_split(LENGTHS, ["chrM"], ["chr1:101-200"], [], ["chr1:901-1000", "chr2:1-50"])
    assert split["val"] == [Region("chr1", 100, 200), Region("chrM", 0, 100)]
    assert split["test"] == [Region("chr1", 900, 1000), Region("chr2", 0, 50)]
    assert split["train"] == [Region("chr1", 0, 100), Region("chr1", 200, 900), Region("chr2", 50, 500)]
    # Every base is in exactly one split.
    for contig, length in LENGTHS.items():
        total = sum(covered(split[s], contig, length) for s in ("train", "val", "test"))
        assert (total == 1).all(), contig


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((["chrX"], [], [], []), ["--data.val_contigs", "unknown contig 'chrX'", "known: chr1, chr2, chrM"]),
        (([], ["chr1:900-1001"], [], []), ["--data.val_ranges", "ends past the end of chr1 (length 1000)"]),
        (([], ["chr9:1-10"], [], []), ["--data.val_ranges", "unknown contig 'chr9'"]),
        (([], ["chr1:100-200"], [], ["chr1:200-300"]), ["--data.test_ranges", "overlaps chr1:100-200", "val_ranges"]),
        (([], ["chr1:1-500", "chr1:100-200"], [], []), ["--data.val_ranges", "overlaps chr1:1-500"]),
        ((["chr2"], [], ["chr2"], []), ["--data.test_contigs", "'chr2' is already held out by --data.val_contigs"]),
        ((["chr2"], [], [], ["chr2:1-10"]), ["--data.test_ranges", "chr2", "--data.val_contigs already holds"]),
        ((["chr2"], ["chr2:1-10"], [], []), ["--data.val_ranges", "--data.val_contigs already holds"]),
        ((["chr1", "chr2"], [], ["chrM"], []), ["no training data"]),
        (([], ["chr1:1-1000", "chr2:1-500"], [], ["chrM:1-100"]), ["no training data"]),
        (([], ["chr1"], [], []), ["--data.val_ranges", "not a region"]),
    ],
)
def test_split_errors(args, words):
    with pytest.raises(SplitError) as e:
        build_split(LENGTHS, *args)
    for word in words:
        assert word in str(e.value), str(e.value)


def test_split_errors_are_collected():
    with pytest.raises(SplitError) as e:
        build_split(LENGTHS, ["chrX"], ["chr2:1-600"], [], [])
    assert "2 problems" in str(e.value) and "chrX" in str(e.value) and "chr2:1-600" in str(e.value)


def test_unknown_contig_list_is_truncated():
    lengths = {f"scaffold{i}": 10 for i in range(50)}
    with pytest.raises(SplitError) as e:
        build_split(lengths, ["chr1"])
    assert "scaffold9, ... (50 contigs)" in str(e.value) and "scaffold10" not in str(e.value)


def test_restrict_and_record(chr22):
    lengths, tokens = chr22
    n_free = {CHR22: n_free_intervals(tokens, 50)}
    split = build_split(lengths, [], [f"{CHR22}:500001-520000"], [], [f"{CHR22}:900001-1000000"])
    restricted = {name: restrict(regions, n_free) for name, regions in split.items()}
    assert restricted["val"] == [Region(CHR22, 500_000, N_BLOCK[0])]
    assert restricted["train"] == [Region(CHR22, 0, 500_000), Region(CHR22, N_BLOCK[1], 900_000)]
    assert restricted["test"] == split["test"]
    record = json.loads(json.dumps(split_record(restricted, fasta="x.fa", max_n_run=50)))
    assert record["fasta"] == "x.fa" and record["max_n_run"] == 50
    assert record["splits"]["val"] == {
        "bases": N_BLOCK[0] - 500_000,
        "num_regions": 1,
        "regions": [{"contig": CHR22, "start": 500_000, "end": N_BLOCK[0]}],
    }
    assert record["splits"]["train"]["bases"] == 500_000 + 900_000 - N_BLOCK[1]


# ----- sampler --------------------------------------------------------------------------------------------


def epoch_windows(sampler, epoch):
    n = sampler.num_windows
    return sampler.windows(np.arange(epoch * n, (epoch + 1) * n))


def assert_disjoint(windows):
    spans = sorted((w.contig, w.start, w.end) for w in windows)
    for (c1, _, e1), (c2, s2, _) in zip(spans, spans[1:]):
        assert c1 != c2 or s2 >= e1, "windows overlap"


@pytest.mark.parametrize("window_len", [100, 513])
def test_no_leakage_phix(genome_copy, window_len):
    with Genome(genome_copy("phiX174_NC_001422.1.fna")) as genome:
        lengths = genome.lengths
    split = build_split(lengths, [], ["NC_001422.1:1001-2000"], [], ["NC_001422.1:4001-4500"])
    sampler = WindowSampler(split["train"], window_len, seed=7)
    heldout = covered(split["val"] + split["test"], "NC_001422.1", 5386)
    seen = np.zeros(5386, dtype=np.int64)
    for epoch in range(12):
        windows = epoch_windows(sampler, epoch)
        assert_disjoint(windows)
        for w in windows:
            assert w.end - w.start == window_len
            assert not heldout[w.start : w.end].any(), w
            seen[w.start : w.end] += 1
    assert not seen[heldout > 0].any()
    # The random phase moves windows between epochs, so training still reaches (nearly) every train base.
    assert seen[heldout == 0].astype(bool).mean() > 0.9


def test_no_leakage_chr22(chr22):
    lengths, tokens = chr22
    n_free = {CHR22: n_free_intervals(tokens, 50)}
    split = build_split(lengths, [], [f"{CHR22}:100001-200000"], [], [f"{CHR22}:700001-750000"])
    train = restrict(split["train"], n_free)
    sampler = WindowSampler(train, 1025, seed=3)
    forbidden = covered(split["val"] + split["test"], CHR22, 1_000_000) + (tokens == N_ID)
    windows = epoch_windows(sampler, 0) + epoch_windows(sampler, 1)
    assert len(windows) == 2 * sampler.num_windows
    starts = np.array([w.start for w in windows])
    hits = np.cumsum(np.concatenate(([0], forbidden > 0)))
    assert (hits[starts + 1025] - hits[starts] == 0).all()  # no window touches a held-out base or an N


def test_sampler_tiling_and_drops():
    regions = [Region("a", 0, 1050), Region("b", 10, 60), Region("a", 2000, 2300), Region("c", 0, 99)]
    sampler = WindowSampler(regions, 100, seed=1)
    assert sampler.num_windows == 10 + 3 and len(sampler) == 13
    assert sampler.dropped_regions == 2 and sampler.dropped_bases == 50 + 99
    assert sampler.slack_bases == 50
    for epoch in range(5):
        windows = epoch_windows(sampler, epoch)
        assert_disjoint(windows)
        assert sum(w.contig == "a" and w.start < 1050 for w in windows) == 10
        for w in windows:
            assert any(r.contig == w.contig and r.start <= w.start and w.end <= r.end for r in regions[:3]), w
    # The shuffle and phase differ between epochs.
    assert epoch_windows(sampler, 0) != epoch_windows(sampler, 1)


def test_sampler_determinism():
    regions = [Region("a", 0, 10_000), Region("b", 5, 7_000)]
    index = np.array([0, 5, 999, 12345, 3])
    one, two = WindowSampler(regions, 64, seed=11), WindowSampler(regions, 64, seed=11)
    assert one.windows(index) == two.windows(index)
    # Order of queries (cache state) does not matter: the window is a function of (seed, index) alone.
    assert [two.window(i) for i in index[::-1]] == one.windows(index)[::-1]
    other = WindowSampler(regions, 64, seed=12)
    assert other.windows(np.arange(50)) != one.windows(np.arange(50))
    with pytest.raises(ValueError):
        one.window(-1)


def test_sampler_needs_a_window():
    with pytest.raises(ValueError, match="--data.seq_len"):
        WindowSampler([Region("a", 0, 100)], 101, seed=0)
    with pytest.raises(ValueError, match="--data.seq_len"):
        WindowSampler([], 10, seed=0)


# ----- rank slicing ---------------------------------------------------------------------------------------


def step_indices(cursor, dp_size, accum, micro):
    return {(m, r): batch_indices(cursor, m, r, dp_size, micro) for m in range(accum) for r in range(dp_size)}


def test_batch_indices_disjoint_and_contiguous():
    cursor, dp_size, accum, micro = 96, 4, 3, 8
    parts = step_indices(cursor, dp_size, accum, micro)
    flat = np.concatenate(list(parts.values()))
    assert len(np.unique(flat)) == flat.size == dp_size * accum * micro
    assert np.array_equal(np.sort(flat), cursor + np.arange(dp_size * accum * micro))
    assert batch_indices(cursor, 1, 2, dp_size, micro).tolist() == list(range(96 + 48, 96 + 56))


def test_batch_indices_resume_at_another_world_size():
    # 4 ranks x 2 micro steps x 4 and 2 ranks x 4 micro steps x 4 both consume 32 samples a step: after a
    # resume at the other size the run sees the same samples, step by step.
    micro = 4
    for step in range(3):
        cursor = step * 32
        a = np.concatenate(list(step_indices(cursor, 4, 2, micro).values()))
        b = np.concatenate(list(step_indices(cursor, 2, 4, micro).values()))
        assert set(a.tolist()) == set(b.tolist()) == set(range(cursor, cursor + 32))
    with pytest.raises(ValueError, match="rank 2"):
        batch_indices(0, 0, 2, 2, 4)


# ----- eval windows ---------------------------------------------------------------------------------------


def test_eval_windows():
    regions = [Region("a", 0, 10_000), Region("b", 100, 150), Region("c", 500, 5_500)]
    windows = eval_windows(regions, 100, 30)
    assert windows == eval_windows(regions, 100, 30)
    assert len(windows) == 30
    assert_disjoint(windows)
    for w in windows:
        assert w.end - w.start == 100
        assert any(r.contig == w.contig and r.start <= w.start and w.end <= r.end for r in regions)
    # Spread in proportion: contig a holds 2/3 of the tiles; the windows reach both ends of the split.
    assert sum(w.contig == "a" for w in windows) == 20
    assert windows[0].start < 500 and windows[-1].contig == "c" and windows[-1].end > 5_000
    # A small split gives all the windows it has.
    assert len(eval_windows(regions, 100, 1000)) == 100 + 50
    assert eval_windows([Region("b", 0, 50)], 100, 10) == []
