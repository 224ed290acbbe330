"""Checkpoint directory policy (layer L3): tags, completion markers, retention, resume lookup, layouts,
conversion to DeepSpeed's universal format.

DeepSpeed writes the model, optimizer and scheduler state of a tag; this module adds what makes a
checkpoint trustworthy for resuming: a COMPLETE marker written only after every rank has finished
writing, per-rank RNG states, a client_state.json naming the parallel layout that wrote it, and deletion
of old checkpoints only once a newer one is complete. A run killed mid-save therefore leaves the previous
checkpoint as the newest complete one.

A checkpoint resumes as is only under the layout that wrote it (DeepSpeed cannot re-partition ZeRO state);
`convert_to_universal` turns it into a universal checkpoint, which resumes under any data-parallel size and
tensor-parallel degree with --checkpoint.universal true.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

import torch

from megagenome.parallel.layout import ParallelLayout
from megagenome.train import universal  # a DeepSpeed seam: it imports deepspeed inside its functions

MARKER = "COMPLETE"
INFO = "client_state.json"  # step, samples_consumed, config_hash, format and the layout that wrote the checkpoint
UNIVERSAL_ROOT = "checkpoints_universal"  # convert-checkpoint's default output, beside <run dir>/checkpoints
_TAG = re.compile(r"^step_(\d+)$")
_ZERO_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
LAYOUT_KEYS = tuple(ParallelLayout(1).record())  # world_size, tensor, pipeline, sequence, data_parallel, zero_stage


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def complete_tags(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _TAG.match(name)
        path = os.path.join(root, name)
        if m and os.path.exists(os.path.join(path, MARKER)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_complete(root: str) -> str | None:
    tags = complete_tags(root)
    return tags[-1][1] if tags else None


def has_any_checkpoint(root: str) -> bool:
    return os.path.isdir(root) and any(_TAG.match(n) for n in os.listdir(root))


def resolve_resume(resume: str, root: str) -> str | None:
    """The checkpoint directory to load, or None to start fresh. Raises ValueError naming the flag."""
    if resume == "none":
        if has_any_checkpoint(root):
            raise ValueError(
                f"--checkpoint.resume=none but {root} already holds checkpoints; resume with "
                "--checkpoint.resume auto or choose a new --log.run_dir (nothing is overwritten)"
            )
        return None
    if resume == "auto":
        return latest_complete(root)
    path = os.path.abspath(resume)
    if not os.path.isdir(path):
        raise ValueError(f"--checkpoint.resume={resume}: no such directory")
    if os.path.exists(os.path.join(path, MARKER)):
        return path
    inner = latest_complete(path)
    if inner is None:
        raise ValueError(
            f"--checkpoint.resume={resume}: no complete checkpoint there (a complete one is a step_* "
            f"directory holding a {MARKER} marker)"
        )
    return inner


def save(
    engine, root: str, step: int, client_state: dict, rank: int, keep_last: int, barrier, layout: dict | None = None
) -> str:
    """Save a checkpoint for `step` on every rank, then mark it complete and prune old ones (rank 0).

    layout (LAYOUT_KEYS) goes into client_state.json with the client state, so a resume under another layout
    is refused before DeepSpeed is asked to load, and convert-checkpoint knows what it converts."""
    tag = tag_for(step)
    path = os.path.join(root, tag)
    if os.path.exists(os.path.join(path, MARKER)):
        return path  # already saved (e.g. a stop right after a periodic checkpoint)
    engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False)
    torch.save(_rng_state(), os.path.join(path, f"rng_rank{rank:05d}.pt"))
    barrier()
    if rank == 0:
        info = {**client_state, "format": "deepspeed", "layout": layout}
        _write_json(os.path.join(path, INFO), info)
        with open(os.path.join(path, MARKER), "w", encoding="utf-8") as fh:
            fh.write(f"{step}\n")
        for _, old in complete_tags(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return path


def load(engine, path: str, rank: int, restore_rng: bool = True) -> dict:
    """Restore engine state and (with restore_rng) this rank's RNG state; return the client state saved with it.

    Whether DeepSpeed reads `path` as a universal checkpoint is its config's checkpoint.load_universal."""
    root, tag = os.path.split(path.rstrip("/"))
    loaded, client_state = engine.load_checkpoint(
        root, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if loaded is None:
        raise ValueError(f"DeepSpeed could not load the checkpoint in {path}")
    universal.repair_universal_load(engine, path)
    rng_file = os.path.join(path, f"rng_rank{rank:05d}.pt")
    if restore_rng and os.path.exists(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state or {}


# ----- layouts -----------------------------------------------------------------------------------------------


def is_universal(path: str) -> bool:
    """Whether the tag directory `path` holds a universal checkpoint (DeepSpeed's zero/<param>/ layout)."""
    return os.path.isdir(os.path.join(path, "zero")) and not glob.glob(os.path.join(path, "*optim_states.pt"))


def read_info(path: str) -> dict:
    """client_state.json of the tag directory `path`; for a checkpoint saved before megagenome wrote one, what the
    file names tell: the format, and the number of ZeRO partitions as layout["zero_partitions"]."""
    try:
        with open(os.path.join(path, INFO), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        pass
    shards = [_ZERO_SHARD.match(os.path.basename(f)) for f in glob.glob(os.path.join(path, "*optim_states.pt"))]
    partitions = len({m.group(1) for m in shards if m})
    return {"format": "universal" if is_universal(path) else "deepspeed", "layout": {"zero_partitions": partitions}}


def describe(layout: dict) -> str:
    """'2 ranks (tensor 1 x pipeline 1 x sequence 1 x data 2, ZeRO stage 1)'."""
    if "world_size" not in layout:
        return f"{layout.get('zero_partitions', '?')} ZeRO partition(s)"
    return ParallelLayout.from_record(layout).describe()


def _partitions(layout: dict) -> int:
    """How many ways ZeRO split the optimizer state: over sequence x data parallelism (0 at stage 0)."""
    if "world_size" not in layout:
        return layout.get("zero_partitions", 0)
    return layout["sequence"] * layout["data_parallel"] if layout["zero_stage"] > 0 else 0


def same_layout(a: dict | None, b: dict | None) -> bool:
    return bool(a) and bool(b) and all(a.get(k) == b.get(k) for k in LAYOUT_KEYS)


def rng_applies(path: str, current: dict) -> bool:
    """Whether the per-rank RNG files of the checkpoint in `path` belong to the ranks of a run with layout
    `current`: only under the layout that saved them (at another one, rank r's file was drawn for another share of
    the batch, or does not exist). A checkpoint saved before client_state.json recorded layouts: assumed so."""
    saved = read_info(path).get("layout") or {}
    return "world_size" not in saved or same_layout(saved, current)


def resume_problems(path: str, current: dict, universal: bool, global_batch: int | None = None) -> list[str]:
    """Why the checkpoint in `path` cannot be resumed by a run with layout `current` (LAYOUT_KEYS), global batch
    `global_batch` and --checkpoint.universal=`universal`; empty when it can. Checked before any process group
    exists, so a layout change is reported by megagenome, naming the way out, rather than by DeepSpeed half-way
    through loading."""
    info = read_info(path)
    saved = info.get("layout") or {}
    step, samples = info.get("step"), info.get("samples_consumed")
    batch = []
    if global_batch and step and samples is not None and samples != step * global_batch:
        batch.append(
            f"checkpoint {path} was trained with a global batch of {samples // step} ({samples} samples in {step} "
            f"steps); this run's is {global_batch}. The data cursor and the schedule assume one global batch: keep "
            f"it (--train.micro_batch_size x --train.grad_accum_steps x data-parallel size = {samples // step})"
        )
    return batch + _layout_problems(path, saved, current, universal)


def _layout_problems(path: str, saved: dict, current: dict, universal: bool) -> list[str]:
    if is_universal(path):
        if not universal:
            return [
                f"--checkpoint.resume={path} is a universal checkpoint (written by megagenome convert-checkpoint): "
                "add --checkpoint.universal true to load it"
            ]
        problems = []
        if current["pipeline"] > 1:
            problems.append(
                f"--checkpoint.universal: DeepSpeed cannot load a universal checkpoint into pipeline stages "
                f"(--parallel.pipeline={current['pipeline']}); resume with --parallel.pipeline 1"
            )
        if current["zero_stage"] == 0:
            problems.append(
                "--checkpoint.universal: DeepSpeed loads a universal checkpoint only into a ZeRO optimizer; use a "
                "DeepSpeed JSON with zero_optimization.stage 1, 2 or 3 (e.g. ds_configs/zero1.json)"
            )
        return problems
    if universal:
        return [
            f"--checkpoint.universal true but {path} is not a universal checkpoint: convert it first with "
            f"`megagenome convert-checkpoint --checkpoint {path}` and resume from the converted one, or drop "
            "--checkpoint.universal to resume it under the layout that wrote it"
        ]
    model_parallel_changed = "world_size" in saved and (
        saved["tensor"] != current["tensor"] or saved["pipeline"] != current["pipeline"]
    )
    partitions = _partitions(saved)
    zero_changed = partitions > 0 and partitions != current["sequence"] * current["data_parallel"]
    if not (model_parallel_changed or zero_changed):
        return []
    out = os.path.join(os.path.dirname(os.path.dirname(path)), UNIVERSAL_ROOT)  # convert-checkpoint's default
    how = (
        f"convert it first: `megagenome convert-checkpoint --checkpoint {path}`, then resume with "
        f"--checkpoint.resume {out} --checkpoint.universal true"
    )
    if saved.get("pipeline", 1) > 1 or current["pipeline"] > 1:
        how = "pipeline-parallel checkpoints cannot be converted to another layout; resume with the original layout"
    elif saved.get("zero_stage") == 0:
        how = (
            "a ZeRO stage 0 checkpoint cannot be converted (DeepSpeed's converter reads ZeRO 1-3 checkpoints only); "
            "resume with its tensor and pipeline degrees (its data-parallel size may change)"
        )
    return [
        f"checkpoint {path} was saved by {describe(saved)}; this run has {describe(current)}. DeepSpeed resumes a "
        f"checkpoint only under the layout that wrote it (it cannot re-partition ZeRO or tensor-parallel state): {how}"
    ]


# ----- conversion --------------------------------------------------------------------------------------------


def resolve_source(checkpoint: str) -> str:
    """The tag directory that `convert-checkpoint --checkpoint` names: a step_* directory, a checkpoints root or a
    run directory (its checkpoints/); the newest complete one of the latter two. Raises ValueError saying why not."""
    path = os.path.abspath(checkpoint)
    if not os.path.isdir(path):
        raise ValueError(f"--checkpoint={checkpoint}: no such directory")
    if _TAG.match(os.path.basename(path)):
        if not os.path.exists(os.path.join(path, MARKER)):
            raise ValueError(
                f"--checkpoint={checkpoint} is not a complete checkpoint: it has no {MARKER} marker (its save was "
                "interrupted or is still running); convert a complete one"
            )
        return path
    for root in (os.path.join(path, "checkpoints"), path):
        found = latest_complete(root)
        if found is not None:
            return found
    raise ValueError(
        f"--checkpoint={checkpoint}: no complete checkpoint there (a complete one is a step_* directory holding a "
        f"{MARKER} marker, in <run dir>/checkpoints/)"
    )


def convert_to_universal(checkpoint: str, output: str | None = None, workers: int = 1) -> str:
    """Convert the checkpoint that `checkpoint` names (see resolve_source) into a universal checkpoint, written as
    <output>/step_XXXXXXXX (default output: <run dir>/checkpoints_universal); returns that directory.

    The source is only read. The conversion runs in a hidden temporary directory beside the result; the client
    state (step, samples_consumed, config_hash), client_state.json (format "universal", the source's layout and
    path) and the source's per-rank RNG files are added, the COMPLETE marker is written last, and one rename
    publishes the directory: an interrupted conversion leaves no step_* directory behind.
    """
    src = resolve_source(checkpoint)
    info = read_info(src)
    layout = info.get("layout") or {}
    if is_universal(src):
        raise ValueError(f"{src} is already a universal checkpoint: resume from it with --checkpoint.universal true")
    if layout.get("pipeline", 1) > 1:
        raise ValueError(
            f"{src} was saved with pipeline parallelism ({describe(layout)}): megagenome does not convert pipeline "
            "checkpoints (their per-layer files name parameters by stage layer, not as the dense model does); "
            "resume it with the original layout"
        )
    if not glob.glob(os.path.join(src, "*optim_states.pt")):
        raise ValueError(
            f"{src} holds no ZeRO optimizer shards (ZeRO stage 0), and DeepSpeed's converter reads ZeRO stage 1-3 "
            "checkpoints only. A ZeRO stage 0 checkpoint needs no conversion to resume at another data-parallel "
            "size; its tensor and pipeline degrees cannot change"
        )
    tag = os.path.basename(src)
    run_dir = os.path.dirname(os.path.dirname(src))  # src is <run dir>/checkpoints/step_X
    out_root = os.path.abspath(output) if output else os.path.join(run_dir, UNIVERSAL_ROOT)
    final = os.path.join(out_root, tag)
    if os.path.exists(final):
        raise ValueError(f"{final} already exists; remove it or choose another --output (nothing is overwritten)")
    os.makedirs(out_root, exist_ok=True)
    work = os.path.join(out_root, f".{tag}.converting-{os.getpid()}")
    staged = os.path.join(work, tag)  # DeepSpeed writes `latest_universal` into work/, which is then removed
    try:
        universal.to_universal(src, staged, workers=workers)
        for rng in glob.glob(os.path.join(src, "rng_rank*.pt")):
            shutil.copy2(rng, staged)
        out_info = {k: v for k, v in info.items() if k not in ("format", "layout")}
        out_info.update({"format": "universal", "layout": layout, "converted_from": src})
        _write_json(os.path.join(staged, INFO), out_info)
        with open(os.path.join(staged, MARKER), "w", encoding="utf-8") as fh:
            fh.write(f"{tag_step(tag)}\n")
        os.rename(staged, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def tag_step(tag: str) -> int:
    m = _TAG.match(tag)
    if not m:
        raise ValueError(f"{tag!r} is not a step_XXXXXXXX tag")
    return int(m.group(1))


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(value, fh, indent=2, sort_keys=True)
        fh.write("\n")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
