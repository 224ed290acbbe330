"""A fine-tuning run's weights (layer L3): its task model read back from a checkpoint, LoRA merged, and the head
that an export carries beside the backbone.

A `megagenome finetune` run directory is marked by task.json (files/run_files.py TASK: the task, classes, layer,
pooling, LoRA settings, the regression target's scale and the backbone's ModelConfig). read_task_run rebuilds the
task model from it, loads the checkpoint of the best step (best.json; or --step), whatever its ZeRO stage, folds LoRA's
adapters into the backbone's weights (peft's merge) and returns the plain backbone's state dict, which everything
that reads a pretrained model reads (export, embed, score-variants, eval), and the head's.

An export of a fine-tuning run (after_training/export.py) is a pretrained model's export plus TASK_HEAD (the head's
linear layer) and a "task" entry in megagenome.json; weights.py's load_task_model rebuilds the task model from either.
This module imports nothing of weights.py, which reads a fine-tuning run's backbone through it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from megagenome.config import ModelConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.files.run_files import BEST, DS_CONFIG, SUMMARY, TASK
from megagenome.model import family_of
from megagenome.model import lora as lora_adapters
from megagenome.model.heads import TaskModel
from megagenome.weights import checkpoint
from megagenome.weights.consolidate import CheckpointError, checkpoint_tag, module_shards

TASK_HEAD = "task_head.safetensors"
HEAD_FIELDS = ("task", "classes", "layer", "pooling", "target_mean", "target_std", "metric")


@dataclass
class TaskWeights:
    """A fine-tuning run's weights at one step: the backbone's config and dense state (LoRA merged), the head's."""

    model_cfg: ModelConfig
    backbone: dict[str, torch.Tensor]
    head: dict[str, torch.Tensor]
    record: dict  # task.json
    tag: str  # the checkpoint directory read
    step: int


def is_task_run(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TASK))


def read_record(run_dir: str) -> dict:
    with open(os.path.join(run_dir, TASK), encoding="utf-8") as fh:
        return json.load(fh)


def best_step(run_dir: str) -> int | None:
    """The step best.json names (the best validation evaluation so far), or None before the first evaluation."""
    path = os.path.join(run_dir, BEST)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return int(json.load(fh)["step"])


def empty_task_model(record: dict) -> TaskModel:
    """The task model task.json describes, with LoRA adapters if it was trained with them, weights not loaded."""
    model_cfg = ModelConfig(**record["pretrained"]["model"])
    family = family_of(model_cfg)
    with torch.random.fork_rng(devices=[]):
        backbone = family.build(model_cfg, VOCAB_SIZE)
        classes = max(len(record["classes"]), 1)
        rc = record.get("rc_average", False)  # absent: off (and in runs before it)
        model = TaskModel(backbone, record["task"], classes, record["layer"], record["pooling"], 0.0, rc)
        if record.get("lora"):
            lora = record["lora"]
            model.backbone = lora_adapters.add(backbone, family, lora["r"], lora["alpha"], lora["dropout"])
    model.set_target_scale(record["target_mean"], record["target_std"])
    return model


def read_task_run(run_dir: str, step: int | None = None) -> TaskWeights:
    """The weights of a fine-tuning run at `step` (default: its best step, else its newest checkpoint)."""
    record = read_record(run_dir)
    tag = checkpoint_tag(run_dir, step if step is not None else best_step(run_dir))
    with open(os.path.join(run_dir, DS_CONFIG), encoding="utf-8") as fh:
        ds_json = json.load(fh)
    state = module_shards(tag, ds_json)[0]
    model = empty_task_model(record)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    tied = family_of(ModelConfig(**record["pretrained"]["model"])).tied_weights(model.backbone.cfg)
    missing = [k for k in missing if not any(k.endswith("." + alias) for alias in tied)]  # one tensor, loaded once
    if missing or unexpected:
        raise CheckpointError(f"{tag}: weights do not fit the task model: missing {missing}, unexpected {unexpected}")
    backbone = model.backbone
    if lora_adapters.is_adapted(backbone):
        backbone = lora_adapters.merge(backbone)
    step_read = int(checkpoint.read_info(tag).get("step") or checkpoint.tag_step(os.path.basename(tag)))
    model_cfg = ModelConfig(**record["pretrained"]["model"])
    dense = {k: v.detach().clone() for k, v in backbone.state_dict().items()}
    head = {k: v.detach().clone() for k, v in model.head.state_dict().items()}
    return TaskWeights(model_cfg, dense, head, record, tag, step_read)


def head_manifest(weights: TaskWeights, run_dir: str) -> dict:
    """The "task" entry of an export's megagenome.json: the head's fields, its file, and the run's summary."""
    entry = {k: weights.record[k] for k in HEAD_FIELDS}
    entry["rc_average"] = bool(weights.record.get("rc_average", False))
    entry.update(head=TASK_HEAD, lora_merged=bool(weights.record.get("lora")), step=weights.step)
    summary = os.path.join(run_dir, SUMMARY)
    if os.path.isfile(summary):
        with open(summary, encoding="utf-8") as fh:
            done = json.load(fh)
        entry["results"] = {k: done[k] for k in ("validation", "test") if k in done}
    return entry


def write_head(out_dir: str, weights: TaskWeights, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    head = {k: v.to(dtype).contiguous() for k, v in weights.head.items()}
    save_file(head, os.path.join(out_dir, TASK_HEAD), metadata={"format": "pt"})
