"""Masked DNA LMs on the bundled E. coli genome (MLM transformer, GPN, Caduceus RC-PS and post hoc), and BRCA1 VEP.

Held-out masked bits/base at equal parameters, tokens and wall time, and each model's zero-shot AUROC on the BRCA1
saturation-editing set.

Arms (each a `bash launch/local.sh` run on 2 CPU ranks, the default job's genome, held-out range and recipe:
configs/tiny_transformer.yaml's data and train sections; every model 854K to 859K parameters, within 1%):
  mlm_transformer   configs/tiny_mlm.yaml: the transformer twin with --model.objective mlm
  gpn               configs/tiny_gpn.yaml: GPN's dilated CNN, 16 blocks of width 64
  caduceus_ph       configs/tiny_caduceus.yaml --model.rc_equivariance post_hoc: a plain BiMamba, RC augmentation
                    in training, both strands averaged at inference
  caduceus_ps       configs/tiny_caduceus.yaml: Caduceus-PS, RC-equivariant by parameter sharing
each at the default budget (600 steps of 8,192 tokens: equal tokens), and each non-transformer arm again as
<arm>@wall for the MLM transformer's training time: 600 steps x the arm's median training tokens/s over the
transformer's (evaluations, start-up and the Markov baselines are not counted: one evaluation of the 256 masked
held-out windows takes Caduceus minutes, which would otherwise eat its whole budget), with warmup and the WSD
decay scaled alike and one evaluation at the end. Each reports held-out masked bits/base (the cross entropy in bits
of the 15% masked positions of every held-out window, the same positions and corruptions for every arm) with its
eval curve, against the masked baseline: the best two-sided k-mer context model (k bases each side, k = 0..4) under
the same masking, fitted on the training split's two strands and scored on the same masked positions
(megagenome/data/masked_baseline.py; every arm shares configs/tiny_mlm.yaml's data section, so it is computed once
per invocation, 16 evaluation windows for a smoke run), with the strongest order-k Markov chain (causal, both
strands) for scale only.

BRCA1 (--vep, on by default): each arm's model section (objective mlm) over configs/brca1_locus.yaml (600 steps of
16 x 512 bases, 2 ranks), then the 3,893 SNVs of Findlay et al. 2018 scored by `megagenome score-variants` (GPN's
masked marginal, what it computes for an mlm model; benchmarks/brca1_vep.py's score()), forward and with
--reverse_complement, except for the two Caduceus arms, whose scores are reverse-complement symmetric by
construction (RC-PS) or by their inference (post hoc: both strands averaged), so RC scoring would repeat the
forward score. AUROC of LOF against FUNC + INT with the stratified bootstrap 95% interval, beside the causal
transformer's row of benchmarks/results/brca1_vep.json and the composition-only baseline.

Arms run cheapest first: the transformer's and GPN's E. coli and BRCA1 runs (under an hour), then the two Caduceus
arms' E. coli runs, then their BRCA1 runs. Designed to finish in pieces: one invocation spends at most
--budget_minutes (default 40) on 2 cores. It starts no run once the budget is spent, and a training run still going
at the deadline is stopped (recorded as stopped, not failed); the next invocation with the same --work resumes it
from its last checkpoint (every 50 steps). The results files are rewritten after every run and keep what earlier
invocations measured: an arm recorded there (with the same --steps, --variants, --bootstrap and --seed) is not run
again, even from an empty --work, so committing the files after each invocation carries the figures to the next
session; each arm names the date, commit and machine it was measured on. An arm whose run directory under --work
holds a summary.json is read, not run again, and so is a scoring run whose summary JSON is there. A failed arm is
recorded and the others go on. Writes benchmarks/results/mlm_architectures.{json,md}; --render_only rewrites the
.md from the .json; --steps and --variants are for smoke runs (with --out elsewhere).

    python benchmarks/mlm_architectures.py [--work /tmp/mlm_arch] [--arms mlm_transformer gpn caduceus_ph caduceus_ps]
        [--budgets tokens wall] [--vep | --no-vep] [--budget_minutes 40] [--render_only]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable

import brca1_vep
import harness
from architectures import model_flags
from cpu_recipes import collect

from megagenome.config.load import load_config
from megagenome.data import masked_baseline
from megagenome.data.dataset import build_genome_data

ARMS = {  # name: (config, extra flags); the order they run in
    "mlm_transformer": ("configs/tiny_mlm.yaml", []),
    "gpn": ("configs/tiny_gpn.yaml", []),
    "caduceus_ph": ("configs/tiny_caduceus.yaml", ["--model.rc_equivariance", "post_hoc"]),
    "caduceus_ps": ("configs/tiny_caduceus.yaml", []),
}
REFERENCE = "mlm_transformer"
EXPENSIVE = ("caduceus_ph", "caduceus_ps")  # a step costs 1.7x (post hoc) and 3.3x (PS) the transformer's on CPU
BRCA1_CONFIG = "configs/brca1_locus.yaml"
STEPS = 600  # the default job's budget (configs/tiny_transformer.yaml)
CHECKPOINT_INTERVAL = 50  # an arm stopped at an invocation's budget resumes from here
SETTINGS = ("steps", "variants", "bootstrap", "seed")  # a recorded arm is kept when these match
RC_REDUNDANT = {
    "caduceus_ps": "RC-PS: exactly reverse-complement equivariant by construction",
    "caduceus_ph": "post hoc: its inference averages both strands",
}
CAUSAL = harness.RESULTS / "brca1_vep.json"
LOAD_NOTE = (
    "Load: the 1-minute load average before -> after an arm this invocation ran (2: its two ranks alone); an arm "
    "read from --work shows -. The runs are deterministic, so held-out bits/base at equal tokens do not depend on the "
    "load; wall s and tokens/s do, and compare only between quiet arms (the @wall step counts come from tokens/s "
    "measured at different times, under whatever else the machine ran then)."
)


def wall_steps(steps: int, tokens_per_s: float, reference_tokens_per_s: float) -> int:
    """Steps of an arm for the reference's training time: `steps` (the reference's, at the same tokens per step)
    times the ratio of their median training throughputs; at least 3."""
    return max(3, round(steps * tokens_per_s / reference_tokens_per_s))


def budget_flags(steps: int, evaluations: int = 1) -> list[str]:
    """A run of `steps` steps with the default recipe's proportions (warmup 50/600; the WSD decay is a fraction of
    max_steps already) and `evaluations` evenly spaced evaluations, the last at the end."""
    return ["--train.max_steps", str(steps), "--train.warmup_steps", str(max(1, round(steps * 50 / STEPS))),
            "--train.eval_interval", str(max(1, steps // evaluations))]  # fmt: skip


def smoke_flags(steps: int | None) -> list[str]:
    """--steps (smoke runs only): every training run `steps` steps, logging every other step and evaluating 16
    windows; none otherwise."""
    if not steps:
        return []
    return [*budget_flags(steps, 3), "--train.log_interval", "2", "--data.eval_windows", "16"]


def subset_vcf(vcf: pathlib.Path, dest: pathlib.Path, n: int) -> pathlib.Path:
    """--variants (smoke runs only): n records of the VCF, evenly spaced over it (both classes), its header kept."""
    lines = vcf.read_text().splitlines(keepends=True)
    header = [line for line in lines if line.startswith("#")]
    records = [line for line in lines if not line.startswith("#")]
    every = max(1, len(records) // n)
    return harness.write_text(dest, "".join(header + records[::every][:n]))


def arm_flags(name: str) -> list[str]:
    """The arm's model section as flags (for configs/brca1_locus.yaml, whose model is the causal transformer's)."""
    config, extra = ARMS[name]
    return [*model_flags(config), *extra]


def rc_modes(name: str) -> list[bool]:
    """Strand modes to score: forward, and the reverse-complement average where it is not the forward score."""
    return [False] if name in RC_REDUNDANT else [False, True]


def causal_rows(path=CAUSAL) -> list[dict]:
    """The causal transformer's rows of benchmarks/results/brca1_vep.json ([] when it is not there)."""
    if not pathlib.Path(path).exists():
        return []
    result = json.loads(pathlib.Path(path).read_text())
    return [{**r, "run_dir": result["meta"]["run_dir"], "date": result["meta"]["date"]} for r in result["rows"]]


