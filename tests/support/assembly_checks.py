"""Checks of megagenome/run/assembly.py run inside a worker's process group (a test worker's, not a test).

`from_run_dir_evaluates(run_dir, trained)`: assemble the finished run in `trained` again from its directory
(assembly.from_run_dir: its config.yaml, its newest complete checkpoint) in this world, evaluate its held-out
windows, and write what came out next to what the run itself logged at that step to <run_dir>/rank<r>.json.
"""

from __future__ import annotations

import json
import os

from megagenome.observe.metrics import read_metrics
from megagenome.run import assembly


def from_run_dir_evaluates(run_dir: str, trained: str) -> None:
    run, validated, client = assembly.from_run_dir(trained)
    try:
        found = assembly.evaluate_heldout(run, validated.data)
    finally:
        validated.data.close()
    logged = [r for r in read_metrics(os.path.join(trained, "metrics.jsonl")) if r.get("split") == "val"]
    logged = [r for r in logged if r["step"] == client["step"]]
    os.makedirs(run_dir, exist_ok=True)
    out = {"step": client["step"], "evaluated": found, "logged": logged[-1] if logged else None}
    with open(os.path.join(run_dir, f"rank{run.ranks.rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(out, fh)
