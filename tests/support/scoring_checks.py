"""`megagenome score-variants` under 2 ranks, run by support/worker.py after the training scenarios of
support/trained.py (a check scenario: every rank calls it in the live process group), and the test VCF on phiX174
that tests/test_variant_scoring.py uses too.

For each case, every rank scores the VCF together (rank 0 writes <run_dir>/<name>_2ranks.vcf/.tsv/.json); then rank
0 alone scores it again as a world of one in the same process (<name>_1rank.*), so the test can require equality to
the bit, with the same threads and library state."""

from __future__ import annotations

import os

from megagenome.after_training.inference import World, start_world
from megagenome.after_training.variant_scoring import Options, run
from megagenome.data.fasta import Genome

CONTIG = "NC_001422.1"

# (name, run, options): batch size 3 makes batches that do not divide evenly over the ranks.
CASES = [
    ("dense_rc", "dense", {"window": 128, "batch_size": 3, "reverse_complement": True}),
    ("mlm", "mlm", {"window": 40, "batch_size": 3}),
]


def _other(base: str, k: int = 1) -> str:
    return "ACGT"[("ACGT".index(base.upper()) + k) % 4]


def phix_records(seq: str) -> list[tuple[int, str, str, str | None]]:
    """(1-based POS, REF, ALT, CLASS or None) on phiX174 `seq`: SNVs labelled LOF/FUNC (for AUROC), an unlabelled SNV,
    a multi-allelic SNV with a `*` ALT (skipped), an insertion, a deletion, an MNV, a symbolic <DEL> (skipped), and
    variants 2 bases from the contig's start and end."""
    records = [(2, seq[1], _other(seq[1]), "LOF")]
    for i, pos in enumerate(range(150, 1150, 100)):  # ten SNVs, alternating labels
        records.append((pos, seq[pos - 1], _other(seq[pos - 1], 1 + i % 3), "LOF" if i % 2 else "FUNC"))
    records += [
        (1300, seq[1299], f"{_other(seq[1299])},*", "FUNC"),
        (1500, seq[1499], seq[1499] + "ACGTA", "LOF"),  # insertion of 5
        (1700, seq[1699:1703], seq[1699], "LOF"),  # deletion of 3
        (1900, seq[1899:1901], _other(seq[1899]) + _other(seq[1900], 2), "FUNC"),  # MNV
        (2100, seq[2099], _other(seq[2099]), None),
        (2300, seq[2299], "<DEL>", "LOF"),
        (len(seq) - 3, seq[-4:-1], seq[-4], "FUNC"),  # deletion at the contig's end
        (len(seq) - 1, seq[-2], _other(seq[-2]), "FUNC"),
    ]
    return records


def write_test_vcf(path: str, fasta: str, records=None) -> str:
    """The VCF of `records` (default: phix_records of the FASTA's phiX174) with a CLASS INFO field."""
    with Genome(fasta) as genome:
        seq = genome.read_contig(CONTIG).decode()
        length = genome.lengths[CONTIG]
    lines = [
        "##fileformat=VCFv4.2",
        f"##contig=<ID={CONTIG},length={length}>",
        '##INFO=<ID=CLASS,Number=1,Type=String,Description="functional class">',
        "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO",
    ]
    for n, (pos, ref, alt, label) in enumerate(records if records is not None else phix_records(seq)):
        lines.append(f"{CONTIG}\t{pos}\tv{n}\t{ref}\t{alt}\t.\t.\t{f'CLASS={label}' if label else '.'}")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def options(run_dir: str, fasta: str, vcf: str, out: str, **kw) -> Options:
    """Options of a labelled run writing <out>.vcf, .tsv and .json (kw overrides any)."""
    base = {"output": out + ".vcf", "summary_json": out + ".json", "label_field": "CLASS", "positive": ["LOF"]}
    base |= {"bootstrap": 200, "progress": False, "overwrite": True}
    return Options(run=run_dir, fasta=fasta, vcf=vcf, **{**base, **kw})


def score_two_ranks(run_dir: str, runs: dict, fasta: str, **_) -> None:
    world = start_world()
    os.makedirs(run_dir, exist_ok=True)
    vcf = write_test_vcf(os.path.join(run_dir, f"variants_rank{world.rank}.vcf"), fasta)
    for name, layout, kw in CASES:
        run(options(runs[layout], fasta, vcf, os.path.join(run_dir, f"{name}_2ranks"), **kw), world)
        if world.main:
            run(options(runs[layout], fasta, vcf, os.path.join(run_dir, f"{name}_1rank"), **kw), World(0, 1))
        world.gather(None)  # a barrier: rank 1 waits for rank 0's world of one
