"""Supervised against zero-shot variant-effect prediction on BRCA1 (Findlay et al. 2018 saturation genome editing),
as in the Evo 2 paper's BRCA1 analysis, for models of three families trained by megagenome on the BRCA1 locus.

For each run directory (default: /tmp/brca1_runs/{transformer,hyena,striped_hyena}, trained by
`megagenome pretrain --config configs/brca1_locus.yaml <the family's model section of configs/tiny_transformer.yaml,
tiny_hyena.yaml or tiny.yaml as --model.* flags> --train.grad_accum_steps 2 --log.run_dir /tmp/brca1_runs/<family>`),
one `megagenome score-variants --supervised` run over all 3,893 SNVs of examples/data/BRCA1_Findlay2018_SGE_GRCh38.vcf
gives, for LOF against FUNC + INT, the zero-shot AUROC (of -(ALT - REF log-likelihood)) and the supervised AUROC (the
out-of-fold probability of a classifier on the model's REF and ALT embeddings, cross-validated in folds of position
blocks), each with a stratified bootstrap 95% interval, over all SNVs, coding SNVs (CSQ Missense, Synonymous,
Nonsense) and noncoding SNVs (every other CSQ) (--subset_field CSQ --subset_groups). Beside them: two baselines
without a model (the composition score of benchmarks/brca1_vep.py, and the same classifier and folds on one-hot REF
and ALT bases) and Evo 2's published BRCA1 figures with where each comes from. Writes
benchmarks/results/supervised_vep.{md,json} (or --out).

A second table, "the second task", is read from --second_task (default benchmarks/results/species_task.json) when it
exists (second_task_lines): another benchmark writes it.

    python benchmarks/supervised_vep.py [--runs DIR ...] [--window 512] [--classifier logistic] [--nproc 1]
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import brca1_vep
import harness
import numpy as np
import yaml

RUNS = [f"/tmp/brca1_runs/{family}" for family in ("transformer", "hyena", "striped_hyena")]
FAMILY_CONFIGS = {"transformer": "tiny_transformer.yaml", "hyena": "tiny_hyena.yaml", "striped_hyena": "tiny.yaml"}
CODING = ["Missense", "Synonymous", "Nonsense"]
SUBSETS = [f"coding={','.join(CODING)}", "noncoding=*"]
OUT = harness.RESULTS / "supervised_vep"
SECOND_TASK = harness.RESULTS / "species_task.json"

# Evo 2's published BRCA1 figures (LOF vs FUNC + INT). `value` None: the figure shows it, but no text this benchmark
# could read states the number, so it is not given here. Nature 2026 = Brixi et al., "Genome modelling and design
# across all domains of life with Evo 2", Nature (s41586-026-10176-5; bioRxiv 2025.02.18.638918).
PUBLISHED = [
    {"model": "Evo 2 1B base", "score": "zero-shot", "snvs": "all 3,893", "value": "0.73", "verified": "yes",
     "source": "github ArcInstitute/evo2 notebooks/brca1/brca1_zero_shot_vep.ipynb, last cell's output "
               "(8,192-bp windows; 'Zero-shot prediction AUROC: 0.73')"},
    {"model": "Evo 2 7B, 40B", "score": "zero-shot", "snvs": "coding (n = 2,077), noncoding (n = 1,125)",
     "value": None, "verified": "no",
     "source": "Nature 2026 Fig. 3e: bars only; the caption gives the n, not the AUROCs"},
    {"model": "Evo 2 7B, 40B", "score": "zero-shot", "snvs": "all (coding and noncoding in aggregate)",
     "value": None, "verified": "no",
     "source": "Nature 2026 Extended Data Fig. 5a: bars only (benchmarks/results/brca1_vep.md cites 0.87 for 7B "
               "from the paper; not re-verified here)"},
    {"model": "Evo 2 40B, block 20 embeddings", "score": "supervised", "snvs": "held-out test set (n = 789)",
     "value": None, "verified": "no",
     "source": "Nature 2026 Fig. 3g-i (REF and variant embeddings 'extracted and concatenated'; test set n = 789) "
               "and Extended Data Fig. 5d,e (block 20; window-averaged embeddings; 5-fold CV of a ridge-regularised "
               "classifier on the training set): the AUROC is in Fig. 3i's bars; a third-party summary quotes "
               "0.95 (AUPRC 0.86), which this benchmark could not check against the paper"},
]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=RUNS, help="Run (or export) directories; missing ones are noted.")
    ap.add_argument("--window", type=int, default=None, help="--window (default: each run's training window).")
    ap.add_argument("--embed_window", type=int, default=None, help="--embed_window (default: score-variants').")
    ap.add_argument("--embed_layers", type=int, nargs="+", default=None, help="--embed_layers (default: its).")
    ap.add_argument("--classifier", default="logistic", choices=["logistic", "gradient_boosting"])
    ap.add_argument("--cv_folds", type=int, default=5)
    ap.add_argument("--block_size", type=int, default=100)
    ap.add_argument("--nproc", type=int, default=1, help="Ranks (> 1: through the deepspeed launcher).")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vcf", default=str(brca1_vep.VCF), help="Labelled VCF (INFO CLASS, CSQ).")
    ap.add_argument("--second_task", default=str(SECOND_TASK), help="The second task's results JSON, if any.")
    ap.add_argument("--out", default=str(OUT), help="Results path without suffix (.md and .json are written).")
    ap.add_argument("--render_only", action="store_true", help="Rewrite the .md from the .json only.")
    return ap.parse_args(argv)


def trained(run_dir: str) -> bool:
    return os.path.isfile(os.path.join(run_dir, "megagenome.json")) or bool(
        glob.glob(os.path.join(run_dir, "checkpoints", "*", "COMPLETE"))
    )


def training_command(run_dir: str) -> str | None:
    """The command that trained a run of configs/brca1_locus.yaml with a family's model section (as the runs in
    RUNS were trained), read back from the run's config.yaml; None when it is not such a run."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return None
    cfg = yaml.safe_load(open(path, encoding="utf-8"))
    model = yaml.safe_load(open(harness.REPO / "configs" / FAMILY_CONFIGS[cfg["model"]["family"]], encoding="utf-8"))
    model = model["model"]
    if any(cfg["model"].get(k) != v for k, v in model.items()) or "BRCA1" not in cfg["data"]["fasta"]:
        return None
    flags = " ".join(f"--model.{k} {shlex.quote(str(v))}" for k, v in model.items())
    return (f"megagenome pretrain --config configs/brca1_locus.yaml {flags} --train.grad_accum_steps 2 "
            f"--log.run_dir {run_dir}")  # fmt: skip


