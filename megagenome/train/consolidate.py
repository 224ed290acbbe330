"""One dense state dict from a checkpoint of any layout (layer L3, a DeepSpeed seam): what evaluation, variant scoring
and export load, on one process, without the engine or the world that wrote the checkpoint.

Where the weights are, by layout (the run's config.yaml and ds_config.json say which):

- pipeline stages: the layer files (layer_XX[-model_YY]-model_states.pt), renamed and tensor shards merged
  (parallel/pipeline.py dense_state_dict);
- ZeRO-3: the parameters live only in the optimizer partitions; DeepSpeed's zero_to_fp32 gathers the fp32 master
  weights;
- ZeRO 0-2, any tensor-parallel degree, sequence parallel: mp_rank_XX_model_states.pt (one per tensor rank, written
  by data-parallel rank 0) holds the module's weights in the run's dtype, the ones its forward used; tensor shards
  are concatenated along their family's split dimension (parallel/tensor_parallel.py merge_shards);
- universal checkpoints (`megagenome convert-checkpoint`): zero/<parameter>/fp32.pt, already merged.

The result has the model's state-dict keys (its family's tied aliases restored: lm_head.weight is embed.weight for a
tied transformer) and is checked against the shapes the run config's model has (the family's expected_shapes): a
checkpoint of another model is refused naming the first tensor that differs.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from megagenome.config import ModelConfig, RootConfig
from megagenome.config.load import load_config
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model import family_of
from megagenome.parallel import pipeline
from megagenome.parallel.tensor_parallel import merge_shards
from megagenome.train import checkpoint
from megagenome.train.ds_config import zero_stage


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model its run config describes."""


def checkpoint_tag(run_dir: str, step: int | None = None) -> str:
    """The newest complete checkpoint of a run directory, or the one of `step`; a clear error when there is none."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isfile(os.path.join(run_dir, "config.yaml")):
        raise CheckpointError(f"{run_dir}: not a run directory (no config.yaml)")
    path = checkpoint.latest_complete(root) if step is None else os.path.join(root, checkpoint.tag_for(step))
    if path is None or not os.path.exists(os.path.join(path, checkpoint.MARKER)):
        found = ", ".join(str(s) for s, _ in checkpoint.complete_tags(root)) or "none"
        which = "" if step is None else f" of step {step}"
        raise CheckpointError(f"{run_dir}: no complete checkpoint{which} (complete steps: {found})")
    return path


def run_weights(run_dir: str, step: int | None = None) -> tuple[RootConfig, dict[str, torch.Tensor], str]:
    """(the run's config, its dense weights, the checkpoint directory read) of a run directory's newest complete
    checkpoint or the one of `step`."""
    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    tag = checkpoint_tag(run_dir, step)
    ds_path = os.path.join(run_dir, "ds_config.json")
    ds_json = json.load(open(ds_path, encoding="utf-8")) if os.path.exists(ds_path) else {}
    return cfg, dense_state_dict(tag, cfg, ds_json), tag


def dense_state_dict(tag: str, cfg: RootConfig, ds_json: dict) -> dict[str, torch.Tensor]:
    """The model's dense state dict (on CPU, in the dtype the checkpoint holds) from the checkpoint directory `tag`
    written under cfg's layout and the DeepSpeed dict ds_json (the run's ds_config.json)."""
    if checkpoint.is_universal(tag):
        state = _universal(tag)
    elif cfg.parallel.pipeline > 1:
        state = pipeline.dense_state_dict(tag, cfg.model)
    else:
        shards = module_shards(tag, ds_json)
        state = shards[0] if len(shards) == 1 else merge_shards(shards, family_of(cfg.model).partition_dim)
    state = family_of(cfg.model).tie(state, cfg.model)
    state = {k: v.detach().contiguous() for k, v in state.items()}
    check_shapes(state, cfg.model, tag)
    return state


def module_shards(tag: str, ds_json: dict) -> list[dict[str, torch.Tensor]]:
    """The engine module's state dict of a ZeRO 0-3 checkpoint directory `tag` written without pipeline
    parallelism, one per tensor-parallel rank (ZeRO-3: one, the fp32 master weights gathered by DeepSpeed's
    zero_to_fp32, frozen parameters included); any module, whatever its keys (a fine-tuning run's task model too)."""
    if zero_stage(ds_json) == 3:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        parent, name = os.path.split(os.path.normpath(tag))
        return [dict(get_fp32_state_dict_from_zero_checkpoint(parent, name))]
    files = sorted(glob.glob(os.path.join(tag, "mp_rank_*_model_states.pt")))
    if not files:
        raise CheckpointError(f"{tag}: no mp_rank_*_model_states.pt files")
    return [torch.load(f, map_location="cpu", weights_only=False)["module"] for f in files]


def _universal(tag: str) -> dict[str, torch.Tensor]:
    root = os.path.join(tag, "zero")
    state = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "fp32.pt")
        if os.path.isfile(path):
            state[name] = torch.load(path, map_location="cpu", weights_only=False)["param"]
    return state


def check_shapes(state: dict[str, torch.Tensor], model: ModelConfig, source: str) -> None:
    """Refuse weights that are not the model `model` describes: missing or extra tensors, or another shape."""
    expected = family_of(model).expected_shapes(model, VOCAB_SIZE)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = [(k, tuple(state[k].shape), want) for k, want in expected.items() if k in state and state[k].shape != want]
    if missing or extra or wrong:
        parts = []
        if wrong:
            k, got, want = wrong[0]
            parts.append(f"{k} has shape {list(got)}, the config's model needs {list(want)}")
        if missing:
            parts.append(f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        if extra:
            parts.append(f"unexpected {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}")
        raise CheckpointError(
            f"{source}: these weights are not the model of its config ({'; '.join(parts)}); was it written with "
            "another --model.* shape?"
        )
