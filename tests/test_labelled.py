"""Labelled sequence sets (data/labelled.py, data/species_task.py): the species task built from the bundled genomes
in every Genomic Benchmarks layout and read back base for base against the FASTA files, its leakage rule, the
BED readers over phiX174, the validation split, and the errors (each naming its file and line)."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import shutil

import numpy as np
import pytest

from megagenome.data import labelled
from megagenome.data.labelled import Example
from megagenome.data.species_task import LAYOUTS

PHIX = "phiX174_NC_001422.1.fna"  # plain FASTA, one 5,386 bp contig
LAMBDA = "lambda_NC_001416.1.fa.gz"  # plain gzip, which data/fasta.py's Genome refuses
YEAST = "scerevisiae_S288C_ASM205763v1.fa.bgz"  # BGZF, 17 contigs, a 17 kb run of N on chrXII
PHIX_ID = "NC_001422.1"
LAYOUT_NAMES = {"folders": r"train/phiX/0.txt", "fasta": f"{PHIX_ID}:", "csv": "train.csv:"}


def read_contigs(path: str) -> dict[str, str]:
    """{record id: upper-case bases} of a FASTA file, read here independently of the code under test."""
    with open(path, "rb") as fh:
        compressed = fh.read(2) == b"\x1f\x8b"
    text = (gzip.open(path, "rb") if compressed else open(path, "rb")).read().decode()
    records = [r.split("\n", 1) for r in text.split(">")[1:]]
    return {head.split()[0]: body.replace("\n", "").upper() for head, body in records}


@pytest.fixture(scope="module")
def genome_dir(tmp_path_factory):
    """Copies of the bundled genomes, so that their indexes are built for the copies only."""
    src = os.path.join(os.path.dirname(__file__), "data")
    dest = tmp_path_factory.mktemp("genomes")
    return {name: shutil.copy(os.path.join(src, name), dest / name) for name in (PHIX, LAMBDA, YEAST)}


@pytest.fixture(scope="module")
def genomes(genome_dir):
    return {"phiX": str(genome_dir[PHIX]), "lambda": str(genome_dir[LAMBDA]), "yeast": str(genome_dir[YEAST])}


@pytest.fixture(scope="module")
def contigs(genomes):
    return {species: read_contigs(path) for species, path in genomes.items()}


@pytest.fixture(scope="module")
def built(genomes, tmp_path_factory):
    """{layout: (root, manifest)}: the species task in every layout, 12 training and 4 test windows of 150 bases."""
    out = {}
    for layout in LAYOUTS:
        root = str(tmp_path_factory.mktemp("species") / layout)
        kwargs = dict(window=150, train_per_class=12, test_per_class=4, test_fraction=0.25, seed=7, layout=layout)
        out[layout] = root, labelled.build_species_task(genomes, root, **kwargs)
    return out


def test_species_layouts_read_back_as_the_fasta_bases(built, contigs):
    """Every layout reads back to the same examples, each equal to its FASTA's bases at the manifest's coordinates."""
    read_back = {}
    for layout, (root, manifest) in built.items():
        data = labelled.read_genomic_benchmarks(root)
        assert data.task == "classification" and data.classes == ("lambda", "phiX", "yeast") and data.source == root
        assert {s: len(v) for s, v in data.splits.items()} == {"train": 36, "test": 12}
        by_name = {(w["split"], w["species"], w["name"]): w for w in manifest["windows"]}
        assert len(by_name) == len(manifest["windows"]) == 48
        for split, examples in data.splits.items():
            for e in examples:
                w = by_name.pop((split, data.classes[e.label], e.name))
                assert e.sequence == contigs[w["species"]][w["contig"]][w["start"] - 1 : w["end"]]
                assert len(e.sequence) == w["end"] - w["start"] + 1 == 150
        assert not by_name  # every window of the manifest was read back
        assert any(LAYOUT_NAMES[layout] in e.name for e in data.splits["train"])
        read_back[layout] = sorted((data.classes[e.label], e.sequence) for e in data.splits["test"])
    assert read_back["folders"] == read_back["fasta"] == read_back["csv"]  # the same seed draws the same windows


def test_species_leakage_rule_and_manifest(built, contigs, genomes):
    root, manifest = built["folders"]
    assert json.load(open(os.path.join(root, "manifest.json"))) == manifest
    assert manifest["rule"] in open(os.path.join(root, "README.md")).read()
    assert manifest["seed"] == 7 and manifest["classes"] == ["lambda", "phiX", "yeast"]
    for species, g in manifest["genomes"].items():
        assert g["sha256"] == hashlib.sha256(open(genomes[species], "rb").read()).hexdigest()
        assert [c["name"] for c in g["contigs"]] == list(contigs[species])
    check_leakage(manifest, contigs, test_fraction=0.25)
    assert manifest["sampling"]["phiX"] == {"train": "disjoint", "test": "disjoint"}


def check_leakage(manifest: dict, contigs: dict, test_fraction: float) -> None:
    """Every test window in the last test_fraction of its contig, every training window before it, no test window
    overlapping a training window, and no overlap within a split sampled "disjoint"."""
    spans: dict[tuple, list[tuple[int, int]]] = {}
    for w in manifest["windows"]:
        length = len(contigs[w["species"]][w["contig"]])
        boundary = length - math.floor(length * test_fraction)  # 0-based first test base
        if w["split"] == "test":
            assert boundary <= w["start"] - 1 and w["end"] <= length, w
            assert w["start"] - 1 >= length * (1 - test_fraction)
        else:
            assert w["end"] <= boundary, w
        spans.setdefault((w["species"], w["contig"], w["split"]), []).append((w["start"], w["end"]))
    for (species, contig, split), mine in spans.items():
        if split == "test":
            for a, b in mine:
                assert all(b < s or e < a for s, e in spans.get((species, contig, "train"), []))
    for species, splits in manifest["sampling"].items():
        for split, how in splits.items():
            if how == "disjoint":
                for key, mine in spans.items():
                    if key[0] == species and key[2] == split:
                        ordered = sorted(mine)
                        assert all(e < s for (_, e), (s, _) in zip(ordered, ordered[1:]))


def test_species_falls_back_to_overlapping_windows_on_the_right_side(genomes, contigs, tmp_path):
    """phiX's 1,077-base test region holds 5 disjoint windows of 200; 12 asked for come from all start positions."""
    two = {"phiX": genomes["phiX"], "lambda": genomes["lambda"]}
    manifest = labelled.build_species_task(two, str(tmp_path / "t"), 200, 10, 12, test_fraction=0.2, seed=1)
    assert manifest["sampling"] == {
        "lambda": {"train": "disjoint", "test": "disjoint"},
        "phiX": {"train": "disjoint", "test": "overlapping"},
    }
    check_leakage(manifest, contigs, test_fraction=0.2)
    starts = [w["start"] for w in manifest["windows"] if w["species"] == "phiX" and w["split"] == "test"]
    assert len(set(starts)) == 12 and min(starts) - 1 >= 5386 - 1077
    with pytest.raises(ValueError, match=r"phiX174_NC_001422\.1\.fna \(phiX, test split\): only 878 window.*"):
        labelled.build_species_task(two, str(tmp_path / "u"), 200, 10, 879, test_fraction=0.2)


