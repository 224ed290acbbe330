"""Tier 1: FASTA validation (file, line and column of each problem) and Genome random access, plain and BGZF."""

import gzip
import os
import shutil

import pytest

from megagenome.data.fasta import FastaError, Genome, validate_fasta

ECOLI_CONTIG, ECOLI_LENGTH = "K-12-MG1655", 4_639_675


def write(tmp_path, text: bytes, name: str = "bad.fa") -> str:
    path = tmp_path / name
    path.write_bytes(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "where", "words"),
    [
        (b"ACGT\nACGT\n", ":1:", "no FASTA header"),
        (b"\n\n;comment\n", "", "no FASTA header"),
        (b";comment\nACGT\n>a\nACGT\n", ":2:", "sequence before the first header"),
        (b">a one\nACGT\n>b\nAC\n>a two\nACGT\n", ":5:", "duplicate record name 'a' (first defined at line 1)"),
        (b">a\nACGT\nAC-T\n", ":3:3:", "'-' is not a nucleotide"),
        (b">a\nACGT\nACGT\nAC*\n", ":4:3:", "'*' is not a nucleotide"),
        (b">a\nACGT\nACUT\n", ":3:3:", "'U' is not a nucleotide"),
        (b">a\r\nACGT\r\nACGT\r\n", ":1:", "Windows (CRLF) line endings; convert with `dos2unix`"),
        (b">a\nACGT\r\nACGT\n", ":2:", "mixed line endings: CRLF here, LF at line 1"),
        (b">a\r\nACGT\r\nACGT\n>b\r\n", ":1:", "mixed line endings: CRLF here, LF at line 3"),
        (b">\nACGT\n", ":1:", "header has an empty name"),
        (b">a\nACGT\n> b\nACGT\n", ":3:", "header has an empty name"),
        (b">a\n>b\nACGT\n", ":1:", "record has no sequence"),
        (b">a\nACGT\n>b\n", ":3:", "record has no sequence"),
        (b">a\nACGT\n>b\n\n>c\nAC\n", ":3:", "record has no sequence"),
        (b">a\nACGT\nAC\nACGT\n", ":3:", "shorter than the record's first line"),
        (b">a\nACGT\nACGTA\n", ":3:", "longer (5) than the record's first line (4)"),
        (b">a\nACGT\n\nACGT\n", ":3:", "blank line inside a record"),
        (b">a\nACGT\n\n\n>b\nACGT\n", ":4:", "second blank line"),
    ],
)
def test_bad_fasta(tmp_path, text, where, words):
    path = write(tmp_path, text)
    with pytest.raises(FastaError) as e:
        validate_fasta(path)
    message = str(e.value)
    assert message.startswith(f"{path}{where}"), message
    assert words in message, message
    # Genome refuses the same file before pyfaidx sees it.
    with pytest.raises(FastaError):
        Genome(path)


def test_missing_and_empty(tmp_path):
    with pytest.raises(FastaError, match="not found"):
        validate_fasta(str(tmp_path / "absent.fa"))
    with pytest.raises(FastaError, match="empty"):
        validate_fasta(write(tmp_path, b""))
    with pytest.raises(FastaError, match="directory"):
        validate_fasta(str(tmp_path))


def test_plain_gzip_rejected_with_bgzip_hint(genome_copy):
    path = genome_copy("lambda_NC_001416.1.fa.gz")
    with pytest.raises(FastaError) as e:
        Genome(path)
    message = str(e.value)
    assert path in message and "plain gzip cannot be read at random offsets" in message
    assert "`bgzip`" in message and "`gunzip`" in message
    assert not os.path.exists(path + ".fai")


def test_compression_must_match_the_name(tmp_path, ecoli_fasta):
    # pyfaidx chooses its reader by file name; a mismatch would silently read compressed bytes as bases.
    bgzf_as_plain = str(tmp_path / "ecoli.fa")
    shutil.copy(ecoli_fasta, bgzf_as_plain)
    with pytest.raises(FastaError, match="BGZF-compressed but its name does not end in .gz"):
        validate_fasta(bgzf_as_plain)
    with pytest.raises(FastaError, match="not compressed"):
        validate_fasta(write(tmp_path, b">a\nACGT\n", "plain.fa.gz"))


