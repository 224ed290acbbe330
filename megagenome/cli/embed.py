"""`megagenome embed` (layer L5): a trained model's hidden states at chosen layers, pooled per window, for a FASTA,
its regions, a BED or a VCF's variants (after_training/embedding.py).
"""

from __future__ import annotations

from jsonargparse import ArgumentParser

from .args import Parsed, model_source

HELP = "Embeddings of a FASTA's windows, regions, BED intervals or variants (REF and ALT) by a trained model."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome embed",
        description="The hidden states of a trained model at chosen layers for windows of a FASTA: every record, "
        "--regions, a --bed or a --vcf (a REF and an ALT window per ALT allele, centred on the variant), a sequence "
        "longer than --window tiled into consecutive windows, one row each. Pooled per window (mean, centre or "
        "per_base) and written to a safetensors file (a float32 tensor per layer, `lengths`, metadata) with a TSV "
        "index of the rows. Runs in one process or under the deepspeed launcher (batches split over ranks; the same "
        "tensors). Exit status 2 on bad input, with nothing written.",
    )
    model_source(parser)
    parser.add_argument("--fasta", type=str, required=True, help="FASTA to embed (plain or BGZF).")
    parser.add_argument(
        "--regions",
        type=str,
        nargs="*",
        default=[],
        help="Embed only these regions (contig:start-end, 1-based inclusive), in the order given; default: every "
        "record whole.",
    )
    parser.add_argument(
        "--bed",
        type=str | None,
        default=None,
        help="Embed the features of this BED file, one by one in the file's order (overlapping ones too), each named "
        "by its 4th column (else its span).",
    )
    parser.add_argument(
        "--vcf",
        type=str | None,
        default=None,
        help="Embed a REF and an ALT window per ALT allele of this VCF (REF checked against the FASTA; symbolic "
        "ALTs and alleles longer than half the window skipped), as score-variants builds them.",
    )
    parser.add_argument("--output", type=str, required=True, help="Embeddings to write (.safetensors).")
    parser.add_argument(
        "--index", type=str | None, default=None, help="Row index (TSV; default: --output with .safetensors -> .tsv)."
    )
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=[-1],
        help="Layers to write (one forward pass for all): 0 the embedding output, i (1..n_layer) the output of "
        "block i, -1 the final norm's output, which the LM head reads (default). Tensors layer_<i>, final_norm.",
    )
    parser.add_argument(
        "--pool",
        type=str,
        default="mean",
        choices=["mean", "centre", "per_base"],
        help="mean: over the window's bases; centre: the variant's position (VCF), else the window's middle; "
        "per_base: every position, (rows, window, d_model), zero past each row's `lengths`.",
    )
    parser.add_argument(
        "--window",
        type=int | None,
        default=None,
        help="Bases per window (default: the run's training window --data.seq_len; at most the model's context "
        "--model.max_seq_len).",
    )
    parser.add_argument("--batch_size", type=int, default=16, help="Windows per forward pass.")
    parser.add_argument("--dtype", type=str, default="fp32", choices=["fp32", "bf16", "fp16"], help="Inference dtype.")
    parser.add_argument("--overwrite", action="store_true", help="Replace outputs that exist (refused otherwise).")
    parser.add_argument("--progress", type=bool, default=True, help="Show a progress bar (rank 0).")
    return parser


def main(parsed: Parsed) -> int:
    from megagenome.after_training import embedding

    return embedding.main(parsed.ns)
