"""Labelled sequence sets for `megagenome finetune`: the readers, a validation split, and the species task.

Three tasks: "classification" (one class per sequence), "regression" (one float per sequence) and "per_base" (one
class per base; positions without a label, such as padding, are IGNORE). Every example keeps a name saying where it
came from (a file of the set, a 1-based inclusive region `contig:start-end`, a FASTA id), so that a prediction can
be traced back to its input.

Sources: a Genomic Benchmarks directory (github.com/ML-Bioinfo-CEITEC/genomic_benchmarks: `train/<class>/<n>.txt`,
one sequence per file, and `test/` likewise), or the same with one FASTA file per class (`train/<class>.fa`) or
with `train.csv`/`test.csv`; a BED file of intervals over a FASTA with a label column; and a BED of windows
labelled base by base from an annotation BED. An optional `validation` split is read where one is given; otherwise
split_validation makes one from the training split.

Sequences are upper-cased and may hold only A, C, G, T and N: an IUPAC ambiguity code other than N is an error
naming the file and line (the model's tokenizer would turn it into N anyway, and a set carrying them is usually not
the set its author meant). Every error is a ValueError that names the file and line.

The second real labelled task, "which species is this window from?", is written from genomes in these layouts by
data/species_task.py (build_species_task, re-exported here).
"""

from __future__ import annotations

import csv
import gzip
import io
import math
import os
import zlib
from dataclasses import dataclass

import numpy as np

from megagenome.data import bed as bedlib
from megagenome.data.fasta import Genome
from megagenome.data.species_task import SPECIES_RULE as SPECIES_RULE
from megagenome.data.species_task import build_species_task as build_species_task

TASKS = ("classification", "regression", "per_base")
IGNORE = -100  # per-base label of positions without a label (padding)
SPLITS = ("train", "validation", "test")  # validation is optional in a set read from disk
FASTA_SUFFIXES = (".fasta.gz", ".fa.gz", ".fasta", ".fa")

_GZIP_MAGIC = b"\x1f\x8b"
_EXAMPLE_BASES = b"ACGTNacgtn"
_EXAMPLE_EXPECTED = "A, C, G, T or N (either case; other IUPAC codes are refused: map them to N first)"
_MAX_LISTED = 50


@dataclass(frozen=True)
class Example:
    """One labelled sequence: upper-case A/C/G/T/N bases, its label (class index, value, or per-base int64 class
    indices of len(sequence)) and where it came from."""

    sequence: str
    label: int | float | np.ndarray
    name: str


@dataclass
class LabelledSet:
    """A labelled task's examples by split ("train", "test", and "validation" once split or when given)."""

    task: str
    classes: tuple[str, ...]  # class names in index order; () for regression
    splits: dict[str, list[Example]]
    source: str  # a short description (path) for records and errors


def _raise_all(path: str, problems: list[str]) -> None:
    """ValueError listing `problems` (at most _MAX_LISTED), if any."""
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        more = [f"... and {len(problems) - _MAX_LISTED} more"] if len(problems) > _MAX_LISTED else []
        listed = "\n".join(f"  - {p}" for p in problems[:_MAX_LISTED] + more)
        raise ValueError(f"{len(problems)} problems in {path}:\n{listed}")


def _read_bytes(path: str) -> bytes:
    """The file's bytes, decompressed when it is gzip (or BGZF: gzip members the gzip module reads as one stream)."""
    try:
        with open(path, "rb") as fh:
            compressed = fh.read(2) == _GZIP_MAGIC
        with gzip.open(path, "rb") if compressed else open(path, "rb") as fh:
            return fh.read()
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: cannot read the file: {e}") from e


def _check_line(line: bytes, allowed: bytes, where: str, expected: str) -> None:
    """Raise, naming `where` and the column, for the first byte of `line` not in `allowed`."""
    if not line.translate(None, allowed):
        return
    column = next(i for i, b in enumerate(line) if b not in allowed)
    char = line[column : column + 1].decode("latin-1")
    raise ValueError(f"{where}: character {char!r} (column {column + 1}) is not {expected}")


