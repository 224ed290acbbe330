"""`megagenome report` of a fine-tuning run (layer L1): its plots and report.md (report.py draws them).

A `megagenome finetune` run directory (task.json beside metrics.jsonl) gets, in --output (default RUN/report):

    loss.png             training loss and validation loss (the objective: cross entropy in nats, or the
                         standardised target's mean squared error)
    <metric>.png         each validation metric of the task over the steps (accuracy, mcc, auroc; or spearman,
                         pearson, mse)
    lr.png               learning rate
    examples_per_s.png   throughput, all ranks together
    report.md            task, classes, steps, best step by the early-stopping metric, the validation and test
                         metrics of the best checkpoint (summary.json), links to the PNGs
"""

from __future__ import annotations

import json
import os
import sys

from megagenome.files.outputs import check_outputs
from megagenome.files.run_files import REPORT, TASK
from megagenome.observe.report import Plot, ReportError, RunRecords, draw, load, publish

METRICS = {
    "classification": ("accuracy", "mcc", "auroc"),
    "per_base": ("accuracy", "mcc", "auroc"),
    "regression": ("spearman", "pearson", "mse"),
}
NAMES = {"mcc": "MCC", "auroc": "AUROC", "spearman": "Spearman", "pearson": "Pearson", "mse": "MSE"}


def plots(task: str) -> list[Plot]:
    out = [Plot("loss", "Loss", "loss", (("train", "loss", "training"), ("validation", "loss", "validation")))]
    for m in METRICS[task]:
        name = NAMES.get(m, m)
        out.append(Plot(m, f"Validation {name}", name, (("validation", m, f"validation {name}"),)))
    out.append(Plot("lr", "Learning rate", "learning rate", (("train", "lr", "learning rate"),)))
    out.append(
        Plot("examples_per_s", "Throughput", "examples/s", (("train", "examples_per_s", "all ranks"),), from_zero=True)
    )
    return out


def report(records: RunRecords, out: str) -> dict:
    """Write the PNGs and report.md of a fine-tuning run's records into `out`; report.py's result dict."""
    with open(os.path.join(records.run_dir, TASK), encoding="utf-8") as fh:
        task = json.load(fh)
    figures, skipped = draw(plots(task["task"]), records)
    path, drawn = publish(out, figures, lambda names: markdown(records, task, names, skipped))
    return {"report": path, "plots": drawn, "skipped": skipped}


def markdown(records: RunRecords, task: dict, drawn: dict[str, str], skipped: dict[str, str]) -> str:
    summary, config = records.summary or {}, records.config or {}
    train = records.split("train")
    model = task["pretrained"]["model"]
    how = "LoRA" if task.get("lora") else ("head only" if task.get("freeze_backbone") else "full fine-tuning")
    if task.get("init") == "random":
        how += " from random weights (--model.init random: the from-scratch control)"
    sizes = task["data"]["sizes"]
    facts = [
        ("task", f"{task['task']}" + (f" ({', '.join(task['classes'])})" if task["classes"] else "")),
        (
            "pretrained",
            f"`{task['pretrained']['path']}`: {model.get('family', 'transformer')}, "
            f"{model['n_layer']} layers, d_model {model['d_model']}",
        ),  # fmt: skip
        ("fine-tuning", f"{how}; head on layer {task['layer']}, {task['pooling']} pooling{_head_notes(task)}"),
        ("examples", ", ".join(f"{k} {v:,}" for k, v in sizes.items())),
        ("steps", f"{train[-1]['step'] if train else 0:,} of {(config.get('train') or {}).get('max_steps', '?')}"),
    ]
    if summary:
        stop = "stopped early" if summary.get("stopped_early") else "ran to max_steps"
        facts.append(("best step", f"{summary.get('best_step')} by validation {summary.get('metric')} ({stop})"))
    lines = [
        f"# megagenome fine-tuning report: {os.path.basename(os.path.abspath(records.run_dir))}",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in facts),
    ]
    results = [(split, summary[split]) for split in ("validation", "test") if summary.get(split)]
    if results:
        keys = ["loss", *METRICS[task["task"]]]
        lines += ["", "## The best checkpoint", "", "| split | n | " + " | ".join(keys) + " |"]
        lines.append("|---" * (len(keys) + 2) + "|")
        baseline = summary.get("baseline") or {}
        rows = [(split, m) for split, m in results]
        rows += [(f"{split}, k-mer baseline", baseline[split]) for split, _ in results if baseline.get(split)]
        for split, m in rows:
            cells = [f"{m[k]:.4f}" if isinstance(m.get(k), float) else "-" for k in keys]
            lines.append(f"| {split} | {m.get('n', '-')} | " + " | ".join(cells) + " |")
        if baseline.get("name"):
            lines += ["", f"The k-mer baseline: {baseline['name']}, {baseline['choice']} chosen on validation "
                      f"{baseline['metric']}, fitted on the same training split (run/task_baseline.py)."]  # fmt: skip
        elif baseline.get("failed"):
            lines += ["", f"The k-mer baseline could not be fitted: {baseline['failed']}"]
    else:
        lines += ["", "The run has not finished: no summary.json with the best checkpoint's metrics yet."]
    lines += ["", "## Plots", ""]
    lines += [f"![{name}]({file})\n" for name, file in drawn.items()]
    if skipped:
        lines += ["## Not drawn", "", *(f"- {n}.png: {why}" for n, why in skipped.items())]
    return "\n".join(lines).rstrip() + "\n"


def is_task_run(run_dir: str) -> bool:
    return os.path.isfile(os.path.join(run_dir, TASK))


def main(ns) -> int:
    """`megagenome report RUN [--output DIR]` of a fine-tuning run: exit 0, or 2 with a message."""
    out = getattr(ns, "output", None) or os.path.join(ns.run, REPORT)
    try:
        check_outputs([("--output", os.path.join(out, "report.md"))], overwrite=True)  # before any work
        records = load(ns.run)
        result = report(records, out)
    except (ReportError, ValueError) as e:  # ValueError: an unwritable --output, a damaged metrics.jsonl
        print(f"megagenome report: error: {e}", file=sys.stderr)
        return 2
    print(f"megagenome report: {result['report']} and {len(result['plots'])} plot(s)")
    for name, why in result["skipped"].items():
        print(f"  not drawn: {name}.png ({why})")
    return 0


def _head_notes(task: dict) -> str:
    """How the head input was chosen and whether outputs average both strands, for the facts table."""
    notes = []
    if (task.get("head_input") or {}).get("by_choice"):
        notes.append(f"chosen by linear probes on validation {task['head_input']['metric']}")
    if task.get("rc_average"):
        notes.append("outputs averaged over both strands")
    return f" ({'; '.join(notes)})" if notes else ""
