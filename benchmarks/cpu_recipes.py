"""The default job and the one-hour CPU recipe against the strongest Markov baseline, through the real launcher.

Arms (each a `bash launch/local.sh` run on 2 CPU ranks, the same genome and held-out range):
  old_default   configs/tiny_transformer.yaml (the default job's configs/tiny.yaml until 2026-12-03) as it was until
                2026-12-02: AdamW, cosine at 2e-3, 512-base windows, micro batch 8
  wsd           the same with warmup-stable-decay at 4e-3
  default       configs/tiny_transformer.yaml today: WSD at 4e-3, 1024-base windows, micro batch 4 (same tokens per
                step)
  cpu_1h        configs/cpu_1h.yaml: d_model 256, 2000 steps, WSD at 3e-3 (sized for one hour on a quiet 2-core CPU)

An arm whose run directory under --work already holds a summary.json is read, not run again (a rerun of a finished
run reports it as it was), so arms can be run one at a time or collected from earlier runs. Writes
benchmarks/results/cpu_recipes.{json,md}: held-out bits/base and its eval curve, the strongest order-k Markov
baseline (both strands), wall time, tokens/s, the load average before and after each arm, date and hardware.

    python benchmarks/cpu_recipes.py [--work /tmp/cpu_recipes] [--arms old_default wsd default cpu_1h]
"""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess

import harness

OLD = ["--data.seq_len", "512", "--train.micro_batch_size", "8", "--data.eval_windows", "512"]
COSINE = ["--train.schedule", "cosine", "--train.lr", "2e-3", "--train.min_lr", "2e-4"]
ARMS = {
    "old_default": ["configs/tiny_transformer.yaml", *OLD, *COSINE],
    "wsd": ["configs/tiny_transformer.yaml", *OLD],
    "default": ["configs/tiny_transformer.yaml"],
    "cpu_1h": ["configs/cpu_1h.yaml"],
}
MARGIN = 0.05  # issue 15: the default job should beat the strongest baseline by this much


def launch(run_dir: pathlib.Path, config: str, *flags: str, checkpoint_interval: int = 0) -> dict:
    """Runs one arm unless it already finished; returns its load averages around the run (None when read).
    checkpoint_interval > 0: an interrupted arm resumes from its last checkpoint when run again (summary's
    first_step then says its wall_s covers only the last invocation)."""
    if (run_dir / "summary.json").exists():
        return {"ran": False}
    cmd = ["bash", "launch/local.sh", "--config", config, *flags, "--log.run_dir", str(run_dir), "--log.progress",
           "false", "--checkpoint.interval", str(checkpoint_interval)]  # fmt: skip
    before = harness.load_average()
    subprocess.run(cmd, cwd=harness.REPO, env=harness.child_env(), check=True, stdout=subprocess.DEVNULL)
    return {"ran": True, "load_before": before, "load_after": harness.load_average(), "command": " ".join(cmd[1:])}


def collect(run_dir: pathlib.Path) -> dict:
    """What the run directory says: summary, eval curve, median tokens/s."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = harness.read_jsonl(run_dir / "metrics.jsonl")
    best = summary["best_markov_order"]
    return {
        "parameters": summary["parameters"],
        "steps": summary["steps"],
        "tokens": max(r["tokens"] for r in rows if "tokens" in r),
        "heldout_bits_per_base": summary["heldout_bits_per_base"],
        "curve": [(r["step"], r["bits_per_base"]) for r in rows if r.get("split") == "val"],
        "best_markov_order": best,
        "best_markov_bits_per_base": summary["markov_bits_per_base"][str(best)],
        "markov_strands": summary.get("markov_strands"),
        "wall_s": summary["wall_s"],
        "first_step": summary.get("first_step", 0),  # > 0: wall_s is the last invocation's, resumed at that step
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r),
    }


def markdown(results: dict, when: str) -> str:
    lines = [
        f"# The default job and the one-hour CPU recipe against the Markov baselines ({when})",
        "",
        f"Hardware: {harness.hardware()}; {harness.software()}. 2 ranks through `launch/local.sh` (ZeRO-1 + bf16, "
        "BF16_Optimizer).",
        "Command: `python benchmarks/cpu_recipes.py` (arms and their flags: the script's ARMS).",
        "",
        "| arm | parameters | tokens | held-out bits/base | best Markov (order, strands) | margin | wall s | tokens/s "
        "| load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        load = f"{r['load_before']:.1f} -> {r['load_after']:.1f}" if r.get("ran") else "not recorded"
        wall = f"{r['wall_s']:.0f}" + (f" (steps {r['first_step'] + 1}-{r['steps']} only)" if r["first_step"] else "")
        lines.append(
            f"| {name} | {r['parameters']:,} | {r['tokens']:,} | {r['heldout_bits_per_base']:.4f} | "
            f"{r['best_markov_bits_per_base']:.4f} ({r['best_markov_order']}, {r['markov_strands'] or 'forward'}) | "
            f"{r['best_markov_bits_per_base'] - r['heldout_bits_per_base']:+.4f} | {wall} | "
            f"{r['tokens_per_s_median']:,.0f} | {load} |"
        )
    lines += ["", "Eval curves (step, held-out bits/base):", ""]
    lines += [f"- {name}: " + ", ".join(f"({s}, {b:.4f})" for s, b in r["curve"]) for name, r in results.items()]
    lines += [
        "",
        f"Margin: the strongest Markov baseline minus the model (the goal for the default job: >= {MARGIN}). Runs",
        "summarised before 2026-12-01 fitted the baselines on the forward strand only ('forward').",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--work", default="/tmp/cpu_recipes", help="run directories, one per arm (kept)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = ap.parse_args()
    work = pathlib.Path(args.work)
    results = {}
    for name in args.arms:
        config, *flags = ARMS[name]
        ran = launch(work / name, config, *flags)
        results[name] = {**collect(work / name), **ran}
    when = harness.today()
    record = {"date": when, "hardware": harness.hardware(), "arms": results}
    paths = harness.write_results(harness.RESULTS, "cpu_recipes", record, markdown(results, when))
    print(paths["md"].read_text())


if __name__ == "__main__":
    main()