class Stopped(Exception):
    """A run stopped (or not started) at the invocation's deadline: it resumes from --work when run again."""


def launch(run_dir: pathlib.Path, config: str, *flags: str, deadline: float) -> dict:
    """Runs one arm unless it already finished (its summary.json), until the deadline (time.monotonic()): killed
    there, it raises Stopped and resumes from its last checkpoint at the next invocation. Returns the load averages
    around the run (ran False when read)."""
    if (run_dir / "summary.json").exists():
        return {"ran": False}
    left = deadline - time.monotonic()
    if left < 60:
        raise Stopped("not started: this invocation's budget is spent")
    cmd = ["bash", "launch/local.sh", "--config", config, *flags, "--log.run_dir", str(run_dir), "--log.progress",
           "false", "--checkpoint.interval", str(CHECKPOINT_INTERVAL)]  # fmt: skip
    log = run_dir.parent / f"{run_dir.name}.log"
    before = harness.load_average()
    rc, how = harness.run_session(cmd, log, left, env=harness.child_env())
    if how == "timeout":
        raise Stopped(f"stopped at this invocation's budget after {left / 60:.0f} min; rerun with the same --work")
    if rc != 0:
        raise RuntimeError(f"exit {rc}: {' '.join(cmd)} (log: {log})")
    return {"ran": True, "load_before": before, "load_after": harness.load_average(), "command": " ".join(cmd[1:])}


