"""Checkpoint directory policy (layer L3): tags, completion markers, retention, resume lookup, layouts,
conversion to DeepSpeed's universal format.

DeepSpeed writes the model, optimizer and scheduler state of a tag; this module adds what makes a
checkpoint trustworthy for resuming: a COMPLETE marker written only after every rank has finished
writing, listing every file with its size and SHA-256 (weights/integrity.py), per-rank RNG states, a
client_state.json naming the parallel layout that wrote it, and deletion of old checkpoints only once a newer
one is complete. A run killed mid-save therefore leaves the previous checkpoint as the newest complete one; a
save that fails (a full disk) removes its partial directory and raises SaveError; a resume verifies the
checkpoint against its manifest and falls back, with a warning, to the newest complete one that verifies.

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

from megagenome.engine import safe_load, universal  # universal: a DeepSpeed seam, deepspeed imported inside
from megagenome.files.run_files import CHECKPOINTS, UNIVERSAL
from megagenome.parallel.layout import ParallelLayout
from megagenome.weights import integrity
from megagenome.weights.integrity import MARKER, SaveError, verify
from megagenome.weights.integrity import agree_on_resume as agree_on_resume  # re-exported: part of this interface

INFO = "client_state.json"  # step, samples_consumed, config_hash, train_optimizer, format and the writing layout
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
        what = "a file, not a directory" if os.path.exists(path) else "no such directory"
        raise ValueError(f"--checkpoint.resume={resume}: {what}")
    if os.path.exists(os.path.join(path, MARKER)):
        return path
    inner = latest_complete(path)
    if inner is None:
        raise ValueError(
            f"--checkpoint.resume={resume}: no complete checkpoint there (a complete one is a step_* "
            f"directory holding a {MARKER} marker)"
        )
    return inner


def resolve_verified(resume: str, root: str, level: str = "digest") -> tuple[str | None, list[str]]:
    """resolve_resume, with the checkpoint verified against its manifest (integrity.verify at `level`, "digest" or
    "size"). Returns (the checkpoint directory or None, warnings to print).

    auto (or a directory of checkpoints): the newest complete checkpoint that verifies; each damaged one skipped
    is a warning naming its bad files and the checkpoint fallen back to. ValueError when none verifies. A
    checkpoint named explicitly that fails: ValueError naming its files, no fallback. A checkpoint whose marker
    has no manifest (written by an earlier version) is accepted, with a warning that it is unverifiable."""
    path = resolve_resume(resume, root)
    if path is None:
        return None, []
    explicit = resume not in ("auto", "none") and os.path.exists(os.path.join(os.path.abspath(resume), MARKER))
    candidates = [path] if explicit else [p for _, p in reversed(complete_tags(os.path.dirname(path)))]
    damaged = []
    for candidate in candidates:
        problems = verify(candidate, level)
        if not problems:
            return candidate, integrity.resume_warnings(damaged, candidate)
        damaged.append((candidate, problems))
    listing = " | ".join(f"{p}: {'; '.join(problems)}" for p, problems in damaged)
    if explicit:
        raise ValueError(
            f"--checkpoint.resume={resume}: checkpoint {path} does not match the manifest in its {MARKER} marker "
            f"({'; '.join(damaged[0][1])}). It was named explicitly, so nothing else is tried: restore these "
            "files, or name another checkpoint (--checkpoint.resume auto takes the newest one that verifies)"
        )
    raise ValueError(
        f"--checkpoint.resume={resume}: no complete checkpoint under {os.path.dirname(path)} matches its manifest "
        f"({listing}). Restore the damaged files, or start afresh in a new --log.run_dir"
    )


def save(
    engine, root: str, step: int, client_state: dict, rank: int, keep_last: int, barrier, layout=None, gather=None
) -> str:
    """Save a checkpoint for `step` on every rank, mark it complete with its manifest and prune old ones (rank 0).
    Returns the tag directory.

    layout (a dict of LAYOUT_KEYS) goes into client_state.json with the client state, so a resume under another
    layout is refused before DeepSpeed is asked to load, and convert-checkpoint knows what it converts. gather is an
    all_gather_object-style callable (engine/engine.py all_gather_object) through which the ranks agree on the
    space check and on failures and share the hashing; None: a world of one (with several ranks, only `barrier`
    synchronises them, and a failure on one rank cannot reach the others).

    Before writing, SaveError if the filesystem lacks room for a checkpoint the size of the last complete one.
    A write that fails on any rank (ENOSPC, quota, I/O error) removes the partial tag directory, and only it, and
    raises SaveError on every rank naming the path, the cause and the complete checkpoint that remains."""
    tag = tag_for(step)
    path = os.path.join(root, tag)
    if os.path.exists(os.path.join(path, MARKER)):
        return path  # already saved (e.g. a stop right after a periodic checkpoint)
    share = gather or _local_share(barrier)
    if rank == 0 and os.path.isdir(path):  # an interrupted save of this step (no marker): none of its files count
        shutil.rmtree(path, ignore_errors=True)
    short = integrity.space_shortfall(path, latest_complete(root)) if rank == 0 or gather is None else None
    verdicts = share(short)
    if any(verdicts):
        raise SaveError(next(v for v in verdicts if v))
    info = {**client_state, "format": "deepspeed", "layout": layout}
    _agree_or_abandon(share(_write_tag(engine, root, tag, client_state, rank, info)), path, rank, barrier)
    world = len(verdicts)
    rels = integrity.list_files(path)
    mine = integrity.hash_files(path, rels[rank::world], strict=False) if world > 1 or rank == 0 else {}
    shares = share(mine)
    failure = _mark_complete(path, step, rels, shares, root, keep_last) if rank == 0 else None
    _agree_or_abandon(share(failure), path, rank, barrier)
    return path


def _local_share(barrier):
    """gather's stand-in for a world of one: synchronise through barrier, return [obj]."""

    def share(obj):
        barrier()
        return [obj]

    return share


