"""The rows and results files of benchmarks/sweep.py: each cell's figures from its run directories (medians over
its repeats), then sweep.csv, sweep.json, sweep.md and (with matplotlib) sweep.png.

A repeat's figures come from what the worker left in its run directory: cell_rank<r>.json of every rank (status,
peak memory, memory in use at the start), memory.json (model states), env.json and metrics.jsonl (tokens/s,
TFLOP/s, MFU and HFU of the timed steps); crash.json where the worker died or hung in it.
"""

from __future__ import annotations

import json
import pathlib
import sys
import textwrap

import harness

STATUSES = ("ok", "oom", "invalid", "error")
NOTES = [  # the notes under the table (written into the JSON's meta too)
    "Notes:",
    "",
    "- Cells of one world size share one process group and run in grid order; each engine is destroyed "
    "after its cell, and the memory still in use when the next one starts is in the 'at start' column.",
    "- On CPU the ranks share the machine's cores (--num_threads, default cores / ranks), so absolute "
    "figures are this machine's only; compare cells within one sweep, and take absolute times from a GPU. "
    "The CPU peak that MFU divides by is a matmul rate measured at the start of each cell, so it moves with "
    "the load on the machine.",
]


def rank_records(run_dir: pathlib.Path, world: int) -> list[dict] | None:
    """Every rank's cell_rank<r>.json, or None when some rank did not finish the cell."""
    paths = [run_dir / f"cell_rank{r}.json" for r in range(world)]
    return [json.loads(p.read_text()) for p in paths] if all(p.exists() for p in paths) else None


