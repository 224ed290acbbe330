"""Pretraining throughput and learning speed on this machine, through the real `deepspeed` launcher.

Measures, in one invocation:
  1. tokens/s of configs/tiny_transformer.yaml and of a ~20M-parameter shape (d_model 512, 6 layers) on the same
     ranks, as the median over logged intervals after the first (warm-up) interval;
  2. the steps the tiny model needs before its held-out bits/base drops below each order-k Markov
     baseline (k = 0..8), from a full tiny run evaluated every --eval_every steps.

Writes benchmarks/results/pretrain_cpu.{json,md} with the date, the hardware and the command.

    python benchmarks/pretrain_cpu.py [--nproc 2] [--tiny_steps 600] [--eval_every 50]
"""

from __future__ import annotations

import json
import pathlib
import shutil
import statistics
import subprocess

import harness

SHAPES = {
    "tiny (configs/tiny_transformer.yaml)": [],
    "~20M (d_model 512, 6 layers, 8 heads)": ["--model.d_model", "512", "--model.n_layer", "6", "--model.n_head", "8"]
    + ["--train.micro_batch_size", "2"],
}
SPEED_RUN = ["--train.max_steps", "12", "--train.warmup_steps", "2", "--train.log_interval", "3"]
SPEED_RUN += ["--train.eval_interval", "0", "--data.eval_windows", "2"]


def launch(nproc: int, run_dir: pathlib.Path, *overrides: str) -> None:
    cmd = [
        "bash",
        str(harness.REPO / "launch" / "local.sh"),
        "--config",
        str(harness.REPO / "configs" / "tiny_transformer.yaml"),
    ]
    cmd += ["--log.run_dir", str(run_dir), "--log.progress", "false", "--checkpoint.resume", "none", *overrides]
    subprocess.run(
        cmd, cwd=harness.REPO, env=harness.child_env(NPROC=str(nproc)), check=True, stdout=subprocess.DEVNULL
    )


def rows(run_dir: pathlib.Path) -> list[dict]:
    return harness.read_jsonl(run_dir / "metrics.jsonl")


def throughput(run_dir: pathlib.Path) -> float:
    train = [r for r in rows(run_dir) if "split" not in r]
    return statistics.median(r["tokens_per_s"] for r in train[1:])


def tokens_per_step(run_dir: pathlib.Path) -> int:
    """Tokens of one optimizer step, from the last training row (cumulative tokens / step)."""
    last = [r for r in rows(run_dir) if "split" not in r][-1]
    return last["tokens"] // last["step"]


def speed(nproc: int, work: pathlib.Path) -> dict:
    """Tokens/s of every shape: a 12-step run each, logged every 3 steps."""
    out = {}
    for name, extra in SHAPES.items():
        run_dir = work / f"speed{len(out)}"
        launch(nproc, run_dir, *SPEED_RUN, *extra)
        summary = json.loads((run_dir / "summary.json").read_text())
        out[name] = {
            "parameters": summary["parameters"],
            "tokens_per_s": throughput(run_dir),
            "tokens_per_step": tokens_per_step(run_dir),
        }
    return out


def full_run(nproc: int, steps: int, eval_every: int, full: pathlib.Path) -> dict:
    """The full tiny run, evaluated every eval_every steps: its curve and the first eval below each baseline."""
    launch(
        nproc,
        full,
        "--train.max_steps",
        str(steps),
        "--train.eval_interval",
        str(eval_every),
        "--checkpoint.interval",
        "0",
    )
    summary = json.loads((full / "summary.json").read_text())
    evals = [r for r in rows(full) if r.get("split") == "val"]
    beat = {}
    for k, bits in summary["markov_bits_per_base"].items():
        first = next((r["step"] for r in evals if r["bits_per_base"] < bits), None)
        beat[k] = {"markov_bits_per_base": bits, "first_eval_step_below": first}
    return {
        "steps": steps,
        "eval_every": eval_every,
        "wall_s": summary["wall_s"],
        "final_heldout_bits_per_base": summary["heldout_bits_per_base"],
        "eval_curve": [(r["step"], r["bits_per_base"]) for r in evals],
        "steps_to_beat_markov": beat,
    }


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--nproc", type=int, default=2, help="CPU ranks")
    ap.add_argument(
        "--tiny_steps", type=int, default=600, help="steps of the full tiny run (configs/tiny_transformer.yaml: 600)"
    )
    ap.add_argument("--eval_every", type=int, default=50, help="evaluation interval of the full tiny run")
    args = ap.parse_args()
    work = harness.work_dir("mg-bench-")
    try:
        throughput_rows = speed(args.nproc, work)
        full = full_run(args.nproc, args.tiny_steps, args.eval_every, work / "full")
        result = {
            "date": harness.today(),
            "hardware": f"{harness.cpu()}, no GPU",
            "ranks": args.nproc,
            "command": harness.command("pretrain_cpu.py", harness.argv_of(None)),
            "throughput": throughput_rows,
            "tiny_full_run": full,
        }
        harness.write_results(harness.RESULTS, "pretrain_cpu", result, markdown(result), indent=2)
        print(markdown(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def markdown(r: dict) -> str:
    lines = [
        f"# Pretraining on CPU: throughput and steps to beat Markov baselines ({r['date']})",
        "",
        f"Hardware: {r['hardware']}; {r['ranks']} ranks through the `deepspeed` launcher, ZeRO-1 bf16 "
        "(configs/tiny_transformer.yaml's DeepSpeed JSON; ds_configs/zero1_bf16.json before 2026-12-01, the same "
        "engine).",
        f"Command: `{r['command']}`",
        "",
        "| model | parameters | tokens/step | tokens/s (all ranks, median) |",
        "|---|---|---|---|",
    ]
    for name, s in r["throughput"].items():
        lines.append(f"| {name} | {s['parameters']:,} | {s['tokens_per_step']:,} | {s['tokens_per_s']:,.0f} |")
    f = r["tiny_full_run"]
    lines += [
        "",
        f"Full tiny run: {f['steps']} steps, {f['wall_s']:.0f} s wall time (launch to summary), final "
        f"held-out {f['final_heldout_bits_per_base']:.4f} bits/base; evaluated every {f['eval_every']} steps.",
        "",
        "| Markov order k | held-out bits/base | first eval step with the model below it |",
        "|---|---|---|",
    ]
    for k, b in f["steps_to_beat_markov"].items():
        step = b["first_eval_step_below"]
        lines.append(
            f"| {k} | {b['markov_bits_per_base']:.4f} | {step if step is not None else 'not within the run'} |"
        )
    lines += ["", "Eval curve (step, bits/base): " + ", ".join(f"({s}, {b:.4f})" for s, b in f["eval_curve"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
