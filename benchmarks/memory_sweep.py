"""Memory and speed of ZeRO stages, offload and activation checkpointing on 2 CPU ranks.

A 51M-parameter model (d_model 512, 16 layers, 8 heads) at seq_len 2048 in bf16, swept over engine
configurations (ZeRO 0-3, ZeRO-2 with optimizer offload, ZeRO-3 with parameter + optimizer offload) x
activation checkpointing policy (none, full, selective) x micro batch (1, 2). For each cell:

- model-state bytes per rank, counted from the engine's tensors (engine/memory.py model_state_bytes, the memory.json
  that `megagenome pretrain` writes, written here per engine configuration);
- peak RSS per rank over the cell's steps (ru_maxrss, the metrics.jsonl mem_peak_bytes, reset before every
  step through /proc/self/clear_refs), with MALLOC_MMAP_THRESHOLD_=65536 so that freed memory goes back to the
  kernel and one step's activations do not inflate the next step's RSS;
- step time (forward + backward + optimizer step, the slower rank), as CPU time (process time, which ignores
  waiting for a core that other jobs on a shared machine hold) and as wall time, each as a ratio to ZeRO-0
  without checkpointing at the same micro batch: the median over the cell's timed steps over the baseline's.

Each engine configuration runs in one `deepspeed` launch (a worker mode of this script) of its own: its cells
share the engine, with the policy and micro batch switched between steps, and are interleaved step by step
(round 1: every cell once, round 2: every cell again, ...) after one untimed warm-up step that creates the
optimizer states. Fresh processes per configuration, because DeepSpeed engines are not freed when dropped
(their hooks keep them alive; engine.destroy() frees ZeRO 0-2 but not ZeRO-3), so a later engine's RSS would
include the earlier ones. ZeRO-0, the baseline, runs first and again last, so drift over the sweep shows in its two
measurements and both enter its median. A cell that fails is a row with its error.

Batches are random A/C/G/T tokens: speed and memory do not depend on the bases. Checkpointing uses torch's
checkpoint (DeepSpeed's keeps the same tensors, tests/test_activation_checkpointing.py). Stage 0 trains bf16 with
bf16 gradients, the only bf16 mode DeepSpeed allows there; stages 1-3 use the shipped bf16.json (fp32 gradient
accumulation).

    python benchmarks/memory_sweep.py [--grid reduced|full] [--rounds 2] [--nproc 2]
    python benchmarks/memory_sweep.py --render

Writes benchmarks/results/memory_sweep.{csv,json,md,png} (PNG needs matplotlib: pip install -e '.[bench]'): the CSV
holds every row, the JSON the run's description (date, command, machine, load, wall time, exit codes, parameter
count), and the Markdown is rendered from those two alone, so --render rewrites it from them without a sweep.
"""

from __future__ import annotations

import csv
import gc
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

import harness

MODEL = {"d_model": 512, "n_layer": 16, "n_head": 8, "max_seq_len": 2048}
SEQ_LEN = 2048
ENGINES = {
    "zero0": ["zero0.json", harness.BF16_ONLY],
    "zero1": ["zero1.json", "bf16.json"],
    "zero2": ["zero2.json", "bf16.json"],
    "zero3": ["zero3.json", "bf16.json"],
    "zero2_offload": ["zero2_offload.json", "bf16.json"],
    "zero3_offload": ["zero3_offload.json", "bf16.json"],
}
POLICIES = ["none", "full", "selective"]
MICROS = [1, 2]
BASELINE = "zero0"
WORKER_TIMEOUT_S = 3600


