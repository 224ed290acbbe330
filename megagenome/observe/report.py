"""`megagenome report RUN` (layer L1): PNG plots of a run's metrics and a short Markdown summary.

Reads <run dir>/metrics.jsonl (required), summary.json (the baselines, parameter count and wall time; absent
while a run is in progress) and config.yaml (the model's shape), and writes into --output (default RUN/report):

    loss.png           training loss and held-out loss (nats per token)
    bits_per_base.png  held-out bits per base, summary.json's baselines as horizontal lines: order-k Markov chains,
                       or a masked run's two-sided k-mer context models
    lr.png             learning rate
    tokens_per_s.png   throughput, all ranks together
    mfu.png            MFU and HFU (causal attention counted at half, as Megatron-LM does) and MFU counting every
                       attention score (PaLM), % of the peak the run divided by
    memory.png         peak memory, largest rank and rank 0
    report.md          model size, steps, tokens, final train loss, held-out bits/base against the baselines,
                       throughput, MFU (both conventions), peak memory, and links to the PNGs

A plot whose metric no row carries (MFU without a known peak, memory where it is not measured) is not drawn, and
report.md says why. matplotlib draws on its Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from dataclasses import dataclass

import yaml

from megagenome.files.outputs import OutputError, check_outputs, staged
from megagenome.files.run_files import CONFIG, METRICS, REPORT, SUMMARY
from megagenome.observe.metrics import read_metrics


class ReportError(Exception):
    """The run directory cannot be reported on (no metrics.jsonl, no rows)."""


@dataclass(frozen=True)
class Plot:
    name: str  # the PNG's file name without .png
    title: str
    ylabel: str
    series: tuple[tuple[str, str, str], ...]  # (split, metrics key, legend label); the first one decides if drawn
    scale: float = 1.0  # values are multiplied by this before plotting
    baselines: bool = False  # draw summary.json's baselines as horizontal lines
    from_zero: bool = False  # the y axis starts at 0 (quantities whose small wiggles should not look large)


PLOTS = (
    Plot("loss", "Loss", "nats per token", (("train", "loss", "training"), ("val", "loss", "held-out"))),
    Plot(
        "bits_per_base",
        "Held-out bits per base",
        "bits per base",
        (("val", "bits_per_base", "model (held-out)"),),
        baselines=True,
    ),
    Plot("lr", "Learning rate", "learning rate", (("train", "lr", "learning rate"),)),
    Plot(
        "tokens_per_s", "Throughput", "tokens/s (all ranks)", (("train", "tokens_per_s", "tokens/s"),), from_zero=True
    ),
    Plot(
        "mfu",
        "FLOPs utilisation",
        "% of peak",
        (
            ("train", "mfu", "MFU"),
            ("train", "hfu", "HFU"),
            ("train", "mfu_full_attn", "MFU, every score counted (PaLM)"),
        ),
        scale=100.0,
        from_zero=True,
    ),
    Plot(
        "memory",
        "Peak memory",
        "GiB",
        (("train", "mem_peak_bytes_max", "largest rank"), ("train", "mem_peak_bytes", "rank 0")),
        scale=1 / 2**30,
        from_zero=True,
    ),
)


@dataclass
class RunRecords:
    run_dir: str
    rows: list[dict]
    summary: dict | None
    config: dict | None

    def split(self, name: str) -> list[dict]:
        return [r for r in self.rows if r.get("split", "train") == name]

    def series(self, split: str, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows of `split` that carry a number under `key`."""
        pairs = [(r["step"], float(r[key])) for r in self.split(split) if _number(r.get(key))]
        return [s for s, _ in pairs], [v for _, v in pairs]

    @property
    def masked(self) -> bool:
        """Whether summary.json compares the model with masked baselines (an mlm run, run/summary.py)."""
        return bool((self.summary or {}).get("masked_baseline_bits_per_base"))

    @property
    def baselines(self) -> dict[int, float]:
        """The baselines the model's held-out figure is compared with: a masked run's two-sided k-mer context models
        ({k bases each side: bits}), else the order-k Markov chains ({k: bits})."""
        key = "masked_baseline_bits_per_base" if self.masked else "markov_bits_per_base"
        found = (self.summary or {}).get(key) or {}
        return {int(k): float(v) for k, v in sorted(found.items(), key=lambda kv: int(kv[0]))}

    def baseline_name(self, k: int) -> str:
        return f"masked k-mer, k={k} each side" if self.masked else f"order-{k} Markov"


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def load(run_dir: str) -> RunRecords:
    """The records of a run directory; ReportError when it has no metrics.jsonl or no rows in it."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.isdir(run_dir) else "has no metrics.jsonl"
        raise ReportError(f"{run_dir} {what}: give a run directory of `megagenome pretrain` (--log.run_dir)")
    rows = [r for r in read_metrics(path) if "step" in r]
    if not rows:
        raise ReportError(f"{path} has no rows yet: nothing to report")

    def optional(name: str, reader) -> dict | None:
        p = os.path.join(run_dir, name)
        if not os.path.isfile(p):
            return None
        with open(p, encoding="utf-8") as fh:
            return reader(fh)

    return RunRecords(run_dir, rows, optional(SUMMARY, json.load), optional(CONFIG, yaml.safe_load))


def figure(plot: Plot, records: RunRecords):
    """The matplotlib Figure of `plot` (on an Agg canvas), or a string saying why it cannot be drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    split, key, _ = plot.series[0]
    if not records.series(split, key)[0]:
        return f'no {"training" if split == "train" else "held-out"} row carries "{key}"'
    fig = Figure(figsize=(8, 4.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    top = 0.0
    for i, (split, key, label) in enumerate(plot.series):
        steps, values = records.series(split, key)
        # Later series dashed over a wider first one: equal curves (MFU = HFU, one rank's memory) stay visible.
        style = {"linewidth": 2.5, "alpha": 0.8} if i == 0 else {"linewidth": 1.5, "linestyle": "--"}
        if plot.baselines:
            style = {"linewidth": 2.0, "color": "black"}
        if steps:
            marker = "o" if len(steps) <= 30 else None
            top = max(top, *(v * plot.scale for v in values))
            ax.plot(steps, [v * plot.scale for v in values], marker=marker, markersize=4, label=label, **style)
    if plot.baselines:
        _draw_baselines(ax, records)
    ax.set(title=f"{plot.title} ({os.path.basename(os.path.abspath(records.run_dir))})", xlabel="step")
    ax.set_ylabel(plot.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 3.5
    if plot.from_zero:
        ax.set_ylim(0, 1.1 * top if top > 0 else 1.0)
    ax.grid(True, alpha=0.3)
    if len(ax.get_legend_handles_labels()[0]) > 1:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small", frameon=False)
    return fig


def draw(plots, records: RunRecords) -> tuple[dict, dict[str, str]]:
    """Each plot's figure: ({name: figure} drawn, {name: why not} skipped)."""
    drawn, skipped = {}, {}
    for plot in plots:
        fig = figure(plot, records)
        if isinstance(fig, str):
            skipped[plot.name] = fig
        else:
            drawn[plot.name] = fig
    return drawn, skipped


def _draw_baselines(ax, records: RunRecords) -> None:
    """summary.json's baselines (order-k Markov, or a masked run's two-sided k-mer models) as horizontal lines:
    dashed, coloured by k, the best one solid red; the legend lists them by k (0, 1, 2, ...), whatever their
    values."""
    from matplotlib import colormaps

    baselines = records.baselines
    if not baselines:
        return
    best = min(baselines, key=baselines.get)
    cmap = colormaps["viridis"]
    for k, v in sorted(baselines.items(), key=lambda kv: int(kv[0])):
        label = f"{records.baseline_name(k)} {v:.4f}" + (" (best)" if k == best else "")
        if k == best:
            ax.axhline(v, color="tab:red", linewidth=2.0, label=label)
        else:
            ax.axhline(v, color=cmap(k / max(max(baselines), 1)), linewidth=1.2, linestyle="--", label=label)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def facts(records: RunRecords) -> list[tuple[str, str]]:
    """The summary table of report.md: (what, value) pairs, from the rows first, summary.json and config.yaml
    where the rows do not say."""
    train, evals = records.split("train"), records.split("val")
    summary, config = records.summary or {}, records.config or {}
    model, train_cfg = config.get("model") or {}, config.get("train") or {}
    timed = train[1:] or train  # the first window includes warm-up
    last = train[-1] if train else {}
    out = [("model", _model_line(summary, model, config.get("data") or {}))]
    of = f" of {train_cfg['max_steps']:,}" if train_cfg.get("max_steps") else ""
    out.append(("steps", f"{last.get('step', 0):,}{of}"))
    if _number(last.get("tokens")):
        out.append(("tokens", f"{last['tokens']:,} (training, all ranks)"))
    if _number(last.get("loss")):
        out.append(("final train loss", f"{last['loss']:.4f} nats/token (step {last['step']})"))
    out.append(("held-out bits/base", _heldout_line(evals, records)))
    tps = _median([r["tokens_per_s"] for r in timed if _number(r.get("tokens_per_s"))])
    if tps is not None:
        out.append(("throughput", f"{tps:,.0f} tokens/s (median over logged intervals after the first, all ranks)"))
    mfu = _median([r["mfu"] for r in timed if _number(r.get("mfu"))])
    hfu = _median([r["hfu"] for r in timed if _number(r.get("hfu"))])
    full = _median([r["mfu_full_attn"] for r in timed if _number(r.get("mfu_full_attn"))])
    if mfu is not None:
        peak = f" of {last['peak_tflops']:.4g} TFLOP/s per device" if _number(last.get("peak_tflops")) else ""
        source = f" ({last['peak_source']})" if last.get("peak_source") else ""
        shown_hfu = f" (HFU {100 * hfu:.2f}%)" if hfu is not None else ""
        out.append(("MFU", f"{100 * mfu:.2f}%{shown_hfu}{peak}{source}, median"))
        if full is not None and full != mfu:
            out.append(
                ("MFU, every score", f"{100 * full:.2f}% (PaLM's count; MFU above counts causal attention at half)")
            )
    else:
        out.append(("MFU", "not recorded (no peak TFLOP/s known to the run)"))
    mem = [r["mem_peak_bytes_max"] for r in train if _number(r.get("mem_peak_bytes_max"))]
    out.append(("peak memory", f"{max(mem) / 2**30:.2f} GiB (largest rank)" if mem else "not recorded"))
    if _number(summary.get("wall_s")):
        out.append(("wall time", f"{summary['wall_s']:.1f} s (last invocation)"))
    return out


def _model_line(summary: dict, model: dict, data: dict) -> str:
    size = f"{summary['parameters']:,} parameters" if _number(summary.get("parameters")) else "parameters unknown"
    shape = [
        f"{model[k]} {label}" if label != "d_model" else f"d_model {model[k]}"
        for k, label in (("n_layer", "layers"), ("d_model", "d_model"), ("n_head", "heads"))
        if model.get(k) is not None
    ]
    if summary.get("model"):  # the family's own line (run/summary.py; older runs: the generic shape above)
        shape = [summary["model"]]
    if data.get("seq_len"):
        shape.append(f"windows of {data['seq_len']} tokens")
    return size + (": " + ", ".join(shape) if shape else "")


def _heldout_line(evals: list[dict], records: RunRecords) -> str:
    final = next((r for r in reversed(evals) if _number(r.get("bits_per_base"))), None)
    if final is None:
        return "not evaluated yet"
    line = f"{final['bits_per_base']:.4f} (step {final['step']})"
    baselines = records.baselines
    if not baselines:
        return line + "; no baselines (no summary.json: the run has not finished)"
    best = min(baselines, key=baselines.get)
    gap = final["bits_per_base"] - baselines[best]
    verdict = f"{-gap:.4f} below it" if gap < 0 else f"{gap:.4f} above it (not yet below)"
    kind = " (masked positions)" if records.masked else ""
    return line + f"{kind}; best baseline {records.baseline_name(best)} {baselines[best]:.4f}: the model is {verdict}"


def markdown(records: RunRecords, drawn: dict[str, str], skipped: dict[str, str]) -> str:
    """report.md: the facts table, the model against every baseline, the plots (links), what was not drawn."""
    name = os.path.basename(os.path.abspath(records.run_dir))
    sources = [n for n, have in ((SUMMARY, records.summary), (CONFIG, records.config)) if have]
    lines = [
        f"# megagenome run report: {name}",
        "",
        f"Run directory `{os.path.abspath(records.run_dir)}`; from metrics.jsonl"
        + "".join(f", {s}" for s in sources)
        + " by `megagenome report`.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {what} | {value} |" for what, value in facts(records)),
    ]
    evals = [r for r in records.split("val") if _number(r.get("bits_per_base"))]
    if records.baselines:
        against = (
            "the masked baselines (two-sided k-mer context under the same masking: data/masked_baseline.py)"
            if records.masked
            else "the Markov baselines"
        )
        lines += ["", f"## Held-out bits per base against {against}", "", "| | bits/base |", "|---|---|"]
        if evals:
            lines.append(f"| model (step {evals[-1]['step']}) | {evals[-1]['bits_per_base']:.4f} |")
        best = min(records.baselines, key=records.baselines.get)
        for k, v in records.baselines.items():
            lines.append(f"| {records.baseline_name(k)}{' (best)' if k == best else ''} | {v:.4f} |")
    lines += ["", "## Plots", ""]
    for plot in PLOTS:
        if plot.name in drawn:
            lines += [f"![{plot.title}]({drawn[plot.name]})", ""]
    if skipped:
        lines += ["## Not drawn", ""]
        lines += [f"- {name}.png: {why}" for name, why in skipped.items()]
    return "\n".join(lines).rstrip() + "\n"


def report(run_dir: str, output: str | None = None) -> dict:
    """Write the PNGs and report.md of `run_dir` into `output` (default run_dir/report). Returns {"report": path
    of report.md, "plots": {name: png path}, "skipped": {name: why}}."""
    out = output or os.path.join(run_dir, REPORT)
    try:  # before any work: report.md (and the PNGs beside it) can be written there
        check_outputs([("--output" if output else "the report directory", os.path.join(out, "report.md"))], True)
    except OutputError as e:
        raise ReportError(str(e)) from e
    records = load(run_dir)
    figures, skipped = draw(PLOTS, records)
    path, plots = publish(out, figures, lambda drawn: markdown(records, drawn, skipped))
    return {"report": path, "plots": plots, "skipped": skipped}


def publish(out: str, figures: dict, markdown_of) -> tuple[str, dict[str, str]]:
    """Each figure as out/<name>.png and report.md (the text markdown_of({name: file name}) gives) published together
    (files/outputs.py staged: all or none; an earlier report is replaced only by a complete one); (report.md's path,
    {name: PNG path})."""
    drawn = {name: f"{name}.png" for name in figures}
    path = os.path.join(out, "report.md")
    plots = {name: os.path.join(out, file) for name, file in drawn.items()}
    with staged(*plots.values(), path) as temps:
        for fig, tmp in zip(figures.values(), temps):
            fig.savefig(tmp, format="png")
        with open(temps[-1], "w", encoding="utf-8") as fh:
            fh.write(markdown_of(drawn))
    return path, plots


def main(ns) -> int:
    """`megagenome report RUN [--output DIR]`: exit 0, or 2 with a message when RUN cannot be reported on."""
    try:
        result = report(ns.run, getattr(ns, "output", None))
    except (ReportError, ValueError) as e:  # ValueError: a damaged metrics.jsonl (its file and line)
        print(f"megagenome report: error: {e}", file=sys.stderr)
        return 2
    print(f"megagenome report: {result['report']} and {len(result['plots'])} plot(s)")
    for name, why in result["skipped"].items():
        print(f"  not drawn: {name}.png ({why})")
    return 0