def _fasta_records(path: str) -> list[tuple[str, bytes, int]]:
    """(id, bases as written, header line) of every record of a FASTA file (plain or gzip), each line checked."""
    records: list[tuple[str, bytes, int]] = []
    name, header, parts = "", 0, []
    for number, raw in enumerate(_read_bytes(path).splitlines(), start=1):
        line = raw.strip()
        if line.startswith(b">"):
            if header:
                records.append(_fasta_record(path, name, parts, header))
            fields = line[1:].split(maxsplit=1)
            if not fields or line[1:2].isspace():
                raise ValueError(f"{path}:{number}: FASTA header has no name right after '>'")
            name, header, parts = fields[0].decode("utf-8", "replace"), number, []
        elif line:
            if not header:
                raise ValueError(f"{path}:{number}: sequence before the first FASTA header ('>name')")
            _check_line(line, _EXAMPLE_BASES, f"{path}:{number}", _EXAMPLE_EXPECTED)
            parts.append(line)
    if header:
        records.append(_fasta_record(path, name, parts, header))
    if not records:
        raise ValueError(f"{path}: no FASTA records")
    return records


def _fasta_record(path: str, name: str, parts: list[bytes], header: int) -> tuple[str, bytes, int]:
    if not parts:
        raise ValueError(f"{path}:{header}: FASTA record {name!r} has no sequence")
    return name, b"".join(parts), header


def read_genomic_benchmarks(root: str) -> LabelledSet:
    """A classification set in Genomic Benchmarks' layout: `root/<split>/<class>/<n>.txt` (one sequence per file),
    or `root/<split>/<class>.fa|.fasta|.fa.gz|.fasta.gz` (one example per record, named by its id), or
    `root/<split>.csv` (a header naming a `seq` or `sequence` column and a `label` column). Splits: train and test,
    validation where given. Classes are the sorted classes of the training split; a class only in another split,
    an empty split or sequence, and a missing train or test split are errors naming the path."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise ValueError(f"{root}: not a directory (a Genomic Benchmarks dataset is a folder with train/ and test/)")
    as_csv = os.path.exists(os.path.join(root, "train.csv"))
    paths = {s: os.path.join(root, f"{s}.csv" if as_csv else s) for s in SPLITS}
    for split in ("train", "test"):
        if not os.path.exists(paths[split]):
            raise ValueError(
                f"{paths[split]}: the {split} split is missing; {root} needs train/ and test/ (class folders or "
                f"class FASTA files) or train.csv and test.csv"
            )
    read = _read_csv_split if as_csv else _read_dir_split
    rows = {split: read(split, path) for split, path in paths.items() if os.path.exists(path)}
    classes = tuple(sorted({label for label, _, _ in rows["train"]}))
    index = {c: i for i, c in enumerate(classes)}
    splits: dict[str, list[Example]] = {}
    for split, found in rows.items():
        unknown = sorted({label for label, _, _ in found} - index.keys())
        if unknown:
            raise ValueError(f"{paths[split]}: class(es) {unknown} are not in the training split (classes: {classes})")
        splits[split] = [Example(seq, index[label], name) for label, seq, name in found]
    return LabelledSet("classification", classes, splits, root)


def _read_dir_split(split: str, path: str) -> list[tuple[str, str, str]]:
    """(class, sequence, name) of a split folder: one folder of <n>.txt files per class, or one FASTA per class."""
    if not os.path.isdir(path):
        raise ValueError(f"{path}: not a directory (the {split} split: one folder or FASTA file per class)")
    entries = sorted(e for e in os.listdir(path) if not e.startswith("."))
    folders = [e for e in entries if os.path.isdir(os.path.join(path, e))]
    files = [e for e in entries if e not in folders]
    if folders and files:
        raise ValueError(f"{path}: holds both class folders ({folders[0]}/) and files ({files[0]}); use one layout")
    if not entries:
        raise ValueError(f"{path}: empty split (no class folders or class FASTA files)")
    if folders:
        return [row for c in folders for row in _read_class_folder(split, c, os.path.join(path, c))]
    rows, seen = [], {}
    for entry in files:
        label = next((entry[: -len(s)] for s in FASTA_SUFFIXES if entry.lower().endswith(s)), "")
        if not label:
            raise ValueError(f"{os.path.join(path, entry)}: not a class FASTA file (<class>{'|'.join(FASTA_SUFFIXES)})")
        if label in seen:
            raise ValueError(f"{os.path.join(path, entry)}: class {label!r} is also in {seen[label]}")
        seen[label] = entry
        records = _fasta_records(os.path.join(path, entry))
        rows += [(label, seq.upper().decode("ascii"), name) for name, seq, _ in records]
    return rows


def _read_class_folder(split: str, label: str, folder: str) -> list[tuple[str, str, str]]:
    """(class, sequence, name) of every <n>.txt file of a class folder, in numeric order of n."""
    names = [e for e in os.listdir(folder) if not e.startswith(".")]
    wrong = [e for e in names if not e.endswith(".txt") or not os.path.isfile(os.path.join(folder, e))]
    if wrong:
        raise ValueError(f"{os.path.join(folder, wrong[0])}: not a <n>.txt sequence file")
    if not names:
        raise ValueError(f"{folder}: no <n>.txt sequence files (class {label!r} of the {split} split)")
    rows = []
    for entry in sorted(names, key=lambda e: (not e[:-4].isdigit(), int(e[:-4]) if e[:-4].isdigit() else 0, e)):
        path = os.path.join(folder, entry)
        lines = [line.strip() for line in _read_bytes(path).splitlines()]
        for number, line in enumerate(lines, start=1):
            _check_line(line, _EXAMPLE_BASES, f"{path}:{number}", _EXAMPLE_EXPECTED)
        sequence = b"".join(lines).upper().decode("ascii")
        if not sequence:
            raise ValueError(f"{path}: empty sequence")
        rows.append((label, sequence, f"{split}/{label}/{entry}"))
    return rows


def _read_csv_split(split: str, path: str) -> list[tuple[str, str, str]]:
    """(class, sequence, "<split>.csv:<line>") of every row of a split's CSV file."""
    try:
        text = _read_bytes(path).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text: {e}") from e
    reader = csv.reader(io.StringIO(text, newline=""))
    header: list[str] = []
    rows = []
    try:
        for row in reader:
            if not row or not "".join(row).strip():
                continue
            if not header:
                header = [c.strip().lower() for c in row]
                seq_col, label_col = _csv_columns(path, reader.line_num, header)
                continue
            rows.append(_csv_row(path, reader.line_num, row, len(header), seq_col, label_col, split))
    except csv.Error as e:
        raise ValueError(f"{path}:{reader.line_num}: malformed CSV: {e}") from e
    if not rows:
        raise ValueError(f"{path}: empty split (no rows after the header)")
    return rows