def grid(name: str) -> list[tuple[str, list[tuple[str, int]]]]:
    """(engine run, [(policy, micro), ...]) in running order; ZeRO-0 first and last (the baseline, bracketed)."""
    every = [(p, m) for m in MICROS for p in POLICIES]
    if name == "full":
        runs = [(e, every) for e in ENGINES]
    else:
        # ~15 minutes on 2 cores: every configuration at micro 1 without checkpointing; all policies and both
        # micro batches at ZeRO-0 (the baseline) and ZeRO-3 (the least model-state memory), but selective at
        # micro 2 only at ZeRO-0.
        plain = [("none", 1)]
        runs = [(BASELINE, every)] + [(e, plain) for e in ENGINES if e not in (BASELINE, "zero3")]
        runs.append(("zero3", [c for c in every if c != ("selective", 2)]))
    return [*runs, (BASELINE + "#2", [("none", m) for m in MICROS])]


# ---------------------------------------------------------------------------------------------------- worker


def run_engine(out: pathlib.Path, run_name: str, cells: list, rounds: int, rank: int, world: int):
    """Build one engine, take a warm-up step, then `rounds` interleaved timed steps of every cell.

    Returns ({cell: {"times": [...], "peaks": [...]}}, {cell: error}).
    """
    import torch

    from megagenome.config import ModelConfig, RootConfig
    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.engine import engine as ds
    from megagenome.engine.memory import MemoryProbe
    from megagenome.model.transformer import DNATransformer
    from megagenome.parallel.layout import ParallelLayout
    from megagenome.train.accounting import peak_memory_bytes

    samples = {c: {"times": [], "cpu": [], "peaks": []} for c in cells}
    errors: dict[tuple[str, int], str] = {}
    cfg = RootConfig(model=ModelConfig(**MODEL))
    cfg.train.micro_batch_size, cfg.train.max_steps, cfg.train.warmup_steps = 1, 1000, 10
    engine_name = run_name.split("#")[0]
    files = [
        str(out / f) if f == harness.BF16_ONLY else str(harness.REPO / "ds_configs" / f) for f in ENGINES[engine_name]
    ]
    batch = ParallelLayout(world).batch(cfg.train)
    ds_config = harness.ds_dict(files, " + ".join(files), "memory_sweep", False, batch, cfg.train)
    torch.manual_seed(0)
    model = DNATransformer(cfg.model, VOCAB_SIZE)
    n_params = model.num_parameters()  # before initialize: ZeRO-3 leaves empty parameters on the module
    engine = ds.initialize(model, model.param_groups(cfg.train.weight_decay), ds_config)
    os.makedirs(out / run_name, exist_ok=True)
    memory_path = str(out / run_name / "memory.json")
    probe = MemoryProbe(engine, memory_path, 1, rank, n_params, world, ds_config)
    gen = torch.Generator().manual_seed(rank)
    acgt = torch.tensor([3, 4, 5, 6])  # token ids of A, C, G, T (megagenome.data.tokenizer)

    def step(policy: str, micro: int, index: int) -> tuple[float, float]:
        model.cfg.checkpointing = policy  # read at every forward; this switches the policy between steps
        model.set_checkpoint_function(None)
        ids = acgt[torch.randint(0, 4, (micro, SEQ_LEN + 1), generator=gen)]  # (micro, T + 1)
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_weight": torch.ones(micro, SEQ_LEN)}
        ds.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss, _, _ = engine(**batch)
        engine.backward(loss)
        if index == probe.at_step:  # memory.json at the second step: optimizer states exist, gradients complete
            probe.record()
        engine.step()
        return time.perf_counter() - t0, time.process_time() - c0

    step("none", 1, 0)  # warm-up: creates the optimizer states
    index = 1
    for _ in range(rounds):
        for cell in cells:
            if cell in errors:
                continue
            try:
                harness.reset_peak(gpu=False)
                seconds, cpu_seconds = step(*cell, index)
                samples[cell]["times"].append(seconds)
                samples[cell]["cpu"].append(cpu_seconds)
                samples[cell]["peaks"].append(peak_memory_bytes(torch.device("cpu")))
            except Exception as e:  # config or memory errors are the same on every rank: a row, not a crash
                errors[cell] = f"{type(e).__name__}: {e}"
            index += 1
    return samples, errors


