"""Intervals: N-free stretches of a contig, the train/val/test split by contig and range, and its record.

The split is by contig or by declared range, never by random window (docs/architecture.md): neighbouring windows of
one genome share repeats and local composition, so a window-level split would leak. Training data is
"everything not held out", computed here once so that no sampler can reach a held-out base.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from megagenome.config import Region, parse_region
from megagenome.data.tokenizer import N_ID

SPLITS = ("train", "val", "test")


class SplitError(ValueError):
    """The held-out split flags do not describe a usable split of this genome."""


def n_free_intervals(tokens: np.ndarray, max_n_run: int) -> np.ndarray:
    """(k, 2) int64 [start, end) intervals of `tokens` that avoid every run of N longer than `max_n_run`.

    Shorter N runs stay inside the intervals (they are scored with weight 0 but keep windows contiguous).
    """
    tokens = np.asarray(tokens)
    n = tokens.size
    is_n = np.concatenate(([False], tokens == N_ID, [False]))
    edges = np.flatnonzero(is_n[1:] != is_n[:-1])  # alternating run starts and ends
    run_start, run_end = edges[0::2], edges[1::2]
    long_run = (run_end - run_start) > max_n_run
    # The kept intervals are the gaps between long runs: [0, s1), [e1, s2), ..., [ek, n).
    starts = np.concatenate(([0], run_end[long_run]))
    ends = np.concatenate((run_start[long_run], [n]))
    keep = ends > starts
    return np.stack([starts[keep], ends[keep]], axis=1).astype(np.int64).reshape(-1, 2)


def _known(lengths: Mapping[str, int]) -> str:
    names = list(lengths)
    return ", ".join(names[:10]) + (f", ... ({len(names)} contigs)" if len(names) > 10 else "")


def build_split(
    lengths: Mapping[str, int],
    val_contigs: Iterable[str] = (),
    val_ranges: Iterable[str] = (),
    test_contigs: Iterable[str] = (),
    test_ranges: Iterable[str] = (),
    allow_no_train: bool = False,
) -> dict[str, list[Region]]:
    """{"train", "val", "test"} -> Regions; val/test are the named contigs and ranges, train is the rest.

    Raises SplitError listing every problem, each naming its flag: unknown contigs, ranges past a contig's
    end, held-out pieces that overlap (within or across val and test), a contig held out whole and also
    named in a range, and a split that leaves nothing to train on (unless allow_no_train: a prepare manifest may
    hold a whole source out, as long as another source trains).
    """
    problems: list[str] = []
    held: dict[str, list[Region]] = {"val": [], "test": []}
    whole = _held_contigs(lengths, {"val": val_contigs, "test": test_contigs}, held, problems)
    ranges = _held_ranges(lengths, {"val": val_ranges, "test": test_ranges}, whole, held, problems)
    problems += _overlaps(ranges)
    if problems:
        raise SplitError(_join(problems))
    train = _train_regions(lengths, whole, held["val"] + held["test"])
    if not train and not allow_no_train:
        raise SplitError(
            "--data.val_contigs/--data.val_ranges/--data.test_contigs/--data.test_ranges hold out the whole "
            "genome: no training data is left"
        )
    order = {name: i for i, name in enumerate(lengths)}
    split = {"train": train}
    for name in ("val", "test"):
        split[name] = sorted(held[name], key=lambda r: (order[r.contig], r.start))
    return split


def _held_contigs(lengths: Mapping[str, int], names_by_split: dict, held: dict, problems: list[str]) -> dict[str, str]:
    """Add the contigs held out whole to `held`; returns contig -> the flag that holds it out."""
    whole: dict[str, str] = {}
    for split, names in names_by_split.items():
        flag = f"--data.{split}_contigs"
        for name in names:
            if name not in lengths:
                problems.append(f"{flag}: unknown contig {name!r} (known: {_known(lengths)})")
            elif name in whole:
                problems.append(f"{flag}: contig {name!r} is already held out by {whole[name]}")
            else:
                whole[name] = flag
                held[split].append(Region(name, 0, int(lengths[name])))
    return whole


def _held_ranges(
    lengths: Mapping[str, int], texts_by_split: dict, whole: dict[str, str], held: dict, problems: list[str]
) -> list[tuple[Region, str]]:
    """Add the held-out ranges to `held`; returns every range with its flag, for the overlap check."""
    ranges: list[tuple[Region, str]] = []
    for split, texts in texts_by_split.items():
        flag = f"--data.{split}_ranges"
        for text in texts:
            try:
                region = parse_region(text)
            except ValueError as e:
                problems.append(f"{flag}: {e}")
                continue
            if region.contig not in lengths:
                problems.append(f"{flag}: {text!r}: unknown contig {region.contig!r} (known: {_known(lengths)})")
            elif region.end > lengths[region.contig]:
                problems.append(
                    f"{flag}: {text!r} ends past the end of {region.contig} (length {lengths[region.contig]})"
                )
            elif region.contig in whole:
                problems.append(
                    f"{flag}: {text!r} is on contig {region.contig!r}, which {whole[region.contig]} already holds "
                    f"out whole"
                )
            else:
                held[split].append(region)
                ranges.append((region, flag))
    return ranges


def _overlaps(ranges: list[tuple[Region, str]]) -> list[str]:
    """Overlaps among held-out ranges (whole contigs are checked on their own): sorted by position, each range is
    compared with the one reaching furthest before it, so a long range covering several is caught."""
    problems = []
    reach: tuple[Region, str] | None = None
    for b, flag_b in sorted(ranges, key=lambda p: (p[0].contig, p[0].start)):
        if reach is not None and reach[0].contig == b.contig and b.start < reach[0].end:
            problems.append(
                f"{flag_b}: {_fmt(b)} overlaps {_fmt(reach[0])} from {reach[1]}; held-out ranges must be disjoint"
            )
        if reach is None or reach[0].contig != b.contig or b.end > reach[0].end:
            reach = (b, flag_b)
    return problems


def _train_regions(lengths: Mapping[str, int], whole: dict[str, str], held: list[Region]) -> list[Region]:
    """Everything not held out, contig by contig in the genome's order."""
    cuts_by_contig: dict[str, list[tuple[int, int]]] = {}
    for r in held:
        cuts_by_contig.setdefault(r.contig, []).append((r.start, r.end))
    train: list[Region] = []
    for name, length in lengths.items():
        if name in whole:
            continue
        cursor = 0
        for start, end in sorted(cuts_by_contig.get(name, [])):
            if start > cursor:
                train.append(Region(name, cursor, start))
            cursor = max(cursor, end)
        if cursor < length:
            train.append(Region(name, cursor, int(length)))
    return train


