"""Finished runs for the tests of what comes after training (eval, score-variants, export, distillation), trained
once per session in one 2-rank `deepspeed` launch (support/worker.py), in every checkpoint layout the commands must
read: ZeRO-0 and ZeRO-3 with 2 data-parallel ranks, tensor parallel 2, pipeline parallel 2, and a masked (mlm)
model. Checks that need real collectives after training (inference split over 2 ranks) run in the same launch:
AFTER lists them as worker check scenarios (module:function, run_dir, args).

tests/conftest.py's `trained` fixture starts it; TrainedRuns gives each run's directory.
"""

from __future__ import annotations

import pathlib

from support.helpers import copy_genome
from support.runs import STEPS, Runs, ds, run_worker, scenario

# name -> (ds_config fragments, extra config overrides section__key=value)
LAYOUTS: dict[str, tuple[tuple[str, ...], dict]] = {
    "dense": (("zero0",), {}),
    "zero3": (("zero3",), {}),
    "tp2": (("zero1",), {"parallel__tensor": 2}),
    "pp2": (("zero1",), {"parallel__pipeline": 2, "train__grad_accum_steps": 2, "train__micro_batch_size": 4}),
    "mlm": (("zero0",), {"model__objective": "mlm"}),
}

# Distillation (--train.distill_from) of a smaller student from the "dense" run, trained after LAYOUTS: under every
# ZeRO stage, with alpha 0 (must equal plain training) and without a teacher.
STUDENT = {"model__d_model": 16, "train__distill_alpha": 0.5, "train__distill_temperature": 2.0}
DISTILL: dict[str, tuple[tuple[str, ...], dict]] = {
    **{f"distill_zero{z}": ((f"zero{z}",), {}) for z in range(4)},
    "distill_alpha0": (("zero0",), {"train__distill_alpha": 0.0}),
    "student_plain": (("zero0",), {"train__distill_from": None}),
}

# Check scenarios run after the training ones, in the same 2-rank process group: (name, "module:function", args).
# The run directories of LAYOUTS are passed as args["runs"] = {name: dir}; each check writes into its own run_dir.
AFTER: list[tuple[str, str, dict]] = [
    ("eval_2ranks", "support.eval_checks:eval_two_ranks", {}),
    ("score_2ranks", "support.scoring_checks:score_two_ranks", {}),
    ("init_from_2ranks", "support.export_checks:init_from_two_ranks", {}),
    ("finetune_2ranks", "support.finetune_checks:finetune_two_ranks", {}),
    ("generate_2ranks", "support.generate_checks:generate_two_ranks", {}),
]


def _scenarios(root: pathlib.Path, fasta: str) -> list[dict]:
    out = []
    teacher = {"train__distill_from": str(root / "dense")}
    students = {name: (fragments, {**STUDENT, **teacher, **kw}) for name, (fragments, kw) in DISTILL.items()}
    for name, (fragments, overrides) in {**LAYOUTS, **students}.items():
        sc = scenario(root, fasta, name, ds(*fragments), 4, dropout=0.0)
        for dotted, value in overrides.items():
            section, key = dotted.split("__")
            sc["config"].setdefault(section, {})[key] = value
        out.append(sc)
    runs = {name: str(root / name) for name in LAYOUTS}
    for name, check, args in AFTER:
        args = {"runs": runs, "fasta": fasta, **args}
        out.append({"name": name, "check": check, "run_dir": str(root / name), "args": args})
    return out


class TrainedRuns:
    def __init__(self, root: pathlib.Path, runs: Runs, fasta: str):
        self.root, self.runs, self.fasta = root, runs, fasta

    def run_dir(self, name: str) -> pathlib.Path:
        """The run directory of a finished LAYOUTS run (its final checkpoint is step STEPS); fails with the worker's
        output when the run did not finish."""
        self.runs._final_tag(name)
        return self.root / name

    def check_dir(self, name: str) -> pathlib.Path:
        """The run directory of an AFTER check; fails with the output when a rank's check raised."""
        errors = sorted((self.root / name).glob("error_rank*.txt"))
        assert not errors, self.runs._output_tail(name)
        return self.root / name


def train_all(root: pathlib.Path) -> TrainedRuns:
    fasta = copy_genome("phiX174_NC_001422.1.fna", root / "genome")
    # Eleven tiny runs and the checks: ~1.5 min on 2 idle cores; the limit leaves room for a loaded machine.
    return TrainedRuns(root, run_worker(root, _scenarios(root, fasta), 2, timeout_s=900), fasta)


__all__ = ["AFTER", "DISTILL", "LAYOUTS", "STEPS", "TrainedRuns", "train_all"]
