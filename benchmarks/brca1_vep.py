"""Zero-shot variant-effect prediction on BRCA1 (Findlay et al. 2018 saturation genome editing), as in the Evo 2
paper's BRCA1 analysis, with a model trained by megagenome on the BRCA1 locus (configs/brca1_locus.yaml).

Scores all 3,893 SNVs of examples/data/BRCA1_Findlay2018_SGE_GRCh38.vcf against the N-padded GRCh38 chr17 FASTA
through `megagenome score-variants` (a subprocess; through the `deepspeed` launcher with --nproc > 1), forward only
and averaged with the reverse complement, and reports the AUROC of LOF against FUNC + INT (of -score: a lower
ALT - REF log-likelihood ratio predicts loss of function) with its stratified bootstrap 95% interval, and variants/s,
beside the published Evo 2 figures. Writes benchmarks/results/brca1_vep.{md,json} (or --out).

    python benchmarks/brca1_vep.py [--run_dir runs/brca1] [--window 512] [--rc off on] [--nproc 1] [--batch_size 32]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

import harness
import numpy as np
import yaml

DATA = harness.REPO / "examples" / "data"
FASTA = DATA / "GRCh38_chr17_BRCA1_region_Npadded.fa.bgz"
VCF = DATA / "BRCA1_Findlay2018_SGE_GRCh38.vcf"
OUT = harness.RESULTS / "brca1_vep"

# Published zero-shot AUROCs of LOF vs FUNC + INT on the same 3,893 SNVs, as examples/data/README.md cites them.
PUBLISHED = [
    ("Evo 2 1B base", "1B", "0.73", "its BRCA1 notebook, github ArcInstitute/evo2 notebooks/brca1"),
    ("Evo 2 1B base", "1B", "0.76", "as reported by NVIDIA BioNeMo"),
    ("Evo 2 7B", "7B", "0.87", "Evo 2"),
]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--run_dir", default=str(harness.REPO / "runs" / "brca1"), help="Run (or export) directory to score with."
    )
    ap.add_argument("--step", type=int, default=None, help="Checkpoint step (default: newest complete).")
    ap.add_argument("--window", type=int, default=None, help="--window of score-variants (default: its default).")
    ap.add_argument("--rc", nargs="+", choices=["off", "on"], default=["off", "on"], help="Strand modes to run.")
    ap.add_argument("--nproc", type=int, default=1, help="Ranks (> 1: through the deepspeed launcher).")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vcf", default=str(VCF), help="Labelled VCF (INFO CLASS: FUNC, INT, LOF).")
    ap.add_argument("--out", default=str(OUT), help="Results path without suffix (.md and .json are written).")
    ap.add_argument("--render_only", action="store_true", help="Rewrite the .md (and baseline) from the .json only.")
    return ap.parse_args(argv)


def training(run_dir: str, source: str) -> dict:
    """Steps and tokens of the scored checkpoint (its client_state.json and the run's config), where known."""
    out = {"steps": None, "tokens": None, "seq_len": None}
    cfg_path = os.path.join(run_dir, "config.yaml")
    state_path = os.path.join(source, "client_state.json")
    if os.path.exists(cfg_path):
        out["seq_len"] = yaml.safe_load(open(cfg_path, encoding="utf-8"))["data"]["seq_len"]
    if os.path.exists(state_path):
        state = json.load(open(state_path, encoding="utf-8"))
        out["steps"] = state.get("step")
        if state.get("samples_consumed") is not None and out["seq_len"]:
            out["tokens"] = state["samples_consumed"] * out["seq_len"]
    return out


def score(args, fasta: str, work: str, rc: bool) -> dict:
    """One `megagenome score-variants` run; its JSON summary."""
    name = "rc" if rc else "fwd"
    flags = [args.run_dir, "--fasta", fasta, "--vcf", args.vcf, "--output", os.path.join(work, f"{name}.vcf.gz")]
    flags += [
        "--label_field",
        "CLASS",
        "--positive",
        "LOF",
        "--bootstrap",
        str(args.bootstrap),
        "--seed",
        str(args.seed),
    ]
    flags += ["--batch_size", str(args.batch_size), "--dtype", args.dtype, "--progress", "false", "--overwrite"]
    flags += ["--summary_json", os.path.join(work, f"{name}.json")]
    flags += ["--reverse_complement"] if rc else []
    flags += ["--window", str(args.window)] if args.window else []
    flags += ["--step", str(args.step)] if args.step is not None else []
    if args.nproc > 1:
        cmd = harness.deepspeed_cmd(args.nproc, "--module", "megagenome", "score-variants", *flags)
    else:
        cmd = [sys.executable, "-m", "megagenome", "score-variants", *flags]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=harness.REPO, env=harness.child_env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"score-variants failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    print(done.stdout.strip(), flush=True)
    with open(os.path.join(work, f"{name}.json"), encoding="utf-8") as fh:
        return json.load(fh)


def device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()} ({harness.hardware()})"
    return f"CPU: {harness.hardware()}"


