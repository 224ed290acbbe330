"""BED intervals for gene-centric training: a strict reader and flank-and-merge; and the features of a BED in file
order (read_features: overlaps kept, each with its name), what `megagenome embed --bed` embeds one by one.

A BED file names the regions to train on (genes, exons, promoters). Coordinates are 0-based and half-open,
as in megagenome's own intervals. The reader checks every line and reports every problem at once, each as
`path:line: ...`, because a BED file is usually produced by a pipeline and fixed in one go. Overlapping lines
are an error rather than merged silently: two genes that overlap would otherwise be sampled twice as often
where they share bases, and a BED with duplicates usually means the wrong file. Flanking, which makes
neighbours touch or overlap on purpose, merges them explicitly (`flank_and_merge`).
"""

from __future__ import annotations

import gzip
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

_GZIP_MAGIC = b"\x1f\x8b"
_UINT = re.compile(r"[0-9]+")
_MAX_LISTED = 50  # problems listed in one message; the rest are counted


class BedError(ValueError):
    """A BED file that cannot be used; the message names the file and the line of each problem."""


def _known(lengths: Mapping[str, int]) -> str:
    names = list(lengths)
    return ", ".join(names[:10]) + (f", ... ({len(names)} contigs)" if len(names) > 10 else "")


def _lines(path: str) -> list[str]:
    """The file's lines (plain or gzip), without line endings; CRLF is accepted."""
    with open(path, "rb") as fh:
        compressed = fh.read(2) == _GZIP_MAGIC
    try:
        with gzip.open(path, "rb") if compressed else open(path, "rb") as fh:
            data = fh.read()
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise BedError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x}); is this a BED file?") from e
    except (OSError, EOFError) as e:
        raise BedError(f"{path}: cannot read the file: {e}") from e


def _coordinate_problem(label: str, value: str) -> str:
    if _UINT.fullmatch(value):
        return ""
    if value.startswith("-") and _UINT.fullmatch(value[1:]):
        return f"{label} {value} is negative"
    return f"{label} {value!r} is not a non-negative integer"


@dataclass(frozen=True)
class Feature:
    """One line of a BED file: [start, end) on a FASTA contig, its name (column 4, or contig:start+1-end when there
    is none), its line number, and all its tab-separated columns as written, stripped (`columns[4]` is the score
    where there is one: what data/labelled.py reads labels from). The columns take no part in comparisons."""

    contig: str
    start: int
    end: int
    name: str
    line: int
    columns: tuple[str, ...] = field(default=(), compare=False, repr=False)


def read_features(
    path: str, contig_lengths: Mapping[str, int], contig_map: Mapping[str, str] | None = None
) -> list[Feature]:
    """Every interval of a BED3+ file in the file's order, overlapping ones kept (one per feature: what is embedded
    or scored per gene or peak), checked line by line as read_bed checks them; raises BedError listing every
    problem."""
    features, problems = _parse(path, contig_lengths, contig_map)
    _raise(path, problems)
    return features


def read_bed(
    path: str, contig_lengths: Mapping[str, int], contig_map: Mapping[str, str] | None = None
) -> dict[str, np.ndarray]:
    """{FASTA contig: (K, 2) int64 [start, end) intervals sorted by start} from a BED3+ file.

    Columns are tab-separated; columns after the third (name, score, strand, ...) are ignored. `track`,
    `browser`, `#` and blank lines are skipped. BED contig names are FASTA names unless `contig_map` maps them
    (e.g. {"chrM": "MT"}). Only contigs with intervals are in the result, in `contig_lengths` order. Raises
    BedError listing every problem: too few columns, non-integer or negative coordinates, start >= end, an end
    past the contig, an unknown contig, and intervals on one contig that overlap (touching is fine).
    """
    features, problems = _parse(path, contig_lengths, contig_map)
    rows: dict[str, list[tuple[int, int, int]]] = {}  # contig -> (start, end, line)
    for f in features:
        rows.setdefault(f.contig, []).append((f.start, f.end, f.line))
    out: dict[str, np.ndarray] = {}
    for contig in contig_lengths:
        if contig not in rows:
            continue
        ordered = sorted(rows[contig])
        reach = ordered[0]  # the interval reaching furthest so far, so one long line covering several is caught
        for row in ordered[1:]:
            if row[0] < reach[1]:
                problems.append(
                    f"{path}:{row[2]}: {contig}:{row[0]}-{row[1]} overlaps line {reach[2]} ({contig}:{reach[0]}-"
                    f"{reach[1]}); merge overlapping intervals first (e.g. `bedtools merge`)"
                )
            if row[1] > reach[1]:
                reach = row
        out[contig] = np.array([r[:2] for r in ordered], dtype=np.int64).reshape(-1, 2)  # (K, 2)
    _raise(path, problems)
    return out


