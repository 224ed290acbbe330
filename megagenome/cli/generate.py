"""`megagenome generate` (layer L5): DNA sampled from a trained causal model (after_training/generation.py)."""

from __future__ import annotations

from jsonargparse import ArgumentParser

from .args import Parsed, model_source

HELP = "Sample DNA from a trained causal model: continue a prompt base by base (cached decoding)."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome generate",
        description="Continue a prompt (--prompt, each record of --prompt_fasta, or an empty prompt) by --length "
        "bases drawn from a causal model's next-base distribution over A, C, G and T, --num_samples times, and "
        "write a FASTA record per sample (the prompt and the generated bases; the header names the settings and the "
        "model), and with --scores each generated base's log-probability. Decoding is cached: attention layers keep "
        "their keys and values, Hyena operators their filters' states (the LI layers a recurrent state), so each base "
        "costs one step; a sequence longer than the model's context is read through a sliding window. Masked-LM "
        "models are refused. Runs in one process or under the deepspeed launcher (samples "
        "dealt over ranks; the same samples). Exit status 2 on bad input, with nothing written.",
    )
    model_source(parser)
    parser.add_argument("--output", type=str, required=True, help="FASTA to write, one record per sample.")
    parser.add_argument("--prompt", type=str, default="", help="The bases to continue (default: an empty prompt).")
    parser.add_argument(
        "--prompt_fasta", type=str | None, default=None, help="Continue each record of this FASTA (plain or BGZF)."
    )
    parser.add_argument("--length", type=int, default=1000, help="Bases to generate per sample.")
    parser.add_argument("--num_samples", type=int, default=1, help="Samples per prompt.")
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="Divide the logits by this; 0: greedy (the most likely base)."
    )
    parser.add_argument("--top_k", type=int | None, default=None, help="Draw from the k most likely bases only (1-4).")
    parser.add_argument(
        "--top_p", type=float | None, default=None, help="Draw from the smallest set of bases whose probability >= p."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the draws: the same seed, the same samples.")
    parser.add_argument(
        "--scores", type=str | None, default=None, help="TSV of each generated base's log-probability (natural log)."
    )
    parser.add_argument("--batch_size", type=int, default=8, help="Samples decoded together.")
    parser.add_argument("--dtype", type=str, default="fp32", choices=["fp32", "bf16"], help="Inference dtype.")
    parser.add_argument(
        "--slide",
        type=int | None,
        default=None,
        help="Past the model's --model.max_seq_len positions, the window "
        "it reads drops this many of the oldest bases when full (default: a quarter of the window).",
    )
    parser.add_argument("--overwrite", action="store_true", help="Replace outputs that exist (refused otherwise).")
    parser.add_argument("--progress", type=bool, default=True, help="Show a progress bar with bases/s (rank 0).")
    return parser


def main(parsed: Parsed) -> int:
    from megagenome.after_training import generation

    return generation.main(parsed.ns)
