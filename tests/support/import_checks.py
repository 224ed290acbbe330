"""What the import tests share (tests/test_import_*.py): continued pretraining from an import, through the real
`megagenome pretrain` (one rank, ZeRO-0, float32, phiX174), and the batch its first step trained on."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import torch

from megagenome.data.dataset import build_genome_data
from support.helpers import cli, copy_genome, run_config, tiny_config, write_yaml


def first_step(imported: str, tmp_path: pathlib.Path, **data) -> tuple[float, dict[str, torch.Tensor]]:
    """(the first step's logged loss, its batch) of `pretrain --config RUN.yaml --config IMPORTED/model.yaml
    --model.init_from IMPORTED`: the line `megagenome import` prints, RUN.yaml the tiny config without a model
    section (data: overrides of its data section). The batch is rebuilt from the same config: the same seeded
    windows, reverse complements and masks."""
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path / "genome")
    run = tiny_config(tmp_path, fasta, tmp_path / "run", train__max_steps=2, train__warmup_steps=1,
                      train__eval_interval=0)  # fmt: skip
    del run["model"]  # the import's model.yaml gives it
    run["data"].update(data)
    argv = ["--config", write_yaml(tmp_path / "run.yaml", run), "--config", os.path.join(imported, "model.yaml"),
            "--model.init_from", imported]  # fmt: skip
    proc = cli("pretrain", *argv, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    first = next(r for r in rows if r.get("step") == 1 and "loss" in r and "split" not in r)
    cfg, _ = run_config(argv)
    with build_genome_data(cfg.data, cfg.model.objective) as genome:
        return first["loss"], genome.train_batch(np.arange(cfg.train.micro_batch_size))
