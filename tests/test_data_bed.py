"""Tier 1: gene-centric BED intervals (data/bed.py): strict reading with every problem at once, flank and merge."""

from __future__ import annotations

import gzip
import pathlib

import numpy as np
import pytest

from megagenome.data.bed import BedError, flank_and_merge, read_bed

DATA = pathlib.Path(__file__).resolve().parent / "data"


def contig_length(name: str) -> tuple[str, int]:
    """(record name, length) of a one-record FASTA in tests/data."""
    lines = (DATA / name).read_bytes().splitlines()
    return lines[0][1:].split()[0].decode(), sum(len(line.strip()) for line in lines[1:])


@pytest.fixture(scope="module")
def genome() -> dict[str, int]:
    """A two-contig genome of real lengths: phiX174 (5,386 bp) and the human mitochondrion (16,569 bp)."""
    return dict([contig_length("phiX174_NC_001422.1.fna"), contig_length("chrM_rCRS_16569bp.fa")])


def write(tmp_path, text: str, name: str = "genes.bed") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


GOOD = (
    "track name=genes description='test genes'\n"
    "browser position NC_001422.1:1-5386\n"
    "# a comment\n"
    "NC_001422.1\t100\t200\tgeneA\t0\t+\n"
    "MT_human\t1000\t2000\tMT-RNR1\n"
    "\n"
    "NC_001422.1\t0\t50\n"
    "NC_001422.1\t200\t300\tgeneB\n"  # touches geneA: fine
    "NC_001422.1\t5300\t5386\tgeneC\n"  # ends exactly at the contig's end
)


def test_read_bed_sorts_per_contig(tmp_path, genome):
    assert genome == {"NC_001422.1": 5386, "MT_human": 16_569}
    intervals = read_bed(write(tmp_path, GOOD), genome)
    assert list(intervals) == ["NC_001422.1", "MT_human"]  # genome order, not file order
    assert intervals["NC_001422.1"].dtype == np.int64
    assert intervals["NC_001422.1"].tolist() == [[0, 50], [100, 200], [200, 300], [5300, 5386]]
    assert intervals["MT_human"].tolist() == [[1000, 2000]]


def test_gzip_crlf_and_contig_map(tmp_path, genome):
    path = tmp_path / "genes.bed.gz"
    path.write_bytes(gzip.compress(b"chrM\t10\t20\r\nchrM\t30\t40\r\n"))
    assert read_bed(str(path), genome, contig_map={"chrM": "MT_human"})["MT_human"].tolist() == [[10, 20], [30, 40]]
    with pytest.raises(BedError, match=r"genes\.bed\.gz:1: unknown contig 'chrM' \(known: NC_001422\.1, MT_human\)"):
        read_bed(str(path), genome)


def test_flank_and_merge(tmp_path, genome):
    intervals = read_bed(write(tmp_path, GOOD), genome)
    merged = flank_and_merge(intervals, 20, genome)
    # [0,50]->[0,70]; [100,200]->[80,220] and [200,300]->[180,320] merge; [5300,5386] is clipped at the end.
    assert merged["NC_001422.1"].tolist() == [[0, 70], [80, 320], [5280, 5386]]
    assert merged["MT_human"].tolist() == [[980, 2020]]
    assert flank_and_merge(intervals, 0, genome)["NC_001422.1"].tolist() == [[0, 50], [100, 300], [5300, 5386]]
    assert flank_and_merge(intervals, 25, genome)["NC_001422.1"].tolist() == [[0, 325], [5275, 5386]]  # touching
    # A long interval swallowing later ones, given unsorted.
    nested = {"MT_human": np.array([[500, 600], [100, 1000], [990, 1200], [2000, 2100]])}
    assert flank_and_merge(nested, 0, genome)["MT_human"].tolist() == [[100, 1200], [2000, 2100]]
    assert flank_and_merge({"MT_human": np.zeros((0, 2))}, 5, genome)["MT_human"].shape == (0, 2)
    with pytest.raises(ValueError, match="flank must be >= 0"):
        flank_and_merge(intervals, -1, genome)
    with pytest.raises(BedError, match="unknown contig 'chr1'"):
        flank_and_merge({"chr1": np.array([[0, 1]])}, 0, genome)