def summarise_repeat(cell: dict, warmup: int, budget_gb: float | None) -> dict:
    """One repeat of one cell: its status and figures from the run directory."""
    run_dir = pathlib.Path(cell["run_dir"])
    world = cell["world"]
    ranks = rank_records(run_dir, world)
    out: dict = {"status": "error", "oom_kind": None, "error": None}
    if ranks is None:
        crash = run_dir / "crash.json"
        out.update(json.loads(crash.read_text()) if crash.exists() else {"error": "no result from the worker"})
        return out
    statuses = [r["status"] for r in ranks]
    status = next((s for s in ("oom", "error", "invalid") if s in statuses), "ok")
    failed = next((r for r in ranks if r["status"] == status and status != "ok"), None)
    out.update(
        status=status,
        oom_kind=failed["oom_kind"] if failed else None,
        error=failed["error"] if failed else None,
        peak_bytes_per_rank=[r["peak_bytes"] for r in ranks],
        in_use_at_start_bytes_per_rank=[r["in_use_at_start_bytes"] for r in ranks],
        device=ranks[0]["device"],
        wall_s=max(r["wall_s"] for r in ranks),
    )
    memory_file = run_dir / "memory.json"
    if memory_file.exists():
        memory = json.loads(memory_file.read_text())
        out["model_state_bytes_per_rank"] = [r["total"] for r in memory["ranks"]]
        out["parameters"] = memory["parameters"]
    env_file = run_dir / "env.json"
    if env_file.exists():
        out["env"] = json.loads(env_file.read_text())
    rows = [r for r in harness.read_jsonl(run_dir / "metrics.jsonl", missing_ok=True) if "split" not in r]
    timed = [r for r in rows if r["step"] > warmup]
    if status == "ok" and timed:
        for key in ("tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "hw_tflops_per_gpu", "mfu", "hfu"):
            out[key] = harness.median([r.get(key) for r in timed])
        out["peak_tflops"] = timed[-1].get("peak_tflops")
        out["peak_source"] = timed[-1].get("peak_source")
        out["mem_peak_bytes_max_metrics"] = max((r.get("mem_peak_bytes_max") or 0) for r in timed) or None
        out["timed_steps"] = len(timed)
        out["loss_last"] = timed[-1].get("loss")
    elif status == "ok":
        out.update(status="error", error=f"no metrics rows after the {warmup} warm-up steps in {run_dir}")
    if budget_gb is not None and out["device"] == "cpu" and out["status"] == "ok":
        peak = max(out["peak_bytes_per_rank"])
        if peak > budget_gb * 2**30:
            out.update(
                status="oom",
                oom_kind="simulated",
                error=f"simulated: peak RSS {peak / 2**30:.2f} GiB > --cpu_memory_budget_gb {budget_gb:g}",
                tokens_per_s_measured=out.get("tokens_per_s"),
            )
            for key in ("tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "hw_tflops_per_gpu", "mfu", "hfu"):
                out[key] = None
    return out


def summarise(cells: list[dict], repeats: int, warmup: int, budget_gb: float | None) -> list[dict]:
    """One row per cell of the grid: medians over its repeats."""
    rows = []
    for cell in cells:
        runs = [summarise_repeat(dict(cell, run_dir=d), warmup, budget_gb) for d in cell["run_dirs"]]
        statuses = [r["status"] for r in runs]
        status = next((s for s in ("oom", "error", "invalid") if s in statuses), "ok")
        failed = next((r for r in runs if r["status"] == status and status != "ok"), {})
        row = {k: cell[k] for k in ("cell", "world", "size", "seq_len", "zero", "checkpointing", "micro")}
        row.update({k: cell[k] for k in ("grad_accum", "tp", "pp", "precision")})
        row.update({k: cell[k] for k in ("d_model", "n_layer", "n_head", "parameters")})
        row["dp"] = (
            cell["world"] // (cell["tp"] * cell["pp"]) if cell["world"] % (cell["tp"] * cell["pp"]) == 0 else None
        )
        row.update(status=status, oom_kind=failed.get("oom_kind"), error=failed.get("error"), repeats=len(runs))
        ok = [r for r in runs if r["status"] == "ok"]
        for key in ("tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "hw_tflops_per_gpu", "mfu", "hfu"):
            row[key] = harness.median([r.get(key) for r in ok]) if status == "ok" else None
        row["tokens_per_s_repeats"] = [r.get("tokens_per_s") for r in ok]
        tokens_per_step = (row["dp"] or 0) * cell["micro"] * cell["grad_accum"] * cell["seq_len"]
        row["step_s"] = tokens_per_step / row["tokens_per_s"] if row["tokens_per_s"] and tokens_per_step else None
        last = next((r for r in reversed(runs) if r.get("peak_bytes_per_rank")), {})
        row["peak_tflops"] = next((r.get("peak_tflops") for r in ok if r.get("peak_tflops")), None)
        row["peak_source"] = next((r.get("peak_source") for r in ok if r.get("peak_source")), None)
        # A refused configuration ran nothing: its process's memory says nothing about the cell.
        peaks = [r["peak_bytes_per_rank"] for r in runs if r.get("peak_bytes_per_rank") and r["status"] != "invalid"]
        row["peak_bytes_per_rank"] = [max(p) for p in zip(*peaks)] if peaks else None
        row["in_use_at_start_bytes_per_rank"] = last.get("in_use_at_start_bytes_per_rank")
        row["model_state_bytes_per_rank"] = last.get("model_state_bytes_per_rank")
        row["memory_kind"] = {"cuda": "max_memory_allocated", "cpu": "peak RSS"}.get(last.get("device"))
        row["tokens_per_s_measured_simulated_oom"] = next(
            (r.get("tokens_per_s_measured") for r in runs if r.get("oom_kind") == "simulated"), None
        )
        row["wall_s"] = sum(r.get("wall_s") or 0 for r in runs)
        row["env"] = next((r["env"] for r in runs if r.get("env")), None)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------- results

CSV_FIELDS = [
    "cell",
    "world",
    "size",
    "parameters",
    "d_model",
    "n_layer",
    "n_head",
    "seq_len",
    "zero",
    "checkpointing",
    "micro",
    "grad_accum",
    "tp",
    "pp",
    "dp",
    "precision",
    "status",
    "oom_kind",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "step_s",
    "tflops_per_device",
    "hw_tflops_per_device",
    "mfu",
    "hfu",
    "peak_tflops",
    "peak_source",
    "memory_kind",
    "peak_gib_max",
    "peak_gib_per_rank",
    "in_use_at_start_gib_per_rank",
    "model_state_gib_per_rank",
    "repeats",
    "tokens_per_s_repeats",
    "wall_s",
    "error",
]


def _gib(values) -> str:
    return "/".join(f"{v / 2**30:.3f}" for v in values) if values else ""


def _num(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def table_row(r: dict) -> dict:
    """A results row as CSV strings (per-rank values joined rank 0/rank 1/...)."""
    return {
        **{k: r[k] for k in ("cell", "world", "size", "parameters", "d_model", "n_layer", "n_head", "seq_len")},
        **{k: r[k] for k in ("zero", "checkpointing", "micro", "grad_accum", "tp", "pp", "precision", "status")},
        "dp": "" if r["dp"] is None else r["dp"],
        "oom_kind": r["oom_kind"] or "",
        "tokens_per_s": _num(r["tokens_per_s"], ".1f"),
        "tokens_per_s_per_device": _num(r["tokens_per_s_per_gpu"], ".1f"),
        "step_s": _num(r["step_s"], ".4f"),
        "tflops_per_device": _num(r["tflops_per_gpu"], ".4g"),
        "hw_tflops_per_device": _num(r["hw_tflops_per_gpu"], ".4g"),
        "mfu": _num(r["mfu"], ".4f"),
        "hfu": _num(r["hfu"], ".4f"),
        "peak_tflops": _num(r["peak_tflops"], ".4g"),
        "peak_source": r["peak_source"] or "",
        "memory_kind": r["memory_kind"] or "",
        "peak_gib_max": _num(max(r["peak_bytes_per_rank"]) / 2**30 if r["peak_bytes_per_rank"] else None, ".3f"),
        "peak_gib_per_rank": _gib(r["peak_bytes_per_rank"]),
        "in_use_at_start_gib_per_rank": _gib(r["in_use_at_start_bytes_per_rank"]),
        "model_state_gib_per_rank": _gib(r["model_state_bytes_per_rank"]),
        "repeats": r["repeats"],
        "tokens_per_s_repeats": " ".join(f"{v:.1f}" for v in r["tokens_per_s_repeats"] if v is not None),
        "wall_s": f"{r['wall_s']:.1f}",
        "error": (r["error"] or "").replace("\n", " ")[:500],
    }


def write_results(rows: list[dict], meta: dict, results: pathlib.Path, name: str) -> dict[str, pathlib.Path]:
    """name.csv, name.json, name.md and (with matplotlib) name.png in `results`; returns the paths written."""
    paths = {ext: results / f"{name}.{ext}" for ext in ("csv", "json", "md", "png")}
    table = [table_row(r) for r in rows]
    harness.write_csv(paths["csv"], CSV_FIELDS, table)
    png_note = plot(rows, meta, paths["png"])
    if png_note:
        paths.pop("png")
        if (results / f"{name}.png").exists():
            (results / f"{name}.png").unlink()  # a stale plot of another sweep must not sit beside these results
    harness.write_json(paths["json"], {"meta": {**meta, "png": png_note or "written"}, "rows": rows})
    harness.write_text(paths["md"], markdown(rows, table, meta, name, png_note))
    return paths


def markdown(rows: list[dict], table: list[dict], meta: dict, name: str, png_note: str | None) -> str:
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    lines = [
        f"# Sweep: model size x seq len x ZeRO stage x checkpointing x micro batch x tp x pp ({name})",
        "",
        *harness.header(meta),
        f"- environment (env.json of a cell): {meta['env']}",
        f"- grid: {meta['grid']}",
        f"- per cell: {meta['warmup']} warm-up + {meta['steps']} timed steps, {meta['precision']}, "
        f"{meta['repeats']} repeat(s) interleaved; one launch per {'cell' if meta['isolate'] else 'world size'}"
        f"; launches: {meta['launches']}; sweep wall time {meta['wall_s'] / 60:.1f} min",
        f"- cells: {len(rows)} ({', '.join(f'{n} {s}' for s, n in counts.items() if n)})",
        f"- plot: {name}.png" if not png_note else f"- plot: not written ({png_note})",
        "",
        "tokens/s: global (all ranks), median over the timed steps (and over repeats). TFLOP/s per device, MFU and "
        "HFU from metrics.jsonl (model FLOPs 6N + 6·L·d·s per token, causal attention at half as Megatron-LM "
        "counts it; 6N + 12·L·d·s before 2026-12-01 and for mlm; HFU adds what checkpointing recomputes), "
        "divided by the peak in the peak column (its source: datasheet, override, or a matmul rate measured at "
        "start on CPU). Peak memory per rank (rank 0/rank 1/...): max_memory_allocated on a GPU, peak RSS on CPU, "
        "reset before each cell; 'at start' is what was in use when the cell began (earlier cells' leftovers, the "
        "process itself). Model states: memory.json (parameters, gradients, master weights, optimizer states). "
        "oom rows: out of memory caught and recorded (oom kind cuda / cpu allocator / killed), or, on CPU with "
        "--cpu_memory_budget_gb, simulated: a peak RSS over the budget (throughput dropped, the measured value is "
        "in the JSON as tokens_per_s_measured_simulated_oom).",
        "",
        *harness.table(MD_COLUMNS, [md_row(r, t) for r, t in zip(rows, table)]),
    ]
    return "\n".join([*lines, "", *meta.get("notes", [])]) + "\n"


MD_COLUMNS = ["cell", "params", "seq", "ZeRO", "ckpt", "micro", "tp", "pp", "dp", "status", "tokens/s", "step s"]
MD_COLUMNS += ["TFLOP/s/dev", "MFU", "HFU", "peak TFLOP/s (source)", "peak GiB/rank", "at start GiB/rank"]
MD_COLUMNS += ["model states GiB/rank", "note"]


def md_row(r: dict, t: dict) -> list:
    """A cell's Markdown cells: the row's figures as the CSV writes them (t), its status and note."""
    peak = f"{t['peak_tflops']} ({t['peak_source']})" if t["peak_tflops"] else ""
    status = r["status"] + (f" ({r['oom_kind']})" if r["oom_kind"] else "")
    return [r["cell"], f"{r['parameters']:,}", r["seq_len"], r["zero"], r["checkpointing"], r["micro"], r["tp"]] + [
        r["pp"], t["dp"], status, t["tokens_per_s"], t["step_s"], t["tflops_per_device"], t["mfu"], t["hfu"], peak,
        t["peak_gib_per_rank"], t["in_use_at_start_gib_per_rank"], t["model_state_gib_per_rank"], t["error"][:160],
    ]  # fmt: skip


def plot(rows: list[dict], meta: dict, path: pathlib.Path) -> str | None:
    """Bar chart of tokens/s per cell (failed cells marked) and peak memory per rank; None, or why no PNG."""
    plt = harness.pyplot()
    if plt is None:
        note = "matplotlib is not installed: pip install -e '.[bench]'"
        print(f"{note}; no PNG written", file=sys.stderr)
        return note
    fig, (ax_tps, ax_mem) = plt.subplots(2, 1, figsize=(max(8, 0.55 * len(rows) + 3), 9), sharex=True)
    x = list(range(len(rows)))
    tps = [r["tokens_per_s"] or 0 for r in rows]
    colours = ["tab:blue" if r["status"] == "ok" else "tab:red" for r in rows]
    ax_tps.bar(x, tps, color=colours)
    top = max(tps + [1])
    for i, r in enumerate(rows):
        if r["status"] != "ok":
            label = r["status"] + (f"\n({r['oom_kind']})" if r["oom_kind"] else "")
            ax_tps.text(i, top * 0.02, label, ha="center", va="bottom", fontsize=7, color="tab:red", rotation=90)
    ax_tps.set_ylabel("tokens/s (global, median of timed steps)")
    ax_tps.set_title("Throughput per cell (red: no throughput, status written)")
    peaks = [max(r["peak_bytes_per_rank"]) / 2**30 if r["peak_bytes_per_rank"] else 0 for r in rows]
    states = [max(r["model_state_bytes_per_rank"]) / 2**30 if r["model_state_bytes_per_rank"] else 0 for r in rows]
    ax_mem.bar([i - 0.2 for i in x], peaks, width=0.4, label="peak memory (max over ranks)")
    ax_mem.bar([i + 0.2 for i in x], states, width=0.4, label="model states (max over ranks)")
    kind = next((r["memory_kind"] for r in rows if r["memory_kind"]), "peak memory")
    ax_mem.set_ylabel(f"GiB per rank ({kind})")
    ax_mem.legend(fontsize=8)
    ax_mem.set_xticks(x, [r["cell"] for r in rows], rotation=90, fontsize=7)
    fig.suptitle(f"megagenome sweep, {meta['date']}", fontsize=10)
    width = int(fig.get_size_inches()[0] * 20)  # characters of 6-point monospace per line
    footer = "\n".join(
        textwrap.wrap(meta["command"], width) + textwrap.wrap(f"{meta['hardware']}; {meta['software']}", width)
    )
    fig.text(0.01, 0.005, footer, fontsize=6, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
