"""`megagenome import` (layer L5): a published checkpoint -> a megagenome export directory
(after_training/importing.py).
"""

from __future__ import annotations

from typing import Literal

from jsonargparse import ArgumentParser

from .args import Parsed

HELP = "Import a published checkpoint (Evo 2, Evo 1, HyenaDNA, Caduceus, GPN, Llama) as a megagenome export."
# model/__init__.py PUBLISHED, not imported here (the parser stays torch-free); tests/test_cli.py checks they agree.
FORMATS = ("evo2", "evo1", "hyenadna", "caduceus", "gpn", "llama")


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome import",
        description="Read a published model's checkpoint in its authors' layout and write a megagenome export "
        "directory (model.safetensors, megagenome.json, a model card, model.yaml): eval, score-variants, embed, "
        "finetune, export and `pretrain --model.init_from DIR` read it. What does not map into a megagenome "
        "family is refused before anything is written, naming the key. An existing --output is refused.",
    )
    parser.add_argument(
        "source",
        type=str,
        help="The checkpoint: a Hugging Face directory (config.json with model.safetensors, sharded safetensors, "
        "pytorch_model.bin or a .ckpt), or one weights file (.safetensors, .pt, .bin, .ckpt) with --source_config.",
    )
    parser.add_argument(
        "--format",
        type=Literal[FORMATS],
        required=True,
        help="The published layout: evo2 (Evo 2's vortex .pt with its YAML config as --source_config), evo1 (Evo 1's "
        "Hugging Face checkpoint or a stripedhyena state dict), hyenadna (the original HyenaDNA: config.json with "
        "its layer section and weights.ckpt), caduceus (Caduceus-Ph's Hugging Face checkpoint), gpn (the gpn "
        "package's GPNForMaskedLM, convnet encoder), llama (a transformers LlamaForCausalLM directory whose "
        "tokenizer has single-base tokens).",
    )
    parser.add_argument("--output", type=str, required=True, help="Export directory to create (must not exist).")
    parser.add_argument(
        "--source_config",
        type=str | None,
        default=None,
        help="The checkpoint's config (JSON or YAML), when SOURCE is a weights file or its config lives elsewhere.",
    )
    parser.add_argument("--dtype", type=Literal["fp32", "bf16"], default="fp32", help="Dtype of model.safetensors.")
    return parser


def main(parsed: Parsed) -> int:
    from megagenome.after_training import importing

    return importing.main(parsed.ns)
