"""Universal checkpoints (layer L2, a DeepSpeed seam): what DeepSpeed's converter needs to merge tensor-parallel
shards, running its ds_to_universal, and repairing two DeepSpeed 0.19.8 ZeRO-3 universal-load bugs.

Split out of engine/engine.py; used by weights/checkpoint.py (convert_to_universal, load) and engine/engine.py
(initialize records universal_checkpoint_info on the model).
"""

from __future__ import annotations

import os

from megagenome.engine import safe_load


def universal_checkpoint_info(model) -> dict:
    """What DeepSpeed's ds_to_universal needs to merge this model's tensor-parallel shards, saved with every
    checkpoint (DeepSpeed stores the module attribute `universal_checkpoint_info` in mp_rank_XX_model_states.pt).

    Parameters marked `tensor_model_parallel` are concatenated along their `partition_dim`: dim 0 is the converter's
    default, dim 1 (row-parallel: attention proj, MLP w_down) is listed by name; all other parameters (norms) are
    replicated over the tensor-parallel group and listed by name, so the converter keeps one copy. Exact names
    (anchored regular expressions) rather than patterns: every entry matches, as the converter's strict mode wants.
    Without tensor parallelism only the format version is recorded.
    """
    import re

    from deepspeed.checkpoint import constants as C

    info: dict = {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    params = list(model.named_parameters())  # a tied parameter appears once, under its first name
    sharded = {name: p.partition_dim for name, p in params if getattr(p, "tensor_model_parallel", False)}
    if sharded:
        info[C.TP_REPLICATED_PARAMETER_PATTERNS] = [re.escape(n) + "$" for n, _ in params if n not in sharded]
        info[C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] = [re.escape(n) + "$" for n, d in sharded.items() if d == 1]
    return info


def repair_universal_load(engine, tag_dir: str) -> None:
    """After engine.load_checkpoint of the universal checkpoint in tag_dir: undo two faults of DeepSpeed 0.19.8's
    ZeRO-3 universal load (load_hp_checkpoint_state_from_checkpoint_dir_stage3); nothing happens for other loads.

    - It copies optimizer parameter group 0's hyperparameters into every group, so our no-decay group (norm
      weights) resumes with weight decay 0.1. ZeRO 1/2 restore group by group; this does the same for ZeRO-3,
      from the checkpoint's zero/optimizer_state.pt.
    - It gives every group's optimizer state one shared `step` tensor, which torch's AdamW increments in place once
      per group, so the Adam step count (bias correction) runs ahead by a step per group per step. Each state gets
      its own copy.
    Measured without the repair, 2 ranks -> 1 rank, 3 steps after the resume: 2.6e-3 nats of loss and 9e-4 on the
    norm weights. A DeepSpeed that gets both right is left as it was.
    """
    import torch

    if not (engine.load_universal_checkpoint() and engine.zero_optimization_stage() == 3):
        return
    state = safe_load.load(os.path.join(tag_dir, "zero", "optimizer_state.pt"))
    saved = state["optimizer_state_dict"]["param_groups"]
    optimizer = engine.optimizer.optimizer  # the wrapped torch optimizer
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"{tag_dir}: the universal checkpoint has {len(saved)} optimizer parameter groups, the model "
            f"{len(optimizer.param_groups)}; it was written for a different model"
        )
    for group, loaded in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in loaded.items() if k != "params"})
    for param_state in optimizer.state.values():
        if isinstance(param_state.get("step"), torch.Tensor):
            param_state["step"] = param_state["step"].clone()


def _check_tensor_parallel_info(tag_dir: str) -> None:
    """Refuse a tensor-parallel checkpoint that does not say how to merge its shards (one saved before megagenome
    recorded universal_checkpoint_info): the converter would concatenate every shard along dim 0, replicated norm
    weights included, and the result would fail to load deep inside DeepSpeed."""
    import glob

    from deepspeed.checkpoint import constants as C

    files = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))
    if len(files) < 2:
        return  # one model-parallel rank: nothing to merge
    state = safe_load.load(files[0], mmap=True)
    info = state.get(C.UNIVERSAL_CHECKPOINT_INFO) or {}
    if C.TP_REPLICATED_PARAMETER_PATTERNS not in info:
        raise ValueError(
            f"{tag_dir} holds {len(files)} tensor-parallel shards but no record of how to merge them "
            "(universal_checkpoint_info: which weights are replicated, which are split along dim 1); it was saved "
            "before megagenome recorded it and cannot be converted. Resume it with its original layout"
        )


def to_universal(src_tag_dir: str, out_tag_dir: str, workers: int = 1) -> str:
    """Convert the DeepSpeed checkpoint in src_tag_dir (one tag directory) into a universal checkpoint in
    out_tag_dir, with DeepSpeed's own converter (`python -m deepspeed.checkpoint.ds_to_universal`) in a child
    process: its worker pools, memory and prints stay out of this one. Returns the converter's output.

    --inject_missing_state adds the format version to checkpoints saved without universal_checkpoint_info (any
    saved before megagenome recorded it); it never overrides recorded info. DeepSpeed also writes a
    `latest_universal` file into out_tag_dir's parent. Raises RuntimeError with the converter's last output lines,
    ValueError for a tensor-parallel checkpoint without the info its shards need.
    """
    import subprocess
    import sys

    safe_load.vet(src_tag_dir)  # the converter unpickles fully: nothing in the checkpoint may name another global
    _check_tensor_parallel_info(src_tag_dir)
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        src_tag_dir,
        "--output_folder",
        out_tag_dir,
        "--num_extract_workers",
        str(workers),
        "--num_merge_workers",
        str(max(1, workers // 2)),
        "--inject_missing_state",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:  # its last line (the exception, not the child's traceback) and how to see the rest
        last = next((line for line in reversed(output.strip().splitlines()) if line.strip()), "no output")
        raise RuntimeError(
            f"DeepSpeed's ds_to_universal failed (exit {proc.returncode}) on {src_tag_dir}: {last.strip()}. Its whole "
            f"output: python -m deepspeed.checkpoint.ds_to_universal --input_folder {src_tag_dir} --output_folder "
            "/tmp/x --inject_missing_state"
        )
    return output
