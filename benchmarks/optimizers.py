"""Optimizers and schedules side by side on the default genome and model (issue 15, part 5).

    python benchmarks/optimizers.py [--steps 100] [--ranks 2] [--lrs adamw=1e-3,2e-3 muon=0.01,0.02 ...]

Every arm trains configs/tiny_transformer.yaml's model (d_model 128, 4 layers) on its genome (E. coli K-12 MG1655, the
last ~5% held out) for the same --steps optimizer steps of its batch (16 windows of 512 bases: the same token budget and
the same windows in the same order for every arm), warmup 10% of the steps, then evaluates the whole held-out range
once. Per optimizer, each learning rate of its sweep is one arm (the sweep is written into the table); every AdamW LR is
also run with the warmup-stable-decay schedule (decay over the last 20% of the steps, 1-sqrt shape). The engine is
ZeRO-0 in fp32 (ds_configs/zero0.json) for every arm, because LAMB and Adafactor are refused where DeepSpeed hands
the optimizer flat partitions (ZeRO 1-3, the bf16 wrapper): the comparison is then of the optimizers alone.

Noise: the first arm (AdamW at its first LR) is run again at the end as a control; the table gives its two
held-out values and step times, and the load average before and after. All arms run in one `deepspeed` launch
(pretrain.run per arm in one process group). Memory: a 2-step run per optimizer at ZeRO-0 and at ZeRO-2 (fp32) of a
~19M-parameter model (d_model 512, 6 layers, micro batch 1, so that model states dominate) gives (a) memory.json's
optimizer-state bytes per parameter (one data-parallel replica: the states are created at the first step, so the
probe after step 1 sees them) and (b) rank 0's peak RSS during the arm minus its RSS at the arm's start, per
parameter (the peak reset through /proc/self/clear_refs: harness.reset_peak, as in benchmarks/sweep.py); refused
combinations are named with the reason.

Writes benchmarks/results/optimizers.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import harness

TINY = harness.REPO / "configs" / "tiny_transformer.yaml"
DEFAULT_LRS = {
    "adamw": [2e-3, 4e-3],
    "lamb": [5e-3, 2e-2],
    "adafactor": [1e-2, 3e-2],
    "muon": [0.02, 0.05],  # --train.muon_lr (Muon's matrices); the AdamW half at --train.lr 2e-3
    "adam8bit": [2e-3, 4e-3],
}
MUON_ADAM_LR = 2e-3
MEMORY_MODEL = ["--model.d_model", "512", "--model.n_layer", "6", "--model.n_head", "8"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, worker=True, paragraph=True)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per arm (the token budget)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--lrs", nargs="*", default=[], help="optimizer=lr1,lr2 (overrides the default sweep)")
    p.add_argument("--optimizers", default=",".join(DEFAULT_LRS), help="comma-separated subset")
    p.add_argument("--work_dir", default=None, help="default: a fresh temporary directory")
    p.add_argument("--results_dir", default=str(harness.RESULTS))
    p.add_argument("--timeout_s", type=float, default=5400)
    return p.parse_args(argv)


def sweep(args) -> dict[str, list[float]]:
    lrs = {k: list(v) for k, v in DEFAULT_LRS.items() if k in args.optimizers.split(",")}
    for item in args.lrs:
        name, values = item.split("=", 1)
        lrs[name] = [float(v) for v in values.split(",")]
    return lrs


def arm_flags(optimizer: str, lr: float, schedule: str = "cosine") -> list[str]:
    """The flags of one arm over configs/tiny_transformer.yaml (its optimizer, LR and schedule)."""
    flags = ["--train.optimizer", optimizer, "--train.schedule", schedule]
    if optimizer == "muon":
        return flags + ["--train.muon_lr", str(lr), "--train.lr", str(MUON_ADAM_LR), "--train.min_lr", "2e-4"]
    return flags + ["--train.lr", str(lr), "--train.min_lr", str(lr / 10)]


def common_flags(args, run_dir: pathlib.Path, steps: int) -> list[str]:
    flags = ["--train.ds_config", "ds_configs/zero0.json", "--train.max_steps", str(steps)]
    flags += ["--train.warmup_steps", str(max(1, steps // 10)), "--train.eval_interval", "0"]
    flags += ["--train.log_interval", str(max(1, steps // 10)), "--checkpoint.interval", "0"]
    flags += ["--checkpoint.resume", "none", "--log.progress", "false", "--log.tensorboard", "false"]
    return flags + ["--log.run_dir", str(run_dir)]


def training_arms(args, work: pathlib.Path) -> list[dict]:
    arms = []
    for optimizer, lrs in sweep(args).items():
        for lr in lrs:
            arms.append({"name": f"{optimizer}_lr{lr:g}", "optimizer": optimizer, "lr": lr, "schedule": "cosine"})
    for lr in sweep(args).get("adamw", []):
        arms.append({"name": f"adamw_wsd_lr{lr:g}", "optimizer": "adamw", "lr": lr, "schedule": "wsd"})
    if arms:
        first = dict(arms[0], name=arms[0]["name"] + "_control", control=True)
        arms.append(first)
    for a in arms:
        a["flags"] = arm_flags(a["optimizer"], a["lr"], a["schedule"]) + common_flags(
            args, work / a["name"], args.steps
        )
    return arms


def memory_arms(args, work: pathlib.Path) -> list[dict]:
    arms = []
    for optimizer in sweep(args):
        for stage in (0, 2):
            name = f"mem_{optimizer}_zero{stage}"
            flags = arm_flags(optimizer, DEFAULT_LRS.get(optimizer, [1e-3])[0]) + common_flags(args, work / name, 2)
            flags[flags.index("ds_configs/zero0.json")] = f"ds_configs/zero{stage}.json"
            flags += ["--data.eval_windows", "8", "--train.micro_batch_size", "1", *MEMORY_MODEL]
            arms.append({"name": name, "optimizer": optimizer, "stage": stage, "flags": flags, "memory": True})
    return arms


def worker(spec_path: pathlib.Path) -> None:
    """Every arm through pretrain.run in this process group; a refused arm is recorded with its reason."""
    from megagenome.config.load import config_from_args
    from megagenome.engine import engine
    from megagenome.run import pretrain

    spec = json.loads(spec_path.read_text())
    out = {}
    for arm in spec["arms"]:
        started, rss_start = time.time(), harness.reset_peak(gpu=False)
        try:
            pretrain.run(config_from_args(["--config", str(TINY), *arm["flags"]]), [str(TINY)], keep_process_group=True)
            out[arm["name"]] = {
                "wall_s": time.time() - started,
                "rss_start": rss_start,
                "rss_peak": harness.peak(gpu=False),
            }
        except SystemExit as e:  # refused before launch (the checks' problems are printed), or stopped
            out[arm["name"]] = {"refused": f"exit {e.code}"}
        except Exception as e:  # noqa: BLE001  (a failing arm is a row, the others still run)
            out[arm["name"]] = {"error": f"{type(e).__name__}: {e}"[:400]}
    if harness.rank() == 0:
        (spec_path.parent / "walls.json").write_text(json.dumps(out))
    engine.shutdown()


def refusal(arm: dict) -> str | None:
    """The validation problems of an arm's config (what the run would refuse, before launch), else None."""
    from megagenome.config.load import config_from_args
    from megagenome.run.assembly import validate

    try:
        validate(config_from_args(["--config", str(TINY), *arm["flags"]]), [str(TINY)], 2, data=False, runtime=False)
    except Exception as e:  # noqa: BLE001  (ConfigError lists every problem: the optimizer's is the reason)
        lines = [x.strip(" -") for x in str(e).splitlines() if "optimizer" in x] or str(e).splitlines()
        return (lines[0] if lines else type(e).__name__)[:300]
    return None


