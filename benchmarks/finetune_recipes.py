"""Fine-tuning recipes side by side (issue 43): does `megagenome finetune` learn more than k-mer counts?

Each arm is one `megagenome finetune` of the default job's model (`bash launch/local.sh --config configs/tiny.yaml`:
runs/tiny, StripedHyena 2, 600 steps on E. coli) with its own flags on top of the command's defaults, on 1 rank;
`default` adds none. Every run's summary.json carries its k-mer baseline (run/task_baseline.py: composition into
logistic regression, chosen on validation, scored on the same test windows), so each row shows the model's test MCC
beside the baseline's on the same split.

Tasks (Genomic Benchmarks folders written by megagenome.data.species_task; on every contig the last 20% is the test
region and no window crosses into it; validation is a stratified 10% of the training windows):
  two_species   E. coli K-12 against S. aureus NCTC 8325 (the first is the model's pretraining genome, whose test
                region holds its held-out range), 512-base windows, 400 training and 100 test windows per class
  species       benchmarks/species_task.py's four species (E. coli, S. aureus, S. cerevisiae, phage lambda),
                256-base windows, 400 and 100 per class
  two_species_held_out  as two_species with the test region the last 5% of each genome: every E. coli test window
                lies inside the default job's held-out range, so the model never saw a test base; 250 test per class
The tasks with a 20% test region hold E. coli test windows that the model saw in pretraining (unlabelled); the
results say how many, and give each class's test windows right, model against baseline, to show where a margin
comes from. Each margin has a paired bootstrap 95% interval over the test windows (from predictions_test.tsv).

Arms (ARMS): `default` adds no flag (lr a quarter of the pretraining run's peak, reverse complements at 0.5 and
evaluation on both strands, the head's layer and pooling chosen by linear probes on validation); head_x10 and
layer_decay_0.8 add one learning-rate scale to it (the head's, layer-wise decay); `scratch` is the same from random
weights (--model.init random), the control that shows what pretraining bought; default_seed_N repeat the default
under other seeds of the validation split, the training order and the head (the k-mer baseline is refitted on each
split). The others change one thing at a time, most with the head on the final norm, mean pooled (FIXED): the
probes' choice against none, evaluation on one strand, no reverse complements, lower learning rates (lr_1e-4 is the
recipe before the defaults changed), the controls under the same flags, last-base pooling and a linear probe of the
frozen backbone.

Designed to finish in pieces: an invocation starts no arm after --budget_minutes (default 40; an arm takes 3-12 min
on 2 cores), and benchmarks/results/finetune_recipes.{json,md} are rewritten after every arm, keeping the arms that
earlier invocations measured (with the same --model): committing them carries the figures to the next session. An arm
whose run directory under --work holds a summary.json is read, not run again.

    python benchmarks/finetune_recipes.py [--model runs/tiny] [--tasks two_species species] [--arms default ...]
        [--work /tmp/finetune_recipes] [--budget_minutes 40] [--render_only]
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import harness

from megagenome.files.digest import sha256_file

GENOMES = {
    "ecoli": "examples/data/ecoli_K12_MG1655_NC_000913.2.fa.bgz",
    "saureus": "tests/data/saureus_NCTC8325_NC_007795.1.fasta.gz",
    "scerevisiae": "tests/data/scerevisiae_S288C_ASM205763v1.fa.bgz",
    "lambda": "tests/data/lambda_NC_001416.1.fa.gz",
}
TASKS = {  # name: (species, window, training windows per class, test windows per class, test fraction)
    "two_species": (("ecoli", "saureus"), 512, 400, 100, 0.2),
    "species": (("ecoli", "saureus", "scerevisiae", "lambda"), 256, 400, 100, 0.2),
    # Test windows only from the last 5% of each genome: E. coli's lie inside the default job's held-out range
    # (K-12-MG1655:4400001-4639675), so no test base was in the model's pretraining; 250 per class for resolution.
    "two_species_held_out": (("ecoli", "saureus"), 512, 400, 250, 0.05),
}
BOOTSTRAP = 2000  # resamples of the test windows for the margin's paired 95% interval (numpy default_rng(0))
FIXED = ["--model.layer", "-1", "--model.pooling", "mean"]  # the head input of every run before the probes chose it
NO_RC = ["--data.rc_prob", "0"]
ARMS = {  # name: flags on top of `megagenome finetune`'s defaults (module docstring)
    "default": [],
    "default_seed_2": ["--train.seed", "2", "--data.seed", "2"],  # another validation split, order and head draw
    "default_seed_3": ["--train.seed", "3", "--data.seed", "3"],
    "scratch": ["--model.init", "random"],
    "final_mean": FIXED,
    "one_strand_eval": ["--model.rc_average", "false"],
    "final_mean_one_strand_eval": ["--model.rc_average", "false", *FIXED],
    "no_rc": [*NO_RC, *FIXED],
    "head_x10": ["--train.head_lr_scale", "10"],  # the head at 10x the backbone's rate
    "layer_decay_0.8": ["--train.layer_lr_decay", "0.8"],  # block i of n at 0.8^(n - i) of the rate
    "lr_3e-4": ["--train.lr", "3e-4", *FIXED],
    "lr_1e-4": ["--train.lr", "1e-4", *NO_RC, *FIXED],  # the defaults before this benchmark chose them
    "scratch_final_mean": ["--model.init", "random", *FIXED],
    "scratch_no_rc": ["--model.init", "random", *NO_RC, *FIXED],
    "scratch_lr_1e-4": ["--model.init", "random", "--train.lr", "1e-4", *NO_RC, *FIXED],
    "pool_last": ["--model.layer", "-1", "--model.pooling", "last"],
    "probe": ["--model.freeze_backbone", "true", "--train.lr", "1e-2"],
}
OUT = harness.RESULTS / "finetune_recipes"


def model_identity(model: str) -> dict:
    """What tells one pretrained model from another at the same path (a run retrained on another machine differs in
    its last digits): its held-out bits/base and step (a run directory) or its weights file's sha256 (an export
    directory). Earlier arms are kept only for the same identity."""
    summary = os.path.join(model, "summary.json")
    if os.path.exists(summary):
        with open(summary, encoding="utf-8") as fh:
            s = json.load(fh)
        return {"steps": s.get("steps"), "heldout_bits_per_base": s.get("heldout_bits_per_base")}
    return {"export": sha256_file(os.path.join(model, "model.safetensors"))}


def kept(previous: dict | None, model: str, identity: dict) -> dict:
    """The arms an earlier invocation measured on this very model (its path and identity), else none."""
    same = previous and previous.get("model") == model and previous.get("model_identity") == identity
    return previous["results"] if same else {}


def build_task(name: str, work: str) -> str:
    """The task's folder under work (written once; its manifest names every window)."""
    from megagenome.data.species_task import build_species_task

    path = os.path.join(work, "tasks", name)
    if not os.path.exists(os.path.join(path, "manifest.json")):
        species, window, train, test, fraction = TASKS[name]
        genomes = {s: str(harness.REPO / GENOMES[s]) for s in species}
        build_species_task(genomes, path, window, train, test, test_fraction=fraction)
    return path