def _csv_columns(path: str, line: int, header: list[str]) -> tuple[int, int]:
    """The indices of the sequence and label columns of a CSV header."""
    seq = next((header.index(n) for n in ("seq", "sequence") if n in header), -1)
    if seq < 0 or "label" not in header:
        raise ValueError(f"{path}:{line}: the header {header} needs a 'seq' (or 'sequence') and a 'label' column")
    return seq, header.index("label")


def _csv_row(path: str, line: int, row: list[str], width: int, seq_col: int, label_col: int, split: str) -> tuple:
    if len(row) != width:
        raise ValueError(f"{path}:{line}: malformed CSV line: {len(row)} field(s), the header has {width}")
    sequence, label = row[seq_col].strip().encode("utf-8", "surrogateescape"), row[label_col].strip()
    _check_line(sequence, _EXAMPLE_BASES, f"{path}:{line}", _EXAMPLE_EXPECTED)
    if not sequence or not label:
        raise ValueError(f"{path}:{line}: empty {'sequence' if not sequence else 'label'}")
    return label, sequence.upper().decode("ascii"), f"{split}.csv:{line}"


def _region(feature: bedlib.Feature) -> str:
    return f"{feature.contig}:{feature.start + 1}-{feature.end}"


def _fetch(genome: Genome, feature: bedlib.Feature, bed: str) -> str:
    """The feature's bases, upper-cased, checked to be A/C/G/T/N."""
    bases = genome.fetch(feature.contig, feature.start, feature.end)
    where = f"{bed}:{feature.line} ({_region(feature)} of {genome.path})"
    _check_line(bases, _EXAMPLE_BASES, where, _EXAMPLE_EXPECTED)
    return bases.upper().decode("ascii")


def read_bed_task(fasta: str, bed: str, label_column: int, task: str) -> tuple[list[Example], tuple[str, ...]]:
    """(one example per BED interval, in file order; the classes) for a classification or regression task: bases
    from the FASTA, the label from the BED's 1-based column `label_column` (4 the name, 5 the score, or a later
    one). Classes are the sorted distinct labels (() for regression). Errors name the BED file and line."""
    if task not in ("classification", "regression"):
        raise ValueError(f"read_bed_task: task must be classification or regression, got {task!r}")
    if label_column < 4:
        raise ValueError(f"{bed}: label column {label_column}: columns 1-3 are chrom, start, end; use 4 or more")
    with Genome(fasta) as genome:
        features = bedlib.read_features(bed, genome.lengths)
        sequences = [_fetch(genome, f, bed) for f in features]
    if not features:
        raise ValueError(f"{bed}: no intervals")
    labels, problems = [], []
    for f in features:
        value = f.columns[label_column - 1] if len(f.columns) >= label_column else ""
        if not value:
            problems.append(f"{bed}:{f.line}: no label in column {label_column} (the line has {len(f.columns)})")
        elif task == "regression":
            number = _to_float(value)
            if not math.isfinite(number):
                problems.append(f"{bed}:{f.line}: label {value!r} (column {label_column}) is not a finite number")
            labels.append(number)
        else:
            labels.append(value)
    _raise_all(bed, problems)
    classes = tuple(sorted(set(labels))) if task == "classification" else ()
    index = {c: i for i, c in enumerate(classes)}
    examples = [Example(s, index[v] if classes else v, _region(f)) for f, s, v in zip(features, sequences, labels)]
    return examples, classes