def read_arm(work: pathlib.Path, arm: dict, walls: dict) -> dict:
    run = work / arm["name"]
    row = {k: arm[k] for k in ("name", "optimizer", "lr", "schedule", "stage") if k in arm} | walls.get(arm["name"], {})
    if not (run / "metrics.jsonl").exists():
        return row
    train, val = harness.run_rows(run)
    timed = train[1:] or train
    if timed and timed[0].get("tokens_per_s"):
        tokens_per_step = train[-1]["tokens"] / train[-1]["step"]
        row["step_s"] = statistics.median(tokens_per_step / r["tokens_per_s"] for r in timed)
    if val:
        row["bits_per_base"] = val[-1]["bits_per_base"]
    if train:
        row["train_loss"] = train[-1]["loss"]
        row["tokens"] = train[-1]["tokens"]
    memory = run / "memory.json"
    if memory.exists():
        row["memory"] = json.loads(memory.read_text())
    return row


def launch(args, work: pathlib.Path, arms: list[dict]) -> dict:
    spec = work / "spec.json"
    spec.write_text(json.dumps({"arms": arms}))
    rc, _ = harness.launch_worker(__file__, args.ranks, spec, work / "launch.log", args.timeout_s)
    if rc != 0:
        print(f"launch exited {rc}; its log: {work / 'launch.log'}", file=sys.stderr)
    walls = work / "walls.json"
    return json.loads(walls.read_text()) if walls.exists() else {}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def per_parameter(memory: dict) -> dict:
    """Optimizer-state and master-weight bytes per parameter of rank 0 (memory.json), and the per-parameter model
    states in all."""
    ranks = memory.get("ranks") or [memory]
    rank = ranks[0]
    measured = rank.get("measured") or rank
    n = memory.get("parameters") or rank.get("parameters")
    if not n:
        return {}
    return {k: measured.get(k, 0) / n for k in ("optimizer_states", "master_params", "grads", "params")}


