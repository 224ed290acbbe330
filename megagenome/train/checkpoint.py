"""Checkpoint directory policy (layer L3): tags, completion markers, retention, resume lookup.

DeepSpeed writes the model, optimizer and scheduler state of a tag; this module adds what makes a
checkpoint trustworthy for resuming: a COMPLETE marker written only after every rank has finished
writing, per-rank RNG states, and deletion of old checkpoints only once a newer one is complete. A
run killed mid-save therefore leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import os
import re
import shutil

import torch

MARKER = "COMPLETE"
_TAG = re.compile(r"^step_(\d+)$")


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


def save(engine, root: str, step: int, client_state: dict, rank: int, keep_last: int, barrier) -> str:
    """Save a checkpoint for `step` on every rank, then mark it complete and prune old ones (rank 0)."""
    tag = tag_for(step)
    path = os.path.join(root, tag)
    if os.path.exists(os.path.join(path, MARKER)):
        return path  # already saved (e.g. a stop right after a periodic checkpoint)
    engine.save_checkpoint(root, tag=tag, client_state=client_state, save_latest=False)
    torch.save(_rng_state(), os.path.join(path, f"rng_rank{rank:05d}.pt"))
    barrier()
    if rank == 0:
        with open(os.path.join(path, MARKER), "w", encoding="utf-8") as fh:
            fh.write(f"{step}\n")
        for _, old in complete_tags(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return path


def load(engine, path: str, rank: int) -> dict:
    """Restore engine state, this rank's RNG state, and return the client state saved with it."""
    root, tag = os.path.split(path.rstrip("/"))
    loaded, client_state = engine.load_checkpoint(
        root, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if loaded is None:
        raise ValueError(f"DeepSpeed could not load the checkpoint in {path}")
    rng_file = os.path.join(path, f"rng_rank{rank:05d}.pt")
    if os.path.exists(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state or {}


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
