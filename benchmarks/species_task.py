"""The second labelled task (issue 26): which species is a window of DNA from?

Four bundled genomes (E. coli K-12, S. aureus NCTC 8325, S. cerevisiae S288C, phage lambda) cut into windows by
data/species_task.py in the Genomic Benchmarks folder layout. Leakage rule: on every contig the last 20% of its bases
is the test region and the rest the training region; no window crosses the boundary, so no test base is ever inside
a training window (the validation set is a stratified 10% of the training windows, the same rule as Genomic
Benchmarks' own splits do not give). Each pretrained model given is fine-tuned with `megagenome finetune` (a
subprocess: full fine-tuning, LoRA and a frozen backbone, i.e. a linear probe of the final norm), and a baseline with
no model is fitted beside them: scikit-learn's logistic regression on each window's 4-mer frequencies. Test accuracy,
MCC and macro one-vs-rest AUROC of the best validation checkpoint. Writes benchmarks/results/species_task.{md,json}
(or --out).

    python benchmarks/species_task.py [--models DIR ...] [--window 256] [--steps 300] [--modes full lora probe]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import harness
import numpy as np
import yaml

GENOMES = {
    "ecoli": harness.REPO / "examples" / "data" / "ecoli_K12_MG1655_NC_000913.2.fa.bgz",
    "saureus": harness.REPO / "tests" / "data" / "saureus_NCTC8325_NC_007795.1.fasta.gz",
    "scerevisiae": harness.REPO / "tests" / "data" / "scerevisiae_S288C_ASM205763v1.fa.bgz",
    "lambda": harness.REPO / "tests" / "data" / "lambda_NC_001416.1.fa.gz",
}
MODELS = ["/tmp/brca1_runs/transformer", "/tmp/brca1_runs/hyena", "/tmp/brca1_runs/striped_hyena"]
OUT = harness.RESULTS / "species_task"
MODES = {
    "full": {},
    "lora": {"model.lora": True, "train.lr": 1e-3},
    "probe": {"model.freeze_backbone": True, "train.lr": 1e-2},
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS, help="Pretrained run or export directories.")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--train_per_class", type=int, default=400)
    ap.add_argument("--test_per_class", type=int, default=100)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--micro_batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4, help="Full fine-tuning's peak LR (LoRA and probe: MODES).")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="Work directory (default: a temporary one).")
    ap.add_argument("--out", default=str(OUT), help="Results path without suffix (.md and .json are written).")
    ap.add_argument("--render_only", action="store_true", help="Rewrite the .md from the .json only.")
    return ap.parse_args(argv)


def kmer_features(sequences: list[str], k: int = 4) -> np.ndarray:
    """(N, 4^k) k-mer frequencies of each sequence (k-mers with N skipped): the fine-tuning baseline's features."""
    from megagenome.run.task_baseline import composition

    return composition(sequences, k)


