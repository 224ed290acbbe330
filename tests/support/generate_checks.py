"""`megagenome generate` under the launcher (tests/test_generate.py): run in the 2-rank launch of support/trained.py
(its AFTER checks), the samples dealt over the ranks, rank 0 writing them all."""

from __future__ import annotations

import os

from megagenome.after_training.generation import Options, run

SETTINGS = dict(prompt="ACGTACGTTTGACAATTAAT", length=24, num_samples=5, batch_size=2, seed=3, top_p=0.9,
                progress=False)  # fmt: skip


def generate_two_ranks(run_dir: str, runs: dict, fasta: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    out = os.path.join(run_dir, "samples")
    run(Options(run=runs["dense"], output=out + ".fa", scores=out + ".tsv", **SETTINGS))