def test_truncated_bgzf(tmp_path, ecoli_fasta):
    with open(ecoli_fasta, "rb") as fh:
        head = fh.read(200_000)
    path = write(tmp_path, head, "truncated.fa.bgz")
    with pytest.raises(FastaError, match="cannot read the file"):
        validate_fasta(path)


def test_lenient_layouts_accepted(tmp_path):
    # What samtools/pyfaidx accept must pass too: comments and blank lines before the first header, a short
    # last line, one blank line ending a record, IUPAC codes, lowercase, and no newline at the end.
    text = b";comment\n\n>one desc\nACGTA\nCGTAC\nNNr\n\n>two\nacgtn\nAC"
    path = write(tmp_path, text)
    validate_fasta(path)
    with Genome(path) as genome:
        assert list(genome.lengths.items()) == [("one", 13), ("two", 7)]
        assert genome.read_contig("one") == b"ACGTACGTACNNr"
        assert genome.fetch("one", 4, 11) == b"ACGTACN"
        assert genome.read_contig("two") == b"acgtnAC"
        assert genome.fetch("two", 3, 3) == b""


def test_ecoli_bgzf_fetch_matches_gunzip(ecoli_fasta):
    with gzip.open(ecoli_fasta, "rb") as fh:
        lines = fh.read().split(b"\n")
    assert lines[0] == b">" + ECOLI_CONTIG.encode()
    plain = b"".join(lines[1:])
    with Genome(ecoli_fasta) as genome:
        assert genome.path == ecoli_fasta
        assert genome.lengths == {ECOLI_CONTIG: ECOLI_LENGTH}
        # Offsets at the start, across line ends (70 bases a line), BGZF block edges (~64 KiB) and the end.
        for start, end in [
            (0, 1),
            (0, 70),
            (69, 141),
            (65_000, 67_000),
            (1_234_567, 1_240_000),
            (ECOLI_LENGTH - 100, ECOLI_LENGTH),
        ]:
            assert genome.fetch(ECOLI_CONTIG, start, end) == plain[start:end], (start, end)
        assert genome.read_contig(ECOLI_CONTIG) == plain
        assert os.path.exists(ecoli_fasta + ".gzi")


def test_chr17_case_preserved(genome_copy):
    path = genome_copy("hg19_chr17_1-40000_softmasked.fa")
    with open(path, "rb") as fh:
        seq = fh.read().split(b"\n")[1]
    with Genome(path) as genome:
        assert genome.lengths == {"chr17": 40_000}
        got = genome.fetch("chr17", 10_000, 12_000)
        assert got == seq[10_000:12_000]
        assert got != got.upper() and got != got.lower()  # this stretch mixes both cases
        assert sum(genome.read_contig("chr17").count(c) for c in b"acgtn") == 17_395


def test_fetch_bounds(genome_copy):
    with Genome(genome_copy("phiX174_NC_001422.1.fna")) as genome:
        assert genome.lengths == {"NC_001422.1": 5386}
        assert len(genome.fetch("NC_001422.1", 5000, 5386)) == 386
        with pytest.raises(ValueError, match="outside NC_001422.1"):
            genome.fetch("NC_001422.1", 5000, 5387)
        with pytest.raises(ValueError, match="outside"):
            genome.fetch("NC_001422.1", -1, 10)
        with pytest.raises(ValueError, match="no contig 'chr1'.*NC_001422.1"):
            genome.fetch("chr1", 0, 10)


def test_index_dir(tmp_path, genome_copy):
    path = genome_copy("phiX174_NC_001422.1.fna")
    with Genome(path, index_dir=str(tmp_path / "idx")) as genome:
        assert len(genome.read_contig("NC_001422.1")) == 5386
    assert os.path.exists(tmp_path / "idx" / "phiX174_NC_001422.1.fna.fai")
    assert not os.path.exists(path + ".fai")