def test_species_is_deterministic_per_seed(genomes, tmp_path):
    two = {"phiX": genomes["phiX"], "lambda": genomes["lambda"]}
    first, again, other = (
        labelled.build_species_task(two, str(tmp_path / name), 100, 8, 3, seed=seed, layout="csv")
        for name, seed in (("a", 3), ("b", 3), ("c", 4))
    )
    assert first["windows"] == again["windows"] and first["windows"] != other["windows"]
    assert open(tmp_path / "a" / "train.csv").read() == open(tmp_path / "b" / "train.csv").read()


def test_species_skips_n_windows(contigs, tmp_path):
    """A 40 kb slice of yeast chrXII around its 17 kb run of N: no window holds more N than max_n_fraction allows,
    and without the limit some windows do hold N (so the filter is what keeps them out)."""
    chr12 = contigs["yeast"]["chrXII"][440_000:480_000]
    assert chr12.count("N") == 17_357
    rdna = tmp_path / "yeast_chrXII_440001-480000.fa"
    rdna.write_text(">chrXII_440001-480000\n" + "\n".join(chr12[i : i + 60] for i in range(0, len(chr12), 60)) + "\n")
    phix = shutil.copy(os.path.join(os.path.dirname(__file__), "data", PHIX), tmp_path / PHIX)
    genomes = {"rdna": str(rdna), "phiX": str(phix)}
    n_counts = {}
    for limit in (0.0, 0.5, 1.0):
        out = str(tmp_path / f"n{limit}")
        manifest = labelled.build_species_task(genomes, out, 1000, 25, 2, max_n_fraction=limit, seed=2)
        data = labelled.read_genomic_benchmarks(out)
        counts = [e.sequence.count("N") for e in data.splits["train"] if data.classes[e.label] == "rdna"]
        assert len(counts) == 25 and max(counts) <= limit * 1000
        n_counts[limit] = sum(counts)
        assert manifest["sampling"]["rdna"]["train"] == ("disjoint" if limit == 1.0 else "overlapping")
    assert n_counts[0.0] == 0 and n_counts[1.0] > 1000


