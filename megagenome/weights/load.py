"""A trained model's weights (layer L3): read whole from a run directory (any checkpoint layout, consolidated by
weights/consolidate.py) or a `megagenome export` directory, built into a dense model, and loaded into a new run's
model (`--model.init_from`, this rank's tensor-parallel shard); a fine-tuning run's task model (load_task_model).

An export directory is marked by its manifest, megagenome.json (EXPORT_MANIFEST); export.py writes it and this
module reads it back, so that inference, export and the assembly of a run all read weights one way.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import replace

import torch

from megagenome.config import ConfigError, ModelConfig, RootConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model import family_of
from megagenome.model.heads import TaskModel
from megagenome.weights import task_weights
from megagenome.weights.consolidate import CheckpointError, check_shapes, run_weights

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EXPORT_MANIFEST = "megagenome.json"  # what marks a `megagenome export` directory
FORMAT = "megagenome-export"
# 2: the manifest's model config names its family (--model.family); a version-1 export is a transformer's.
FORMAT_VERSION = 2
READS_VERSIONS = (1, 2)
WEIGHTS = "model.safetensors"


def read_weights(
    path: str, step: int | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor], str, RootConfig | None]:
    """(model config, dense weights with the model's state-dict keys, the directory read, the run config or None)
    of a run directory (its newest complete checkpoint, or that of `step`) or a `megagenome export` directory. A
    `megagenome finetune` run directory gives its fine-tuned backbone (LoRA merged) at its best step, or `step`,
    and no run config."""
    if os.path.isfile(os.path.join(path, EXPORT_MANIFEST)):
        if step is not None:
            raise CheckpointError(f"{path} is an export directory: it holds one set of weights, --step does not apply")
        model_cfg, state = read_export(path)
        return model_cfg, state, path, None
    if not os.path.isdir(path):
        what = "a file, not a directory" if os.path.exists(path) else "no such directory"
        raise CheckpointError(f"{path}: {what} (give a run directory or a `megagenome export` directory)")
    if task_weights.is_task_run(path):  # a fine-tuning run: its backbone (task_weights.py)
        weights = task_weights.read_task_run(path, step)
        return weights.model_cfg, weights.backbone, weights.tag, None
    cfg, state, tag = run_weights(path, step)
    return cfg.model, state, tag, cfg


def build_model(model_cfg: ModelConfig, state: dict[str, torch.Tensor] | None) -> torch.nn.Module:
    """The model of `model_cfg` (its family's) on CPU holding `state` (fp32 master copies become the parameters'
    fp32); state None: its family's initialisation, drawn from torch's generator as the caller seeded it. Eager: the
    training run's --model.compile is not carried over (windows and batches of any shape would each recompile)."""
    family = family_of(model_cfg)
    if state is None:
        return family.build(replace(model_cfg, compile=False), VOCAB_SIZE)
    with torch.random.fork_rng(devices=[]):
        model = family.build(replace(model_cfg, compile=False), VOCAB_SIZE)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if k not in family.tied_weights(model_cfg)]
    if missing or unexpected:
        raise CheckpointError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    return model


