"""One dense state dict from a checkpoint of any layout (layer L3, a DeepSpeed seam): what evaluation, variant scoring
and export load, on one process, without the engine or the world that wrote the checkpoint.

Where the weights are, by layout (the run's config.yaml and ds_config.json say which):

- pipeline stages: the layer files (layer_XX[-model_YY]-model_states.pt), renamed and tensor shards merged
  (engine/pipeline.py dense_state_dict);
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
import sys

import torch

from megagenome.config import ModelConfig, RootConfig
from megagenome.config.load import load_config
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.engine import pipeline, safe_load
from megagenome.engine.ds_config import zero_stage
from megagenome.engine.safe_load import CheckpointError
from megagenome.files.run_files import CHECKPOINTS, CONFIG, DS_CONFIG
from megagenome.model import family_of
from megagenome.parallel.tensor_parallel import merge_shards
from megagenome.weights import checkpoint, integrity

__all__ = ["CheckpointError", "checkpoint_tag", "check_shapes", "dense_state_dict", "module_shards", "run_weights"]


def checkpoint_tag(run_dir: str, step: int | None = None, level: str = "digest") -> str:
    """The newest complete checkpoint of a run directory whose files match their manifest (integrity.verify at
    `level`), or the one of `step`; a clear error when there is none.

    As resume does: each newer checkpoint that fails verification is skipped with a warning (stderr, rank 0) naming
    its bad files and the checkpoint read instead; a `step` named explicitly that fails is refused, nothing else
    tried."""
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isfile(os.path.join(run_dir, CONFIG)):
        raise CheckpointError(f"{run_dir}: not a run directory (no config.yaml)")
    complete = checkpoint.complete_tags(root)
    if step is None:
        candidates = [path for _, path in reversed(complete)]
    else:
        candidates = [path for s, path in complete if s == step]
    if not candidates:
        found = ", ".join(str(s) for s, _ in complete) or "none"
        which = "" if step is None else f" of step {step}"
        raise CheckpointError(f"{run_dir}: no complete checkpoint{which} (complete steps: {found})")
    damaged = []
    for path in candidates:
        problems = integrity.verify(path, level)
        if not problems:
            if int(os.environ.get("RANK", "0")) == 0:
                for line in integrity.resume_warnings(damaged, path):
                    print(f"megagenome: warning: {line.replace('resuming', 'reading it')}", file=sys.stderr)
            return path
        damaged.append((path, problems))
    listing = " | ".join(f"{p}: {'; '.join(problems)}" for p, problems in damaged)
    raise CheckpointError(
        f"{run_dir}: no complete checkpoint{'' if step is None else f' of step {step}'} matches its manifest "
        f"({listing}); restore the damaged files{' or give another --step' if step is not None else ''}"
    )


def run_weights(run_dir: str, step: int | None = None) -> tuple[RootConfig, dict[str, torch.Tensor], str]:
    """(the run's config, its dense weights, the checkpoint directory read) of a run directory's newest complete
    checkpoint that verifies, or the one of `step`."""
    cfg = read_run_config(run_dir)
    tag = checkpoint_tag(run_dir, step, cfg.checkpoint.verify)
    ds_path = os.path.join(run_dir, DS_CONFIG)
    try:
        ds_json = json.load(open(ds_path, encoding="utf-8")) if os.path.exists(ds_path) else {}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ds_path}: not readable as JSON ({e})") from e
    return cfg, dense_state_dict(tag, cfg, ds_json), tag


def read_run_config(run_dir: str) -> RootConfig:
    """A run directory's config.yaml, a CheckpointError naming it when missing or broken (never a traceback)."""
    path = os.path.join(run_dir, CONFIG)
    if not os.path.isfile(path):
        raise CheckpointError(f"{run_dir}: not a run directory (no config.yaml)")
    try:
        return load_config(path)
    except Exception as e:  # jsonargparse's errors have no common base: any failure is a broken file
        first = " ".join(str(e).split())[:400]
        raise CheckpointError(f"{path}: not a readable run config ({first}); restore it from the run's backup or "
                              "give another run directory") from e  # fmt: skip


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

        safe_load.vet(tag)  # zero_to_fp32 unpickles fully: nothing in the directory may name another global
        parent, name = os.path.split(os.path.normpath(tag))
        try:
            return [dict(get_fp32_state_dict_from_zero_checkpoint(parent, name))]
        except Exception as e:  # DeepSpeed's reader: a truncated or inconsistent partition, whatever it raises
            raise CheckpointError(f"{tag}: DeepSpeed's zero_to_fp32 could not read it ({type(e).__name__}: {e})") from e
    files = sorted(glob.glob(os.path.join(tag, "mp_rank_*_model_states.pt")))
    if not files:
        raise CheckpointError(f"{tag}: no mp_rank_*_model_states.pt files")
    return [_module_of(safe_load.load(f), f) for f in files]


def _module_of(state, path: str) -> dict[str, torch.Tensor]:
    if not isinstance(state, dict) or not isinstance(state.get("module"), dict):
        raise CheckpointError(f"{path}: not a DeepSpeed model-states file (no 'module' state dict)")
    return state["module"]


def _universal(tag: str) -> dict[str, torch.Tensor]:
    root = os.path.join(tag, "zero")
    state = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "fp32.pt")
        if os.path.isfile(path):
            loaded = safe_load.load(path)
            if not isinstance(loaded, dict) or "param" not in loaded:
                raise CheckpointError(f"{path}: not a universal checkpoint's parameter file (no 'param')")
            state[name] = loaded["param"]
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