def kmer_baseline(data, seed: int) -> dict:
    """Logistic regression on 4-mer frequencies, fitted on train + validation, scored on test."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    from megagenome.observe.task_metrics import classification_metrics

    train = data.splits["train"] + data.splits.get("validation", [])
    x, y = kmer_features([e.sequence for e in train]), np.array([e.label for e in train])
    test_x = kmer_features([e.sequence for e in data.splits["test"]])
    test_y = np.array([e.label for e in data.splits["test"]])
    scaler = StandardScaler().fit(x)
    model = LogisticRegression(max_iter=2000, random_state=seed).fit(scaler.transform(x), y)
    return classification_metrics(test_y, model.predict_proba(scaler.transform(test_x)))


def finetune(args, model_dir: str, mode: str, bench: str, work: str) -> dict:
    """One `megagenome finetune` run; its summary.json and the wall time."""
    run_dir = os.path.join(work, f"{os.path.basename(model_dir.rstrip('/'))}_{mode}")
    cfg = {
        "model": {"pretrained": model_dir},
        "data": {"benchmark": bench, "seed": args.seed},
        "train": {
            "ds_config": [
                str(harness.REPO / "ds_configs" / "zero1.json"),
                str(harness.REPO / "ds_configs" / "bf16.json"),
            ],
            "micro_batch_size": args.micro_batch,
            "max_steps": args.steps,
            "eval_interval": max(1, args.steps // 10),
            "log_interval": 10,
            "warmup_steps": max(1, args.steps // 20),
            "lr": args.lr,
            "patience": 4,
            "seed": args.seed,
        },
        "log": {"run_dir": run_dir, "progress": False},
    }
    for dotted, value in MODES[mode].items():
        section, key = dotted.split(".")
        cfg[section][key] = value
    path = os.path.join(work, f"{os.path.basename(run_dir)}.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg, fh)
    cmd = [sys.executable, "-m", "megagenome", "finetune", "--config", path]
    print("+", " ".join(cmd), flush=True)
    started = time.time()
    done = subprocess.run(cmd, cwd=harness.REPO, env=harness.child_env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"finetune failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    with open(os.path.join(run_dir, "task.json"), encoding="utf-8") as fh:
        record = json.load(fh)
    family = record["pretrained"]["model"].get("family", "transformer")
    wall = time.time() - started
    return {
        "model": model_dir,
        "family": family,
        "mode": mode,
        "wall_s": wall,
        "sizes": record["data"]["sizes"],
        **summary,
    }


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"# The species task: which genome is a window from? ({meta['date']})",
        "",
        f"{meta['classes']} classes ({', '.join(meta['species'])}), windows of {meta['window']} bases: "
        f"{meta['sizes']['train']:,} training, {meta['sizes']['validation']:,} validation, {meta['sizes']['test']:,} "
        "test, written in the Genomic Benchmarks folder layout by `megagenome.data.species_task` and read back by "
        "`megagenome finetune --data.benchmark`.",
        "",
        "Leakage rule: the last 20% of every contig is the test region; no window crosses the boundary, so no test "
        "base is in any training window (validation: a stratified 10% of the training windows).",
        "",
        f"Fine-tuning: {meta['steps']} steps at most of {meta['micro_batch']} windows, 1 rank, ZeRO-1 + bf16, AdamW "
        "(full: lr {full}; LoRA r 8: 1e-3; probe, a frozen backbone with the head alone: 1e-2), validation every "
        f"{max(1, meta['steps'] // 10)} steps, early stopping on MCC with patience 4; the test metrics are the best "
        "validation checkpoint's. Pretrained models: the BRCA1-locus models of configs/brca1_locus.yaml (0.85M "
        "parameters, 600 steps on 1.18 Mb of human sequence), so every species here is new to them.".replace(
            "{full}", str(meta["lr"])
        ),
        "",
        f"Hardware: {meta['hardware']}. Command: `{meta['command']}`",
        "",
        "| model | family | mode | best step | test accuracy | test MCC | test AUROC (macro) | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        t = r["test"]
        lines.append(
            f"| `{r['model']}` | {r['family']} | {r['mode']} | {r['best_step']} | {t['accuracy']:.3f} | "
            f"{t['mcc']:.3f} | {t['auroc']:.3f} | {r['wall_s']:.0f} |"
        )
    b = result["baseline"]
    lines.append(
        f"| no model: logistic regression on 4-mer frequencies | - | - | - | {b['accuracy']:.3f} | {b['mcc']:.3f} | "
        f"{b['auroc']:.3f} | - |"
    )
    lines += [
        "",
        f"Chance: accuracy {1 / meta['classes']:.3f}, MCC 0, AUROC 0.5. wall s: each fine-tuning run's, loading "
        "and evaluations included, on a machine shared with other benchmarks (load 3-5 on 2 cores): not comparable "
        "across rows.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render_only:
        with open(args.out + ".json", encoding="utf-8") as fh:
            harness.write_text(args.out + ".md", markdown(json.load(fh)))
        return 0
    from megagenome.data.labelled import read_genomic_benchmarks
    from megagenome.data.species_task import build_species_task

    with tempfile.TemporaryDirectory(prefix="species_task-") as tmp:
        work = args.work or tmp
        bench = os.path.join(work, "species")
        if not os.path.isdir(bench):
            genomes = {name: str(path) for name, path in GENOMES.items()}
            build_species_task(genomes, bench, args.window, args.train_per_class, args.test_per_class, seed=args.seed)
        data = read_genomic_benchmarks(bench)
        rows = [finetune(args, m, mode, bench, work) for m in args.models for mode in args.modes]
        sizes = rows[0]["sizes"]  # as the runs split them (task.json)
        meta = {
            "date": harness.today(),
            "species": list(data.classes),
            "classes": len(data.classes),
            "window": args.window,
            "sizes": sizes,
            "steps": args.steps,
            "micro_batch": args.micro_batch,
            "lr": args.lr,
            "hardware": harness.hardware(),
            "command": harness.command("species_task.py", harness.argv_of(argv)),
        }
        result = {"meta": meta, "rows": rows, "baseline": kmer_baseline(data, args.seed)}
    harness.write_json(args.out + ".json", result, indent=2)
    harness.write_text(args.out + ".md", markdown(result))
    print(f"wrote {args.out}.md and {args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
