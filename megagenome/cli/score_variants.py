"""`megagenome score-variants` (layer L5): zero-shot variant-effect scores of a VCF
(after_training/variant_scoring.py).
"""

from __future__ import annotations

from typing import Literal

from jsonargparse import ArgumentParser

from .args import Parsed, model_source

HELP = "Score the variants of a VCF with a trained model (AUROC for labelled ones; --supervised: a classifier too)."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome score-variants",
        description="Zero-shot variant-effect scores: each ALT of a VCF scored by a trained model, written into the "
        "VCF (an INFO field, Number=A) and a TSV. Causal models: log-likelihood of a window centred on the variant "
        "with the ALT minus with the REF (Evo 2). Masked models: masked-marginal log p(ALT) - log p(REF) at the masked "
        "variant bases (GPN); indels: the windows' pseudo-log-likelihood difference. Lower = predicted damaging. "
        "With --label_field, AUROC (95% bootstrap interval) of the labelled variants; with --supervised, also a "
        "classifier's cross-validated score on the model's embeddings. Runs in one process or under "
        "the deepspeed launcher (batches split over ranks; the same scores). Exit status 2 on bad input, with "
        "nothing written.",
    )
    model_source(parser)
    parser.add_argument("--fasta", type=str, required=True, help="Reference FASTA of the VCF (plain or BGZF).")
    parser.add_argument("--vcf", type=str, required=True, help="Variants to score (VCF, plain/BGZF/gzip, or BCF).")
    parser.add_argument(
        "--output", type=str, required=True, help="Scored VCF to write: .vcf, .vcf.gz (BGZF), .vcf.bgz or .bcf."
    )
    parser.add_argument(
        "--tsv", type=str | None, default=None, help="Per-ALT table (default: --output with its suffix -> .tsv)."
    )
    parser.add_argument(
        "--window",
        type=int | None,
        default=None,
        help="Bases per scored window, the variant at its centre (default: the run's training window --data.seq_len; "
        "at most the model's context --model.max_seq_len). Alleles longer than half the window are skipped.",
    )
    parser.add_argument(
        "--reverse_complement", action="store_true", help="Average each score with that of the reverse complement."
    )
    parser.add_argument("--batch_size", type=int, default=16, help="Windows per forward pass.")
    parser.add_argument("--dtype", type=str, default="fp32", choices=["fp32", "bf16", "fp16"], help="Inference dtype.")
    parser.add_argument(
        "--label_field", type=str | None, default=None, help="INFO field holding a label per variant, for AUROC."
    )
    parser.add_argument(
        "--positive",
        type=list[str] | str,
        default=[],
        help="Label value(s) of the positive class (LOF, or a list: [LOF,INT] or LOF,INT); every other labelled "
        "variant is negative, unlabelled ones are left out. AUROC is that of -score.",
    )
    parser.add_argument(
        "--bootstrap", type=int, default=1000, help="Bootstrap resamples for the AUROC's 95% interval (0: none)."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the bootstrap (numpy default_rng).")
    parser.add_argument("--info_field", type=str, default="MG_SCORE", help="INFO key of the score (Number=A, Float).")
    parser.add_argument("--summary_json", type=str | None, default=None, help="Also write the summary as JSON here.")
    parser.add_argument("--overwrite", action="store_true", help="Replace outputs that exist (refused otherwise).")
    supervised(parser)
    parser.add_argument("--progress", type=bool, default=True, help="Show a progress bar (rank 0).")
    return parser


def supervised(parser: ArgumentParser) -> None:
    """The flags of --supervised and of --subset_field (after_training/supervised_vep.py)."""
    parser.add_argument(
        "--supervised",
        action="store_true",
        help="Also a supervised score: a classifier on the model's embeddings of each labelled variant's REF and ALT "
        "windows ([REF, ALT] means over --embed_window bases at the variant, per layer), cross-validated in folds "
        "of position blocks; each labelled variant gets the out-of-fold probability of --positive (higher = "
        "predicted positive), written to INFO --supervised_info_field and the TSV's `supervised` and `fold` "
        "columns, with its AUROC and per-fold AUROCs beside the zero-shot ones. Needs --label_field and --positive.",
    )
    parser.add_argument(
        "--embed_layers",
        type=int,
        nargs="+",
        default=None,
        help="With --supervised: layers whose embeddings are the features (0 the embedding output, i the output of "
        "block i, -1 the final norm). Default: the middle block (n_layer // 2, at least 1) and -1.",
    )
    parser.add_argument(
        "--embed_window",
        type=int | None,
        default=None,
        help="With --supervised: bases around the variant each window's embeddings are averaged over, from "
        "embed_window // 2 before it (default 128, at most --window).",
    )
    parser.add_argument(
        "--classifier",
        type=Literal["logistic", "gradient_boosting"] | None,
        default=None,
        help="With --supervised: logistic (standardized features, L2 logistic regression, balanced class weights; "
        "the default) or gradient_boosting (histogram gradient boosting); both seeded by --seed.",
    )
    parser.add_argument(
        "--cv_folds", type=int | None, default=None, help="With --supervised: cross-validation folds (default 5)."
    )
    parser.add_argument(
        "--block_size",
        type=int | None,
        default=None,
        help="With --supervised: bases per position block (default 100); a block's variants, grouped by (contig, "
        "0-based position // block_size), are never split between a fold's training and test parts.",
    )
    parser.add_argument(
        "--supervised_info_field",
        type=str,
        default="MG_SUPERVISED",
        help="INFO key of the supervised score (Number=A, Float).",
    )
    parser.add_argument(
        "--subset_field",
        type=str | None,
        default=None,
        help="INFO field (e.g. CSQ) whose values split the labelled variants into subsets: AUROCs of the zero-shot "
        "(and supervised) score within each. Needs --label_field and --positive.",
    )
    parser.add_argument(
        "--subset_groups",
        type=str,
        nargs="*",
        default=[],
        help="With --subset_field: named groups of its values instead of one subset per value, NAME=V1,V2 (e.g. "
        "coding=Missense,Synonymous,Nonsense 'noncoding=*'; `*`: every value no other group names).",
    )


def main(parsed: Parsed) -> int:
    from megagenome.after_training import variant_scoring

    return variant_scoring.main(parsed.ns)
