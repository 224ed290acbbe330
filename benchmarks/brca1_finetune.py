"""BRCA1 variant effects by fine-tuning (issue 43): does `megagenome finetune`'s default recipe, on the BRCA1 locus
models of benchmarks/supervised_vep.py, learn loss of function better than a classifier on the bases alone?

The task (build_task): every labelled SNV of Findlay et al. 2018 (examples/data/BRCA1_Findlay2018_SGE_GRCh38.vcf,
LOF against FUNC + INT) as its ALT window of --window bases from the locus FASTA (the variant at window // 2, as
score-variants places it), in a Genomic Benchmarks folder (train.csv, test.csv). The test split is one fold of
supervised_vep's cross-validation: StratifiedGroupKFold(5, seed 0) over blocks of 100 bases (assign_folds), fold
--test_fold, so no 100-base block has SNVs on both sides and the test SNVs are the ones that fold scores there.
`megagenome finetune` holds out its own validation split from the training SNVs (stratified, not by block: its choice
of checkpoint and head input can see a test block's neighbours' neighbours, never a test SNV).

Per run directory (default: supervised_vep's RUNS; a missing one is trained first with --train_missing, by the command
supervised_vep documents), one `megagenome finetune` with no recipe flag: the defaults (lr a quarter of the run's
pretraining peak, reverse complements, head input chosen by probes, early stopping). Beside it, on the same split:
the k-mer baseline every finetune reports, and the classifier on one-hot REF and ALT bases (8 features,
supervised_vep's `logistic`), each test AUROC with a stratified bootstrap 95% interval (1000 resamples, seed 0), and
the model's AUROC minus the bases' with a paired interval (the same resamples for both).

    python benchmarks/brca1_finetune.py [--runs DIR ...] [--train_missing] [--window 512] [--test_fold 0]
        [--work /tmp/brca1_finetune] [--render_only]

Writes benchmarks/results/brca1_finetune.{md,json}, rewritten after every run (a run whose summary.json exists under
--work is read, not run again).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import subprocess
import sys
import time

import harness
import numpy as np
import supervised_vep
import yaml

OUT = harness.RESULTS / "brca1_finetune"
VCF = harness.REPO / "examples" / "data" / "BRCA1_Findlay2018_SGE_GRCh38.vcf"
FASTA = harness.REPO / "examples" / "data" / "GRCh38_chr17_BRCA1_region_Npadded.fa.bgz"
FOLDS, BLOCK, SEED = 5, 100, 0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=supervised_vep.RUNS, help="BRCA1 locus run directories")
    ap.add_argument("--train_missing", action="store_true", help="train a missing run of RUNS first")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--test_fold", type=int, default=0, choices=range(FOLDS))
    ap.add_argument("--work", default="/tmp/brca1_finetune")
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--out", default=str(OUT), help="results path, no suffix")
    ap.add_argument("--render_only", action="store_true", help="rewrite the .md from the .json")
    return ap.parse_args(argv)


def build_task(path: str, window: int, test_fold: int) -> dict:
    """The task folder (written once) and its manifest: every SNV's position, ALT, label, fold and split."""
    manifest_path = os.path.join(path, "manifest.json")
    if os.path.exists(manifest_path):
        with open(manifest_path, encoding="utf-8") as fh:
            return json.load(fh)
    from megagenome.after_training.supervised_vep import assign_folds, block_groups
    from megagenome.after_training.variant_windows import skip_reason, variant_windows
    from megagenome.data.fasta import Genome
    from megagenome.data.vcf_scores import labelled_alts, read_sites

    genome = Genome(str(FASTA))
    sites = read_sites(str(VCF), genome.lengths, label_field="CLASS")
    rows = [(i, a, lof) for i, a, lof in labelled_alts(sites, ["LOF"]) if not skip_reason(sites[i], a, window)]
    positive = np.array([lof for *_, lof in rows], dtype=bool)
    groups = block_groups([sites[i].chrom for i, *_ in rows], [sites[i].pos for i, *_ in rows], BLOCK)
    folds, splitter = assign_folds(groups, positive, FOLDS, SEED)
    variants, out = [], {"train": [], "test": []}
    for (i, a, lof), fold in zip(rows, folds):
        s = sites[i]
        fetch = lambda start, end, c=s.chrom: genome.fetch(c, start, end)  # noqa: E731
        ref_window, alt_window, _ = variant_windows(fetch, genome.lengths[s.chrom], s.pos, s.ref, s.alts[a], window)
        split = "test" if fold == test_fold else "train"
        label = "LOF" if lof else "other"
        out[split].append((alt_window.decode("ascii").upper(), label))
        variants.append({"pos": s.pos + 1, "ref": s.ref, "alt": s.alts[a], "label": label, "fold": int(fold),
                         "split": split})  # fmt: skip
    os.makedirs(path, exist_ok=True)
    for split, pairs in out.items():
        with open(os.path.join(path, f"{split}.csv"), "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(["seq", "label"])
            writer.writerows(pairs)
    manifest = {"window": window, "test_fold": test_fold, "splitter": splitter, "variants": variants}
    harness.write_json(manifest_path, manifest)
    return manifest


def task_summary(manifest: dict) -> dict:
    """What the results record keeps of the task (the manifest's per-SNV rows stay in --work)."""
    v = manifest["variants"]
    counts = {s: sum(r["split"] == s for r in v) for s in ("train", "test")}
    lof = sum(r["split"] == "test" and r["label"] == "LOF" for r in v)
    return {k: manifest[k] for k in ("window", "test_fold", "splitter")} | {"snvs": counts, "test_lof": lof}


def onehot_baseline(manifest: dict, bootstrap: int) -> dict:
    """supervised_vep's `logistic` classifier on one-hot REF and ALT bases, fitted on the training SNVs: test AUROC,
    its interval and the test SNVs' probabilities of LOF in test.csv's order ("p", which the record leaves out)."""
    from megagenome.after_training.auroc import auroc, bootstrap_interval
    from megagenome.after_training.supervised_vep import make_classifier

    v = manifest["variants"]
    x = np.array([[r["ref"] == b for b in "ACGT"] + [r["alt"] == b for b in "ACGT"] for r in v], dtype=float)
    y = np.array([r["label"] == "LOF" for r in v])
    test = np.array([r["split"] == "test" for r in v])
    p = make_classifier("logistic", SEED).fit(x[~test], y[~test]).predict_proba(x[test])[:, 1]
    return {"auroc": auroc(p, y[test]), "ci95": list(bootstrap_interval(p, y[test], bootstrap, SEED)), "p": p}


def paired_difference(ours: np.ndarray, theirs: np.ndarray, positive: np.ndarray, n: int) -> dict:
    """AUROC(ours) - AUROC(theirs) on the same SNVs and its percentile 95% interval over n stratified resamples drawn
    for both at once (positives and negatives apart, numpy default_rng(SEED)), as bootstrap_interval draws them."""
    from megagenome.after_training.auroc import auroc

    rng = np.random.default_rng(SEED)
    pos, neg = np.flatnonzero(positive), np.flatnonzero(~positive)
    stats = np.empty(n)
    for b in range(n):
        idx = np.concatenate([rng.choice(pos, len(pos)), rng.choice(neg, len(neg))])
        stats[b] = auroc(ours[idx], positive[idx]) - auroc(theirs[idx], positive[idx])
    lo, hi = np.quantile(stats, [0.025, 0.975])
    return {"delta": auroc(ours, positive) - auroc(theirs, positive), "ci95": [float(lo), float(hi)]}


def train_run(run_dir: str) -> None:
    """The BRCA1 locus run of run_dir's family (its name's last part), trained as supervised_vep's runs were."""
    family = os.path.basename(run_dir.rstrip("/"))
    model = yaml.safe_load(open(harness.REPO / "configs" / supervised_vep.FAMILY_CONFIGS[family], encoding="utf-8"))
    flags = [x for k, v in model["model"].items() for x in (f"--model.{k}", str(v))]
    cmd = [sys.executable, "-m", "megagenome", "pretrain", "--config", "configs/brca1_locus.yaml", *flags,
           "--train.grad_accum_steps", "2", "--log.run_dir", run_dir, "--log.progress", "false"]  # fmt: skip
    print("+", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, cwd=harness.REPO, env=harness.child_env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"pretraining {run_dir} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def finetune(run_dir: str, task: str, work: str, bootstrap: int, bases: np.ndarray) -> dict:
    """One default `megagenome finetune` of run_dir on the task (or the summary an earlier one left): its row."""
    from megagenome.after_training.auroc import bootstrap_interval

    family = yaml.safe_load(open(os.path.join(run_dir, "config.yaml"), encoding="utf-8"))["model"]["family"]
    out = os.path.join(work, "runs", family)
    wall = None
    if not os.path.exists(os.path.join(out, "summary.json")):
        cmd = [sys.executable, "-m", "megagenome", "finetune", "--model.pretrained", run_dir, "--data.benchmark", task,
               "--log.run_dir", out, "--log.progress", "false"]  # fmt: skip
        print("+", " ".join(cmd[1:]), flush=True)
        started = time.time()
        done = subprocess.run(cmd, cwd=harness.REPO, env=harness.child_env(), capture_output=True, text=True)
        wall = time.time() - started
        if done.returncode != 0:
            return {"run_dir": run_dir, "family": family, "failed": f"exit {done.returncode}: {done.stderr[-500:]}"}
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
        s = json.load(fh)
    with open(os.path.join(out, "predictions_test.tsv"), encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    lof = next(k for k in rows[0] if k.endswith("LOF"))  # the probability column of class LOF
    p, y = np.array([float(r[lof]) for r in rows]), np.array([r["label"] == "LOF" for r in rows])
    with open(os.path.join(out, "config.yaml"), encoding="utf-8") as fh:
        lr = yaml.safe_load(fh)["train"]["lr"]
    return {
        "run_dir": run_dir, "family": family, "lr": lr, "best_step": s["best_step"], "last_step": s["last_step"],
        "test": s["test"], "ci95": list(bootstrap_interval(p, y, bootstrap, SEED)), "head_input": s.get("head_input"),
        "against_bases": paired_difference(p, bases, y, bootstrap),
        "baseline": s["baseline"], "wall_s": wall, "load": harness.load_average(),
    }  # fmt: skip


def markdown(record: dict) -> str:
    m, base = record["task"], record["onehot"]
    n, lof = m["snvs"], m["test_lof"]
    split = f"fold {m['test_fold']} of {FOLDS} ({m['splitter']} over {BLOCK}-base blocks, seed {SEED})"
    lines = ["# BRCA1 variant effects by fine-tuning, against the bases alone", "", *harness.header(record["meta"]),
             f"- task: {n['train']} training and {n['test']} test SNVs ({lof} LOF), ALT windows of {m['window']} "
             f"bases; test = {split}", ""]  # fmt: skip
    cols = ["model", "lr (default)", "head input", "best step", "test AUROC [95% CI]", "test MCC",
            "k-mer baseline AUROC", "one-hot bases AUROC [95% CI]", "model - bases [95% CI]",
            "beats the bases"]  # fmt: skip
    rows = []
    for r in record["runs"]:
        if "failed" in r or "missing" in r:
            rows.append([r.get("family", r["run_dir"]), r.get("failed") or r.get("missing"), *["-"] * 8])
            continue
        t, ci, b, d = r["test"], r["ci95"], r["baseline"].get("test") or {}, r["against_bases"]
        head = r.get("head_input") or {}
        where = "final norm" if head.get("layer") == -1 else f"block {head.get('layer')}"
        cells = [f"{r['lr']:g}", f"{where}, {head.get('pooling')}", f"{r['best_step']} of {r['last_step']}",
                 f"{t['auroc']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]", _num(t.get("mcc")), _num(b.get("auroc")),
                 f"{base['auroc']:.3f} [{base['ci95'][0]:.3f}, {base['ci95'][1]:.3f}]",
                 f"{d['delta']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]", _verdict(d["ci95"])]  # fmt: skip
        rows.append([r["family"], *cells])
    lines += harness.table(cols, rows) + [""]
    lines += [
        "Every run is `megagenome finetune --model.pretrained <run> --data.benchmark <task>` with no recipe flag. "
        "model - bases: the AUROC difference on the same test SNVs, with a paired stratified bootstrap interval (1000 "
        "resamples drawn for both at once); beats the bases: yes when that interval lies above zero. The "
        "one-hot classifier sees the REF base too, which the ALT window holds only implicitly (through the model's "
        "memory of the locus it was trained on).",
        "",
    ]
    return "\n".join(lines)


def _verdict(ci: list[float]) -> str:
    """From the paired interval of the AUROC difference: above zero, below it, or across it."""
    return "yes" if ci[0] > 0 else ("no, below" if ci[1] < 0 else "not distinguishable")


def _num(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv=None) -> int:
    args = parse_args(harness.argv_of(argv))
    out = pathlib.Path(args.out)
    if args.render_only:
        if not out.with_suffix(".json").exists():
            print(f"brca1_finetune: --render_only: no {out.with_suffix('.json')} to render", file=sys.stderr)
            return 2
        record = json.loads(out.with_suffix(".json").read_text())
        harness.write_text(out.with_suffix(".md"), markdown(record))
        return 0
    os.chdir(harness.REPO)
    task = os.path.join(args.work, "task")
    manifest = build_task(task, args.window, args.test_fold)
    meta = {"date": harness.today(), "command": harness.command("brca1_finetune.py", harness.argv_of(argv)),
            "hardware": harness.hardware(), "software": harness.software()}  # fmt: skip
    onehot = onehot_baseline(manifest, args.bootstrap)
    bases = onehot.pop("p")
    record = {"meta": meta, "task": task_summary(manifest), "onehot": onehot, "runs": []}
    for run_dir in args.runs:
        if not supervised_vep.trained(run_dir) and args.train_missing:
            train_run(run_dir)
        if not supervised_vep.trained(run_dir):
            record["runs"].append({"run_dir": run_dir, "missing": "not trained (--train_missing trains it)"})
            continue
        record["runs"].append(finetune(run_dir, task, args.work, args.bootstrap, bases))
        harness.write_results(out.parent, out.name, record, markdown(record))
    harness.write_results(out.parent, out.name, record, markdown(record))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