def restrict(regions: list[Region], n_free: Mapping[str, np.ndarray]) -> list[Region]:
    """The parts of `regions` inside the N-free intervals of their contigs, in the same order."""
    out: list[Region] = []
    for region in regions:
        intervals = np.asarray(n_free[region.contig]).reshape(-1, 2)
        starts = np.maximum(intervals[:, 0], region.start)
        ends = np.minimum(intervals[:, 1], region.end)
        keep = ends > starts
        out.extend(Region(region.contig, int(s), int(e)) for s, e in zip(starts[keep], ends[keep]))
    return out


def total_bases(regions: Iterable[Region]) -> int:
    return sum(r.end - r.start for r in regions)


def split_record(split: Mapping[str, list[Region]], fasta: str = "", **extra) -> dict:
    """JSON-able description of a split (the run's split.json): per split its regions and total bases.

    Coordinates are 0-based and half-open, as in BED. `extra` keys (e.g. max_n_run) are stored alongside.
    """
    record: dict = {"fasta": fasta, "coordinates": "0-based, half-open (BED)", **extra, "splits": {}}
    for name, regions in split.items():
        record["splits"][name] = {
            "bases": total_bases(regions),
            "num_regions": len(regions),
            "regions": [{"contig": r.contig, "start": r.start, "end": r.end} for r in regions],
        }
    return record


def _fmt(region: Region) -> str:
    """samtools-style 1-based inclusive text of a region, as the user wrote it on the command line."""
    return f"{region.contig}:{region.start + 1}-{region.end}"


def _join(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems with the held-out split:\n" + "\n".join(f"  - {p}" for p in problems)
