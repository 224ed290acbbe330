"""`megagenome score-variants` (layer L5): zero-shot variant-effect scores of a VCF
(after_training/variant_scoring.py).
"""

from __future__ import annotations

from jsonargparse import ArgumentParser

from .args import Parsed, model_source

HELP = "Score the variants of a VCF with a trained model (and AUROC for labelled ones)."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome score-variants",
        description="Zero-shot variant-effect scores: each ALT of a VCF scored by a trained model, written into the "
        "VCF (an INFO field, Number=A) and a TSV. Causal models: log-likelihood of a window centred on the variant "
        "with the ALT minus with the REF (Evo 2). Masked models: masked-marginal log p(ALT) - log p(REF) at the masked "
        "variant bases (GPN); indels: the windows' pseudo-log-likelihood difference. Lower = predicted damaging. "
        "With --label_field, AUROC (95% bootstrap interval) of the labelled variants. Runs in one process or under "
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
    parser.add_argument("--progress", type=bool, default=True, help="Show a progress bar (rank 0).")
    return parser


def main(parsed: Parsed) -> int:
    from megagenome.after_training import variant_scoring

    return variant_scoring.main(parsed.ns)