def worker(out: pathlib.Path, plan: list, rounds: int) -> None:
    import torch

    from megagenome.engine import engine as ds

    torch.set_num_threads(1)
    rank, _, world = ds.init_distributed()
    for run_name, cells in plan:
        started, rss_before = time.time(), harness.proc_status("VmRSS")
        try:
            samples, errors = run_engine(out, run_name, cells, rounds, rank, world)
        except Exception as e:
            traceback.print_exc()
            samples, errors = (
                {c: {"times": [], "cpu": [], "peaks": []} for c in cells},
                {c: f"{type(e).__name__}: {e}" for c in cells},
            )
        gc.collect()  # the engine of this configuration is gone before the next one is built
        gathered = ds.all_gather_object(samples)
        memory_file = out / run_name / "memory.json"
        memory = json.loads(memory_file.read_text()) if memory_file.exists() else None
        rows = []
        for cell in cells:
            policy, micro = cell
            row = {"run": run_name, "engine": run_name.split("#")[0], "policy": policy, "micro": micro}
            row["error"] = errors.get(cell)
            if cell not in errors:
                per_step = list(zip(*(g[cell]["times"] for g in gathered)))  # (step, rank)
                row["step_s"] = [max(t) for t in per_step]
                row["cpu_s"] = [max(t) for t in zip(*(g[cell]["cpu"] for g in gathered))]
                row["peak_rss_bytes"] = [max(g[cell]["peaks"]) for g in gathered]
            if memory is not None:
                row["model_state_bytes"] = [r["total"] for r in memory["ranks"]]
                row["buffer_bytes"] = [r["buffers"] for r in memory["ranks"]]
                row["formula_bytes"] = memory["formula_bytes_per_rank"]
                row["parameters"] = memory["parameters"]
                row["grad_accum_dtype"] = memory["grad_accum_dtype"]
            row["rss_before_engine_bytes"] = rss_before
            row["engine_wall_s"] = round(time.time() - started, 1)
            rows.append(row)
        if rank == 0:
            with open(out / "cells.jsonl", "a") as fh:
                fh.writelines(json.dumps(row) + "\n" for row in rows)
        ds.barrier()
    ds.shutdown()


# ---------------------------------------------------------------------------------------------------- driver


def launch(nproc: int, work: pathlib.Path, run: tuple, rounds: int) -> tuple[int, str]:
    """One `deepspeed` launch for one engine configuration and its cells; returns (rc, output tail)."""
    run_dir = work / run[0]
    run_dir.mkdir(parents=True, exist_ok=True)
    (work / "plan.json").write_text(json.dumps([run]))
    env = harness.child_env(OMP_NUM_THREADS="1", **harness.QUIET_MALLOC)  # RSS follows live memory
    log, rounds_flag = run_dir / "worker.log", ["--rounds", str(rounds)]
    return harness.launch_worker(__file__, nproc, work, log, WORKER_TIMEOUT_S, *rounds_flag, env=env, tail=2000)


