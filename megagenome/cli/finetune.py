"""`megagenome finetune` (layer L5): its flags (config/finetune.py FinetuneConfig); the run is run/finetune.py's."""

from __future__ import annotations

import os
import sys

from jsonargparse import ArgumentParser

from megagenome.config import ConfigError
from megagenome.config.load import config_files, finetune_config, finetune_parser

from .args import Parsed

HELP = "Fine-tune a pretrained model on labelled sequences (classification, regression, per-base)."


def parser() -> ArgumentParser:
    return finetune_parser(
        "megagenome finetune",
        "Fine-tune a pretrained megagenome model (a run or export directory, any family) on labelled sequences: a "
        "sequence classification, sequence regression or per-base classification head, full fine-tuning or LoRA "
        "(peft), on the DeepSpeed engine (ZeRO 0-3, bf16, gradient accumulation, resumable checkpoints), with a "
        "validation split, early stopping and a test evaluation of the best checkpoint. Inputs: a Genomic "
        "Benchmarks directory, or a FASTA with BED files whose label column gives the label. Writes metrics.jsonl "
        "(accuracy, MCC, AUROC / Spearman, Pearson, MSE), TensorBoard, predictions_<split>.tsv and summary.json "
        "into --log.run_dir; `megagenome export` turns the run into a model directory. Exit status 2 on bad input.",
    )


def main(parsed: Parsed) -> int:
    from megagenome.run import finetune

    files = config_files(parsed.ns, parsed.argv)
    try:
        finetune.run(finetune_config(parsed.values), files)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"megagenome finetune: error: {e}", file=sys.stderr)
        return 2
    return 0
