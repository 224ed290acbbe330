"""`megagenome report` (layer L5): PNG plots and a Markdown summary of a run (observe/report.py; a fine-tuning run:
observe/task_report.py)."""

from __future__ import annotations

from jsonargparse import ArgumentParser

from .args import Parsed

HELP = "PNG plots and a Markdown summary of a run."


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="megagenome report",
        description="PNG plots of a run's metrics.jsonl (loss, held-out bits/base with the Markov baselines of "
        "summary.json as lines, learning rate, tokens/s, MFU, memory) and report.md, a short Markdown summary that "
        "links them; of a `megagenome finetune` run, its loss, validation metrics (accuracy, MCC, AUROC or Spearman, "
        "Pearson, MSE), learning rate and examples/s, and the best checkpoint's validation and test metrics. Reads "
        "the run directory only; works on a run still in progress.",
    )
    parser.add_argument("run", type=str, help="A run directory (with metrics.jsonl).")
    parser.add_argument(
        "--output", type=str | None, default=None, help="Directory for the PNGs and report.md (default: RUN/report)."
    )
    return parser


def main(parsed: Parsed) -> int:
    from megagenome.observe import report, task_report

    if task_report.is_task_run(parsed.ns.run):  # a `megagenome finetune` run: its task metrics
        return task_report.main(parsed.ns)
    return report.main(parsed.ns)
