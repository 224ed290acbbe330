"""`megagenome export` (layer L5): a run -> model.safetensors and a Hugging Face model directory
(after_training/export.py).
"""

from __future__ import annotations

from typing import Literal

from jsonargparse import ArgumentParser

from .args import Parsed, model_source

HELP = "Consolidate a run into model.safetensors and a Hugging Face model directory."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome export",
        description="Consolidate a run (any checkpoint layout) into a model directory: model.safetensors, "
        "megagenome.json and a model card; for a causal transformer also a Hugging Face LlamaForCausalLM "
        "(config.json, generation_config.json), for the other families a Hugging Face model with its own code "
        "(trust_remote_code), and a single-nucleotide tokenizer (tokenizer.json). An existing --output is "
        "refused. Start a new run from the directory with --model.init_from.",
    )
    model_source(parser)
    parser.add_argument("--output", type=str, required=True, help="Directory to create (must not exist).")
    parser.add_argument("--dtype", type=Literal["fp32", "bf16"], default="fp32", help="Dtype of model.safetensors.")
    parser.add_argument(
        "--format",
        type=str,
        default="megagenome",
        help="megagenome (a megagenome export directory, above), or a published layout that its authors' code "
        "loads (the formats of `megagenome import`: evo2, evo1, hyenadna, caduceus, gpn, llama): their config and "
        "weights files (evo2: config.yml and model.pt; hyenadna: config.json and pytorch_model.bin; the others "
        "config.json and model.safetensors).",
    )
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


def main(parsed: Parsed) -> int:
    from megagenome.after_training import export

    return export.main(parsed.ns)