def _parse(
    path: str, contig_lengths: Mapping[str, int], contig_map: Mapping[str, str] | None
) -> tuple[list[Feature], list[str]]:
    """(the file's intervals in order, the problems of its lines)."""
    path = os.fspath(path)
    contig_map = dict(contig_map or {})
    if not os.path.isfile(path):
        raise BedError(f"{path}: BED file not found")
    problems: list[str] = []
    features: list[Feature] = []
    for number, text in enumerate(_lines(path), start=1):
        if not text.strip() or text.startswith("#") or text.split()[0] in ("track", "browser"):
            continue
        fields = text.split("\t")
        if len(fields) < 3:
            hint = " (BED columns are separated by tabs, not spaces)" if len(text.split()) >= 3 else ""
            problems.append(f"{path}:{number}: {len(fields)} column(s); BED needs chrom, start, end{hint}")
            continue
        name, start_text, end_text = fields[0], fields[1].strip(), fields[2].strip()
        bad = [_coordinate_problem(label, value) for label, value in (("start", start_text), ("end", end_text))]
        bad = [b for b in bad if b]
        if bad:
            problems.append(f"{path}:{number}: {'; '.join(bad)}")
            continue
        start, end = int(start_text), int(end_text)
        contig = contig_map.get(name, name)
        if contig not in contig_lengths:
            mapped = f" (mapped from {name!r} by contig_map)" if name in contig_map else ""
            problems.append(f"{path}:{number}: unknown contig {contig!r}{mapped} (known: {_known(contig_lengths)})")
            continue
        if start >= end:
            problems.append(f"{path}:{number}: start {start} >= end {end}; BED intervals are [start, end), non-empty")
            continue
        if end > contig_lengths[contig]:
            problems.append(f"{path}:{number}: end {end} is past the end of {contig} (length {contig_lengths[contig]})")
            continue
        label = fields[3].strip() if len(fields) > 3 and fields[3].strip() else f"{contig}:{start + 1}-{end}"
        features.append(Feature(contig, start, end, label, number, tuple(f.strip() for f in fields)))
    return features, problems


def _raise(path: str, problems: list[str]) -> None:
    """BedError listing `problems` (at most _MAX_LISTED of them), if any."""
    if not problems:
        return
    if len(problems) == 1:
        raise BedError(problems[0])
    listed = problems[:_MAX_LISTED]
    more = [f"... and {len(problems) - _MAX_LISTED} more"] if len(problems) > _MAX_LISTED else []
    raise BedError(f"{len(problems)} problems in {os.fspath(path)}:\n" + "\n".join(f"  - {p}" for p in listed + more))


def flank_and_merge(
    intervals: Mapping[str, np.ndarray], flank: int, contig_lengths: Mapping[str, int]
) -> dict[str, np.ndarray]:
    """Each interval widened by `flank` bases on both sides (clipped to its contig), overlapping or touching
    ones merged; per contig a (K', 2) int64 array sorted by start. `flank=0` only merges."""
    if flank < 0:
        raise ValueError(f"flank must be >= 0, got {flank}")
    out: dict[str, np.ndarray] = {}
    for contig, iv in intervals.items():
        if contig not in contig_lengths:
            raise BedError(f"unknown contig {contig!r} (known: {_known(contig_lengths)})")
        iv = np.asarray(iv, dtype=np.int64).reshape(-1, 2)  # (K, 2)
        if iv.shape[0] == 0:
            out[contig] = iv.copy()
            continue
        iv = iv[np.argsort(iv[:, 0], kind="stable")]
        starts = np.maximum(iv[:, 0] - flank, 0)  # (K,)
        ends = np.minimum(iv[:, 1] + flank, contig_lengths[contig])  # (K,)
        reach = np.maximum.accumulate(ends)  # (K,): furthest end among intervals up to each one
        new = np.concatenate(([True], starts[1:] > reach[:-1]))  # (K,): starts a merged interval
        group_end = np.maximum.reduceat(ends, np.flatnonzero(new))  # (K',)
        out[contig] = np.stack([starts[new], group_end], axis=1)  # (K', 2)
    return out