def test_species_skips_contigs_shorter_than_a_window(genome_dir, ecoli_fasta, contigs, tmp_path):
    """Windows of 150 kb: yeast's chrMT (85,793 bp) is skipped and chrI's 43,985-base test region holds none;
    E. coli's 4.6 Mb BGZF genome reads through the same path."""
    genomes = {"yeast": str(genome_dir[YEAST]), "ecoli": ecoli_fasta}
    manifest = labelled.build_species_task(genomes, str(tmp_path / "big"), 150_000, 3, 2, layout="fasta")
    used = {c["name"]: c["used"] for c in manifest["genomes"]["yeast"]["contigs"]}
    assert used["chrMT"] is False and used["chrI"] is True and sum(used.values()) == 16
    windows = [w for w in manifest["windows"] if w["species"] == "yeast"]
    assert not any(w["contig"] == "chrMT" for w in windows)
    assert not any(w["contig"] == "chrI" and w["split"] == "test" for w in windows)
    data = labelled.read_genomic_benchmarks(str(tmp_path / "big"))
    ecoli = read_contigs(ecoli_fasta)["K-12-MG1655"]
    for e in data.splits["test"]:
        if data.classes[e.label] == "ecoli":
            start, end = (int(x) for x in e.name.split(":")[1].split("-"))
            assert e.sequence == ecoli[start - 1 : end] and start - 1 >= len(ecoli) * 0.8


def test_species_argument_errors(genomes, tmp_path):
    two = {"phiX": genomes["phiX"], "lambda": genomes["lambda"]}
    with pytest.raises(ValueError, match="species name 'a/b'"):
        labelled.build_species_task({"a/b": genomes["phiX"], "x": genomes["lambda"]}, str(tmp_path / "a"), 10, 1, 1)
    with pytest.raises(ValueError, match="layout='tsv'"):
        labelled.build_species_task(two, str(tmp_path / "b"), 10, 1, 1, layout="tsv")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match="not an empty directory"):
        labelled.build_species_task(two, str(tmp_path / "full"), 10, 1, 1)
    with pytest.raises(ValueError, match=r"phiX174_NC_001422\.1\.fna \(phiX, train split\): only 0 window"):
        labelled.build_species_task(two, str(tmp_path / "c"), 6000, 1, 1)


def copy_built(built, layout: str, tmp_path) -> str:
    dest = str(tmp_path / layout)
    shutil.copytree(built[layout][0], dest)
    return dest