def measured_on() -> dict:
    """The date, commit and machine an arm's figures come from (an arm may come from an earlier invocation)."""
    return {"date": harness.today(), "commit": harness.git_commit(), "hardware": harness.hardware()}


def _run(record: dict, section: str, name: str, work: Callable[[], dict]) -> bool:
    """work() into record[section][name]; a failure (a launch or a scoring run that exits non-zero, a run directory
    without what it should hold) is recorded with its message, not raised, so that the other arms still run. False
    when the invocation's budget is spent (the run was stopped or not started: recorded as stopped)."""
    try:
        record[section][name] = work() | {"measured": measured_on()}
    except Stopped as e:
        record[section][name] = {"stopped": str(e)}
        print(f"mlm_architectures: {section} {name}: {e}", file=sys.stderr, flush=True)
        return False
    except (Exception, SystemExit) as e:  # brca1_vep.score() exits on a failed score-variants
        record[section][name] = {"failed": f"{type(e).__name__}: {e}"[:2000]}
        print(f"mlm_architectures: {section} {name} failed: {e}", file=sys.stderr, flush=True)
    return True


def done(entry: dict | None) -> bool:
    """Whether a recorded arm holds figures (neither failed nor stopped): it is kept, not run again."""
    return entry is not None and "failed" not in entry and "stopped" not in entry


def learning_arm(work: pathlib.Path, name: str, *flags: str, deadline: float) -> dict:
    config, extra = ARMS[name.split("@")[0]]
    ran = launch(work / name, config, *extra, *flags, deadline=deadline)
    rows = harness.read_jsonl(work / name / "metrics.jsonl")
    val = [r for r in rows if r.get("split") == "val"]
    return {**collect(work / name), **ran, "masked_positions": val[-1]["bases"] if val else None}


def vep_arm(work: pathlib.Path, name: str, args, fasta: str, vcf: str, steps: int | None, deadline: float) -> dict:
    """Train the arm on the BRCA1 locus (unless done), then score the SNVs (each strand mode unless scored; scoring
    is not stopped at the deadline: minutes, where training is the hour)."""
    run_dir = work / f"brca1_{name}"
    flags = arm_flags(name) + smoke_flags(steps)
    ran = launch(run_dir, BRCA1_CONFIG, *flags, deadline=deadline)
    summary = json.loads((run_dir / "summary.json").read_text())
    scoring = run_dir / "vep"
    scoring.mkdir(exist_ok=True)
    vep_args = brca1_vep.parse_args(
        ["--run_dir", str(run_dir), "--nproc", str(args.nproc), "--batch_size", str(args.batch_size),
         "--bootstrap", str(args.bootstrap), "--seed", str(args.seed), "--vcf", vcf]
    )  # fmt: skip
    rows = []
    for rc in rc_modes(name):
        done = scoring / f"{'rc' if rc else 'fwd'}.json"
        s = json.loads(done.read_text()) if done.exists() else brca1_vep.score(vep_args, fasta, str(scoring), rc)
        ev = s["evaluation"]
        rows.append({"objective": s["objective"], "parameters": s["parameters"], "window": s["window"],
                     "rc": s["reverse_complement"], "auroc": ev["auroc"], "ci95": ev["ci95"],
                     "n_positive": ev["n_positive"], "n_negative": ev["n_negative"], "variants": s["variants"],
                     "variants_per_s": s["variants_per_s"], "ranks": s["ranks"],
                     **brca1_vep.training(str(run_dir), s["model"])})  # fmt: skip
    return {"rows": rows, "heldout_bits_per_base": summary["heldout_bits_per_base"], "wall_s": summary["wall_s"],
            "tokens_per_s_median": summary["tokens_per_s_median"], **ran}  # fmt: skip


