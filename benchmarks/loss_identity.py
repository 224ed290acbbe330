"""Per-step losses of two checkouts side by side: does a restructuring change what trains?

    python benchmarks/loss_identity.py run --checkout /tmp/before --out /tmp/identity/before
    python benchmarks/loss_identity.py run --checkout . --out /tmp/identity/after
    python benchmarks/loss_identity.py compare /tmp/identity/before /tmp/identity/after

`run` trains, in the given checkout (its own code, on this interpreter: `git worktree add --detach /tmp/before
<commit>` makes one), the first 60 steps of the default job (configs/tiny.yaml, 2 ranks through
launch/local.sh) and of its transformer twin (configs/tiny_transformer.yaml), each straight through and stopped
after step 30 then resumed, with a metrics row per step, evaluations and checkpoints at 30 and 60; then a fine-tune of
--model (the default job's run directory) on a two-class task with gradient accumulation 2, a row per step and
validation at 20 and 40. `compare` reads both metrics files of every run and reports each value that differs (losses,
gradient norms, learning rates, token counts, held-out bits/base, validation metrics) and the largest difference.
About 6 minutes per checkout on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import finetune_recipes  # noqa: E402  (builds the two-species task from the bundled genomes)
import harness  # noqa: E402

PRETRAIN = ("tiny", "tiny_transformer")
ROWS = "--train.log_interval 1 --train.eval_interval 30 --checkpoint.interval 30 --log.progress false".split()
KEYS = ("loss", "grad_norm", "lr", "tokens", "window_real_tokens", "bits_per_base", "bases", "accuracy", "mcc", "auroc")
KEYS += ("skipped_steps", "loss_scale", "best")


def run(checkout: str, out: str, model: str) -> None:
    os.makedirs(out, exist_ok=True)
    env = harness.child_env(PYTHONPATH=checkout)  # the checkout's code (each command also runs in it)
    for cfg in PRETRAIN:
        for name, stops in ((cfg, [60]), (f"{cfg}_resumed", [30, 60])):
            for stop in stops:
                args = ["--config", f"configs/{cfg}.yaml", *ROWS, "--train.stop_at", str(stop)]
                _call(["bash", "launch/local.sh", *args, "--log.run_dir", os.path.join(out, name)], checkout, env, out)
    task = finetune_recipes.build_task("two_species", os.path.join(out, "task_work"))
    flags = ["--train.max_steps", "40", "--train.grad_accum_steps", "2", "--train.micro_batch_size", "8"]
    flags += ["--train.eval_interval", "20", "--train.log_interval", "1", "--model.layer", "4"]
    flags += ["--model.pooling", "mean", "--log.progress", "false", "--log.run_dir", os.path.join(out, "finetune")]
    command = [sys.executable, "-m", "megagenome", "finetune", "--model.pretrained", model, "--data.benchmark", task]
    _call([*command, *flags], checkout, env, out)


def _call(command: list[str], cwd: str, env: dict, out: str) -> None:
    print("+", " ".join(command), flush=True)
    with open(os.path.join(out, "commands.log"), "a", encoding="utf-8") as log:
        done = subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"loss_identity: exit {done.returncode}: {' '.join(command)} (see {out}/commands.log)")


def rows(path: str) -> dict:
    out = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            out[(r.get("step"), r.get("split") or r.get("event") or "train")] = {k: r[k] for k in KEYS if k in r}
    return out


def compare(before: str, after: str) -> float:
    """Print every differing value; returns the largest difference (inf for a non-numeric one)."""
    worst = 0.0
    for name in sorted(os.listdir(before)):
        path = os.path.join(before, name, "metrics.jsonl")
        if not os.path.exists(path):
            continue
        a, b = rows(path), rows(os.path.join(after, name, "metrics.jsonl"))
        if a.keys() != b.keys():
            print(f"{name}: rows differ: {sorted(set(a) ^ set(b), key=str)}")
            worst = float("inf")
            continue
        differ = 0
        for key, values in a.items():
            for k, v in values.items():
                w = b[key].get(k)
                if v != w:
                    differ += 1
                    numbers = isinstance(v, (int, float)) and isinstance(w, (int, float))
                    worst = max(worst, abs(v - w) if numbers else float("inf"))
                    print(f"  {name} step {key[0]} {key[1]} {k}: {v} vs {w}")
        steps = sum(1 for key in a if key[1] == "train")
        print(f"{name}: {len(a)} rows ({steps} training steps), {differ} values differ")
    print(f"largest difference: {worst}")
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="train the runs of one checkout")
    r.add_argument("--checkout", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--model", default=str(harness.REPO / "runs" / "tiny"), help="the model fine-tuned")
    c = sub.add_parser("compare", help="compare two checkouts' metrics")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args(argv)
    if args.what == "run":
        run(os.path.abspath(args.checkout), os.path.abspath(args.out), os.path.abspath(args.model))
        return 0
    return 0 if compare(args.before, args.after) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
