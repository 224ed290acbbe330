"""Check scenarios of tests/test_lose_nothing.py, run by support/worker.py between training scenarios, in the same
process group (every rank calls them; rank 0 acts, all ranks wait for it)."""

from __future__ import annotations

import os
import shutil

from megagenome.engine import engine


def corrupt_newest(run_dir: str) -> None:
    """Keep the run's metrics as they were (metrics.uninterrupted.jsonl), then truncate rank 0's model-state file of
    its newest checkpoint to half its size, as a crash of the filesystem under a finished save would."""
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.copy(os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "metrics.uninterrupted.jsonl"))
        root = os.path.join(run_dir, "checkpoints")
        newest = sorted(n for n in os.listdir(root) if n.startswith("step_"))[-1]
        target = os.path.join(root, newest, "mp_rank_00_model_states.pt")
        size = os.path.getsize(target)
        with open(target, "r+b") as fh:
            fh.truncate(size // 2)
    engine.barrier()