def markdown(meta: dict, rows: list[dict], memory_rows: list[dict]) -> str:
    lines = [
        "# Optimizers and schedules on the default genome and model",
        "",
        f"Written by `{meta['command']}` on {meta['date']}.",
        f"Hardware: {meta['hardware']}; {meta['software']}. Load average (1, 5, 15 min) before: {meta['load_before']};"
        f" after: {meta['load_after']}. Wall time {meta['wall_s']:.0f} s.",
        "",
        f"Model: configs/tiny_transformer.yaml (d_model 128, 4 layers, {meta.get('parameters') or '?'} parameters), "
        "E. coli K-12"
        f" MG1655 with the last ~5% held out; {meta['steps']} steps x 16 windows x 512 bases"
        f" ({meta['steps'] * 8192:,} tokens) per arm, the same windows in the same order; warmup"
        f" {max(1, meta['steps'] // 10)} steps; ZeRO-0 fp32 on 2 CPU ranks; held-out bits/base over the whole"
        " held-out range at the end. min_lr = lr / 10 (Muon: the AdamW half at 2e-3 -> 2e-4, --train.muon_lr swept).",
        "",
        "| arm | optimizer | schedule | lr | held-out bits/base | train loss | s/step (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bits = f"{r['bits_per_base']:.4f}" if "bits_per_base" in r else r.get("refused") or r.get("error") or "-"
        loss = f"{r['train_loss']:.4f}" if "train_loss" in r else "-"
        step = f"{r['step_s']:.3f}" if "step_s" in r else "-"
        lines.append(f"| {r['name']} | {r['optimizer']} | {r['schedule']} | {r['lr']:g} | {bits} | {loss} | {step} |")
    best = {}
    for r in rows:
        if "bits_per_base" in r and not r["name"].endswith("_control") and r["schedule"] == "cosine":
            if r["optimizer"] not in best or r["bits_per_base"] < best[r["optimizer"]]["bits_per_base"]:
                best[r["optimizer"]] = r
    lines += [
        "",
        "Best LR of each optimizer (cosine): "
        + ", ".join(
            f"{k} {v['lr']:g} ({v['bits_per_base']:.4f})"
            for k, v in sorted(best.items(), key=lambda kv: kv[1]["bits_per_base"])
        ),
    ]
    control = [r for r in rows if r["name"].endswith("_control") or r["name"] + "_control" in {x["name"] for x in rows}]
    if len(control) == 2 and all("bits_per_base" in r and "step_s" in r for r in control):
        a, b = control
        lines.append(
            f"Noise: the first arm run again at the end: held-out {a['bits_per_base']:.4f} vs {b['bits_per_base']:.4f}"
            f" bits/base, {a['step_s']:.3f} vs {b['step_s']:.3f} s/step"
            f" ({100 * (b['step_s'] / a['step_s'] - 1):+.1f}%)."
        )
    lines += [
        "",
        "## Optimizer memory per parameter (d_model 512, 6 layers, fp32, 2 ranks, micro batch 1, after step 1)",
        "",
        "One replica: memory.json's optimizer_state_bytes_per_parameter (the states one data-parallel replica set"
        " holds, over the parameters). Rank 0: its own tensors (memory.json) and its peak RSS growth during the arm.",
        "",
        "| optimizer | ZeRO | optimizer states B/param (one replica) | rank 0: optimizer states B/param |"
        " rank 0: all model states B/param | rank 0: peak RSS growth B/param |",
        "|---|---|---|---|---|---|",
    ]
    for r in memory_rows:
        if r.get("per_param"):
            pp, mem = r["per_param"], r.get("memory_summary") or {}
            replica = mem.get("optimizer_state_bytes_per_parameter")
            rss = r.get("rss_delta_per_param")
            lines.append(
                f"| {r['optimizer']} | {r['stage']} | {'-' if replica is None else f'{replica:.2f}'} |"
                f" {pp['optimizer_states']:.2f} | {sum(pp.values()):.2f} | {'-' if rss is None else f'{rss:.1f}'} |"
            )
        else:
            reason = r.get("refused") or r.get("error") or "-"
            lines.append(f"| {r['optimizer']} | {r['stage']} | refused: {reason} | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(pathlib.Path(args.worker))
        return
    work = harness.work_dir("optimizers-", args.work_dir)
    started, load_before = time.time(), load()
    arms, memory_rows = training_arms(args, work), memory_arms(args, work)
    for arm in arms + memory_rows:
        arm["refused"] = refusal(arm)
    runnable = [a for a in arms + memory_rows if not a["refused"]]
    walls = launch(args, work, runnable)
    rows = [a if a["refused"] else read_arm(work, a, walls) for a in arms]
    for arm in memory_rows:
        if not arm["refused"]:
            got = read_arm(work, arm, walls)
            memory = got.get("memory") or {}
            summary_keys = ("parameters", "optimizer", "optimizer_state_bytes_per_parameter", "zero_stage")
            arm.update(got, per_param=per_parameter(memory), memory_summary={k: memory.get(k) for k in summary_keys})
            if got.get("rss_peak") and (got.get("memory") or {}).get("parameters"):
                arm["rss_delta_per_param"] = (got["rss_peak"] - got["rss_start"]) / got["memory"]["parameters"]
    summary = next(
        (
            json.loads((work / a["name"] / "summary.json").read_text())
            for a in runnable
            if (work / a["name"] / "summary.json").exists()
        ),
        {},
    )
    meta = {
        "command": harness.command("optimizers.py", harness.argv_of(argv)),
        "date": harness.today(),
        "hardware": harness.hardware(),
        "software": harness.software(),
        "load_before": load_before,
        "load_after": load(),
        "wall_s": time.time() - started,
        "steps": args.steps,
        "parameters": summary.get("parameters"),
        "work_dir": str(work),
    }
    results = pathlib.Path(args.results_dir)
    clean = [{k: v for k, v in r.items() if k not in ("flags", "memory")} for r in rows]
    clean_memory = [{k: v for k, v in r.items() if k not in ("flags", "memory")} for r in memory_rows]
    harness.write_json(results / "optimizers.json", {"meta": meta, "arms": clean, "memory": clean_memory})
    print(harness.write_text(results / "optimizers.md", markdown(meta, clean, clean_memory)).read_text())


if __name__ == "__main__":
    main()