def test_every_problem_reported_at_once(tmp_path, genome):
    text = (
        "NC_001422.1\t100\t200\n"  # 1: fine, but overlapped by line 8
        "NC_001422.1 300 400\n"  # 2: spaces
        "MT_human\t10\n"  # 3: two columns
        "MT_human\tten\t20\n"  # 4: not an integer
        "MT_human\t-5\t20\n"  # 5: negative
        "MT_human\t50\t50\n"  # 6: empty
        "MT_human\t16000\t16570\n"  # 7: past the end
        "NC_001422.1\t150\t250\tdup\n"  # 8: overlaps line 1
        "chr1\t0\t10\n"  # 9: unknown contig
        "MT_human\t0\t5000\n"  # 10: fine, but covers line 11
        "MT_human\t4000\t4100\n"  # 11
        "MT_human\t4200\t4300\n"  # 12: overlaps line 10 too, not only its neighbour 11
    )
    path = write(tmp_path, text)
    with pytest.raises(BedError) as e:
        read_bed(path, genome)
    lines = str(e.value).splitlines()
    assert lines[0] == f"10 problems in {path}:"
    assert lines[1:] == [
        f"  - {path}:2: 1 column(s); BED needs chrom, start, end (BED columns are separated by tabs, not spaces)",
        f"  - {path}:3: 2 column(s); BED needs chrom, start, end",
        f"  - {path}:4: start 'ten' is not a non-negative integer",
        f"  - {path}:5: start -5 is negative",
        f"  - {path}:6: start 50 >= end 50; BED intervals are [start, end), non-empty",
        f"  - {path}:7: end 16570 is past the end of MT_human (length 16569)",
        f"  - {path}:9: unknown contig 'chr1' (known: NC_001422.1, MT_human)",
        f"  - {path}:8: NC_001422.1:150-250 overlaps line 1 (NC_001422.1:100-200); merge overlapping intervals "
        f"first (e.g. `bedtools merge`)",
        f"  - {path}:11: MT_human:4000-4100 overlaps line 10 (MT_human:0-5000); merge overlapping intervals first "
        f"(e.g. `bedtools merge`)",
        f"  - {path}:12: MT_human:4200-4300 overlaps line 10 (MT_human:0-5000); merge overlapping intervals first "
        f"(e.g. `bedtools merge`)",
    ]


def test_one_problem_and_many(tmp_path, genome):
    path = write(tmp_path, "MT_human\t0\t10\nMT_human\t5\t12\n")
    with pytest.raises(BedError) as e:
        read_bed(path, genome)
    assert str(e.value) == (
        f"{path}:2: MT_human:5-12 overlaps line 1 (MT_human:0-10); merge overlapping intervals first "
        f"(e.g. `bedtools merge`)"
    )
    path = write(tmp_path, "".join(f"chr{i}\t0\t10\n" for i in range(80)))
    with pytest.raises(BedError) as e:
        read_bed(path, genome)
    lines = str(e.value).splitlines()
    assert lines[0] == f"80 problems in {path}:" and lines[-1] == "  - ... and 30 more" and len(lines) == 52


def test_empty_missing_and_binary(tmp_path, genome):
    assert read_bed(write(tmp_path, "track name=none\n# nothing\n"), genome) == {}
    with pytest.raises(BedError, match="absent.bed: BED file not found"):
        read_bed(str(tmp_path / "absent.bed"), genome)
    binary = tmp_path / "binary.bed"
    binary.write_bytes(b"MT_human\t0\t10\n\xff\xfe\n")
    with pytest.raises(BedError, match=r"binary\.bed:2: not UTF-8 text"):
        read_bed(str(binary), genome)