def test_reader_errors_name_file_and_line(built, tmp_path):
    root = copy_built(built, "folders", tmp_path)
    bad = os.path.join(root, "train", "phiX", "3.txt")
    open(bad, "w").write("ACGTACGT\nACGRT\n")
    with pytest.raises(ValueError, match=rf"{bad}:2: character 'R' \(column 4\) is not A, C, G, T or N"):
        labelled.read_genomic_benchmarks(root)
    open(bad, "w").write("\n")
    with pytest.raises(ValueError, match=rf"{bad}: empty sequence"):
        labelled.read_genomic_benchmarks(root)
    open(bad, "w").write("acgtn\n")  # lower case is upper-cased
    data = labelled.read_genomic_benchmarks(root)
    assert [e.sequence for e in data.splits["train"] if e.name == "train/phiX/3.txt"] == ["ACGTN"]

    fasta = copy_built(built, "fasta", tmp_path)
    lines = open(os.path.join(fasta, "train", "lambda.fa")).read().splitlines()
    lines[3] = lines[3][:10] + "Y" + lines[3][11:]
    open(os.path.join(fasta, "train", "lambda.fa"), "w").write("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"train/lambda\.fa:4: character 'Y' \(column 11\)"):
        labelled.read_genomic_benchmarks(fasta)

    table = copy_built(built, "csv", tmp_path)
    with open(os.path.join(table, "train.csv"), "a") as fh:
        fh.write("ACGT,phiX,extra\n")
    with pytest.raises(ValueError, match=r"train\.csv:38: malformed CSV line: 3 field\(s\), the header has 2"):
        labelled.read_genomic_benchmarks(table)
    open(os.path.join(table, "train.csv"), "w").write("sequence,kind\nACGT,phiX\n")
    with pytest.raises(ValueError, match=r"train\.csv:1: the header \['sequence', 'kind'\] needs"):
        labelled.read_genomic_benchmarks(table)


def test_reader_errors_for_classes_and_splits(built, tmp_path):
    root = copy_built(built, "folders", tmp_path)
    os.rename(os.path.join(root, "test", "phiX"), os.path.join(root, "test", "T4"))
    with pytest.raises(ValueError, match=r"test: class\(es\) \['T4'\] are not in the training split"):
        labelled.read_genomic_benchmarks(root)
    shutil.rmtree(os.path.join(root, "test"))
    with pytest.raises(ValueError, match="the test split is missing"):
        labelled.read_genomic_benchmarks(root)
    os.mkdir(os.path.join(root, "test"))
    with pytest.raises(ValueError, match=r"test: empty split"):
        labelled.read_genomic_benchmarks(root)
    table = copy_built(built, "csv", tmp_path)
    os.remove(os.path.join(table, "train.csv"))
    with pytest.raises(ValueError, match="the train split is missing"):
        labelled.read_genomic_benchmarks(table)


def test_reader_takes_a_given_validation_split(built, tmp_path):
    root = copy_built(built, "fasta", tmp_path)
    os.mkdir(os.path.join(root, "validation"))
    with gzip.open(os.path.join(root, "validation", "yeast.fa.gz"), "wt") as fh:  # gzip read as plain text
        fh.write(">v1 first\nACGT\nAC\n>v2\nnnnn\n")
    data = labelled.read_genomic_benchmarks(root)
    assert [(e.sequence, e.label, e.name) for e in data.splits["validation"]] == [
        ("ACGTAC", 2, "v1"),
        ("NNNN", 2, "v2"),
    ]


@pytest.fixture
def phix(tmp_path):
    return shutil.copy(os.path.join(os.path.dirname(__file__), "data", PHIX), tmp_path / PHIX)


def write_bed(path, rows) -> str:
    path.write_text("".join("\t".join(str(f) for f in row) + "\n" for row in rows))
    return str(path)


def test_read_bed_task(phix, tmp_path):
    bases = read_contigs(str(phix))[PHIX_ID]
    rows = [
        (PHIX_ID, 0, 100, "promoter", 3.5, "x"),
        (PHIX_ID, 200, 350, "gene", -1.25, "y"),
        (PHIX_ID, 300, 400, "gene", "7e0", "x"),
    ]
    bed = write_bed(tmp_path / "labels.bed", rows)
    examples, classes = labelled.read_bed_task(str(phix), bed, 4, "classification")
    assert classes == ("gene", "promoter") and [e.label for e in examples] == [1, 0, 0]
    assert [e.name for e in examples] == [f"{PHIX_ID}:1-100", f"{PHIX_ID}:201-350", f"{PHIX_ID}:301-400"]
    assert [e.sequence for e in examples] == [bases[0:100], bases[200:350], bases[300:400]]
    examples, classes = labelled.read_bed_task(str(phix), bed, 5, "regression")
    assert classes == () and [e.label for e in examples] == [3.5, -1.25, 7.0]
    assert [e.label for e in labelled.read_bed_task(str(phix), bed, 6, "classification")[0]] == [0, 1, 0]
    with pytest.raises(ValueError, match=r"(?s)3 problems in .*labels\.bed:2: no label in column 7 \(the line has 6\)"):
        labelled.read_bed_task(str(phix), bed, 7, "classification")
    with pytest.raises(ValueError, match="columns 1-3 are chrom, start, end"):
        labelled.read_bed_task(str(phix), bed, 3, "classification")
    bad = write_bed(tmp_path / "bad.bed", [(PHIX_ID, 0, 10, "a", "1.5"), (PHIX_ID, 10, 20, "b", "high")])
    with pytest.raises(ValueError, match=r"bad\.bed:2: label 'high' \(column 5\) is not a finite number"):
        labelled.read_bed_task(str(phix), bad, 5, "regression")
    nan = write_bed(tmp_path / "nan.bed", [(PHIX_ID, 0, 10, "a", "nan")])
    with pytest.raises(ValueError, match=r"nan\.bed:1: label 'nan'"):
        labelled.read_bed_task(str(phix), nan, 5, "regression")


def test_read_per_base_task(phix, tmp_path):
    bases = read_contigs(str(phix))[PHIX_ID]
    windows = write_bed(tmp_path / "windows.bed", [(PHIX_ID, 100, 200), (PHIX_ID, 1000, 1050), (PHIX_ID, 3000, 3010)])
    rows = [
        (PHIX_ID, 150, 180, "exon"),
        (PHIX_ID, 170, 250, "intron"),
        (PHIX_ID, 1040, 1100, "exon"),
        (PHIX_ID, 90, 105, "exon"),
    ]
    annotation = write_bed(tmp_path / "genes.bed", rows)
    examples, classes = labelled.read_per_base_task(str(phix), windows, annotation)
    assert classes == ("background", "exon", "intron")
    first = np.zeros(100, dtype=np.int64)
    first[50:80] = 1  # exon 150-180
    first[70:100] = 2  # intron 170-250, later in the file: overwrites the exon's last 10 bases
    first[0:5] = 1  # exon 90-105
    second = np.zeros(50, dtype=np.int64)
    second[40:] = 1
    assert [e.label.dtype for e in examples] == [np.int64] * 3
    np.testing.assert_array_equal(examples[0].label, first)
    np.testing.assert_array_equal(examples[1].label, second)
    np.testing.assert_array_equal(examples[2].label, np.zeros(10, dtype=np.int64))
    assert [e.sequence for e in examples] == [bases[100:200], bases[1000:1050], bases[3000:3010]]
    assert examples[1].name == f"{PHIX_ID}:1001-1050"
    unnamed = write_bed(tmp_path / "plain.bed", [(PHIX_ID, 150, 160)])
    examples, classes = labelled.read_per_base_task(str(phix), windows, unnamed)
    assert classes == ("background", "feature") and examples[0].label.sum() == 10
    reserved = write_bed(tmp_path / "reserved.bed", [(PHIX_ID, 150, 160, "a"), (PHIX_ID, 1, 5, "background")])
    with pytest.raises(ValueError, match=r"reserved\.bed:2: 'background' is the class"):
        labelled.read_per_base_task(str(phix), windows, reserved)


def make_examples(sizes: list[int]) -> list[Example]:
    return [Example("ACGT", label, f"{label}/{i}") for label, n in enumerate(sizes) for i in range(n)][::-1]


def test_split_validation_is_stratified_and_deterministic():
    examples = make_examples([30, 20, 10])
    train, val = labelled.split_validation(examples, 0.2, seed=5, task="classification")
    assert [sum(e.label == c for e in val) for c in range(3)] == [6, 4, 2]
    assert [sum(e.label == c for e in train) for c in range(3)] == [24, 16, 8]
    assert {e.name for e in train} | {e.name for e in val} == {e.name for e in examples}
    position = {e.name: i for i, e in enumerate(examples)}
    assert all(position[a.name] < position[b.name] for part in (train, val) for a, b in zip(part, part[1:]))
    again = labelled.split_validation(examples, 0.2, seed=5, task="classification")
    other = labelled.split_validation(examples, 0.2, seed=6, task="classification")
    assert again == (train, val) and other[1] != val
    assert labelled.split_validation(examples, 0.0, seed=5, task="classification") == (examples, [])


def test_split_validation_keeps_one_example_in_each_part():
    train, val = labelled.split_validation(make_examples([2]), 0.01, seed=0, task="classification")
    assert len(train) == len(val) == 1
    train, val = labelled.split_validation(make_examples([1, 1, 1]), 0.9, seed=0, task="classification")
    assert len(val) == 1 and len(train) == 2  # no class gives away its only example but one part needs one
    values = [Example("A", float(i), str(i)) for i in range(10)]
    train, val = labelled.split_validation(values, 0.3, seed=0, task="regression")
    assert len(val) == 3 and len(train) == 7
    with pytest.raises(ValueError, match=r"validation fraction must be in \[0, 1\), got 1"):
        labelled.split_validation(values, 1, seed=0, task="regression")
    with pytest.raises(ValueError, match="at least 2 training examples"):
        labelled.split_validation(values[:1], 0.5, seed=0, task="regression")
