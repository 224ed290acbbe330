"""Individual genomes from a reference and a VCF: per-haplotype edits, applying them, and lifting coordinates.

This is the only module that imports pysam (docs/architecture.md: one seam per heavy dependency); VCF/BCF parsing is
htslib's, through `pysam.VariantFile`. What this module adds is the checks that turn a VCF into sequence
safely: genotypes become haplotypes only where the phase is known, every REF allele must match the FASTA,
alleles that are not sequence (symbolic, breakends, `*`) are refused, and no two edits of one haplotype may
touch the same reference base. Every error names the VCF and the line of the record, and CHROM:POS.

Line numbers: pysam does not report them. For text VCF (plain, BGZF or gzip) a record's line is the number
of header lines plus its index among the records, plus one; this is exact because htslib refuses blank lines
and `#` lines after the header (it stops with a parse error there instead of skipping them). BCF has no lines:
its errors name the record's ordinal instead, and its edits carry line 0.

Coordinates are 0-based on the reference (`Edit.pos`), as everywhere in megagenome; messages print the VCF's
1-based POS.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

import numpy as np
import pysam

from megagenome.data.tokenizer import ALLOWED

_GZIP_MAGIC = b"\x1f\x8b"
_SEQUENCE = re.compile(b"[" + re.escape(ALLOWED) + b"]+")
_ONLY = "only sequence-resolved SNVs, MNVs and indels"
_PHASE_HINT = "phase it first (e.g. WhatsHap, SHAPEIT5 or Beagle) so that each haplotype is known"


class VariantError(ValueError):
    """A VCF that cannot be turned into haplotype sequences; the message names the file, line and CHROM:POS."""


@dataclass(frozen=True, slots=True)
class Edit:
    """Replace reference bases [pos, pos + len(ref)) by `alt`; `line` is the VCF line, for messages only."""

    pos: int  # 0-based start on the reference
    ref: str
    alt: str
    line: int = field(default=0, compare=False)

    @property
    def end(self) -> int:
        return self.pos + len(self.ref)


def _compression(path: str) -> str:
    """'bgzf', 'gzip' (plain: htslib cannot seek in it) or '', from the header's 'BC' subfield (SAM spec 4.1)."""
    with open(path, "rb") as fh:
        head = fh.read(18)
    if head[:2] != _GZIP_MAGIC:
        return ""
    return "bgzf" if len(head) >= 18 and head[3] & 0x04 and head[12:14] == b"BC" else "gzip"


@contextlib.contextmanager
def _readable(path: str) -> Iterator[str]:
    """A path htslib can read: the file itself, or for plain gzip a decompressed temporary copy.

    pysam asks htslib for the file offset on open, which plain gzip cannot give ("seek not implemented in files
    compressed by method 1", pysam issue #536); hand-gzipped VCFs are common, so they are decompressed here
    rather than refused.
    """
    if _compression(path) != "gzip":
        yield path
        return
    fd, tmp = tempfile.mkstemp(prefix="megagenome-", suffix=".vcf")
    try:
        with os.fdopen(fd, "wb") as out, gzip.open(path, "rb") as src:
            shutil.copyfileobj(src, out, 1 << 20)
        yield tmp
    finally:
        os.unlink(tmp)


def _open_text(path: str) -> IO[bytes]:
    # BGZF is a series of gzip members, which the gzip module reads as one stream.
    return gzip.open(path, "rb") if _compression(path) else open(path, "rb")


class _Locator:
    """Turns a record's index into "path:line" (text VCF) or "path: record N" (BCF), and shows the line."""

    def __init__(self, path: str, text_path: str, is_bcf: bool):
        self.path, self.text_path, self.is_bcf = path, text_path, is_bcf
        self.header_lines = 0
        if not is_bcf:
            with _open_text(text_path) as fh:
                self.header_lines = sum(1 for _ in itertools.takewhile(lambda line: line.startswith(b"#"), fh))

    def line(self, index: int) -> int:
        return 0 if self.is_bcf else self.header_lines + index + 1

    def __call__(self, index: int) -> str:
        return f"{self.path}: record {index + 1}" if self.is_bcf else f"{self.path}:{self.line(index)}"

    def text(self, index: int) -> str:
        """The record's line, shortened, for parse errors (empty for BCF)."""
        if self.is_bcf:
            return ""
        with _open_text(self.text_path) as fh:
            line = next(itertools.islice(fh, self.line(index) - 1, None), b"<end of file>")
        text = line.rstrip(b"\r\n").decode("utf-8", "replace")
        return text if len(text) <= 80 else text[:77] + "..."


def _known(names: Sequence[str]) -> str:
    return ", ".join(names[:10]) + (f", ... ({len(names)} in all)" if len(names) > 10 else "")


