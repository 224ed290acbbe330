"""Context extension on the default genome: bits/base at a 4x longer context after continuing a short-context run
with rotary scaling (linear, yarn), without it (plain longer windows), and of the base model with no more training.

One `deepspeed --num_gpus N` launch of this script (a worker mode; CPU ranks on gloo) runs, in one process group,
`megagenome pretrain` on configs/tiny_transformer.yaml (E. coli K-12, its held-out range, its model and engine: ZeRO-1
+ bf16):

    base      --data.seq_len S (--model.max_seq_len S) for B steps of a B + E step schedule, stopped with a checkpoint
    linear    resumed from base's checkpoint at 4S (--model.max_seq_len 4S, --data.seq_len 4S) with
    yarn        --model.rope_scaling linear|yarn --model.rope_factor 4 --checkpoint.allow_context_change true
    none        or no scaling (unextended rotary: positions past S were never trained), for the last E steps

Every arm continues the same schedule with the same optimizer state and the same global batch of windows (4x the
tokens per step). Afterwards, in this process and in float32, the held-out bits/base at 4S of every arm's final
weights and of the base model's weights under each scaling (no extra training: none, linear, ntk, yarn), all over
the same held-out windows (the arms' --data.eval_windows windows of 4S spread over the held-out range); the base
model at its own context S beside them. Writes benchmarks/results/context_extension.{md,json} with the machine, its
load and the date.

    python benchmarks/context_extension.py [--nproc 2] [--short 256] [--base_steps 200] [--extra_steps 30]
"""

from __future__ import annotations

import datetime
import json
import pathlib
import shutil
import subprocess
import time

import harness

TINY = harness.REPO / "configs" / "tiny_transformer.yaml"
FACTOR = 4
ARMS = {"linear": "linear", "yarn": "yarn", "none": "none"}  # trained arm -> --model.rope_scaling
ZERO_SHOT = ("none", "linear", "ntk", "yarn")


def arm_flags(scaling: str, long: int) -> list[str]:
    """The flags of a continuation at context `long` with rotary scaling `scaling` (none: unscaled)."""
    flags = ["--model.max_seq_len", str(long), "--data.seq_len", str(long), "--model.rope_scaling", scaling]
    return flags + (["--model.rope_factor", str(FACTOR)] if scaling != "none" else [])


def scenarios(args, work: pathlib.Path, fasta: str) -> list[dict]:
    """Each scenario: its run directory and its flags over configs/tiny_transformer.yaml."""
    total = args.base_steps + args.extra_steps
    common = ["--data.fasta", fasta, "--train.max_steps", str(total), "--train.warmup_steps", str(args.warmup)]
    common += [
        "--data.eval_windows",
        str(args.eval_windows),
        "--train.eval_interval",
        "0",
        "--train.log_interval",
        "10",
    ]
    common += ["--checkpoint.interval", "0", "--log.progress", "false", "--log.tensorboard", "false"]
    base = ["--model.max_seq_len", str(args.short), "--data.seq_len", str(args.short)]
    base += ["--train.stop_at", str(args.base_steps), "--checkpoint.resume", "none"]
    out = [{"name": "base", "flags": common + base + ["--log.run_dir", str(work / "base")]}]
    ckpt = work / "base" / "checkpoints" / f"step_{args.base_steps:08d}"
    for name, scaling in ARMS.items():
        flags = arm_flags(scaling, args.short * FACTOR) + ["--checkpoint.allow_context_change", "true"]
        flags += ["--checkpoint.resume", str(ckpt), "--log.run_dir", str(work / name)]
        out.append({"name": name, "flags": common + flags})
    return out


def worker(spec_path: pathlib.Path) -> None:
    """Every scenario of the spec through pretrain.run in this process group; rank 0 writes each one's wall time."""
    from megagenome.config.load import config_from_args
    from megagenome.engine import engine
    from megagenome.run import pretrain

    spec = json.loads(spec_path.read_text())
    walls = {}
    for s in spec["scenarios"]:
        started = time.time()
        pretrain.run(config_from_args(["--config", str(TINY), *s["flags"]]), [str(TINY)], keep_process_group=True)
        walls[s["name"]] = time.time() - started
    if harness.rank() == 0:
        (spec_path.parent / "walls.json").write_text(json.dumps(walls))
    engine.shutdown()


