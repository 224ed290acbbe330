"""The variants of a VCF to score, and the VCF written back with a score per ALT (layer L1 data).

`read_sites` reads every record once (pysam, as data/variants.py does: plain, BGZF or gzip VCF, or BCF), with the
checks that must pass before any model runs: each CHROM is a FASTA contig (else the error names the VCF line and
lists the FASTA's contigs), a declared contig length matches the FASTA, REF is a nucleotide sequence inside the
contig, POS at least 1, and a label field (for AUROC) and a subset field (AUROCs within subsets) are declared;
`check_refs` then compares every REF with the FASTA. ALTs that are not sequence (symbolic `<DEL>`, breakends, `*`)
and alleles with bases other than A, C, G and T (N, IUPAC codes: a model would score them as if they were bases) are
kept with their reason, to be skipped rather than refused: a multi-allelic record may hold one next to scorable
ones.

`write_scored` writes the input's records unchanged plus one INFO field, Number=A Type=Float (`.` for an ALT that
was not scored), or more (score-variants --supervised's second score), to the caller's temporary (files/outputs.py
staged), published with the TSV. Text, BGZF (`.gz`, `.bgz`) or BCF (`.bcf`) by the output's suffix. Line numbers
come from data/variants.py's `_Locator` (text VCF: header lines plus the record's index plus one; BCF: the record's
ordinal).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import pysam

from megagenome.data.fasta import Genome
from megagenome.data.variants import _SEQUENCE, VariantError, _allele_problem, _known, _Locator, _readable
from megagenome.files import outputs


@dataclass(frozen=True)
class Site:
    """One VCF record: position 0-based on the FASTA contig, its ALTs and, per ALT, a label (None: missing) and why
    it cannot be scored ('' when it can)."""

    index: int  # the record's ordinal in the file
    where: str  # "path:line" (text VCF) or "path: record N" (BCF), for messages
    chrom: str
    pos: int
    id: str
    ref: str
    alts: tuple[str, ...]
    labels: tuple[str | None, ...]
    unscorable: tuple[str, ...]
    subsets: tuple[str | None, ...] = ()  # per ALT: its value of the subset field (None: missing); () when not read


def read_sites(
    vcf_path: str, contig_lengths: Mapping[str, int], label_field: str | None = None, subset_field: str | None = None
) -> list[Site]:
    """Every record of the VCF as a Site, checked against the FASTA's contigs (see the module docstring); with
    `subset_field`, each ALT's value of that INFO field (read as labels are) in Site.subsets."""
    vcf_path = os.fspath(vcf_path)
    if not os.path.isfile(vcf_path):
        raise VariantError(f"{vcf_path}: VCF file not found")
    with _open(vcf_path) as (vf, where):
        for flag, name in (("--label_field", label_field), ("--subset_field", subset_field)):
            if name is not None and name not in vf.header.info:
                declared = _known(list(vf.header.info)) or "none"
                raise VariantError(f"{vcf_path}: {flag} {name}: no such INFO field (declared: {declared})")
        return [
            _site(vf, rec, index, where, contig_lengths, label_field, subset_field)
            for index, rec in _records(vf, where, vcf_path)
        ]


class _open:
    """Context manager: (pysam.VariantFile, _Locator) of a VCF/BCF, htslib's warnings quieted (the checks say more)."""

    def __init__(self, vcf_path: str):
        self.vcf_path = vcf_path

    def __enter__(self) -> tuple[pysam.VariantFile, _Locator]:
        self._verbosity = pysam.set_verbosity(0)
        self._readable = _readable(self.vcf_path)
        text_path = self._readable.__enter__()
        try:
            self.vf = pysam.VariantFile(text_path)
        except (OSError, ValueError) as e:
            self.__exit__(None, None, None)
            raise VariantError(f"{self.vcf_path}: htslib cannot open it as VCF/BCF: {e}") from e
        return self.vf, _Locator(self.vcf_path, text_path, self.vf.format == "BCF")

    def __exit__(self, *exc) -> None:
        if getattr(self, "vf", None) is not None:
            self.vf.close()
        self._readable.__exit__(None, None, None)
        pysam.set_verbosity(self._verbosity)


