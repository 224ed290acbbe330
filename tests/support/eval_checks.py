"""`megagenome eval` under 2 ranks, run by support/worker.py after the training scenarios of support/trained.py (a
check scenario: every rank calls it in the live process group). Rank 0 writes each result to
<run_dir>/<name>.json; tests/test_evaluate.py compares them with one process's."""

from __future__ import annotations

import json
import os

from megagenome.after_training.evaluate import evaluate
from megagenome.after_training.inference import load_model

# (name, run, evaluate kwargs): batch size 3 makes batches that do not divide evenly over the ranks.
CASES = [
    ("dense", "dense", {"window": 50, "batch_size": 3, "rc": False}),
    ("dense_rc", "dense", {"window": 128, "batch_size": 3, "rc": True}),
    ("mlm", "mlm", {"window": 40, "batch_size": 3, "rc": False}),
]


def eval_two_ranks(run_dir: str, runs: dict, fasta: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    for name, run, kw in CASES:
        result = evaluate(load_model(runs[run]), fasta, [], progress=False, **kw)
        if result is not None:
            result["run"].pop("seconds"), result["run"].pop("bases_per_s")
            with open(os.path.join(run_dir, f"{name}.json"), "w", encoding="utf-8") as fh:
                json.dump(result, fh)