def _to_float(text: str) -> float:
    """The number `text` spells, NaN when it is none."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def read_per_base_task(fasta: str, windows_bed: str, annotation_bed: str) -> tuple[list[Example], tuple[str, ...]]:
    """(one example per window of windows_bed, in file order; the classes) with each base labelled by the
    annotation feature covering it: classes are "background" (index 0: no feature), then the sorted distinct
    names (column 4) of the annotation features; a feature without a name column is of class "feature". Where
    features overlap, the later one in the annotation file overwrites the earlier one."""
    with Genome(fasta) as genome:
        windows = bedlib.read_features(windows_bed, genome.lengths)
        annotations = bedlib.read_features(annotation_bed, genome.lengths)
        sequences = [_fetch(genome, w, windows_bed) for w in windows]
    if not windows:
        raise ValueError(f"{windows_bed}: no windows")
    names = [a.columns[3] if len(a.columns) > 3 and a.columns[3] else "feature" for a in annotations]
    reserved = [a.line for a, n in zip(annotations, names) if n == "background"]
    message = "'background' is the class of bases without a feature; rename the feature"
    _raise_all(annotation_bed, [f"{annotation_bed}:{line}: {message}" for line in reserved])
    classes = ("background", *sorted(set(names)))
    index = {c: i for i, c in enumerate(classes)}
    by_contig: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # contig -> starts, ends, class (file order)
    for contig in {a.contig for a in annotations}:
        mine = [(a.start, a.end, index[n]) for a, n in zip(annotations, names) if a.contig == contig]
        by_contig[contig] = tuple(np.array(column, dtype=np.int64) for column in zip(*mine))
    empty = (np.zeros(0, dtype=np.int64),) * 3
    examples = []
    for w, seq in zip(windows, sequences):
        labels = np.zeros(w.end - w.start, dtype=np.int64)
        starts, ends, ids = by_contig.get(w.contig, empty)
        for k in np.flatnonzero((starts < w.end) & (ends > w.start)):  # in file order: later features overwrite
            labels[max(starts[k], w.start) - w.start : min(ends[k], w.end) - w.start] = ids[k]
        examples.append(Example(seq, labels, _region(w)))
    return examples, classes


def split_validation(
    examples: list[Example], fraction: float, seed: int, task: str
) -> tuple[list[Example], list[Example]]:
    """(train, validation) from a training list: a seeded (numpy default_rng) share `fraction` of it, stratified
    by class for classification (each class keeps one training example); at least one example in each part when
    fraction > 0, (examples, []) when it is 0. Both parts keep the input's order; the same input and seed give
    the same split on every run."""
    if task not in TASKS:
        raise ValueError(f"split_validation: unknown task {task!r} (tasks: {', '.join(TASKS)})")
    if not 0 <= fraction < 1:
        raise ValueError(f"validation fraction must be in [0, 1), got {fraction}")
    if fraction == 0:
        return list(examples), []
    if len(examples) < 2:
        raise ValueError(f"a validation split needs at least 2 training examples, got {len(examples)}")
    rng = np.random.default_rng(seed)
    groups: dict[int, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(int(e.label) if task == "classification" else 0, []).append(i)
    chosen: list[int] = []
    for label in sorted(groups):
        members = np.array(groups[label])
        take = min(math.floor(fraction * len(members) + 0.5), len(members) - 1)
        chosen += rng.permutation(members)[:take].tolist()
    if not chosen:
        largest = max(sorted(groups), key=lambda label: len(groups[label]))
        chosen = [int(rng.choice(groups[largest]))]
    picked = set(chosen)
    return [e for i, e in enumerate(examples) if i not in picked], [examples[i] for i in sorted(picked)]
