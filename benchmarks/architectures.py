"""Transformer vs Hyena vs StripedHyena 2 on the bundled E. coli genome: learning efficiency and long-context cost.

Learning efficiency (each arm a `bash launch/local.sh` run on 2 CPU ranks, the same genome, held-out range and
recipe; configs/tiny_transformer.yaml, tiny_hyena.yaml and tiny.yaml, the default job's StripedHyena 2, have the
same width, depth and parameter count within 1%):
  <family>            the default job's budget (600 steps of 8,192 tokens)
  <family>@wall       the transformer's wall time: max_steps scaled by the transformer's wall time over the
                      family's own at the default budget (warmup, evaluations and the WSD decay scaled alike)
  <family>@cpu_1h     configs/cpu_1h.yaml's budget (4,000 steps): --budgets cpu_1h (about an hour each)
Each reports held-out bits/base with its eval curve, and the strongest order-k Markov baseline (both strands).

Long-context cost (--lengths): one process per family and length (bf16 weights, eager, micro batch 1, the default
job's shape), forward + backward of one window: the median step time of the timed steps after one warm-up (--steps,
at least 16k tokens' worth), the peak RSS above the model's, both per token; the growth exponent k of step time ~
L^k fitted by least squares on log-log over the lengths; and the planner's H200 prediction (`megagenome plan`, bf16,
the 1B configs dna_1b.yaml and striped_1b.yaml) from 8k to 1M bases.

An arm whose run directory under --work already holds a summary.json is read, not run again. Writes
benchmarks/results/architectures.{json,md}.

    python benchmarks/architectures.py [--work /tmp/architectures] [--budgets default wall] [--lengths 1024 4096 ...]
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
import subprocess
import sys

import harness
from cpu_recipes import collect, launch

FAMILIES = {"transformer": "configs/tiny_transformer.yaml", "hyena": "configs/tiny_hyena.yaml",
            "striped_hyena": "configs/tiny.yaml"}  # fmt: skip
PLAN_CONFIGS = {"transformer": "configs/dna_1b.yaml", "striped_hyena": "configs/striped_1b.yaml"}
PLAN_LENGTHS = (8192, 32768, 131072, 262144, 1048576)
H200 = {"gpus": 1, "gpus_per_node": 1, "gpu": "H200", "gpu_memory_gb": 141.0}
MARGIN = 0.05  # the default job's goal: this far below the strongest Markov baseline
LOAD_NOTE = (
    "Load: the 1-minute load average before -> after an arm this invocation ran (2: its two ranks alone); an arm "
    "read from --work shows -. The runs are deterministic, so held-out bits/base at equal tokens do not depend on the "
    "load; wall s and tokens/s do, and compare only between quiet arms."
)
TIMED_TOKENS = 16384  # the fewest tokens a length's timed steps cover


def wall_flags(steps: int) -> list[str]:
    """A run of `steps` steps with the default recipe's proportions: warmup 50/600, evaluations every third."""
    return ["--train.max_steps", str(steps), "--train.warmup_steps", str(max(1, round(steps * 50 / 600))),
            "--train.eval_interval", str(max(1, steps // 3))]  # fmt: skip


def model_flags(config: str) -> list[str]:
    """The family config's model section as flags over configs/cpu_1h.yaml's (whose model is the transformer's)."""
    import yaml

    shape = yaml.safe_load((harness.REPO / config).read_text())["model"]
    return [item for key, value in shape.items() for item in (f"--model.{key}", str(value))]


def learning(work: pathlib.Path, budgets: list[str]) -> dict:
    out = {}
    for family, config in FAMILIES.items():
        if "default" in budgets or "wall" in budgets:
            ran = launch(work / family, config)
            out[family] = {**collect(work / family), **ran}
    if "wall" in budgets:
        reference = out["transformer"]["wall_s"]
        for family, config in FAMILIES.items():
            if family == "transformer":
                continue
            steps = max(3, round(out[family]["steps"] * reference / out[family]["wall_s"]))
            name = f"{family}@wall"
            ran = launch(work / name, config, *wall_flags(steps))
            out[name] = {**collect(work / name), **ran}
    if "cpu_1h" in budgets:
        for family, config in FAMILIES.items():
            name = f"{family}@cpu_1h"
            flags = [] if family == "transformer" else model_flags(config)
            ran = launch(work / name, "configs/cpu_1h.yaml", *flags, checkpoint_interval=500)  # an hour: resumable
            out[name] = {**collect(work / name), **ran}
    return out


def cost_worker(family: str, length: int, steps: int) -> dict:
    """One family at one length, in this process: median step time and the peak RSS above the model's."""
    import time

    import torch
    import yaml

    from megagenome.config import ModelConfig
    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model import family_of

    shape = yaml.safe_load((harness.REPO / FAMILIES[family]).read_text())["model"]
    cfg = ModelConfig(**{**shape, "max_seq_len": length})
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg, VOCAB_SIZE).bfloat16()
    x = torch.randint(0, 4, (1, length))
    base = harness.reset_peak(False)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        loss, _, _ = model(x, x.roll(-1, 1), torch.ones(1, length))
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    return {"step_s": step, "s_per_token": step / length, "peak_bytes_per_token": (harness.peak(False) - base) / length}


def costs(lengths: list[int], steps: int, work: pathlib.Path) -> dict:
    """Each family at each length in a process of its own, timed over at least `steps` steps and TIMED_TOKENS tokens
    (short windows take more steps: one step of 1k bases is too short to time alone). A measurement already in
    --work (cost_<family>_<length>.json) is read, not taken again."""
    out = {}
    for family in FAMILIES:
        rows = {}
        for length in lengths:
            cached = work / f"cost_{family}_{length}.json"
            if not cached.exists():
                n = max(steps, TIMED_TOKENS // length)
                cmd = [sys.executable, __file__, "--cost-worker", f"{family}:{length}:{n}"]
                done = subprocess.run(cmd, cwd=harness.REPO, env=harness.child_env(), capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"{family} at {length}: {done.stderr[-2000:]}")
                harness.write_text(cached, done.stdout.strip().splitlines()[-1])
            rows[length] = {**json.loads(cached.read_text()), "steps": max(steps, TIMED_TOKENS // length)}
        xs = [math.log(n) for n in lengths]
        ys = [math.log(rows[n]["step_s"]) for n in lengths]
        out[family] = {"lengths": rows, "growth_exponent": _slope(xs, ys)}
    return out


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def predictions() -> dict:
    """The planner's recommendation for the two 1B configs at each length on one H200 (bf16, micro batch 1):
    tokens/s, the checkpointing it needs and its memory; None where no layout fits."""
    import os

    from megagenome.config.load import config_from_args
    from megagenome.planner.timing import Cluster
    from megagenome.run import plan

    os.chdir(harness.REPO)  # the run configs name their files relative to the repository
    out = {}
    for family, config in PLAN_CONFIGS.items():
        rows = {}
        for length in PLAN_LENGTHS:
            flags = ["--config", config, "--data.seq_len", str(length), "--model.max_seq_len", str(length),
                     "--train.micro_batch_size", "1", "--train.grad_accum_steps", "1"]  # fmt: skip
            built = plan.build(config_from_args(flags), Cluster(**H200))
            best = built.get("recommendation")
            rows[length] = None if not best else {
                "tokens_per_s": best["tokens_per_s_per_gpu"], "checkpointing": best["checkpointing"],
                "stage": best["stage"], "offload": best["offload"], "memory_gib": best["memory_gib"]["total"],
            }  # fmt: skip
        out[family] = rows
    return out


def markdown(record: dict) -> str:
    lines = ["# Transformer, Hyena and StripedHyena 2 on E. coli: learning efficiency and long-context cost", ""]
    lines += harness.header(record) + [""]
    lines += ["## Learning efficiency (2 CPU ranks, ZeRO-1 + bf16, the default job's recipe)", ""]
    rows = []
    for name, r in record["learning"].items():
        margin = r["best_markov_bits_per_base"] - r["heldout_bits_per_base"]
        rows.append([name, f"{r['parameters']:,}", f"{r['tokens']:,}", f"{r['heldout_bits_per_base']:.4f}",
                     f"{r['best_markov_bits_per_base']:.4f} (order {r['best_markov_order']})", f"{margin:+.4f}",
                     f"{r['wall_s']:.0f}", f"{r['tokens_per_s_median']:,.0f}", _load(r)])  # fmt: skip
    cols = ["arm", "parameters", "tokens", "held-out bits/base", "best Markov", "margin", "wall s", "tokens/s", "load"]
    lines += harness.table(cols, rows)
    lines += ["", LOAD_NOTE, ""]
    lines += ["Eval curves (step, held-out bits/base):", ""]
    lines += [f"- {n}: " + ", ".join(f"({s}, {b:.4f})" for s, b in r["curve"]) for n, r in record["learning"].items()]
    lines += ["", f"Margin: the strongest Markov baseline minus the model (the default job's goal: >= {MARGIN}).", ""]
    if record.get("costs"):
        lines += _cost_lines(record["costs"])
    if record.get("predictions"):
        lines += _prediction_lines(record["predictions"])
    return "\n".join(lines) + "\n"


def _load(r: dict) -> str:
    return f"{r['load_before']:.1f} -> {r['load_after']:.1f}" if r.get("ran") else "-"


def _cost_lines(costs: dict) -> list[str]:
    lines = ["## Long-context cost on CPU (one process, bf16, micro batch 1, forward + backward)", ""]
    lengths = list(next(iter(costs.values()))["lengths"])
    cols = ["family", *(f"{n} bases: us/token, KiB/token" for n in lengths), "growth exponent"]
    rows = []
    for family, c in costs.items():
        cells = [f"{v['s_per_token'] * 1e6:.1f}, {v['peak_bytes_per_token'] / 1024:.1f}" for v in c["lengths"].values()]
        rows.append([family, *cells, f"{c['growth_exponent']:.2f}"])
    lines += harness.table(cols, rows)
    lines += [
        "",
        "Growth exponent: k in step time ~ L^k (least squares on log-log): 1 is linear in the window, 2 quadratic.",
        "Peak memory: the RSS above the model's over the steps, divided by the window's tokens.",
        "",
    ]
    return lines


def _prediction_lines(preds: dict) -> list[str]:
    lines = ["## The planner's H200 prediction (one GPU, bf16, micro batch 1, 1B models; predicted, not measured)", ""]
    cols = ["family (config)", *(f"{n:,} bases" for n in PLAN_LENGTHS)]
    rows = []
    for family, by_length in preds.items():
        cells = [f"{r['tokens_per_s']:,.0f} tok/s ({r['checkpointing']}, {r['memory_gib']:.0f} GiB)" if r else
                 "does not fit" for r in by_length.values()]  # fmt: skip
        rows.append([f"{family} ({PLAN_CONFIGS[family]})", *cells])
    lines += harness.table(cols, rows)
    return lines + ["", "Each cell: the planner's recommended layout (checkpointing policy, memory per GPU).", ""]


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--work", default="/tmp/architectures", help="run directories, one per arm (kept)")
    ap.add_argument("--budgets", nargs="+", default=["default", "wall"], choices=["default", "wall", "cpu_1h"])
    ap.add_argument("--lengths", nargs="*", type=int, default=[1024, 4096, 16384, 65536])
    ap.add_argument("--steps", type=int, default=2, help="timed steps per length (after one warm-up)")
    ap.add_argument("--cost-worker", help=harness.argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cost_worker:
        family, length, steps = args.cost_worker.split(":")
        print(json.dumps(cost_worker(family, int(length), int(steps))))
        return
    work = pathlib.Path(args.work)
    record = {"date": harness.today(), "hardware": harness.hardware(), "software": harness.software(),
              "command": harness.command("architectures.py", sys.argv[1:])}  # fmt: skip
    record["learning"] = learning(work, args.budgets)
    record["costs"] = costs(args.lengths, args.steps, work) if args.lengths else {}
    record["predictions"] = predictions()
    paths = harness.write_results(harness.RESULTS, "architectures", record, markdown(record))
    print(paths["md"].read_text())


if __name__ == "__main__":
    main()