def order(arms: list[str], budgets: list[str], vep: bool) -> list[tuple[str, str]]:
    """(phase, arm) in the order they run: every phase of the cheap arms (the transformer, GPN), then the Caduceus
    arms' E. coli runs, then their BRCA1 runs (hours each). The reference's E. coli run comes first whenever an
    @wall arm needs its throughput; phase "learning" is an arm's equal-tokens run and its @wall run."""
    wanted = [a for a in ARMS if a in arms or (a == REFERENCE and "wall" in budgets)]
    phases = ["learning", "vep"] if vep else ["learning"]
    cheap = [(phase, a) for a in wanted if a not in EXPENSIVE for phase in phases]
    dear = [(phase, a) for phase in phases for a in wanted if a in EXPENSIVE]
    return [(phase, a) for phase, a in cheap + dear if phase == "learning" or a in arms]


def run_all(args, record: dict, write, deadline: float) -> None:
    """Every phase of every arm in order() that the record does not hold yet, the results rewritten after each
    (write(record)), until the deadline (time.monotonic()): then the run in progress is stopped and nothing else
    starts."""
    work = pathlib.Path(args.work)
    fasta = str(harness.copy_input(brca1_vep.FASTA, work / "vep_input", keep=True)) if args.vep else None
    vcf = str(brca1_vep.VCF)
    if args.vep and args.variants:
        vcf = str(subset_vcf(brca1_vep.VCF, work / "vep_input" / f"subset_{args.variants}.vcf", args.variants))
    steps = args.steps  # None: the configs' budget
    for phase, name in order(args.arms, args.budgets, args.vep):
        if phase == "vep":
            if not done(record["vep"].get(name)):
                go_on = _run(
                    record, "vep", name, functools.partial(vep_arm, work, name, args, fasta, vcf, steps, deadline)
                )
                write(record)
                if not go_on:
                    return
            continue
        if not done(record["learning"].get(name)):
            go_on = _run(
                record,
                "learning",
                name,
                functools.partial(learning_arm, work, name, *smoke_flags(steps), deadline=deadline),
            )
            write(record)
            if not go_on:
                return
        reference, own, wall = record["learning"].get(REFERENCE, {}), record["learning"][name], f"{name}@wall"
        if "wall" in args.budgets and name != REFERENCE and done(reference) and done(own):
            if done(record["learning"].get(wall)):
                continue
            n = wall_steps(own["steps"], own["tokens_per_s_median"], reference["tokens_per_s_median"])
            flags = budget_flags(n) + smoke_flags(steps)[6:]  # a smoke run's logging and evaluation windows
            go_on = _run(
                record, "learning", wall, functools.partial(learning_arm, work, wall, *flags, deadline=deadline)
            )
            write(record)
            if not go_on:
                return


def carried(previous: dict, record: dict) -> dict:
    """record with the arms a previous record holds figures for, when it was made with the same SETTINGS (an arm
    measured by an earlier invocation, perhaps in another session, is not run again)."""
    if any(previous.get(k) != record.get(k) for k in SETTINGS):
        return record
    for section in ("learning", "vep"):
        record[section] = {k: v for k, v in previous.get(section, {}).items() if done(v)} | record[section]
    record["arms"] = list(dict.fromkeys([*previous.get("arms", []), *record["arms"]]))  # still pending: still named
    for key in ("causal", "composition"):  # the BRCA1 table's reference rows, kept by a --no-vep invocation
        if key in previous and key not in record:
            record[key] = previous[key]
    return record


def masked_baselines(steps: int | None) -> dict[str, float]:
    """{k: held-out masked bits/base} of the two-sided k-mer baselines of the arms' data (configs/tiny_mlm.yaml's
    data section; a smoke run's 16 evaluation windows): ~10 s on E. coli."""
    cfg = load_config(str(harness.REPO / ARMS[REFERENCE][0])).data
    if steps:
        cfg = dataclasses.replace(cfg, eval_windows=16)
    with build_genome_data(cfg, "mlm") as data:
        return {str(k): v for k, v in masked_baseline.of_run(data).items()}