def heldout(run_dir: pathlib.Path, model_cfg, data_run: pathlib.Path) -> tuple[float, float]:
    """(bits/base, bases) of run_dir's newest weights in a float32 model built with model_cfg, over the held-out
    windows of the run in data_run (its --data.seq_len and --data.eval_windows)."""
    from megagenome.after_training import quantize
    from megagenome.after_training.inference import build_model, read_weights
    from megagenome.config.load import load_config

    _, state, _, _ = read_weights(str(run_dir))
    data, _ = quantize.eval_data(model_cfg, load_config(str(data_run / "config.yaml")), None, None)
    try:
        batches = quantize.eval_batches(data)
    finally:
        data.close()
    return quantize.heldout_bits(build_model(model_cfg, {k: v.float() for k, v in state.items()}).eval(), batches)


def measure(args, work: pathlib.Path) -> list[dict]:
    """The table's rows: every arm's final weights, and the base model's under each scaling, at 4S; base at S."""
    from dataclasses import replace

    from megagenome.config.load import load_config
    from megagenome.observe.metrics import read_metrics

    long = args.short * FACTOR
    base_cfg = load_config(str(work / "base" / "config.yaml")).model
    rows = []
    bits, bases = heldout(work / "base", base_cfg, work / "base")
    rows.append({"model": "base", "extra_steps": 0, "context": args.short, "scaling": "none", "bits": bits})
    for scaling in ZERO_SHOT:
        factor = 1.0 if scaling == "none" else float(FACTOR)
        cfg = replace(base_cfg, max_seq_len=long, rope_scaling=scaling, rope_factor=factor)
        bits, bases = heldout(work / "base", cfg, work / "none")
        rows.append({"model": "base", "extra_steps": 0, "context": long, "scaling": scaling, "bits": bits})
    for name in ARMS:
        cfg = load_config(str(work / name / "config.yaml")).model
        bits, bases = heldout(work / name, cfg, work / "none")
        logged = [r for r in read_metrics(str(work / name / "metrics.jsonl")) if r.get("split") == "val"][-1]
        row = {"model": f"continued ({name})", "extra_steps": args.extra_steps, "context": long, "scaling": name}
        rows.append(row | {"bits": bits, "logged_bf16": logged["bits_per_base"], "bases": bases})
    return rows


def write(results: pathlib.Path, rows: list[dict], meta: dict) -> None:
    harness.write_json(results / "context_extension.json", {"meta": meta, "rows": rows}, indent=2)
    s, long = meta["short"], meta["short"] * FACTOR
    lines = [
        "# Context extension: rotary scaling vs plain longer windows (issue 15 part 4)",
        "",
        f"`{meta['command']}` on {meta['date']}; {meta['hardware']}; {meta['software']}.",
        f"Load (`uptime`) before: `{meta['uptime_before']}`; after: `{meta['uptime_after']}` (the machine is shared).",
        f"One launch of {meta['nproc']} CPU ranks, {meta['launch_s']:.0f} s; per run (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in meta["walls"].items())
        + ".",
        "",
        f"configs/tiny_transformer.yaml (E. coli K-12 MG1655, d_model 128, 4 blocks, ZeRO-1 + bf16, global batch "
        f"{meta['global_batch']} windows): base trained {meta['base_steps']} steps at context {s} of a "
        f"{meta['base_steps'] + meta['extra_steps']}-step cosine schedule, then each continuation resumed its "
        f"checkpoint at context {long} (x{FACTOR}) for the last {meta['extra_steps']} steps. Held-out bits/base "
        f"(float32, lower is better) on {meta['eval_windows']} windows of {long} bases spread over the held-out "
        f"range K-12-MG1655:4400001-4639675 ({meta['bases']:g} bases), all rows at {long} on the same windows except "
        f"the first (the base at its own context {s}, {meta['eval_windows']} windows of {s}).",
        "",
        "| model | extra steps at the long context | context | rotary scaling | held-out bits/base |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['extra_steps']} | {r['context']} | {r['scaling']} | {r['bits']:.4f} |")
    lines += ["", *meta["notes"]]
    harness.write_text(results / "context_extension.md", "\n".join(lines) + "\n")