def _records(vf: pysam.VariantFile, where: _Locator, vcf_path: str) -> Iterator[tuple[int, pysam.VariantRecord]]:
    records = iter(vf)
    for index in itertools.count():
        try:
            rec = next(records)
        except StopIteration:
            return
        except (OSError, ValueError) as e:
            raise VariantError(f"{where(index)}: htslib cannot parse this record ({e}): {where.text(index)}") from e
        yield index, rec


def _site(
    vf: pysam.VariantFile,
    rec: pysam.VariantRecord,
    index: int,
    where: _Locator,
    contig_lengths: Mapping[str, int],
    label_field: str | None,
    subset_field: str | None = None,
) -> Site:
    at = f"{where(index)}: {rec.chrom}:{rec.pos}"
    if rec.pos < 1:
        raise VariantError(f"{at}: POS {rec.pos}: VCF positions start at 1")
    if rec.chrom not in contig_lengths:
        raise VariantError(
            f"{at}: CHROM {rec.chrom!r} is not a contig of the FASTA (its contigs: {_known(list(contig_lengths))})"
        )
    length = contig_lengths[rec.chrom]
    declared = vf.header.contigs[rec.chrom].length if rec.chrom in vf.header.contigs else None
    if declared is not None and declared != length:
        raise VariantError(
            f"{at}: the VCF header declares {rec.chrom} with length {declared} but the FASTA's {rec.chrom} has length "
            f"{length}: the VCF was called against another reference"
        )
    if not _SEQUENCE.fullmatch(rec.ref.encode("latin-1", "replace")):
        raise VariantError(f"{at}: REF {rec.ref!r} is not a nucleotide sequence")
    if rec.start + len(rec.ref) > length:
        raise VariantError(f"{at}: REF {rec.ref} runs past the end of {rec.chrom} (length {length})")
    alts = tuple(rec.alts or ())
    unscorable = tuple(_allele_problem(alt) or _ambiguous("ALT", alt) or _ambiguous("REF", rec.ref) for alt in alts)
    labels = _labels(vf, rec, label_field, len(alts)) if label_field else (None,) * len(alts)
    subsets = _labels(vf, rec, subset_field, len(alts)) if subset_field else ()
    return Site(index, where(index), rec.chrom, rec.start, rec.id or ".", rec.ref, alts, labels, unscorable, subsets)


def _ambiguous(which: str, allele: str) -> str:
    """Why an allele with bases other than A, C, G and T (N, an IUPAC code) is not scored, or ''."""
    other = sorted(set(allele.upper()) - set("ACGT"))
    return f"{which} {allele} has {', '.join(other)}: only A, C, G and T are scored" if other else ""


def check_refs(genome: Genome, sites: Sequence[Site]) -> None:
    """Every REF equals the FASTA's bases (ignoring case); the error names the first mismatch's line, counts all."""
    bad = [(s, genome.fetch(s.chrom, s.pos, s.pos + len(s.ref))) for s in sites]
    bad = [(s, found) for s, found in bad if found.upper() != s.ref.upper().encode("ascii")]
    if bad:
        s, found = bad[0]
        more = f" ({len(bad)} of {len(sites)} REF alleles differ: another reference build?)" if len(bad) > 1 else ""
        raise VariantError(
            f"{s.where}: {s.chrom}:{s.pos + 1}: REF {s.ref} does not match the FASTA {genome.path}, which has "
            f"{found.decode('ascii')} there{more}"
        )


def _labels(vf: pysam.VariantFile, rec: pysam.VariantRecord, field: str, n_alts: int) -> tuple[str | None, ...]:
    """Per ALT: the label (Number=A: that ALT's value, Number=R: its allele's, else the record's, a list joined with
    commas; a Flag is 'True' or 'False'), or None where missing."""
    value = rec.info.get(field)
    number = vf.header.info[field].number
    if isinstance(value, tuple):
        if number in ("A", "R"):
            shift = 1 if number == "R" else 0
            return tuple(_text(value[i + shift]) if i + shift < len(value) else None for i in range(n_alts))
        value = ",".join(str(v) for v in value if v is not None) or None
    return (_text(value),) * n_alts


