"""The species task: "which species is this window from?", written from genomes as a Genomic Benchmarks dataset.

A real labelled task that needs nothing but FASTA files: one class per species, windows of a fixed length drawn
from each genome. It is written to disk in any of the layouts data/labelled.py's read_genomic_benchmarks reads
(class folders of <n>.txt files, one FASTA per class, or train.csv/test.csv), so that `megagenome finetune` reads
it as it reads any other set.

The point of the module is the rule that keeps the test split honest (SPECIES_RULE, also written into the
dataset's README.md and manifest.json): each contig is cut once, near its end, into a training and a test region,
and no window crosses the cut, so no test base is ever seen in training. The manifest lists every window with its
coordinates and the sha256 of each genome, so a dataset can be checked against its sources and rebuilt.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import re
import shutil
import tempfile
import zlib

import numpy as np

from megagenome.data.fasta import FastaError, Genome
from megagenome.files.digest import sha256_file

LAYOUTS = ("folders", "fasta", "csv")

_GZIP_MAGIC = b"\x1f\x8b"
_ACGT = np.zeros(256, dtype=bool)
_ACGT[np.frombuffer(b"ACGT", dtype=np.uint8)] = True
_TO_N = bytes(b if b in b"ACGT" else ord("N") for b in range(256))  # upper-case bases kept, anything else N
_SPECIES_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")

SPECIES_RULE = (
    "For every contig the last test_fraction of its bases (floor(length * test_fraction) bases) is the test region "
    "and the rest the training region. Windows never cross that boundary, so no test base is in any training window. "
    "Within a split, windows are drawn (seeded) from disjoint tiles of each region, so they do not overlap; where the "
    "regions hold fewer clean tiles than asked for, windows are drawn from all clean start positions instead and may "
    "overlap one another (recorded per species and split under 'sampling'), still on their side of the boundary. "
    "Windows with more than max_n_fraction non-ACGT bases are skipped (IUPAC codes other than N, counted as N, are "
    "written as N); contigs shorter than one window are skipped."
)


def build_species_task(
    genomes: dict[str, str],
    out: str,
    window: int,
    train_per_class: int,
    test_per_class: int,
    test_fraction: float = 0.2,
    max_n_fraction: float = 0.0,
    seed: int = 0,
    layout: str = "folders",
) -> dict:
    """Write the task "which species is this window from?" (one class per species; genomes: species -> FASTA, plain,
    gzip or BGZF, any number of contigs) to `out` in a Genomic Benchmarks layout ("folders": train/<species>/<i>.txt,
    "fasta": train/<species>.fa, "csv": train.csv; test likewise), with out/README.md and out/manifest.json (every
    window's species, split, contig and 1-based inclusive start-end, the genomes and their sha256, the rule, the
    seed); returns the manifest.

    The leakage rule (SPECIES_RULE): for every contig the last `test_fraction` of its bases is the test region and
    the rest the training region; windows never cross the boundary, so no test base is ever in a training window.
    Windows within a split are drawn (seeded) from disjoint tiles of the regions, so they do not overlap; where the
    regions hold fewer clean tiles than asked for, they are drawn from every clean start position instead and may
    overlap each other (manifest "sampling": "overlapping"), still on their side of the boundary. Windows with more
    than `max_n_fraction` non-ACGT bases are skipped; contigs shorter than one window are skipped.
    """
    _check_species_args(genomes, out, window, train_per_class, test_per_class, test_fraction, max_n_fraction, layout)
    rng = np.random.default_rng(seed)
    counts = {"train": train_per_class, "test": test_per_class}
    info, windows, sequences, sampling = {}, [], [], {}
    for species in sorted(genomes):
        path = os.fspath(genomes[species])
        contigs = _genome_contigs(path)
        boundaries = {c: len(b) - math.floor(len(b) * test_fraction) for c, b in contigs.items()}
        info[species] = {"path": os.path.abspath(path), "sha256": sha256_file(path), "contigs": []}
        for c, bases in contigs.items():
            contig = {"name": c, "length": len(bases), "test_start": boundaries[c] + 1, "used": len(bases) >= window}
            info[species]["contigs"].append(contig)
        sampling[species] = {}
        for split, n in counts.items():
            regions = [(c, 0, t) if split == "train" else (c, t, len(contigs[c])) for c, t in boundaries.items()]
            regions = [r for r in regions if len(contigs[r[0]]) >= window and r[2] - r[1] >= window]
            where = f"{path} ({species}, {split} split)"
            picked, overlap = _pick(rng, contigs, regions, window, max_n_fraction, n, where)
            sampling[species][split] = "overlapping" if overlap else "disjoint"
            for i, (contig, start) in enumerate(picked):
                sequences.append(contigs[contig][start : start + window].translate(_TO_N).decode("ascii"))
                window_row = {"species": species, "split": split, "index": i, "contig": contig}
                windows.append({**window_row, "start": start + 1, "end": start + window})
    os.makedirs(out, exist_ok=True)
    _write_layout(out, layout, windows, sequences)
    settings = {"window": window, "train_per_class": train_per_class, "test_per_class": test_per_class}
    settings.update(test_fraction=test_fraction, max_n_fraction=max_n_fraction, seed=seed)
    manifest = {"task": "species", "classes": sorted(genomes), "layout": layout, **settings, "rule": SPECIES_RULE}
    manifest.update(genomes=info, sampling=sampling, windows=windows)
    with open(os.path.join(out, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
    with open(os.path.join(out, "README.md"), "w") as fh:
        fh.write(_species_readme(manifest))
    return manifest


def _check_species_args(genomes, out, window, train_per_class, test_per_class, test_fraction, max_n_fraction, layout):
    """ValueError for the first argument of build_species_task that cannot be used, naming it."""
    if len(genomes) < 2:
        raise ValueError(f"genomes: a species task needs at least 2 species, got {sorted(genomes)}")
    for species, path in genomes.items():
        if not _SPECIES_NAME.fullmatch(species):
            raise ValueError(f"genomes: species name {species!r} must be letters, digits and ._+- (it names files)")
        if not os.path.isfile(path):
            raise ValueError(f"{path}: genome FASTA of {species!r} not found")
    checks = {
        "window": (window, window >= 1, ">= 1"),
        "train_per_class": (train_per_class, train_per_class >= 1, ">= 1"),
        "test_per_class": (test_per_class, test_per_class >= 1, ">= 1"),
        "test_fraction": (test_fraction, 0 < test_fraction < 1, "in (0, 1)"),
        "max_n_fraction": (max_n_fraction, 0 <= max_n_fraction <= 1, "in [0, 1]"),
        "layout": (layout, layout in LAYOUTS, f"one of {', '.join(LAYOUTS)}"),
    }
    for name, (value, ok, wanted) in checks.items():
        if not ok:
            raise ValueError(f"{name}={value!r}: must be {wanted}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"{out}: exists and is not an empty directory; the task is written to a new one")


def _genome_contigs(path: str) -> dict[str, bytes]:
    """{contig: upper-case bases} of a FASTA read by data/fasta.py's Genome. Genome reads plain and BGZF files but
    refuses plain gzip (pyfaidx needs random access, which only BGZF's blocks give): such a file is decompressed to
    a temporary copy first, read the same way, its errors naming the original file."""
    with open(path, "rb") as fh:
        head = fh.read(18)
    if head[:2] != _GZIP_MAGIC or (len(head) >= 18 and head[3] & 0x04 and head[12:14] == b"BC"):  # BGZF: SAM spec 4.1
        return _read_genome(path)
    with tempfile.TemporaryDirectory(prefix="megagenome-species-") as tmp:
        copy = os.path.join(tmp, re.sub(r"\.gz$", "", os.path.basename(path)) or "genome.fa")
        try:
            with gzip.open(path, "rb") as src, open(copy, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{path}: cannot decompress the gzip file: {e}") from e
        try:
            return _read_genome(copy, index_dir=tmp)
        except FastaError as e:
            raise FastaError(str(e).replace(copy, path)) from e


def _read_genome(path: str, index_dir: str | None = None) -> dict[str, bytes]:
    with Genome(path, index_dir=index_dir) as genome:
        return {name: genome.read_contig(name).upper() for name in genome.lengths}


def _pick(rng, contigs, regions, window, max_n_fraction, n, where) -> tuple[list[tuple[str, int]], bool]:
    """(n windows as (contig, 0-based start), sorted by region and start; whether they may overlap) from the regions
    [(contig, start, end)]: from disjoint tiles when enough are clean, else from every clean start position."""
    found = 0
    for overlap in (False, True):
        ids, starts = _candidates(rng, contigs, regions, window, max_n_fraction, overlap)
        found = starts.size
        if found >= n:
            take = rng.choice(found, size=n, replace=False)
            take = take[np.lexsort((starts[take], ids[take]))]
            return [(regions[int(ids[t])][0], int(starts[t])) for t in take], overlap
    raise ValueError(
        f"{where}: only {found} window(s) of {window} bases with at most max_n_fraction={max_n_fraction} non-ACGT "
        f"bases fit, {n} asked for (lower train_per_class/test_per_class or window)"
    )


def _candidates(rng, contigs, regions, window, max_n_fraction, overlap) -> tuple[np.ndarray, np.ndarray]:
    """(region index, 0-based start) of the clean candidate windows: each region's disjoint tiles from a random
    offset, or (overlap) every start position; clean is at most max_n_fraction * window non-ACGT bases."""
    ids, starts = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for k, (contig, a, b) in enumerate(regions):
        tiles = (b - a) // window
        if overlap:
            s = np.arange(a, b - window + 1, dtype=np.int64)
        else:
            s = a + int(rng.integers(0, b - a - tiles * window + 1)) + window * np.arange(tiles, dtype=np.int64)
        bad = ~_ACGT[np.frombuffer(contigs[contig], dtype=np.uint8, count=b - a, offset=a)]  # (b - a,)
        if bad.any():
            cum = np.concatenate(([0], np.cumsum(bad, dtype=np.int64)))  # (b - a + 1,)
            s = s[cum[s - a + window] - cum[s - a] <= max_n_fraction * window]
        ids.append(np.full(s.size, k, dtype=np.int64))
        starts.append(s)
    return np.concatenate(ids), np.concatenate(starts)


def _write_layout(out: str, layout: str, windows: list[dict], sequences: list[str]) -> None:
    """Write the windows in the layout and set each window's "name": the Example.name the reader will give it."""
    rows: dict[str, list] = {}
    for w, seq in zip(windows, sequences):
        region = f"{w['contig']}:{w['start']}-{w['end']}"
        if layout == "folders":
            folder = os.path.join(out, w["split"], w["species"])
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{w['index']}.txt"), "w") as fh:
                fh.write(seq + "\n")
            w["name"] = f"{w['split']}/{w['species']}/{w['index']}.txt"
        elif layout == "fasta":
            rows.setdefault(os.path.join(out, w["split"], f"{w['species']}.fa"), []).append(f">{region}\n{seq}\n")
            w["name"] = region
        else:
            csv_rows = rows.setdefault(os.path.join(out, f"{w['split']}.csv"), [])
            csv_rows.append([seq, w["species"]])
            w["name"] = f"{w['split']}.csv:{len(csv_rows) + 1}"
    for path, lines in rows.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", newline="") as fh:
            if layout == "fasta":
                fh.writelines(lines)
            else:
                writer = csv.writer(fh, lineterminator="\n")
                writer.writerows([["seq", "label"], *lines])


def _species_readme(manifest: dict) -> str:
    """out/README.md: what the task is, where its windows come from and the rule that keeps test bases out."""
    layout = {
        "folders": "train/<species>/<i>.txt and test/<species>/<i>.txt, one window per file",
        "fasta": "train/<species>.fa and test/<species>.fa, one record per window named contig:start-end",
        "csv": "train.csv and test.csv, columns seq and label",
    }[manifest["layout"]]
    genomes = "\n".join(f"- {s}: {g['path']} (sha256 {g['sha256']})" for s, g in manifest["genomes"].items())
    return (
        "# Species task: which species is this window from?\n\n"
        f"Classes: {', '.join(manifest['classes'])}. Windows of {manifest['window']} bases, "
        f"{manifest['train_per_class']} training and {manifest['test_per_class']} test windows per species, "
        f"seed {manifest['seed']}, written by megagenome.data.species_task.build_species_task in the Genomic "
        f"Benchmarks layout: {layout}; read it with megagenome.data.labelled.read_genomic_benchmarks. manifest.json "
        "lists every window (species, split, contig, 1-based inclusive start-end).\n\n"
        f"## Leakage rule\n\n{manifest['rule']}\n\ntest_fraction = {manifest['test_fraction']}, max_n_fraction = "
        f"{manifest['max_n_fraction']}; sampling per species and split: {json.dumps(manifest['sampling'])}.\n\n"
        f"## Genomes\n\n{genomes}\n"
    )
