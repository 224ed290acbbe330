"""The exact dict handed to deepspeed.initialize (layer L2, no deepspeed import): the merged and checked DeepSpeed
JSON (engine/ds_config.py) completed with what the run config owns: batch sizes, clipping, the optimizer
(engine/optimizers.py), the schedule (engine/schedules.py), universal loading and the NVMe path."""

from __future__ import annotations

import json

from megagenome.config.sections import TrainConfig
from megagenome.engine import optimizers
from megagenome.engine.ds_config import scaled_lr
from megagenome.engine.schedules import scheduler_entry
from megagenome.parallel.layout import BatchSizes


def build_ds_config(ds: dict, batch: BatchSizes, train: TrainConfig, universal: bool, on_gpu: bool) -> dict:
    """The exact dict given to deepspeed.initialize: the JSON plus the keys the run config owns (batch sizes from the
    layout, optimizer and schedule from --train.*, checkpoint.load_universal from --checkpoint.universal)."""
    merged = json.loads(json.dumps(ds))  # deep copy; the JSON file's dict is never mutated
    merged.setdefault("steps_per_print", 10**9)  # our loop does the logging
    lr, min_lr = scaled_lr(train, batch.global_batch)
    merged.update(
        {
            "train_micro_batch_size_per_gpu": batch.micro,
            "gradient_accumulation_steps": batch.grad_accum,
            "train_batch_size": batch.global_batch,
            "gradient_clipping": train.grad_clip,
        }
    )
    merged.update(optimizers.ds_entries(ds, train, lr, on_gpu))  # "optimizer", or a client optimizer's keys
    scheduler = scheduler_entry(train, lr, min_lr)  # None: the engine gets a client scheduler (engine/schedules.py)
    if scheduler is not None:
        merged["scheduler"] = scheduler
    if universal:
        merged.setdefault("checkpoint", {})["load_universal"] = True
    if train.nvme_path:
        zero = merged.get("zero_optimization", {})
        for key in ("offload_param", "offload_optimizer"):
            if isinstance(zero.get(key), dict) and zero[key].get("device") == "nvme":
                zero[key]["nvme_path"] = train.nvme_path
    return merged