def read_manifest(path: str) -> dict:
    try:
        with open(os.path.join(path, EXPORT_MANIFEST), encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a `megagenome export` directory ({EXPORT_MANIFEST}: {e})") from e
    if manifest.get("format") != FORMAT or manifest.get("format_version") not in READS_VERSIONS:
        versions = " and ".join(str(v) for v in READS_VERSIONS)
        raise CheckpointError(
            f"{path}: {EXPORT_MANIFEST} is format {manifest.get('format')} version {manifest.get('format_version')}, "
            f"this megagenome reads {FORMAT} versions {versions}"
        )
    return manifest


def read_export(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(the model config, the dense weights with the model's state-dict keys, in the stored dtype) of an export
    directory; tied weights are one tensor again (lm_head.weight is embed.weight for a tied transformer)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    manifest = read_manifest(path)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(manifest["model"]) - fields)
    if unknown:
        raise CheckpointError(f"{path}: {EXPORT_MANIFEST} has model fields this megagenome does not know: {unknown}")
    model_cfg = ModelConfig(**manifest["model"])
    try:
        weights = load_file(os.path.join(path, manifest["weights"]))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{path}: cannot read {manifest['weights']}: {e}") from e
    family, form = family_of(model_cfg), None
    if manifest["weight_names"] != "megagenome":
        form = family.huggingface(model_cfg)
        if form is None or form.weight_names != manifest["weight_names"]:
            raise CheckpointError(f"{path}: {manifest['weight_names']} weight names are not a {family.name} model's")
    try:
        state = form.from_hf(weights, VOCAB_SIZE) if form is not None else family.tie(dict(weights), model_cfg)
    except KeyError as e:
        raise CheckpointError(f"{path}: {e.args[0]}") from e
    check_shapes(state, model_cfg, path)
    return model_cfg, state


# ----- --model.init_from ------------------------------------------------------------------------------------------


def init_from(model: torch.nn.Module, run_model: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Load the weights of the export `run_model.init_from` into `model`, this rank's model (its tensor-parallel
    shard when tp_size > 1), before DeepSpeed wraps it. ConfigError when the export cannot be read
    or its model is not this run's shape (naming the tensor); max_seq_len, rope_theta, the rotary scaling, dropout and
    the rest of what no tensor holds may differ (a longer context: README "Context extension")."""
    path = run_model.init_from
    flag = f"--model.init_from={path}"
    try:
        export_cfg, state = read_export(path)
    except CheckpointError as e:
        raise ConfigError([f"{flag}: {e}"]) from e
    family = family_of(run_model)
    expected = family.expected_shapes(run_model, VOCAB_SIZE)
    shape = family_of(export_cfg).describe(export_cfg)
    problems = [
        f"{flag}: tensor {k} is {list(state[k].shape)} in the export ({shape}), this run's model needs {list(want)}"
        for k, want in expected.items()
        if k in state and tuple(state[k].shape) != want
    ]
    problems += [f"{flag}: the export has no tensor {k}, this run's model needs it" for k in expected if k not in state]
    problems += [f"{flag}: the export's tensor {k} is not in this run's model" for k in state if k not in expected]
    if problems:
        raise ConfigError(problems[:3] + ([f"... {len(problems) - 3} more"] if len(problems) > 3 else []))
    local = {k: shard(k, v, tp_rank, tp_size, family) for k, v in state.items()}
    with torch.no_grad():
        model.load_state_dict(local, strict=True)


def shard(name: str, weight: torch.Tensor, rank: int, size: int, family) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s slice of the dense weight `name` (parallel/tensor_parallel.py splits a weight
    into `size` contiguous chunks along the dimension its model family names: model/family.py partition_dim); the
    whole weight when it is replicated."""
    dim = family.partition_dim(name)
    if dim is None or size == 1:
        return weight
    if weight.size(dim) % size:
        raise ConfigError([f"tensor {name} {list(weight.shape)}: dimension {dim} does not split into {size} shards"])
    return weight.chunk(size, dim=dim)[rank]


def load_task_model(path: str, step: int | None = None) -> TaskModel:
    """The task model of a fine-tuning run directory or of its export, on CPU in eval mode (LoRA merged)."""
    from safetensors.torch import load_file

    if task_weights.is_task_run(path):
        weights = task_weights.read_task_run(path, step)
        backbone, head, entry = build_model(weights.model_cfg, weights.backbone), weights.head, weights.record
    else:
        entry = read_manifest(path).get("task")
        if entry is None:
            raise CheckpointError(f"{path}: an export of a pretrained model, not of a fine-tuning run (no task head)")
        model_cfg, state = read_export(path)
        backbone, head = build_model(model_cfg, state), load_file(os.path.join(path, entry["head"]))
    classes, rc = max(len(entry["classes"]), 1), entry.get("rc_average", False)  # absent in exports before it: off
    model = TaskModel(backbone, entry["task"], classes, entry["layer"], entry["pooling"], 0.0, rc)
    model.head.load_state_dict({k: v.float() for k, v in head.items()})
    model.set_target_scale(entry["target_mean"], entry["target_std"])
    return model.eval()