def _allele_problem(allele: str) -> str:
    """Why an ALT allele cannot be applied as sequence, or '' when it can."""
    if allele.startswith("<"):
        return f"ALT {allele} is a symbolic allele"
    if allele == "*":
        return "ALT * (an allele deleted by an overlapping variant) is not sequence"
    if "[" in allele or "]" in allele or allele.startswith(".") or allele.endswith("."):
        return f"ALT {allele} is a breakend"
    if not _SEQUENCE.fullmatch(allele.encode("latin-1", "replace")):
        return f"ALT {allele!r} is not a nucleotide sequence"
    return ""


def _gt_text(gt: tuple, phased: bool) -> str:
    return ("|" if phased else "/").join("." if a is None else str(a) for a in gt)


def _select_sample(vf: pysam.VariantFile, vcf_path: str, sample: str | None) -> str | None:
    samples = list(vf.header.samples)
    if sample is not None:
        if sample not in samples:
            listed = _known(samples) if samples else "none: the VCF has no sample columns"
            raise VariantError(f"{vcf_path}: no sample {sample!r} in the VCF (samples: {listed})")
        return sample
    if len(samples) > 1:
        raise VariantError(f"{vcf_path}: the VCF has {len(samples)} samples ({_known(samples)}); choose one: sample=")
    return samples[0] if samples else None


def _fasta_contig(
    vf: pysam.VariantFile, chrom: str, contig_lengths: Mapping[str, int], contig_map: Mapping[str, str]
) -> tuple[str | None, str]:
    """(FASTA contig of a CHROM, '') or (None, the problem)."""
    names = list(contig_lengths)
    if chrom in contig_map:
        contig = contig_map[chrom]
        if contig not in contig_lengths:
            return None, f"contig_map maps CHROM {chrom!r} to {contig!r}, which is not a FASTA contig ({_known(names)})"
    elif chrom in contig_lengths:
        contig = chrom
    else:  # suggest a mapping when one FASTA name is an obvious match (NC_007795 in gi|...|ref|NC_007795.1|)
        bare = chrom.removeprefix("chr")
        guess = [n for n in names if chrom in n or n in (bare, "chr" + chrom)]
        example = guess[0] if len(guess) == 1 else "<FASTA contig>"
        return None, (
            f"CHROM {chrom!r} is not a FASTA contig (FASTA contigs: {_known(names)}); "
            f"map it with contig_map={{{chrom!r}: {example!r}}}"
        )
    declared = vf.header.contigs[chrom].length if chrom in vf.header.contigs else None
    if declared is not None and declared != contig_lengths[contig]:
        return None, (
            f"the VCF header declares {chrom} with length {declared} but FASTA contig {contig!r} has length "
            f"{contig_lengths[contig]}: the VCF was called against another reference"
        )
    return contig, ""


def read_haplotype_edits(
    vcf_path: str,
    contig_lengths: Mapping[str, int],
    sample: str | None = None,
    contig_map: Mapping[str, str] | None = None,
) -> tuple[int, dict[str, list[list[Edit]]]]:
    """(number of haplotypes, {FASTA contig: [edits of haplotype 0, edits of haplotype 1, ...]}) of one sample.

    Every contig of `contig_lengths` is in the result (with empty lists where the VCF has no edits), in that
    order; each haplotype's edits are sorted by position and do not overlap. Genotypes: a phased `0|1` puts the
    ALT on haplotype 1 only, multi-allelic indices pick their ALT, a haploid `1` gives one haplotype, missing
    alleles (`.`) are reference, unphased genotypes are accepted only when homozygous (`1/1`). A VCF without
    sample columns is one haplotype carrying every record's first ALT. The ploidy is that of the first called
    genotype; a record with another ploidy is an error. Only applied alleles are checked, so a `*` or
    `<DEL>` ALT that the sample does not carry is harmless. VCF CHROMs are FASTA contig names unless
    `contig_map` maps them (e.g. {"MT": "MT_human"}). REF alleles are checked against the sequence later, by
    `apply_edits`. Plain-gzip VCFs are decompressed to a temporary file first (see `_readable`).
    """
    vcf_path = os.fspath(vcf_path)
    contig_map = dict(contig_map or {})
    if not os.path.isfile(vcf_path):
        raise VariantError(f"{vcf_path}: VCF file not found")
    # htslib warns per undeclared contig, and of a missing index (E::idx_find_and_load, harmless: the file is read
    # whole); the checks below say more
    previous_verbosity = pysam.set_verbosity(0)
    try:
        with _readable(vcf_path) as text_path:
            try:
                vf = pysam.VariantFile(text_path)
            except (OSError, ValueError) as e:
                raise VariantError(f"{vcf_path}: htslib cannot open it as VCF/BCF: {e}") from e
            with vf:
                where = _Locator(vcf_path, text_path, vf.format == "BCF")
                return _read_records(vf, where, contig_lengths, _select_sample(vf, vcf_path, sample), contig_map)
    finally:
        pysam.set_verbosity(previous_verbosity)