def score(args, run_dir: str, fasta: str, work: str) -> tuple[dict, str]:
    """One `megagenome score-variants --supervised` run: (its JSON summary, its TSV's path)."""
    flags = [run_dir, "--fasta", fasta, "--vcf", args.vcf, "--output", os.path.join(work, "scored.vcf.gz")]
    flags += ["--label_field", "CLASS", "--positive", "LOF", "--bootstrap", str(args.bootstrap)]
    flags += ["--seed", str(args.seed), "--batch_size", str(args.batch_size), "--progress", "false", "--overwrite"]
    flags += ["--supervised", "--classifier", args.classifier, "--cv_folds", str(args.cv_folds)]
    flags += ["--block_size", str(args.block_size), "--subset_field", "CSQ", "--subset_groups", *SUBSETS]
    flags += ["--summary_json", os.path.join(work, "summary.json")]
    flags += ["--window", str(args.window)] if args.window else []
    flags += ["--embed_window", str(args.embed_window)] if args.embed_window else []
    flags += ["--embed_layers", *map(str, args.embed_layers)] if args.embed_layers else []
    if args.nproc > 1:
        cmd = harness.deepspeed_cmd(args.nproc, "--module", "megagenome", "score-variants", *flags)
    else:
        cmd = [sys.executable, "-m", "megagenome", "score-variants", *flags]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=harness.REPO, env=harness.child_env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"score-variants failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    print(done.stdout.strip(), flush=True)
    with open(os.path.join(work, "summary.json"), encoding="utf-8") as fh:
        return json.load(fh), os.path.join(work, "scored.tsv")


def baselines(tsv: str, vcf: str, args) -> dict:
    """No model, the same SNVs and folds: the composition score (1 if the ALT is A or T) and the classifier on
    one-hot REF and ALT bases (8 features), each over all, coding and noncoding SNVs."""
    from megagenome.after_training.auroc import auroc, bootstrap_interval
    from megagenome.after_training.supervised_vep import make_classifier

    with open(tsv, encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh, delimiter="\t") if r["fold"] != "NA"]
    with open(vcf, encoding="utf-8") as fh:
        csq = {(int(r[1]), r[4]): r[7].split("CSQ=")[1].split(";")[0] for r in
               (line.rstrip("\n").split("\t") for line in fh if not line.startswith("#"))}  # fmt: skip
    y = np.array([r["label"] == "LOF" for r in rows])
    fold = np.array([int(r["fold"]) for r in rows])
    bases = "ACGT"
    onehot = np.array([[r["ref"] == b for b in bases] + [r["alt"] == b for b in bases] for r in rows], dtype=float)
    composition = np.array([float(r["alt"] in "AT") for r in rows])
    learned = np.empty(len(rows))
    for f in range(int(fold.max()) + 1):
        test = fold == f
        model = make_classifier(args.classifier, args.seed).fit(onehot[~test], y[~test])
        learned[test] = model.predict_proba(onehot[test])[:, 1]
    coding = np.array([csq[(int(r["pos"]), r["alt"])] in CODING for r in rows])
    out = {}
    for name, part in (("all", np.ones(len(rows), bool)), ("coding", coding), ("noncoding", ~coding)):
        out[name] = {}
        for key, predictor in (("composition", -composition), ("onehot_supervised", learned)):
            p, t = predictor[part], y[part]
            out[name][key] = {"auroc": auroc(p, t), "ci95": list(bootstrap_interval(p, t, args.bootstrap, args.seed))}
    return out