# ----- the report ---------------------------------------------------------------------------------------------------


def markdown(record: dict) -> str:
    lines = ["# Masked DNA LMs on E. coli: MLM transformer, GPN and Caduceus (RC-PS, post hoc); BRCA1 zero-shot", ""]
    lines += harness.header(record) + [f"- work: `{record['work']}` (run directories, one per arm)", ""]
    lines += ["## Held-out masked bits/base (2 CPU ranks, ZeRO-1 + bf16, the default job's genome and recipe)", ""]
    rows = []
    masked = record.get("masked_baseline") or {}
    best = min(masked, key=masked.get) if masked else None
    for name, r in record["learning"].items():
        if not done(r):
            rows.append([name, _not_done(r), *["-"] * 10])
            continue
        model = r["heldout_bits_per_base"]
        rows.append([name, f"{r['parameters']:,}", f"{r['steps']:,}", f"{r['tokens']:,}", f"{model:.4f}",
                     f"{masked[best]:.4f} (k={best})" if best else "-", f"{masked[best] - model:+.4f}" if best else "-",
                     f"{r['best_markov_bits_per_base']:.4f} (order {r['best_markov_order']})", f"{r['wall_s']:.0f}",
                     f"{r['tokens_per_s_median']:,.0f}", _load(r),
                     f"{r['masked_positions']:,}" if r.get("masked_positions") else "-"])  # fmt: skip
    cols = ["arm", "parameters", "steps", "tokens", "held-out masked bits/base", "best masked baseline",
            "margin (+: below it)", "best Markov (causal, for scale)", "wall s", "tokens/s", "load",
            "masked positions scored"]  # fmt: skip
    lines += harness.table(cols, rows)
    pending = [a for a in record["arms"] if a not in record["learning"]]
    lines += [""] + (
        [f"Not run yet (this file is rewritten after every arm): {', '.join(pending)}.", ""] if pending else []
    )
    lines += [LOAD_NOTE, ""]
    lines += ["Eval curves (step, held-out masked bits/base):", ""]
    lines += [f"- {n}: " + ", ".join(f"({s}, {b:.4f})" for s, b in r["curve"])
              for n, r in record["learning"].items() if "curve" in r]  # fmt: skip
    lines += [
        "",
        "Held-out masked bits/base: at every evaluation each of the held-out range's windows (the last ~5% of the "
        "chromosome, 1024 bases each, spread evenly over it) has 15% of its bases selected (80% of them replaced by "
        "<mask>, 10% by a random base, 10% kept), seeded by the window's position, so every arm and every evaluation "
        "scores the same positions with the same corrupted inputs (megagenome/data/dataset.py eval_batch); the "
        "figure is the cross entropy in bits of the original base at those positions. The masked baseline is what "
        "counting does with what the model sees: each selected base predicted from the 2k + 1 input symbols around "
        "it (A, C, G, T, or no base for <mask>, N and outside the window; the centre is the corrupted input itself), "
        "counts from the training split's windows masked the same way, both strands, seven masking passes, "
        "Krichevsky-Trofimov smoothing (megagenome/data/masked_baseline.py); k = 0..4: "
        + (" ".join(f"{v:.4f}" for v in masked.values()) if masked else "not computed")
        + ". An arm below it has learned more than counts of its neighbourhood. The Markov baseline predicts each "
        "base from the k before it (fitted on the training split, both strands), a one-sided context where a "
        "masked model sees both flanks (less the 15% corrupted): it is there for scale, not as a bound.",
        "",
        "@wall: the arm again for the MLM transformer's training time at equal tokens per step: 600 x its median "
        "tokens/s over the transformer's steps (warmup and the WSD decay scaled alike, one evaluation at the end); "
        "evaluations, start-up and Markov fitting are not counted in either.",
        "",
    ]
    lines += _vep_lines(record)
    lines += _measured_lines(record)
    lines += _fairness_lines()
    return "\n".join(lines) + "\n"


def _not_done(r: dict) -> str:
    key = "failed" if "failed" in r else "stopped"
    return f"{key}: " + r[key].splitlines()[0][:120]