def summarise(rows: list[dict], plan: list, ended: dict[str, tuple[int, str]]) -> list[dict]:
    """One row per (engine, policy, micro) with medians, ratios and, for cells that never ran, the reason.

    ended: each run's (worker rc, output tail)."""
    done = {(r["run"], r["policy"], r["micro"]) for r in rows}
    for run_name, cells in plan:
        rc, tail = ended.get(run_name, (None, ""))
        for policy, micro in cells:
            if (run_name, policy, micro) not in done:
                reason = f"not run: the worker ended with rc {rc} first ({tail.strip().splitlines()[-1:]})"
                rows.append({"run": run_name, "engine": run_name.split("#")[0], "policy": policy, "micro": micro})
                rows[-1]["error"] = reason
    merged: dict[tuple[str, str, int], dict] = {}
    for r in rows:  # the baseline's two runs (first and last) become one row
        m = merged.setdefault((r["engine"], r["policy"], r["micro"]), {**r, "step_s": [], "cpu_s": [], "peaks": []})
        if not r.get("error"):
            m["error"] = None
            m["step_s"] = m["step_s"] + r["step_s"]
            m["cpu_s"] = m["cpu_s"] + r["cpu_s"]
            m["peaks"].append(r["peak_rss_bytes"])
    out = []
    for (engine, policy, micro), m in merged.items():
        base = merged.get((BASELINE, "none", micro), {})
        row = {
            "engine": engine,
            "policy": policy,
            "micro": micro,
            "grad_accum_dtype": m.get("grad_accum_dtype"),
            "model_state_bytes": m.get("model_state_bytes"),
            "formula_bytes": m.get("formula_bytes"),
            "buffer_bytes": m.get("buffer_bytes"),
            "peak_rss_bytes": [max(ranks) for ranks in zip(*m["peaks"])] or None,
            "parameters": m.get("parameters"),
            "error": m.get("error"),
        }
        for key in ("step_s", "cpu_s"):  # wall time, and CPU time (insensitive to other load on the machine)
            median = statistics.median(m[key]) if m[key] else None
            base_median = statistics.median(base[key]) if base.get(key) else None
            row[key] = m[key]
            row[key + "_median"] = median
            row[key + "_ratio"] = median / base_median if median and base_median else None
        out.append(row)
    order = {e: i for i, e in enumerate(ENGINES)}
    return sorted(out, key=lambda r: (r["micro"], order[r["engine"]], POLICIES.index(r["policy"])))


def per_psi(values, psi) -> str:
    """Bytes as multiples of the parameter count (16.00 = 16 bytes per parameter)."""
    return "/".join(f"{v / psi:.2f}" for v in values) if values and psi and None not in values else ""


def gib(values) -> str:
    return "/".join(f"{v / 2**30:.2f}" for v in values) if values else ""


CSV_FIELDS = ["engine", "policy", "micro", "grad_accum_dtype", "model_state_gib_per_rank", "model_state_psi_per_rank"]
CSV_FIELDS += ["formula_psi"]
CSV_FIELDS += ["buffers_gib_per_rank", "peak_rss_gib_per_rank", "cpu_s_median", "cpu_ratio_vs_zero0_none"]
CSV_FIELDS += ["wall_s_median", "wall_ratio_vs_zero0_none", "cpu_s", "wall_s", "error"]


def write_results(rows: list[dict], meta: dict) -> None:
    """memory_sweep.csv (the rows) and memory_sweep.json (meta), then the Markdown from those two and the PNG."""
    table = []
    for r in rows:
        table.append(
            {
                "engine": r["engine"],
                "policy": r["policy"],
                "micro": r["micro"],
                "grad_accum_dtype": r["grad_accum_dtype"] or "bf16",
                "model_state_gib_per_rank": gib(r["model_state_bytes"]),
                "model_state_psi_per_rank": per_psi(r["model_state_bytes"], r["parameters"]),
                "formula_psi": per_psi([r["formula_bytes"]], r["parameters"]),
                "buffers_gib_per_rank": gib(r["buffer_bytes"]),
                "peak_rss_gib_per_rank": gib(r["peak_rss_bytes"]),
                "cpu_s_median": f"{r['cpu_s_median']:.2f}" if r["cpu_s_median"] else "",
                "cpu_ratio_vs_zero0_none": f"{r['cpu_s_ratio']:.2f}" if r["cpu_s_ratio"] else "",
                "wall_s_median": f"{r['step_s_median']:.2f}" if r["step_s_median"] else "",
                "wall_ratio_vs_zero0_none": f"{r['step_s_ratio']:.2f}" if r["step_s_ratio"] else "",
                "cpu_s": " ".join(f"{t:.2f}" for t in r["cpu_s"]),
                "wall_s": " ".join(f"{t:.2f}" for t in r["step_s"]),
                "error": r["error"] or "",
            }
        )
    harness.write_csv(harness.RESULTS / "memory_sweep.csv", CSV_FIELDS, table)
    psi = next((r["parameters"] for r in rows if r.get("parameters")), None)
    harness.write_json(harness.RESULTS / "memory_sweep.json", {**meta, "parameters": psi})
    render()
    plot(rows)


