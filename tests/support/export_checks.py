"""`--model.init_from` under tensor parallelism, run by support/worker.py after the training scenarios of
support/trained.py (a check scenario: every rank calls it in the live 2-rank process group). Rank 0 exports the
"dense" run; then both ranks assemble a tp=2 run (longer context: rotary tables are not saved) from the export, and
each writes <run_dir>/rank<r>.json: whether every tensor of its model shard equals its slice of the export."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megagenome.after_training.export import export
from megagenome.config.load import config_from_dict
from megagenome.model.transformer import TRANSFORMER
from megagenome.run import assembly
from megagenome.weights.load import read_export, shard
from support.helpers import tiny_config


def init_from_two_ranks(run_dir: str, runs: dict, fasta: str) -> None:
    import pathlib

    rank = dist.get_rank()
    out = os.path.join(run_dir, "export")
    if rank == 0:
        export(runs["dense"], out)
    dist.barrier()
    root = pathlib.Path(run_dir)
    cfg = tiny_config(root, fasta, root / "run")
    cfg["model"].update(init_from=out, max_seq_len=256)
    cfg["parallel"] = {"tensor": 2}
    cfg = config_from_dict(cfg)
    validated = assembly.validate(cfg, [], 2)
    try:
        run = assembly.assemble(validated, assembly.start_ranks(cfg, validated.layout))
    finally:
        validated.data.close()
    _, dense = read_export(out)
    tp_rank = run.ranks.state.get_tensor_model_parallel_rank()
    state = run.model.state_dict()
    equal = {
        k: bool(torch.equal(v.detach().cpu(), shard(k, dense[k], tp_rank, 2, TRANSFORMER))) for k, v in state.items()
    }
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump({"tp_rank": tp_rank, "equal": equal, "shapes": {k: list(v.shape) for k, v in state.items()}}, fh)
    dist.barrier()