def markdown(rows: list[dict], meta: dict, baseline: dict) -> str:
    lines = [
        f"# BRCA1 zero-shot variant-effect prediction ({meta['date']})",
        "",
        f"{meta['variants']:,} SNVs of Findlay et al. 2018 (BRCA1 saturation genome editing) scored by "
        f"`megagenome score-variants` with the model of `{meta['run_dir']}`: the log-likelihood of a window centred "
        "on the variant with the ALT minus with the REF (the Evo 2 method). AUROC of LOF against FUNC + INT "
        f"({meta['n_positive']:,} vs {meta['n_negative']:,}) of -score, with a stratified bootstrap 95% interval "
        f"({meta['bootstrap']} resamples, seed {meta['seed']}).",
        "",
        f"Hardware: {meta['hardware']}; {meta['ranks']} rank(s), {meta['dtype']}.",
        f"Command: `{meta['command']}`",
        "",
        "| model | parameters | training | window | rc | AUROC [95% CI] | variants/s | hardware |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        train = "-"
        if r["steps"] is not None:
            train = f"{r['steps']:,} steps" + (f", {r['tokens']:,} tokens" if r["tokens"] else "")
        ci = f" [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" if r["ci95"] else ""
        lines.append(
            f"| megagenome, {r['objective']} (`{meta['run_dir']}`) | {r['parameters']:,} | {train} | {r['window']} | "
            f"{'yes' if r['rc'] else 'no'} | {r['auroc']:.3f}{ci} | {r['variants_per_s']:,.1f} | {r['hardware']} |"
        )
    lo, hi = baseline["ci95"]
    lines.append(
        f"| composition only, no model: score 1 if the ALT is A or T, else 0 | 0 | - | - | - | {baseline['auroc']:.3f} "
        f"[{lo:.3f}, {hi:.3f}] | - | - |"
    )
    for model, size, value, source in PUBLISHED:
        lines.append(f"| {model} (published: {source}) | {size} | OpenGenome2 | - | - | {value} | - | GPU |")
    lines += [
        "",
        "The published Evo 2 models are trained on OpenGenome2 (trillions of bases, all domains of life); the model "
        "here is trained on the 1.18 Mb BRCA1 locus only, BRCA1 included, so the comparison is of the method and the "
        "pipeline, not of the models. variants/s counts ALT alleles scored per second of scoring (model loaded).",
        "",
        "Reading: an AUROC below 0.5 means the model finds LOF ALTs *more* likely than the others. The "
        "composition-only row shows why: LOF ALTs are more often A or T (stop codons TAA, TAG, TGA are A/T-rich), "
        "so a score that only prefers A/T ALTs, as a model knowing no more than that the locus is AT-rich would, "
        "ranks LOF as benign; a model this small, trained on 5M tokens of one locus, lands at that row's AUROC. "
        "Scoring functional constraint needs a model that has seen "
        "many genomes (Evo 2's rows); the pipeline (windows, scores, AUROC) is the same at any size.",
        "",
    ]
    return "\n".join(lines)


def composition_baseline(vcf: str, bootstrap: int, seed: int) -> dict:
    """AUROC (of -score, as for the models) of a score with no model: 1 if the ALT base is A or T, else 0, what a
    model that knows only the locus's AT-rich composition gives (stop codons, TAA/TAG/TGA, are A/T-rich)."""
    from megagenome.after_training.variant_scoring import auroc, bootstrap_interval

    with open(vcf, encoding="utf-8") as fh:
        rows = [line.split("\t") for line in fh if not line.startswith("#")]
    positive = np.array(["CLASS=LOF" in r[7] for r in rows])
    labelled = np.array(["CLASS=" in r[7] for r in rows])
    predictor = -np.array([float(r[4].upper() in ("A", "T")) for r in rows])
    predictor, positive = predictor[labelled], positive[labelled]
    return {"auroc": auroc(predictor, positive), "ci95": list(bootstrap_interval(predictor, positive, bootstrap, seed))}


def score_all(args, argv) -> dict:
    """Every --rc mode scored; the results file's content."""
    hw = device()
    rows, summaries = [], []
    with tempfile.TemporaryDirectory(prefix="brca1_vep-") as work:
        fasta = str(harness.copy_input(FASTA, work))  # pyfaidx writes its index beside the FASTA
        for mode in args.rc:
            s = score(args, fasta, work, mode == "on")
            ev = s["evaluation"]
            rows.append(
                {"objective": s["objective"], "parameters": s["parameters"], **training(args.run_dir, s["model"]),
                 "window": s["window"], "rc": s["reverse_complement"], "auroc": ev["auroc"], "ci95": ev["ci95"],
                 "variants_per_s": s["variants_per_s"], "seconds": s["seconds"], "hardware": hw}
            )  # fmt: skip
            summaries.append({k: v for k, v in s.items() if k not in ("outputs", "fasta")})  # temporary paths
    ev = summaries[0]["evaluation"]
    run_dir = (
        os.path.relpath(args.run_dir, harness.REPO)
        if os.path.abspath(args.run_dir).startswith(str(harness.REPO))
        else args.run_dir
    )
    meta = {
        "date": harness.today(),
        "run_dir": run_dir,
        "variants": summaries[0]["variants"],
        "n_positive": ev["n_positive"],
        "n_negative": ev["n_negative"],
        "bootstrap": args.bootstrap,
        "seed": args.seed,
        "hardware": hw,
        "ranks": summaries[0]["ranks"],
        "dtype": args.dtype,
        "command": harness.command("brca1_vep.py", harness.argv_of(argv)),
    }
    return {"meta": meta, "rows": rows, "published": PUBLISHED, "summaries": summaries}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render_only:
        with open(args.out + ".json", encoding="utf-8") as fh:
            result = json.load(fh)
    else:
        if not os.path.isfile(os.path.join(args.run_dir, "megagenome.json")) and not glob.glob(
            os.path.join(args.run_dir, "checkpoints", "*", "COMPLETE")
        ):
            sys.exit(f"{args.run_dir}: no complete checkpoint; train it first: bash launch/local.sh --config "
                     "configs/brca1_locus.yaml")  # fmt: skip
        result = score_all(args, argv)
    meta = result["meta"]
    meta["command"] = meta["command"].strip()
    if os.path.abspath(meta["run_dir"]).startswith(str(harness.REPO) + os.sep):
        meta["run_dir"] = os.path.relpath(meta["run_dir"], harness.REPO)
    result["baseline"] = composition_baseline(args.vcf, result["meta"]["bootstrap"], result["meta"]["seed"])
    harness.write_json(args.out + ".json", result, indent=2)
    harness.write_text(args.out + ".md", markdown(result["rows"], result["meta"], result["baseline"]))
    print(f"wrote {args.out}.md and {args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