def _measured_lines(record: dict) -> list[str]:
    """Where each arm was measured, when any arm comes from another day, commit or machine than the header's."""
    arms = [(f"{section} {name}", r["measured"]) for section in ("learning", "vep")
            for name, r in record.get(section, {}).items() if done(r) and "measured" in r]  # fmt: skip
    header = (record.get("date"), record.get("hardware"))
    if all((m["date"], m["hardware"]) == header for _, m in arms):
        return []
    lines = ["Measured by more than one invocation; each arm's date, commit and machine:", ""]
    return lines + [f"- {arm}: {m['date']}, {m['commit']}, {m['hardware']}" for arm, m in arms] + [""]


def _load(r: dict) -> str:
    return f"{r['load_before']:.1f} -> {r['load_after']:.1f}" if r.get("ran") else "-"


def _ci(row: dict) -> str:
    return (
        f"{row['auroc']:.3f} [{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}]" if row.get("ci95") else f"{row['auroc']:.3f}"
    )


def _vep_lines(record: dict) -> list[str]:
    vep = record.get("vep") or {}
    if not vep and not record.get("causal"):
        return []
    lines = ["## BRCA1 zero-shot variant-effect prediction (Findlay et al. 2018 SGE, LOF vs FUNC + INT)", ""]
    rows = []
    for name, v in vep.items():
        if not done(v):
            rows.append([name, _not_done(v), *["-"] * 6])
            continue
        for r in v["rows"]:
            train = f"{r['steps']:,} steps, {r['tokens']:,} tokens" if r.get("tokens") else "-"
            rc = "yes" if r["rc"] else ("no" + (f" ({RC_REDUNDANT[name]})" if name in RC_REDUNDANT else ""))
            rows.append([name, f"{r['parameters']:,}", train, f"{v['heldout_bits_per_base']:.4f} (masked)",
                         r["window"], rc, _ci(r), f"{r['variants_per_s']:,.1f}"])  # fmt: skip
    for r in record.get("causal") or []:
        if r["objective"] == "clm":
            train = f"{r['steps']:,} steps, {r['tokens']:,} tokens" if r.get("tokens") else "-"
            name = f"causal transformer (`{r['run_dir']}`, brca1_vep.md, {r['date']})"
            rc = "yes" if r["rc"] else "no"
            rows.append(
                [name, f"{r['parameters']:,}", train, "-", r["window"], rc, _ci(r), f"{r['variants_per_s']:,.1f}"]
            )
    base = record.get("composition")
    if base:
        rows.append(
            ["composition only, no model: score 1 if the ALT is A or T", "0", "-", "-", "-", "-", _ci(base), "-"]
        )
    cols = ["model", "parameters", "training (configs/brca1_locus.yaml)", "held-out bits/base (last 50 kb)",
            "window", "rc", "AUROC [95% CI]", "variants/s"]  # fmt: skip
    lines += harness.table(cols, rows)
    first = next((r for v in vep.values() for r in v.get("rows", [])), None)
    counts = f" ({first['n_positive']:,} LOF vs {first['n_negative']:,})" if first else ""
    lines += [
        "",
        f"Each masked model is trained by `bash launch/local.sh --config {BRCA1_CONFIG}` with its arm's model section "
        "as flags (2 ranks, 600 steps of 16 x 512 bases, that config's cosine schedule at 2e-3, 4 passes over the "
        "1.18 Mb locus, BRCA1 itself included), then scored by `megagenome score-variants` over all 3,893 SNVs "
        "(benchmarks/brca1_vep.py's score(), 2 ranks: the same scores as one process) with GPN's masked marginal: "
        "the REF window (512 bases, the variant at its centre) with the variant's base masked, log p(ALT) - "
        f"log p(REF) there. AUROC of LOF against FUNC + INT{counts} of -score, stratified bootstrap 95% interval "
        f"({record.get('bootstrap', 1000)} resamples, seed {record.get('seed', 0)}). rc yes: the mean of the scores "
        "of both strands (the windows reverse-complemented). The causal transformer's rows are read from "
        "benchmarks/results/brca1_vep.json (the same config and budget, objective clm, the Evo 2 method: the ALT "
        "window's log-likelihood minus the REF window's), not rerun here. Held-out bits/base of a masked model (the "
        "masked positions of the last 50 kb) and of the causal one are not the same quantity.",
        "",
        "Reading: below 0.5, the model finds LOF ALTs more likely than the others, as the composition-only row does "
        "(stop codons are A/T-rich, the locus too). Models of 0.86M parameters trained on one 1.18 Mb locus learn its "
        "composition and little of its constraint (benchmarks/results/brca1_vep.md); this compares the families at "
        "that size, not what they do at scale.",
        "",
    ]
    return lines