def render() -> None:
    """memory_sweep.md from memory_sweep.csv and memory_sweep.json, nothing else."""
    meta = json.loads((harness.RESULTS / "memory_sweep.json").read_text())
    with open(harness.RESULTS / "memory_sweep.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    psi = meta["parameters"]
    lines = [
        "# Memory sweep: ZeRO stage x offload x activation checkpointing x micro batch",
        "",
        *harness.header(meta, f"; {meta['load']}"),
        f"- model: d_model {MODEL['d_model']}, {MODEL['n_layer']} layers, {MODEL['n_head']} heads, "
        f"Ψ = {psi:,} parameters, seq_len {SEQ_LEN}, bf16, AdamW (torch), {meta['nproc']} CPU ranks (gloo)"
        if psi
        else "- model: see benchmarks/memory_sweep.py",
        f"- grid: {meta['grid']}; {meta['rounds']} timed steps per cell after one warm-up step per engine, "
        f"interleaved; one launch per engine configuration; sweep wall time {meta['wall_min']:.1f} min; "
        f"exit codes: {meta['rc']}",
        "- files: memory_sweep.csv (every row, with the per-step times), memory_sweep.json (the values above); "
        "`python benchmarks/memory_sweep.py --render` writes this file again from those two",
        "",
        "Columns: model states per rank (rank 0/rank 1) counted from the engine's tensors (params, grads, "
        "fp32 master params, Adam states) at step 2 between backward and the optimizer step, in GiB and in "
        "bytes per parameter (Ψ); the docs/architecture.md ZeRO formula for bf16 Adam (16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, "
        "16Ψ/N); other optimizer buffers (reduction buckets, not model states); peak RSS per rank over the cell's "
        "steps (ru_maxrss reset before every step, MALLOC_MMAP_THRESHOLD_=65536); median step time and its ratio to "
        "ZeRO-0 without checkpointing at the same micro batch (ZeRO-0 measured first and last in the sweep; all "
        "its steps enter the baseline median), as CPU time (process time of the slower rank: forward, backward, "
        "gradient reduction and optimizer all run on the CPU here, and CPU time does not count time the process "
        "waits for a core taken by other jobs on this shared machine) and as wall time (the per-step values "
        "are in the CSV).",
        "",
        "| engine | grad accum | policy | micro | model states GiB/rank | model states Ψ/rank | formula Ψ "
        "| buffers GiB/rank | peak RSS GiB/rank | CPU s | CPU ratio | wall s | wall ratio | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        lines.append(
            f"| {t['engine']} | {t['grad_accum_dtype']} | {t['policy']} | {t['micro']} | "
            f"{t['model_state_gib_per_rank']} | {t['model_state_psi_per_rank']} | {t['formula_psi']} | "
            f"{t['buffers_gib_per_rank']} | "
            f"{t['peak_rss_gib_per_rank']} | {t['cpu_s_median']} | {t['cpu_ratio_vs_zero0_none']} | "
            f"{t['wall_s_median']} | {t['wall_ratio_vs_zero0_none']} | "
            f"{t['error'][:200]} |"
        )
    harness.write_text(harness.RESULTS / "memory_sweep.md", "\n".join(lines) + "\n")


def plot(rows: list[dict]) -> None:
    plt = harness.pyplot()
    if plt is None:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG written", file=sys.stderr)
        return
    ok = [r for r in rows if not r["error"] and r["peak_rss_bytes"]]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(13, 5.5))
    labels = [f"{r['engine']}\n{r['policy']} m{r['micro']}" for r in ok]
    x = range(len(ok))
    states = [max(r["model_state_bytes"] or [0]) / 2**30 for r in ok]
    rss = [max(r["peak_rss_bytes"]) / 2**30 for r in ok]
    ax_mem.bar([i - 0.2 for i in x], states, width=0.4, label="model states (max over ranks)")
    ax_mem.bar([i + 0.2 for i in x], rss, width=0.4, label="peak RSS (max over ranks)")
    formula = [(r["formula_bytes"] or 0) / 2**30 for r in ok]
    ax_mem.scatter([i - 0.2 for i in x], formula, marker="_", s=200, color="black", label="ZeRO formula", zorder=3)
    ax_mem.set_ylabel("GiB per rank")
    ax_mem.set_xticks(list(x), labels, rotation=90, fontsize=7)
    ax_mem.legend(fontsize=8)
    ax_mem.set_title("Memory per rank")
    cpu = [r["cpu_s_ratio"] or 0 for r in ok]
    wall = [r["step_s_ratio"] or 0 for r in ok]
    ax_time.bar([i - 0.2 for i in x], cpu, width=0.4, color="tab:green", label="CPU time")
    ax_time.bar([i + 0.2 for i in x], wall, width=0.4, color="tab:gray", label="wall time")
    ax_time.axhline(1.0, color="black", linewidth=0.8)
    ax_time.legend(fontsize=8)
    ax_time.set_ylabel("step time / ZeRO-0 no checkpointing (same micro batch)")
    ax_time.set_xticks(list(x), labels, rotation=90, fontsize=7)
    ax_time.set_title("Step time ratio")
    fig.suptitle(f"51M-parameter DNA LM, seq {SEQ_LEN}, bf16, 2 CPU ranks")
    fig.tight_layout()
    fig.savefig(harness.RESULTS / "memory_sweep.png", dpi=110)