def one_run(args, run_dir: str, fasta: str) -> dict:
    """The results row of one run directory (its three subsets), or a note when it has no checkpoint."""
    if not trained(run_dir):
        return {"run_dir": run_dir, "missing": "no complete checkpoint (not trained, or still training)"}
    with tempfile.TemporaryDirectory(prefix="supervised_vep-") as work:
        started = time.perf_counter()
        s, tsv = score(args, run_dir, fasta, work)
        base = baselines(tsv, args.vcf, args)
    family = yaml.safe_load(open(os.path.join(run_dir, "config.yaml"), encoding="utf-8"))["model"]["family"]
    ev, sup = s["evaluation"], s["supervised"]
    subsets = {"all": {"n_positive": ev["n_positive"], "n_negative": ev["n_negative"],
                       "zero_shot": {k: ev[k] for k in ("auroc", "ci95")},
                       "supervised": {k: sup[k] for k in ("auroc", "ci95")}}}  # fmt: skip
    for entry in s["subsets"]["subsets"]:
        subsets[entry["subset"]] = {k: entry[k] for k in ("n_positive", "n_negative", "zero_shot", "supervised")}
    for name, values in base.items():
        subsets[name].update(values)
    return {
        "run_dir": run_dir, "family": family, "parameters": s["parameters"],
        **brca1_vep.training(run_dir, s["model"]), "trained_by": training_command(run_dir), "window": s["window"],
        "variants": s["variants"], "subsets": subsets, "folds": sup["folds"],
        "supervised": {k: v for k, v in sup.items() if k not in ("folds", "auroc", "ci95")},
        "zero_shot_variants_per_s": s["variants_per_s"], "seconds": round(time.perf_counter() - started, 1),
        "load_average": harness.load_average(),
    }  # fmt: skip


def _auroc(part: dict | None) -> str:
    if not part or part.get("auroc") is None:
        return "-"
    ci = part.get("ci95")
    return f"{part['auroc']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def results_lines(rows: list[dict]) -> list[str]:
    """The main table: per run, per subset, zero-shot and supervised AUROCs and the no-model baselines."""
    table = []
    for r in rows:
        if "missing" in r:
            table.append([f"`{r['run_dir']}`", "-", "-", "-", "-", f"not run: {r['missing']}", "-", "-", "-"])
            continue
        folds = [f["auroc"] for f in r["folds"] if f["auroc"] is not None]
        spread = f"{min(folds):.3f}-{max(folds):.3f}" if folds else "-"
        for name in ("all", "coding", "noncoding"):
            s = r["subsets"][name]
            table.append([
                f"{r['family']} (`{r['run_dir']}`)", f"{r['parameters']:,}", name,
                f"{s['n_positive']:,} / {s['n_negative']:,}", _auroc(s["zero_shot"]), _auroc(s["supervised"]),
                spread if name == "all" else "", _auroc(s.get("composition")), _auroc(s.get("onehot_supervised")),
            ])  # fmt: skip
    columns = ["model", "parameters", "SNVs", "LOF / rest", "zero-shot AUROC [95% CI]", "supervised AUROC [95% CI]",
               "supervised, per fold", "composition only", "one-hot bases, supervised"]  # fmt: skip
    return harness.table(columns, table)


def published_lines() -> list[str]:
    rows = [[p["model"], p["score"], p["snvs"], p["value"] or "not stated in text", p["verified"], p["source"]]
            for p in PUBLISHED]  # fmt: skip
    return harness.table(["model", "score", "SNVs", "AUROC", "verified here", "source"], rows)


