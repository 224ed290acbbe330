"""Distillation on the default genome: a small student's held-out bits/base with and without the teacher, at equal
steps and tokens.

    python benchmarks/distill.py [--teacher runs/tiny_transformer] [--steps 300] [--ranks 2]

The teacher is the default job's transformer twin's run (configs/tiny_transformer.yaml: 128 x 4 layers, E. coli K-12;
`bash launch/local.sh --config configs/tiny_transformer.yaml` first).
Two students of configs/tiny_transformer.yaml's data and schedule shortened to --steps, 64 wide and 2 layers deep,
train through the `deepspeed` launcher: one on the usual loss, one with --train.distill_from the teacher (alpha 0.5,
T 2). Both see the same windows in the same order (same seed), so the only difference is the teacher's soft targets.
Writes benchmarks/results/distill.md and .json (every figure from this command's runs).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile
import time

import harness

STUDENT = ["--model.d_model", "64", "--model.n_layer", "2", "--model.n_head", "2"]
DISTILL = ["--train.distill_alpha", "0.5", "--train.distill_temperature", "2.0"]


def final_eval(run_dir: pathlib.Path) -> dict:
    train, val = harness.run_rows(run_dir)
    return {"step": val[-1]["step"], "bits_per_base": val[-1]["bits_per_base"], "tokens": train[-1]["tokens"]}


def train(name: str, extra: list[str], steps: int, ranks: int, work: pathlib.Path) -> dict:
    run_dir = work / name
    cmd = harness.deepspeed_cmd(ranks, "--module", "megagenome", "pretrain")
    cmd += [
        "--config",
        "configs/tiny_transformer.yaml",
        *STUDENT,
        "--train.max_steps",
        str(steps),
        "--log.run_dir",
        str(run_dir),
    ]
    cmd += ["--train.eval_interval", str(steps), "--checkpoint.interval", "0", "--log.progress", "false", *extra]
    started = time.perf_counter()
    subprocess.run(cmd, cwd=harness.REPO, check=True, env=harness.child_env())
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "wall_s": round(time.perf_counter() - started, 1),
        "parameters": summary.get("parameters"),
        **final_eval(run_dir),
    }


def markdown(r: dict) -> str:
    t = r["teacher"]
    plain, taught = r["students"]["plain"], r["students"]["distilled"]
    return "\n".join(
        [
            "# Distillation on the default genome (E. coli K-12 MG1655)",
            "",
            f"Written by `python benchmarks/distill.py {' '.join(r['argv'])}` on {r['date']}.",
            f"Hardware: {r['hardware']}; {r['software']}.",
            "",
            f"Teacher: `{r['teacher_run']}` (configs/tiny_transformer.yaml: d_model 128, 4 layers), held-out "
            f"{t['bits_per_base']:.4f} bits/base after {t['step']} steps ({t['tokens']:,} tokens).",
            f"Students: d_model 64, 2 layers, {r['steps']} steps of configs/tiny_transformer.yaml's batch (same seed, "
            "same windows); distilled with alpha 0.5, temperature 2.",
            "",
            "| student | parameters | steps | tokens | held-out bits/base | wall s |",
            "|---|---:|---:|---:|---:|---:|",
            *(
                f"| {name} | {s['parameters'] or ''} | {s['step']} | {s['tokens']:,} | {s['bits_per_base']:.4f} | "
                f"{s['wall_s']} |"
                for name, s in (("without teacher", plain), ("with teacher", taught))
            ),
            "",
            f"Change from the teacher's soft targets: {taught['bits_per_base'] - plain['bits_per_base']:+.4f} "
            "bits/base (negative: the teacher helped).",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--teacher", default="runs/tiny_transformer", help="The teacher's run directory.")
    ap.add_argument("--steps", type=int, default=300, help="Training steps of each student.")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--results", default=str(harness.RESULTS))
    args = ap.parse_args(argv)
    teacher = (harness.REPO / args.teacher).resolve()
    if not (teacher / "checkpoints").is_dir():
        sys.exit(
            f"{teacher}: no checkpoints; train the teacher first "
            "(bash launch/local.sh --config configs/tiny_transformer.yaml)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        students = {
            "plain": train("plain", [], args.steps, args.ranks, work),
            "distilled": train(
                "distilled", ["--train.distill_from", str(teacher), *DISTILL], args.steps, args.ranks, work
            ),
        }
    result = {
        "date": harness.today(),
        "argv": harness.argv_of(argv),
        "hardware": harness.hardware(),
        "software": harness.software(),
        "teacher_run": args.teacher,
        "teacher": final_eval(teacher),
        "steps": args.steps,
        "students": students,
    }
    harness.write_results(args.results, "distill", result, markdown(result), indent=2)
    print(markdown(result))


if __name__ == "__main__":
    main()
