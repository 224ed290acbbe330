"""`megagenome eval` (layer L5): bits per base of a trained model on any FASTA (after_training/evaluate.py does the
work).
"""

from __future__ import annotations

from jsonargparse import ArgumentParser

from .args import Parsed, model_source

HELP = "Bits per base of a trained model on any FASTA."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome eval",
        description="Evaluate a trained model on a FASTA: bits per base overall, per record and for soft-masked vs "
        "unmasked bases, and the per-sequence mean negative log-likelihood (nats/base averaged over records). Runs in "
        "one process or under the deepspeed launcher (windows split over ranks; the same result).",
    )
    model_source(parser)
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
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing --output (refused otherwise).")
    parser.add_argument("--progress", type=bool, default=True, help="Show a progress bar (rank 0).")
    return parser


def main(parsed: Parsed) -> int:
    from megagenome.after_training import evaluate

    return evaluate.main(parsed.ns)