def _write_tag(engine, root: str, tag: str, client_state: dict, rank: int, info: dict) -> dict | None:
    """This rank's files of the checkpoint: DeepSpeed's, the RNG state, and (rank 0) client_state.json. Returns
    None, or the failure (integrity.write_failure) without raising, so the ranks can agree on it."""
    path = os.path.join(root, tag)
    errors: list[BaseException] = []
    try:
        with integrity.deferred_write_errors(engine, errors):
            engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False)
        if not errors:
            torch.save(_rng_state(), os.path.join(path, f"rng_rank{rank:05d}.pt"))
            if rank == 0:
                _write_json(os.path.join(path, INFO), info)
    except Exception as e:  # any failure is reported on every rank through the next gather
        errors.append(e)
    failure = integrity.write_failure(rank, errors[0], root) if errors else None
    integrity.release(errors)  # closes the partial files now, so that removing them frees their space
    return failure


def _mark_complete(path: str, step: int, rels: list[str], shares: list[dict], root: str, keep_last: int):
    """Rank 0: the manifest from every rank's hashes (what another rank missed hashed here), the COMPLETE marker,
    then retention. Returns None, or the failure (integrity.write_failure)."""
    try:
        files: dict[str, dict] = {}
        for part in shares:
            files.update(part)
        files.update(integrity.hash_files(path, [r for r in rels if r not in files]))
        integrity.write_marker(path, step, files)
    except Exception as e:  # the marker could not be written: the checkpoint is not complete
        return integrity.write_failure(0, e, root)
    for _, old in complete_tags(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return None


def _agree_or_abandon(reports: list, path: str, rank: int, barrier) -> None:
    """After every rank reported (None or a failure): if any failed, rank 0 removes the partial tag directory
    `path` (only it), the ranks wait for that, and each raises the same SaveError."""
    failures = [r for r in reports if r]
    if not failures:
        return
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    barrier()
    raise SaveError(integrity.failure_message(path, failures, latest_complete(os.path.dirname(path))))


def load(engine, path: str, rank: int, restore_rng: bool = True) -> dict:
    """Restore engine state and (with restore_rng) this rank's RNG state; return the client state saved with it.

    Whether DeepSpeed reads `path` as a universal checkpoint is its config's checkpoint.load_universal. A load
    that fails raises ValueError naming `path` and the files that do not match its manifest."""
    root, tag = os.path.split(path.rstrip("/"))
    rng_file = os.path.join(path, f"rng_rank{rank:05d}.pt")
    try:
        safe_load.vet(path)  # DeepSpeed unpickles fully: nothing in the checkpoint may name another global
        loaded, client_state = engine.load_checkpoint(
            root, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if loaded is None:
            raise ValueError("DeepSpeed found nothing to load")
        universal.repair_universal_load(engine, path)
        if restore_rng and os.path.exists(rng_file):
            _set_rng_state(safe_load.load(rng_file))
    except Exception as e:
        raise ValueError(integrity.load_failure(path, e)) from e
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
    out = os.path.join(os.path.dirname(os.path.dirname(path)), UNIVERSAL)  # convert-checkpoint's default
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
        what = "a file, not a directory" if os.path.exists(checkpoint) else "no such directory"
        raise ValueError(f"--checkpoint={checkpoint}: {what}")
    if _TAG.match(os.path.basename(path)):
        if not os.path.exists(os.path.join(path, MARKER)):
            raise ValueError(
                f"--checkpoint={checkpoint} is not a complete checkpoint: it has no {MARKER} marker (its save was "
                "interrupted or is still running); convert a complete one"
            )
        return path
    for root in (os.path.join(path, CHECKPOINTS), path):
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
    out_root = os.path.abspath(output) if output else os.path.join(run_dir, UNIVERSAL)
    final = os.path.join(out_root, tag)
    if os.path.exists(final):
        raise ValueError(f"{final} already exists; remove it or choose another --output (nothing is overwritten)")
    problems = integrity.verify(src)
    if problems:
        raise ValueError(f"{src} does not match its manifest ({'; '.join(problems)}): restore these files or convert "
                         "an earlier checkpoint; nothing was written")  # fmt: skip
    safe_load.vet(src)  # before anything is written: the converter unpickles every file fully
    created = not os.path.exists(out_root)
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
        integrity.write_marker(staged, tag_step(tag), integrity.hash_files(staged, integrity.list_files(staged)))
        os.rename(staged, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created and not os.path.exists(final) and not os.listdir(out_root):
            os.rmdir(out_root)  # a failed conversion leaves no empty --output behind
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