def second_task_lines(path=SECOND_TASK) -> list[str]:
    """The second task's table, from benchmarks/species_task.py's results JSON at `path`, or a note that it is
    absent."""
    lines = ["## The second task: which species is a window from?", ""]
    path = path if os.path.isabs(path) else os.path.join(harness.REPO, path)
    if not os.path.exists(path):
        return lines + [f"Skipped: `{os.path.relpath(path, harness.REPO)}` does not exist yet (written by "
                        "`python benchmarks/species_task.py`).", ""]  # fmt: skip
    with open(path, encoding="utf-8") as fh:
        task = json.load(fh)
    meta, b = task["meta"], task["baseline"]
    lines += [
        f"From `benchmarks/species_task.md` ({meta['date']}): {meta['classes']} species "
        f"({', '.join(meta['species'])}), windows of {meta['window']} bases, {meta['sizes']['test']:,} test windows. "
        "Leakage rule: the last 20% of every contig is the test region and no window crosses it, so no test base is "
        "in a training window. Each BRCA1-locus model fine-tuned by `megagenome finetune` (full, LoRA, a probe of "
        "the frozen backbone); test metrics of the best validation checkpoint.",
        "",
    ]
    rows = [
        [r["family"], r["mode"], f"{r['test']['accuracy']:.3f}", f"{r['test']['mcc']:.3f}", f"{r['test']['auroc']:.3f}"]
        for r in task["rows"]
    ]
    rows.append(
        ["no model: 4-mer logistic regression", "-", f"{b['accuracy']:.3f}", f"{b['mcc']:.3f}", f"{b['auroc']:.3f}"]
    )
    return lines + harness.table(["family", "mode", "test accuracy", "test MCC", "test AUROC"], rows) + [""]


def markdown(result: dict) -> str:
    meta = result["meta"]
    done = [r for r in result["rows"] if "missing" not in r]
    sup = done[0]["supervised"] if done else {}
    lines = [
        f"# BRCA1: supervised against zero-shot variant-effect prediction ({meta['date']})", "",
        f"{done[0]['variants'] if done else 0:,} SNVs of Findlay et al. 2018 (BRCA1 saturation genome editing), LOF "
        "against FUNC + INT, scored by one "
        "`megagenome score-variants --supervised` run per model: the zero-shot score (ALT - REF log-likelihood of a "
        "window centred on the variant; AUROC of -score) and the supervised score (out-of-fold probability of LOF "
        "from a classifier on the model's REF and ALT embeddings). Stratified bootstrap 95% intervals "
        f"({meta['bootstrap']} resamples, seed {meta['seed']}). Coding: CSQ {', '.join(CODING)}; noncoding: the "
        "rest.", "",
        *harness.header(meta),
        f"- supervised: {sup.get('classifier')} on layers {sup.get('embed_layers')} ([REF, ALT] means over "
        f"{sup.get('embed_window')} bases at the variant, {sup.get('features')} features); {sup.get('cv_folds')} "
        f"folds, {sup.get('splitter')} over {sup.get('blocks')} blocks of {sup.get('block_size')} bases",
        *(f"- trained by: `{r['trained_by']}`" for r in done if r.get("trained_by")), "",
        *results_lines(result["rows"]), "",
        "Baselines without a model, on the same SNVs and folds: *composition only*, 1 if the ALT is A or T "
        "(benchmarks/brca1_vep.py: LOF ALTs are A/T-rich, so its AUROC as -score is below 0.5); *one-hot bases, "
        "supervised*, the same classifier on the REF and ALT bases alone (8 features): what a classifier learns "
        "without any model.", "",
        "## Evo 2's published BRCA1 figures", "",
        *published_lines(), "",
        "Not like for like: Evo 2's models were trained on OpenGenome2 (trillions of bases, all domains of life), "
        "these on the 1.18 Mb locus; Evo 2's supervised figure is on a held-out test set of 789 SNVs (how it was "
        "split is not in the captions), these are out-of-fold over all SNVs with folds of whole position blocks; "
        "Evo 2's coding set has 2,077 SNVs where CSQ Missense + Synonymous + Nonsense has 2,768 here (its noncoding "
        "set's 1,125 equals the rest here).", "",
        *second_task_lines(meta["second_task"]),
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render_only:
        with open(args.out + ".json", encoding="utf-8") as fh:
            result = json.load(fh)
    else:
        with tempfile.TemporaryDirectory(prefix="supervised_vep-fasta-") as work:
            fasta = str(harness.copy_input(brca1_vep.FASTA, work))  # pyfaidx writes its index beside the FASTA
            rows = [one_run(args, run_dir, fasta) for run_dir in args.runs]
        meta = {
            "date": harness.today(), "command": harness.command("supervised_vep.py", harness.argv_of(argv)),
            "hardware": brca1_vep.device(),
            "software": harness.software(f"scikit-learn {harness.version('scikit-learn')}"),
            "bootstrap": args.bootstrap, "seed": args.seed, "ranks": args.nproc,
            "second_task": os.path.relpath(args.second_task, harness.REPO),
        }  # fmt: skip
        result = {"meta": meta, "rows": rows, "published": PUBLISHED}
    harness.write_json(args.out + ".json", result, indent=2)
    harness.write_text(args.out + ".md", markdown(result))
    print(f"wrote {args.out}.md and {args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