def pretraining_overlap(model: str, task_dir: str) -> dict | None:
    """How many of the task's test windows from the model's pretraining genome lie wholly inside its held-out
    ranges (the rest were in its pretraining data): {"species", "test_windows", "in_held_out"}, or None where the
    model is not a run directory or pretrained on none of the task's genomes."""
    import yaml

    from megagenome.config.sections import parse_region

    config = os.path.join(model, "config.yaml")
    if not os.path.exists(config):
        return None
    with open(config, encoding="utf-8") as fh:
        data = yaml.safe_load(fh).get("data", {})
    with open(os.path.join(task_dir, "manifest.json"), encoding="utf-8") as fh:
        manifest = json.load(fh)
    fasta = os.path.join(harness.REPO, data.get("fasta") or "")
    if not os.path.isfile(fasta):
        return None
    digest = sha256_file(fasta)  # the task may have been built from another checkout's copy of the genome
    species = [s for s, g in manifest["genomes"].items() if g["sha256"] == digest]
    if not species:
        return None
    held_out = [parse_region(r) for r in data.get("val_ranges") or []]
    tests = [w for w in manifest["windows"] if w["species"] == species[0] and w["split"] == "test"]
    inside = sum(any(w["contig"] == r.contig and r.start < w["start"] and w["end"] <= r.end for r in held_out)
                 for w in tests)  # fmt: skip
    return {"species": species[0], "test_windows": len(tests), "in_held_out": inside}


def from_predictions(run_dir: str, resamples: int = BOOTSTRAP) -> dict:
    """What the run's predictions_test.tsv tells beyond its summary (None each where it is gone):
    margin_ci95, a paired bootstrap 95% interval of the test MCC margin (model minus k-mer baseline; the test windows
    resampled with replacement, both predictions of a window kept together); recall, each class's windows the model
    and the baseline got right, [model, baseline, windows]."""
    import numpy as np
    from sklearn.metrics import matthews_corrcoef

    path = os.path.join(run_dir, "predictions_test.tsv")
    if not os.path.exists(path):
        return {"margin_ci95": None, "recall": None}
    with open(path, encoding="utf-8") as fh:
        rows = [line.rstrip("\n").split("\t") for line in fh]
    head, rows = rows[0], rows[1:]
    label, model, base = (
        np.array([r[head.index(c)] for r in rows]) for c in ("label", "predicted", "baseline_predicted")
    )
    recall = {c: [int((model[label == c] == c).sum()), int((base[label == c] == c).sum()), int((label == c).sum())]
              for c in sorted(set(label))}  # fmt: skip
    rng = np.random.default_rng(0)
    margins = []
    for _ in range(resamples):
        i = rng.integers(0, len(rows), len(rows))
        margins.append(matthews_corrcoef(label[i], model[i]) - matthews_corrcoef(label[i], base[i]))
    return {"margin_ci95": [float(np.percentile(margins, 2.5)), float(np.percentile(margins, 97.5))], "recall": recall}