def _text(value) -> str | None:
    return None if value is None else str(value)


def write_scored(
    vcf_path: str,
    out_path: str,
    scores: Sequence[Sequence[float | None]],
    info_field: str,
    description: str,
    contig_lengths: Mapping[str, int],
    more: Sequence[tuple[str, Sequence[Sequence[float | None]], str, str]] = (),
    target: str | None = None,
) -> None:
    """The input VCF with INFO `info_field` (Number=A, Float) holding scores[record][alt] (None: `.`), and a field
    per (field, scores, description, flag naming it) of `more`, in the format `out_path`'s suffix names, written to
    `target` (the caller's temporary, files/outputs.py staged) or else to `out_path` directly. CHROMs the header
    does not declare are added as contig lines with the FASTA's lengths, and END (which pysam writes for symbolic
    ALTs) when undeclared."""
    out_path = os.fspath(out_path)
    mode = "wz" if out_path.endswith((".gz", ".bgz")) else "wb" if out_path.endswith(".bcf") else "w"
    fields = [(info_field, scores, description, "--info_field"), *more]
    with _open(os.fspath(vcf_path)) as (vf, _):
        header = vf.header  # extended before any record is read, so records parse against it as they are
        for name, _values, text, flag in fields:
            if name in header.info:
                raise VariantError(f"{vcf_path}: the VCF already has an INFO field {name}; choose {flag}")
            header.add_meta("INFO", items=[("ID", name), ("Number", "A"), ("Type", "Float"), ("Description", text)])
        if "END" not in header.info:  # pysam writes END for symbolic ALTs (<DEL>) once a record's INFO is set
            header.add_meta(
                "INFO", items=[("ID", "END"), ("Number", "1"), ("Type", "Integer"), ("Description", "End position")]
            )
        for contig, length in contig_lengths.items():
            if contig not in header.contigs:
                header.contigs.add(contig, length=length)
        with pysam.VariantFile(target or out_path, mode, header=header) as out:
            for rec, *values in zip(vf, *(f[1] for f in fields), strict=True):
                if rec.alts:
                    for (name, *_), per_alt in zip(fields, values):
                        rec.info[name] = tuple(per_alt)
                out.write(rec)


def labelled_alts(sites: Sequence[Site], positives: Sequence[str]) -> list[tuple[int, int, bool]]:
    """(record, ALT, whether its label is one of `positives`) of every ALT that has a label."""
    wanted = set(positives)
    return [(i, a, lab in wanted) for i, s in enumerate(sites) for a, lab in enumerate(s.labels) if lab is not None]


def write_tsv(
    path: str,
    sites: Sequence[Site],
    scores: Sequence[Sequence[float | None]],
    method,
    labels: bool,
    extra: Mapping[str, Sequence[Sequence[str]]] | None = None,
) -> None:
    """One row per ALT: chrom, pos (1-based), id, ref, alt, method (`method(site, alt)`, or "skipped"), score ("NA"
    when skipped; 8 significant digits), with `labels` the label ("NA" when missing), then a column per entry of
    `extra` (name -> per record, per ALT, the cell's text); written whole to `path` (staged)."""
    extra = extra or {}
    columns = ["chrom", "pos", "id", "ref", "alt", "method", "score"] + (["label"] if labels else []) + list(extra)
    rows = []
    for i, (s, row) in enumerate(zip(sites, scores)):
        for a, score in enumerate(row):
            how = "skipped" if score is None else method(s, a)
            cells = [s.chrom, s.pos + 1, s.id, s.ref, s.alts[a], how, "NA" if score is None else f"{score:.8g}"]
            rows.append(cells + ([s.labels[a] or "NA"] if labels else []) + [col[i][a] for col in extra.values()])
    write_text(path, "".join("\t".join(map(str, row)) + "\n" for row in [columns, *rows]))


def write_text(path: str, text: str | bytes) -> None:
    """`text` (UTF-8; or bytes as they are) written whole to `path` or not at all (files/outputs.py)."""
    outputs.write_text(path, text)
