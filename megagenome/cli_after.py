"""Command line of what comes after training (layer L5, beside cli.py): the parsers of `megagenome eval`,
`score-variants`, `export` and `report`, and their dispatch. Each command's work lives in its module (evaluate.py,
variant_scoring.py, export.py, report.py); these functions only declare flags and hand the parsed namespace over.
"""

from __future__ import annotations

from jsonargparse import ArgumentParser

COMMANDS = {
    "eval": "Bits per base of a trained model on any FASTA.",
    "score-variants": "Score the variants of a VCF with a trained model (and AUROC for labelled ones).",
    "export": "Consolidate a run into model.safetensors and a Hugging Face model directory.",
    "report": "PNG plots and a Markdown summary of a run.",
}


def _source(parser: ArgumentParser) -> None:
    parser.add_argument(
        "run",
        type=str,
        help="A run directory (its newest complete checkpoint, or --step) or a `megagenome export` directory.",
    )
    parser.add_argument("--step", type=int | None, default=None, help="Checkpoint step to load (default: newest).")


def eval_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome eval",
        description="Evaluate a trained model on a FASTA: bits per base overall, per record and for soft-masked vs "
        "unmasked bases, and the per-sequence mean negative log-likelihood (nats/base averaged over records). Runs in "
        "one process or under the deepspeed launcher (windows split over ranks; the same result).",
    )
    _source(parser)
    parser.add_argument("--fasta", type=str, required=True, help="FASTA to evaluate (plain or BGZF).")
    parser.add_argument(
        "--regions",
        type=str,
        nargs="*",
        default=[],
        help="Evaluate only these regions (contig:start-end, 1-based inclusive), each reported as its own row; "
        "default: every record whole.",
    )
    parser.add_argument(
        "--window",
        type=int | None,
        default=None,
        help="Tokens per forward pass (default and maximum: the model's --model.max_seq_len). Causal models score "
        "every base but a record's first once, each with up to window-1 bases of context.",
    )
    parser.add_argument("--batch_size", type=int, default=8, help="Windows per forward pass.")
    parser.add_argument(
        "--reverse_complement",
        action="store_true",
        help="Average each base's log-likelihood over the forward strand and the reverse complement.",
    )
    parser.add_argument("--dtype", type=str, default="fp32", choices=["fp32", "bf16", "fp16"], help="Inference dtype.")
    parser.add_argument("--output", type=str | None, default=None, help="Write the results as JSON to this file.")
    parser.add_argument("--progress", type=bool, default=True, help="Show a progress bar (rank 0).")
    return parser


def score_variants_parser() -> ArgumentParser:
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
    _source(parser)
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


def export_parser() -> ArgumentParser:
    from typing import Literal

    parser = ArgumentParser(
        prog="megagenome export",
        description="Consolidate a run (any checkpoint layout) into a model directory: model.safetensors, "
        "megagenome.json and a model card; for a causal model also a Hugging Face LlamaForCausalLM (config.json, "
        "generation_config.json) and a single-nucleotide tokenizer (tokenizer.json). An existing --output is "
        "refused. Start a new run from the directory with --model.init_from.",
    )
    _source(parser)
    parser.add_argument("--output", type=str, required=True, help="Directory to create (must not exist).")
    parser.add_argument("--dtype", type=Literal["fp32", "bf16"], default="fp32", help="Dtype of model.safetensors.")
    parser.add_argument(
        "--quantize",
        type=Literal["none", "int8"],
        default="none",
        help="int8: also write model_int8.pt (torchao dynamic int8 of the blocks' linears) and measure its size "
        "and held-out bits/base next to float32 (on the run's held-out windows, or --eval_fasta).",
    )
    parser.add_argument(
        "--eval_fasta",
        type=str | None,
        default=None,
        help="With --quantize int8: measure bits/base on windows of this FASTA instead of the run's held-out split.",
    )
    parser.add_argument(
        "--eval_windows",
        type=int | None,
        default=None,
        help="With --quantize int8: windows to measure on (default: the run's --data.eval_windows).",
    )
    return parser


def report_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome report",
        description="PNG plots of a run's metrics.jsonl (loss, held-out bits/base with the Markov baselines of "
        "summary.json as lines, learning rate, tokens/s, MFU, memory) and report.md, a short Markdown summary that "
        "links them. Reads the run directory only; works on a run still in progress.",
    )
    parser.add_argument("run", type=str, help="A run directory (with metrics.jsonl).")
    parser.add_argument(
        "--output", type=str | None, default=None, help="Directory for the PNGs and report.md (default: RUN/report)."
    )
    return parser


PARSERS = {
    "eval": eval_parser,
    "score-variants": score_variants_parser,
    "export": export_parser,
    "report": report_parser,
}


def add_commands(sub) -> None:
    """Add the after-training subcommands to cli.py's subcommand group."""
    for name, build in PARSERS.items():
        try:
            sub.add_subcommand(name, build(), help=COMMANDS[name])
        except NotImplementedError:
            continue


def dispatch(command: str, ns) -> int:
    """Run an after-training command on its parsed namespace; its exit status."""
    if command == "eval":
        from megagenome import evaluate

        return evaluate.main(ns)
    if command == "score-variants":
        from megagenome import variant_scoring

        return variant_scoring.main(ns)
    if command == "export":
        from megagenome import export

        return export.main(ns)
    if command == "report":
        from megagenome import report

        return report.main(ns)
    raise ValueError(f"unknown command {command}")