def _read_records(
    vf: pysam.VariantFile,
    where: _Locator,
    contig_lengths: Mapping[str, int],
    sample: str | None,
    contig_map: Mapping[str, str],
) -> tuple[int, dict[str, list[list[Edit]]]]:
    contigs: dict[str, str] = {}  # CHROM -> FASTA contig, checked once per CHROM
    edits: dict[str, list[list[Edit]]] = {}
    ploidy: int | None = None if sample is not None else 1
    ploidy_index = -1  # record that fixed the ploidy
    records = iter(vf)
    for index in itertools.count():
        try:
            rec = next(records)
        except StopIteration:
            break
        except (OSError, ValueError) as e:
            raise VariantError(f"{where(index)}: htslib cannot parse this record ({e}): {where.text(index)}") from e
        at = f"{where(index)}: {rec.chrom}:{rec.pos}"
        if rec.chrom not in contigs:
            contig, problem = _fasta_contig(vf, rec.chrom, contig_lengths, contig_map)
            if contig is None:
                raise VariantError(f"{at}: {problem}")
            contigs[rec.chrom] = contig
        contig = contigs[rec.chrom]
        if not _SEQUENCE.fullmatch(rec.ref.encode("latin-1", "replace")):
            raise VariantError(f"{at}: REF {rec.ref!r} is not a nucleotide sequence")
        if rec.start + len(rec.ref) > contig_lengths[contig]:
            raise VariantError(f"{at}: REF {rec.ref} runs past the end of {contig} (length {contig_lengths[contig]})")
        if sample is None:
            gt: tuple = (1,) if rec.alts else (0,)
        else:
            call = rec.samples[sample]
            gt = tuple(call.allele_indices)
            if None in gt:
                _check_missing(rec, sample, at)
            if not gt:
                raise VariantError(f"{at}: sample {sample!r} has no GT (genotype) in this record")
            if all(a is None for a in gt):
                continue  # missing genotype: reference on every haplotype
            if len(gt) > 1 and not call.phased and len({a or 0 for a in gt}) > 1:
                raise VariantError(
                    f"{at}: sample {sample!r} has the unphased heterozygous genotype {_gt_text(gt, False)}; "
                    f"which haplotype carries the ALT is unknown: {_PHASE_HINT}"
                )
            if ploidy is None:
                ploidy, ploidy_index = len(gt), index
            elif len(gt) != ploidy:
                raise VariantError(
                    f"{at}: genotype {_gt_text(gt, call.phased)} of sample {sample!r} has ploidy {len(gt)}, but "
                    f"the first genotype ({where(ploidy_index)}) has ploidy {ploidy}; mixed ploidy is not supported"
                )
        for hap, allele in enumerate(gt):
            if not allele:  # 0 (reference) or None (missing)
                continue
            alt = rec.alleles[allele]
            problem = _allele_problem(alt)
            if problem:
                raise VariantError(f"{at}: {problem}; structural and symbolic alleles are not supported ({_ONLY})")
            if contig not in edits:
                edits[contig] = [[] for _ in range(ploidy)]
            edits[contig][hap].append(Edit(rec.start, rec.ref, alt, where.line(index)))
    ploidy = ploidy or 1  # no called genotype at all: the sample is the reference
    out: dict[str, list[list[Edit]]] = {}
    for contig in contig_lengths:
        haplotypes = edits.get(contig, [[] for _ in range(ploidy)])
        for hap, hap_edits in enumerate(haplotypes):
            hap_edits.sort(key=lambda e: e.pos)
            for a, b in zip(hap_edits, hap_edits[1:]):
                if b.pos < a.end:
                    chrom = {name: chrom for chrom, name in contigs.items()}[contig]  # the VCF's name, as in CHROM:POS
                    first = f"line {a.line}, " if a.line else ""
                    raise VariantError(
                        f"{_here(where.path, b)}{chrom}:{b.pos + 1}: variant {_short(b.ref)}>{_short(b.alt)} overlaps "
                        f"the variant {_short(a.ref)}>{_short(a.alt)} ({first}{chrom}:{a.pos + 1}) on haplotype {hap}; "
                        f"overlapping variants cannot both be applied"
                    )
        out[contig] = haplotypes
    return ploidy, out