def main() -> None:
    ap = harness.parser(__doc__, worker=True)
    ap.add_argument("--grid", choices=["reduced", "full"], default="reduced", help="cells to run (see grid())")
    ap.add_argument("--rounds", type=int, default=2, help="timed steps per cell, interleaved across cells")
    ap.add_argument("--nproc", type=int, default=2, help="CPU ranks")
    ap.add_argument(
        "--render", action="store_true", help="no sweep: write memory_sweep.md again from memory_sweep.{csv,json}"
    )
    args = ap.parse_args()
    if args.worker:
        plan = [(run, [tuple(c) for c in cells]) for run, cells in json.loads((args.worker / "plan.json").read_text())]
        worker(args.worker, plan, args.rounds)
        return
    if args.render:
        render()
        print(f"wrote {harness.RESULTS}/memory_sweep.md from memory_sweep.csv and memory_sweep.json")
        return
    plan = grid(args.grid)
    work = harness.work_dir("mg-memory-sweep-")
    harness.write_bf16_only(work)
    started, ended, loads = time.time(), {}, []
    for run in plan:
        # A fresh launch per engine configuration: DeepSpeed engines are not freed when dropped (their hooks
        # keep them alive), so a second engine in the same processes would add the first one's memory to RSS.
        load_before = harness.load_average()
        ended[run[0]] = launch(args.nproc, work, run, args.rounds)
        loads.append(f"{run[0]} {load_before:.1f}->{harness.load_average():.1f}")
        print(f"{run[0]}: rc {ended[run[0]][0]}, {(time.time() - started) / 60:.1f} min", flush=True)
    wall = time.time() - started
    rows_file = work / "cells.jsonl"
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []

    meta = {
        "date": harness.today(),
        "command": harness.command("memory_sweep.py", harness.argv_of(None)),
        "hardware": harness.hardware(),
        "software": harness.software(),
        "nproc": args.nproc,
        "grid": args.grid,
        "rounds": args.rounds,
        "wall_min": round(wall / 60, 1),
        "rc": ", ".join(f"{name} {rc}" for name, (rc, _) in ended.items()),
        "load": "1-minute load average before->after each launch (the 2 ranks alone make 2): " + ", ".join(loads),
    }
    results = summarise(rows, plan, ended)
    harness.write_json(work / "summary.json", {"meta": meta, "rows": results})
    write_results(results, meta)
    print(f"wrote {harness.RESULTS}/memory_sweep.{{csv,md,png}} in {wall / 60:.1f} min (work dir {work})")


if __name__ == "__main__":
    main()