def run_arm(model: str, task: str, arm: str, work: str) -> dict:
    """One `megagenome finetune` (or the summary an earlier one left in its run directory): what the table shows."""
    run_dir = os.path.join(work, "runs", task, arm)
    summary_path = os.path.join(run_dir, "summary.json")
    wall, load = None, [harness.load_average()]
    if not os.path.exists(summary_path):
        cmd = [sys.executable, "-m", "megagenome", "finetune", "--model.pretrained", model, "--data.benchmark",
               build_task(task, work), "--log.run_dir", run_dir, "--log.progress", "false", *ARMS[arm]]  # fmt: skip
        print("+", " ".join(cmd[1:]), flush=True)
        started = time.time()
        done = subprocess.run(cmd, cwd=harness.REPO, env=harness.child_env(), capture_output=True, text=True)
        wall = time.time() - started
        if done.returncode != 0:
            return {"failed": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
        load.append(harness.load_average())
    with open(summary_path, encoding="utf-8") as fh:
        s = json.load(fh)
    return {
        "flags": " ".join(ARMS[arm]) or "(none)",
        "best_step": s["best_step"],
        "last_step": s["last_step"],
        "stopped_early": s["stopped_early"],
        "test": s["test"],
        "validation": s["validation"],
        "baseline": s["baseline"],
        "head_input": s.get("head_input"),
        **from_predictions(run_dir),
        "wall_s": wall,
        "load": load if wall is not None else None,
        "measured": {"date": harness.today(), "commit": harness.git_commit(), "hardware": harness.hardware()},
    }


def markdown(record: dict) -> str:
    lines = ["# Fine-tuning recipes against the k-mer baseline", "", *harness.header(record["meta"]),
             f"- pretrained model: `{record['model']}` ({_identity(record.get('model_identity'))})", ""]  # fmt: skip
    for task, arms in record["results"].items():
        species, window, train, test, fraction = TASKS[task]
        lines += [f"## {task}: {', '.join(species)}; {window}-base windows, {train} training and {test} test per "
                  f"class, test windows from the last {fraction:.0%} of each genome", ""]  # fmt: skip
        overlap = record.get("tasks", {}).get(task, {}).get("pretraining_overlap")
        if overlap:
            rest = overlap["test_windows"] - overlap["in_held_out"]
            seen = f"; the other {rest} were in its pretraining data, unlabelled" if rest else ": it saw none of them"
            lines += [f"Test windows of {overlap['species']} (the model's pretraining genome) inside its held-out "
                      f"range: {overlap['in_held_out']} of {overlap['test_windows']}{seen}.", ""]  # fmt: skip
        rows = []
        for arm, r in arms.items():
            if "failed" in r:
                rows.append([arm, f"`{' '.join(ARMS.get(arm, []))}`", "-", r["failed"], *["-"] * 6])
                continue
            t, b = r["test"], r["baseline"].get("test") or {}
            both = t.get("mcc") is not None and b.get("mcc") is not None
            margin = f"{t['mcc'] - b['mcc']:+.3f}" if both else "-"
            if both and r.get("margin_ci95"):
                margin += " [{:+.3f}, {:+.3f}]".format(*r["margin_ci95"])
            wall = f"{r['wall_s']:.0f}" if r.get("wall_s") else "-"
            stop = f"{r['best_step']} of {r['last_step']}" + (" (early stop)" if r["stopped_early"] else "")
            baseline = f"{_num(b.get('mcc'))} ({r['baseline'].get('choice', 'failed')})"
            cells = [_num(t.get("accuracy")), _num(t.get("mcc")), baseline, margin, _num(t.get("auroc")), wall]
            rows.append([arm, f"`{r['flags']}`", _head(r.get("head_input")), stop, *cells])
        cols = ["arm", "flags", "head input", "best step", "test accuracy", "test MCC", "k-mer baseline test MCC",
                "margin", "test AUROC", "wall s"]  # fmt: skip
        lines += harness.table(cols, rows) + [""] + _recall_table(arms)
        earlier = [f"`{arm}` as {r['measured_as']} at {r['measured']['commit']}"
                   for arm, r in arms.items() if r.get("measured_as")]  # fmt: skip
        if earlier:
            lines += ["Measured before a default changed and named by the flags that give the same run now (a head "
                      "input given runs no probe; --data.rc_prob 0 or --model.rc_average false evaluates one strand, "
                      "as before): " + "; ".join(earlier) + ".", ""]  # fmt: skip
    lines += [
        "The k-mer baseline is the same in every arm of a task with the default --data.seed (the same windows and "
        "split, fitted on the training split and chosen on validation by MCC; a default_seed_N arm refits it on its "
        "own split); margin: the model's test MCC minus the baseline's, with a paired bootstrap 95% interval over the "
        f"test windows ({BOOTSTRAP} resamples; where it spans 0 the two are not told apart on this test set). "
        "wall s: the finetune command's, start-up, evaluations and the test included, on 2 cores shared with "
        "whatever else ran (load before and after in the JSON): compare within a row's own load only.",
        "",
    ]
    return "\n".join(lines)


def _recall_table(arms: dict) -> list[str]:
    """Each class's test windows right, model / k-mer baseline, per arm (where its predictions were read)."""
    read = {arm: r["recall"] for arm, r in arms.items() if r.get("recall")}
    if not read:
        return []
    classes = sorted({c for recall in read.values() for c in recall})
    rows = [[arm] + [("{} / {} of {}".format(*recall[c]) if c in recall else "-") for c in classes]
            for arm, recall in read.items()]  # fmt: skip
    return ["Test windows right by class, model / k-mer baseline:", "", *harness.table(["arm", *classes], rows), ""]


def _head(chosen: dict | None) -> str:
    """The head's layer and pooling as the probes chose them, or "as given"."""
    if not chosen or not chosen.get("by_choice"):
        return "as given"
    where = "final norm" if chosen["layer"] == -1 else f"block {chosen['layer']}"
    return f"{where}, {chosen['pooling']} (probes)"


def _identity(identity: dict | None) -> str:
    if not identity:
        return "identity not recorded"
    if "heldout_bits_per_base" in identity:
        return f"{identity['steps']} steps, held-out {identity['heldout_bits_per_base']:.4f} bits/base"
    return f"export weights sha256 {str(identity.get('export'))[:12]}"


def _num(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--model", default="runs/tiny", help="the pretrained run or export directory")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--work", default="/tmp/finetune_recipes")
    ap.add_argument("--budget_minutes", type=float, default=40)
    ap.add_argument("--out", default=str(OUT), help="results path, no suffix")
    ap.add_argument("--render_only", action="store_true", help="rewrite the .md from the .json")
    args = ap.parse_args(harness.argv_of(argv))
    out = pathlib.Path(args.out)
    previous = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else None
    if args.render_only:
        if previous is None:
            print(f"finetune_recipes: --render_only: no {out.with_suffix('.json')} to render", file=sys.stderr)
            return 2
        harness.write_text(out.with_suffix(".md"), markdown(previous))
        return 0
    os.chdir(harness.REPO)
    model = os.path.abspath(args.model)
    if not os.path.exists(os.path.join(model, "config.yaml")) and not os.path.exists(
        os.path.join(model, "megagenome.json")
    ):
        print(f"finetune_recipes: --model {args.model}: no run or export there; train the default job first "
              "(bash launch/local.sh --config configs/tiny.yaml)", file=sys.stderr)  # fmt: skip
        return 2
    meta = {"date": harness.today(), "command": harness.command("finetune_recipes.py", harness.argv_of(argv)),
            "hardware": harness.hardware(), "software": harness.software()}  # fmt: skip
    identity = model_identity(model)
    results = kept(previous, model, identity)
    tasks = (previous or {}).get("tasks", {}) if results else {}
    record = {"meta": meta, "model": model, "model_identity": identity, "tasks": tasks, "results": results}
    deadline, ran = time.monotonic() + 60 * args.budget_minutes, False
    for task in args.tasks:
        overlap = pretraining_overlap(model, build_task(task, args.work))
        record["tasks"].setdefault(task, {})["pretraining_overlap"] = overlap
        for arm in args.arms:
            done = record["results"].get(task, {}).get(arm)
            if done and "failed" not in done:
                if done.get("recall") is None:  # measured before these were read: from its run if still there
                    done.update(from_predictions(os.path.join(args.work, "runs", task, arm)))
                continue
            if time.monotonic() > deadline:
                print(f"finetune_recipes: budget spent; {task}/{arm} and later arms next time", flush=True)
                break
            record["results"].setdefault(task, {})[arm] = run_arm(model, task, arm, args.work)
            ran = True
            harness.write_results(out.parent, out.name, record, markdown(record))
    if not ran and previous and results:  # nothing measured: the header keeps the command that measured
        record["meta"] = previous["meta"]
    harness.write_results(out.parent, out.name, record, markdown(record))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
