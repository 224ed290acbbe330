"""Tier 1: FASTA validation (file, line and column of each problem) and Genome random access, plain and BGZF."""

import gzip
import os
import shutil
import subprocess
import tempfile

import pytest
from support.helpers import DATA

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
        assert not os.path.exists(ecoli_fasta + ".gzi")  # its index is in the cache, not beside the input


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


# ----- where the index goes: never beside the user's FASTA (the "lose nothing" issue, item 8) ------------------


def listing(directory) -> dict[str, tuple[int, int]]:
    """name -> (size, mtime_ns) of every file in `directory`: what a user would see changed."""
    return {e.name: (e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(directory)}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """MEGAGENOME_CACHE set to an empty tmp_path/cache."""
    path = tmp_path / "cache"
    monkeypatch.setenv("MEGAGENOME_CACHE", str(path))
    return path


def cached(cache) -> list[str]:
    return sorted(p.name for p in cache.rglob("*") if p.is_file()) if cache.exists() else []


@pytest.fixture
def read_only(tmp_path):
    """Factory: read_only(dir) -> a read-only bind mount of dir (real for root too), unmounted at the end."""
    mounts = []

    def mount(directory) -> str:
        target = tmp_path / f"ro{len(mounts)}"
        target.mkdir()
        for args in (["--bind", str(directory), str(target)], ["-o", "remount,bind,ro", str(target)]):
            proc = subprocess.run(["mount", *args], capture_output=True, text=True)
            if proc.returncode != 0:
                if args[0] != "--bind":
                    subprocess.run(["umount", str(target)])
                pytest.skip(f"`mount {' '.join(args)}` refused (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
        mounts.append(target)
        return str(target)

    yield mount
    for target in mounts:
        subprocess.run(["umount", str(target)], check=True)


def test_index_built_in_the_cache_or_read_from_beside(tmp_path, cache):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    path = write(inputs, b">a\nACGTACGT\nACG\n>b\nacgtn\n", "g.fa")
    before = listing(inputs)
    with Genome(path) as genome:
        assert genome.lengths == {"a": 11, "b": 5}
    assert listing(inputs) == before
    assert cached(cache) == ["g.fa.fai", "g.fa.fai.lock"]
    # A fresh index already beside the FASTA (samtools faidx's) is read as it is: nothing is built or written.
    (fai,) = cache.rglob("g.fa.fai")
    shutil.copy(fai, path + ".fai")
    shutil.rmtree(cache)
    before = listing(inputs)
    with Genome(path) as genome:
        assert genome.fetch("a", 7, 10) == b"TAC"
    assert listing(inputs) == before and cached(cache) == []
    # One older than the FASTA is left alone (pyfaidx would rebuild it in place); ours goes to the cache.
    os.utime(path + ".fai", ns=(1, 1))
    before = listing(inputs)
    with Genome(path) as genome:
        assert genome.fetch("b", 0, 5) == b"acgtn"
    assert listing(inputs) == before and cached(cache) == ["g.fa.fai", "g.fa.fai.lock"]


def test_fasta_in_a_read_only_directory(tmp_path, ecoli_fasta, monkeypatch, read_only):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    shutil.copy(ecoli_fasta, inputs)
    shutil.copy(DATA / "phiX174_NC_001422.1.fna", inputs)
    mounted = read_only(inputs)
    with pytest.raises(OSError, match="Read-only file system"):  # really read-only, root included
        open(os.path.join(mounted, "probe"), "w")  # noqa: SIM115
    before = listing(inputs)
    monkeypatch.delenv("MEGAGENOME_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with Genome(os.path.join(mounted, os.path.basename(ecoli_fasta))) as genome:  # BGZF: .fai and .gzi
        assert genome.fetch(ECOLI_CONTIG, 65_000, 65_010) == genome.read_contig(ECOLI_CONTIG)[65_000:65_010]
    assert sorted(p.name for p in (tmp_path / "xdg" / "megagenome").rglob("*.bgz.*")) == [
        "ecoli_K12_MG1655_NC_000913.2.fa.bgz.fai",
        "ecoli_K12_MG1655_NC_000913.2.fa.bgz.fai.lock",
        "ecoli_K12_MG1655_NC_000913.2.fa.bgz.gzi",
    ]
    # A cache that cannot be written (here: inside the read-only mount) falls back to the temp directory.
    monkeypatch.setenv("MEGAGENOME_CACHE", os.path.join(mounted, "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with Genome(os.path.join(mounted, "phiX174_NC_001422.1.fna")) as genome:
        assert genome.lengths == {"NC_001422.1": 5386}
    assert list((tmp_path / "tmp").rglob("phiX174_NC_001422.1.fna.fai"))
    assert listing(inputs) == before


def test_a_run_config_that_fails_validation_leaves_the_fasta_folder_unchanged(tmp_path, cache):
    from support.helpers import tiny_config

    from megagenome.config import ConfigError
    from megagenome.config.load import config_from_dict
    from megagenome.run.assembly import validate

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    fasta = shutil.copy(DATA / "phiX174_NC_001422.1.fna", inputs)
    before = listing(inputs)
    cfg = tiny_config(tmp_path, str(fasta), tmp_path / "run", data__val_ranges=["chrX:1-100"])
    with pytest.raises(ConfigError, match="chrX"):  # found after the genome was opened and indexed
        validate(config_from_dict(cfg), [], world_size=1, runtime=False)
    assert listing(inputs) == before
    assert cached(cache) == ["phiX174_NC_001422.1.fna.fai", "phiX174_NC_001422.1.fna.fai.lock"]


def test_every_base_that_starts_a_bgzf_block_is_read(tmp_path):
    """pyfaidx 0.9.2.2 refuses a BGZF read that starts at the first base of a block (within-block offset 65536):
    a training window there crashed a 4,000-step run of configs/cpu_1h.yaml at step ~3,400. Every block start of the
    bundled E. coli genome (from its .gzi and .fai, built here in tmp_path: a fresh clone has none), read as a
    5-base window, equals those bases of the whole contig."""
    import struct

    from support.helpers import REPO

    path = REPO / "examples" / "data" / "ecoli_K12_MG1655_NC_000913.2.fa.bgz"
    Genome(str(path), index_dir=str(tmp_path)).close()
    index = tmp_path / path.name
    name, length, offset, line_bases, line_width = open(f"{index}.fai").readline().split("\t")[:5]
    length, offset, line_bases, line_width = int(length), int(offset), int(line_bases), int(line_width)
    gzi = open(f"{index}.gzi", "rb").read()
    blocks = struct.unpack("<Q", gzi[:8])[0]
    starts = [struct.unpack("<Q", gzi[16 + 16 * i : 24 + 16 * i])[0] for i in range(blocks)]  # uncompressed offsets
    positions = []
    for u in starts:
        line, col = divmod(u - offset, line_width)
        if u >= offset and col < line_bases and line * line_bases + col + 5 <= length:
            positions.append(line * line_bases + col)
    assert len(positions) > 60  # 69 of the 71 block starts are bases
    with Genome(str(path), index_dir=str(tmp_path)) as genome:
        whole = genome.read_contig(name)
        for pos in positions:
            assert genome.fetch(name, pos, pos + 5) == whole[pos : pos + 5], pos


def test_whole_contigs_of_a_multi_record_bgzf_equal_the_plain_text(tmp_path):
    """Genome.read_contig decompresses a BGZF contig of >= 1 Mb with zlib from the .gzi block that holds its first base
    (pyfaidx's Biopython reader took 15 s for the BRCA1 genome's 43.6 Mb record, 0.16 s now); a shorter one goes
    through pyfaidx. Records of several line widths, mixed case, starting inside blocks, one at the first byte of a
    block that follows a short one, one whose length fills its last line; whole contigs and windows equal the plain
    text's. (The bases pyfaidx refuses: test_every_base_that_starts_a_bgzf_block_is_read.)"""
    import random

    from Bio import bgzf

    rng = random.Random(7)
    shapes = [(150_001, 60), (70_000, 70), (3, 80), (1_100_003, 61), (120_000, 60)]
    records = [(f"c{k}", "".join(rng.choices("ACGTNacgtn", k=n)), width) for k, (n, width) in enumerate(shapes)]
    plain = tmp_path / "multi.fa"
    path = tmp_path / "multi.fa.bgz"
    with open(plain, "w") as txt, bgzf.BgzfWriter(str(path), "wb") as out:
        for name, seq, width in records:
            body = "".join(seq[i : i + width] + "\n" for i in range(0, len(seq), width))
            txt.write(f">{name}\n{body}")
            out.write(f">{name}\n".encode())
            if name == "c2":
                out.flush()  # c2's first base starts a BGZF block, after a short one
            out.write(body.encode())
    with Genome(str(path), index_dir=str(tmp_path / "index")) as genome, Genome(str(plain)) as text:
        assert list(genome.lengths) == [r[0] for r in records]
        for name, seq, _ in records:
            assert genome.read_contig(name) == text.read_contig(name) == seq.encode(), name
            for _ in range(20):
                start = rng.randrange(len(seq))
                end = min(len(seq), start + rng.randrange(1, 300))
                assert genome.fetch(name, start, end) == seq[start:end].encode(), (name, start, end)
        assert genome.fetch("c2", 0, 2) == records[2][1][:2].encode()