def notes(rows: list[dict], meta: dict) -> list[str]:
    """The measured headline, stated from the rows (no figure written by hand): each arm against the unscaled one."""
    by = {(r["model"], r["context"], r["scaling"]): r["bits"] for r in rows}
    s, long = meta["short"], meta["short"] * FACTOR

    def ranked(values: dict) -> str:
        parts = []
        for k in sorted(values, key=values.get):
            delta = "" if k == "none" else f" ({values[k] - values['none']:+.4f})"
            parts.append(f"{k} {values[k]:.4f}{delta}")
        return ", ".join(parts)

    cont = {k: by[(f"continued ({k})", long, k)] for k in ARMS}
    zero = {k: by[("base", long, k)] for k in ZERO_SHOT}
    return [
        f"- After the same {meta['extra_steps']} extra steps at {long} (vs unscaled): {ranked(cont)} bits/base.",
        f"- The base model at {long} with no extra training (vs unscaled): {ranked(zero)}; at its own context {s}: "
        f"{by[('base', s, 'none')]:.4f}.",
        "- The continued runs' own final evaluations (bf16, the run's engine): "
        + ", ".join(f"{r['scaling']} {r['logged_bf16']:.4f}" for r in rows if "logged_bf16" in r)
        + ". One seed per arm; the run-to-run spread was not measured.",
    ]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, worker=True)
    ap.add_argument("--nproc", type=int, default=2, help="CPU ranks")
    ap.add_argument("--short", type=int, default=256, help="the base model's context S (the long one is 4S)")
    ap.add_argument("--base_steps", type=int, default=200)
    ap.add_argument("--extra_steps", type=int, default=30, help="steps of every continuation at 4S")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval_windows", type=int, default=48)
    ap.add_argument("--timeout_s", type=float, default=1200.0)
    ap.add_argument("--results_dir", type=pathlib.Path, default=harness.RESULTS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    work = harness.work_dir("mg-ctx-")
    fasta = harness.copy_input(harness.ECOLI, work)
    spec = work / "spec.json"
    spec.write_text(json.dumps({"scenarios": scenarios(args, work, str(fasta))}))
    uptime_before = uptime()
    started = time.time()
    env = harness.child_env(OMP_NUM_THREADS="1")
    rc, tail = harness.launch_worker(
        __file__, args.nproc, spec, work / "worker.log", args.timeout_s, env=env, tail=6000
    )
    launch_s = time.time() - started
    if not (work / "walls.json").exists():
        raise SystemExit(
            f"context_extension.py: the launch did not finish (exit code {rc}); {work}/worker.log:\n{tail}"
        )
    import torch

    torch.set_num_threads(args.nproc)
    rows = measure(args, work)
    cfg = json.loads((work / "base" / "ds_config.json").read_text())
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "command": harness.command("context_extension.py", harness.argv_of(argv)),
        "hardware": harness.hardware(),
        "software": harness.software(),
        "uptime_before": uptime_before,
        "uptime_after": uptime(),
        "nproc": args.nproc,
        "launch_s": launch_s,
        "walls": json.loads((work / "walls.json").read_text()),
        "short": args.short,
        "base_steps": args.base_steps,
        "extra_steps": args.extra_steps,
        "eval_windows": args.eval_windows,
        "global_batch": cfg["train_batch_size"],
        "bases": rows[-1]["bases"],
    }
    meta["notes"] = notes(rows, meta)
    write(args.results_dir, rows, meta)
    print((args.results_dir / "context_extension.md").read_text())
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