def _check_missing(rec: pysam.VariantRecord, sample: str, at: str) -> None:
    """Raise if a None allele was an index past the ALTs: pysam turns those into None, i.e. silently `.`."""
    fields = str(rec).rstrip("\n").split("\t")
    keys = fields[8].split(":")
    text = fields[9 + list(rec.header.samples).index(sample)].split(":")[keys.index("GT")]
    for allele in re.split(r"[|/]", text):
        if allele != "." and int(allele) >= len(rec.alleles):
            raise VariantError(
                f"{at}: genotype {text} of sample {sample!r} names allele {allele} but the record has "
                f"{len(rec.alleles) - 1} ALT(s)"
            )


def apply_edits(seq: bytes, edits: Sequence[Edit], contig: str, vcf_path: str = "") -> bytes:
    """The sequence with `edits` (sorted, non-overlapping, as `read_haplotype_edits` returns them) applied.

    Each REF must equal the reference bases it replaces, ignoring case; on a mismatch the error names the
    first one and counts all of them (many mismatches usually mean another reference build). Untouched bases
    keep their case (soft-masking); ALT bases are inserted uppercase.
    """
    seq = bytes(seq)
    mismatches: list[tuple[Edit, bytes]] = []
    pieces: list[bytes] = []
    cursor = 0
    for edit in edits:
        if edit.pos < cursor or edit.end > len(seq):
            problem = "precedes or overlaps the previous edit" if edit.pos < cursor else "runs past the contig's end"
            raise VariantError(f"{_here(vcf_path, edit)}{contig}:{edit.pos + 1}: REF {_short(edit.ref)} {problem}")
        found = seq[edit.pos : edit.end]
        if found.upper() != edit.ref.upper().encode("ascii"):
            mismatches.append((edit, found))
        pieces += (seq[cursor : edit.pos], edit.alt.upper().encode("ascii"))
        cursor = edit.end
    if mismatches:
        edit, found = mismatches[0]
        more = f" ({len(mismatches)} of {len(edits)} REF alleles differ: another reference build?)"
        raise VariantError(
            f"{_here(vcf_path, edit)}{contig}:{edit.pos + 1}: REF {_short(edit.ref)} does not match the reference, "
            f"which has {_short(found.decode('ascii'))} there{more if len(mismatches) > 1 else ''}"
        )
    pieces.append(seq[cursor:])
    return b"".join(pieces)


def _short(text: str) -> str:
    return text if len(text) <= 40 else f"{text[:37]}... ({len(text)} bp)"


def _here(vcf_path: str, edit: Edit) -> str:
    """The "path:line: " prefix of a message about one edit ("" without a path)."""
    if not vcf_path:
        return ""
    return f"{vcf_path}:{edit.line}: " if edit.line else f"{vcf_path}: "


def lift_positions(positions: np.ndarray, edits: Sequence[Edit]) -> np.ndarray:
    """Reference 0-based positions -> positions in the edited sequence (int64, same shape).

    A base inside an edit's REF span maps to the same offset in its ALT while the ALT is long enough (an SNV's
    base, an indel's anchor base); a deleted base maps to the first base after the ALT. The map is
    non-decreasing and len(seq) lifts to the edited length, so lift both ends of a half-open [start, end)
    directly (not `end - 1` plus one): adjacent ranges stay adjacent, inserted bases go with their anchor's
    range, and a train/held-out partition of the reference stays a partition of the haplotype.
    """
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size and positions.min() < 0:
        raise ValueError(f"negative position {int(positions.min())}")
    if not edits:
        return positions.copy()
    starts = np.fromiter((e.pos for e in edits), dtype=np.int64, count=len(edits))  # (E,)
    ref_len = np.fromiter((len(e.ref) for e in edits), dtype=np.int64, count=len(edits))  # (E,)
    alt_len = np.fromiter((len(e.alt) for e in edits), dtype=np.int64, count=len(edits))  # (E,)
    shift_before = np.concatenate(([0], np.cumsum(alt_len - ref_len)))  # (E + 1,): length change of edits < i
    i = np.searchsorted(starts, positions, side="right") - 1  # last edit starting at or before each position
    j = np.maximum(i, 0)
    offset = positions - starts[j]
    inside = (i >= 0) & (offset < ref_len[j])
    after = positions + shift_before[i + 1]  # past edit i (or before every edit when i == -1)
    within = starts[j] + shift_before[j] + np.minimum(offset, alt_len[j])
    return np.where(inside, within, after)


def lift_position(pos: int, edits: Sequence[Edit]) -> int:
    """One reference 0-based position -> its position in the edited sequence (see `lift_positions`)."""
    return int(lift_positions(np.array([pos]), edits)[0])