def _fairness_lines() -> list[str]:
    return [
        "## What is not compared fairly here",
        "",
        "- Width and depth differ by design at equal parameters (each config's header says why): the transformer 128 "
        "x 4 layers, GPN 64 x 16 blocks (two cycles of its dilation schedule, a 2,045-base receptive field), "
        "Caduceus 128 x 6 BiMamba blocks (no MLP; dt_rank 16 for the parameter count). Caduceus-PS's stream is "
        "256 wide for a 128-wide model's parameters: twice the activations and FLOPs of the others per token.",
        "- Wall time and tokens/s: the selective scan runs in float32 through mambapy's parallel scan (no fused CPU "
        "kernel; the CUDA one, mamba_ssm, is not used on CPU), memory-bound over (batch, T, 256 channels, 16 states) "
        "tensors: on a GPU with mamba_ssm the ratio to the others would be another. The @wall arms measure this "
        "implementation on this CPU, and their step counts use tokens/s measured hours apart on a shared machine.",
        "- The recipe is the transformer's (WSD at 4e-3, 600 steps, micro batch 4): tuned for neither GPN nor "
        "Caduceus; the papers train them with other schedules, widths and far more tokens.",
        "- Caduceus post hoc is evaluated as it is meant to be used, both strands averaged in eval mode (twice the "
        "inference cost); the others see one strand at evaluation. All arms train with the same reverse-complement "
        "augmentation (rc_prob 0.5), which RC-PS does not need.",
        "- The masked bits/base and the causal model's bits/base are different tasks (both flanks vs the left one): "
        "only the masked arms compare with each other; the BRCA1 AUROC is the one figure shared with the causal "
        "model.",
        "",
    ]


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--work", default="/tmp/mlm_arch", help="run directories, one per arm (kept)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument(
        "--budgets",
        nargs="+",
        default=["tokens", "wall"],
        choices=["tokens", "wall"],
        help="tokens: the 600-step runs; wall: the @wall runs too (which need them)",
    )
    ap.add_argument("--vep", action=argparse.BooleanOptionalAction, default=True, help="the BRCA1 arms")
    ap.add_argument("--steps", type=int, help="smoke runs only: every training run this many steps, 16 eval windows")
    ap.add_argument("--variants", type=int, help="smoke runs only: score this many of the SNVs (evenly spaced)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks of score-variants")
    ap.add_argument("--batch_size", type=int, default=32, help="score-variants' windows per batch")
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(harness.RESULTS / "mlm_architectures"), help="results path, no suffix")
    ap.add_argument("--render_only", action="store_true", help="rewrite the .md from the .json")
    ap.add_argument("--budget_minutes", type=float, default=40, help="stop runs after this long (resume: run again)")
    args = ap.parse_args(harness.argv_of(argv))
    deadline = time.monotonic() + 60 * args.budget_minutes
    out = pathlib.Path(args.out)

    def write(record: dict) -> None:
        harness.write_results(out.parent, out.name, record, markdown(record))

    if args.render_only:
        record = json.loads(out.with_suffix(".json").read_text())
        write(record)
        print(out.with_suffix(".md").read_text())
        return 0
    os.chdir(harness.REPO)  # the configs name their files relative to the repository
    record = {"date": harness.today(), "hardware": harness.hardware(), "software": harness.software(),
              "command": harness.command("mlm_architectures.py", harness.argv_of(argv)), "work": args.work,
              "arms": list(args.arms), "budgets": list(args.budgets), "steps": args.steps, "variants": args.variants,
              "bootstrap": args.bootstrap,
              "seed": args.seed, "learning": {}, "vep": {}}  # fmt: skip
    if args.vep:
        record["causal"] = causal_rows()
        record["composition"] = brca1_vep.composition_baseline(str(brca1_vep.VCF), args.bootstrap, args.seed)
    if out.with_suffix(".json").exists():
        record = carried(json.loads(out.with_suffix(".json").read_text()), record)
    record["masked_baseline"] = masked_baselines(args.steps)
    run_all(args, record, write, deadline)
    write(record)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
