"""Throughput and memory sweep: model size x seq len x ZeRO stage x checkpointing x micro batch x tp x pp.

Every combination of the flags' lists is a cell: a short `megagenome pretrain` run (pretrain.run, the CLI's own
code path) of --warmup untimed steps followed by --steps timed steps, logged every step. Cells of one world size
run in one `deepspeed --num_gpus N` launch of this script (a worker mode, like tests/ds_scenarios.py), one after
another in one process group (pretrain.run(cfg, [], keep_process_group=True)); --isolate gives every cell a launch
of its own instead (slower to start, but no earlier cell can leave memory behind). --repeats R runs the whole grid
R times, round after round (interleaved), and takes the median per cell. For each cell:

- tokens/s: the median of metrics.jsonl tokens_per_s (global, all ranks) over the timed steps, and the step time
  it implies; TFLOP/s per device, MFU and HFU (and the peak they divide by, with its source) from the same rows,
  where the rows carry them (on CPU the peak is a matmul rate measured at start, metrics.py resolve_peak);
- peak memory per rank: on a GPU torch.cuda.max_memory_allocated (reset before the cell); on CPU the peak RSS
  (VmHWM, reset before the cell through /proc/self/clear_refs, with MALLOC_MMAP_THRESHOLD_=65536 so freed memory
  goes back to the kernel); the memory in use when the cell started (what earlier cells left: the worker destroys
  each engine and collects garbage after its cell); model-state bytes per rank from the run's memory.json;
- status: ok; oom (torch.OutOfMemoryError, or the CPU allocator's "can't allocate memory", caught on every rank:
  the cell is a row and the sweep goes on with the next one; or a worker killed mid-cell with out-of-memory in its
  log; or, with --cpu_memory_budget_gb, a CPU cell whose peak RSS on some rank exceeded the budget: labelled
  "simulated", its throughput dropped since a real OOM would have given none); invalid (the configuration was
  refused before any work, e.g. ZeRO-2 with pipeline stages); error (anything else, with the message).
  A worker that dies or hangs (the hang watchdog, --hang_timeout_s, ends it) costs only the cell it was in: the
  sweep relaunches the remaining cells.

Engine JSON per cell: ds_configs/zero<stage>.json plus, for --precision bf16, ds_configs/bf16.json (fp32 gradient
accumulation) at stages 1-3 and {"bf16": {"enabled": true}} at stage 0 (the only bf16 mode DeepSpeed allows there).
Checkpointing uses torch's checkpoint (no activation_checkpointing block); with pipeline stages, full and every_k
become --parallel.pipeline_checkpoint_interval 1 and k (the pipeline engine runs the layers itself). The end-of-run
checkpoint that every `megagenome pretrain` run writes is skipped (pretrain's checkpoint.save replaced by a no-op in
the worker) unless --save_checkpoints: it is not part of what is measured and costs disk and time per cell.

    python benchmarks/sweep.py --sizes tiny,20m --seq_lens 512,2048 --zero 0,1,2,3 --checkpointing none,full \\
        --micro 1,2 --tp 1 --pp 1 --steps 6 --warmup 2 --nproc 2

Runs on CPU (gloo) here and on GPUs as is (--nproc: GPUs per launch). Sizes: a name from SIZES or dWIDTHlLAYERShHEADS
(e.g. d256l4h4). Writes benchmarks/results/sweep.{csv,md,json,png} (--results_dir, --name); the PNG needs matplotlib
(pip install -e '.[bench]'), and the Markdown says so when it is missing.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import itertools
import json
import os
import pathlib
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
import traceback

from hardware import hardware, run_in_session, software  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ECOLI = REPO / "examples" / "data" / "ecoli_K12_MG1655_NC_000913.2.fa.bgz"
# name -> (d_model, n_layer, n_head); parameter counts (tied embeddings, 8-token vocabulary) in the results.
SIZES = {
    "tiny": (128, 4, 4),  # configs/tiny.yaml, 0.85M
    "20m": (512, 6, 8),  # benchmarks/pretrain_cpu.py's ~20M shape
    "51m": (512, 16, 8),  # benchmarks/memory_sweep.py's model
    "125m": (768, 12, 12),  # configs/dna_125m.yaml
    "350m": (1024, 24, 16),
    "760m": (1536, 24, 16),
    "1.3b": (2048, 24, 32),
    "2.7b": (2560, 32, 32),
    "6.7b": (4096, 32, 32),
}
CUSTOM_SIZE = re.compile(r"^d(\d+)l(\d+)h(\d+)$")
POLICIES = ("none", "full", "every_k", "selective")
BF16_ONLY = "bf16_only.json"  # written into the work directory: stage 0's bf16 (bf16 gradients)
STATUSES = ("ok", "oom", "invalid", "error")
OOM_MARKERS = ("out of memory", "can't allocate memory", "OutOfMemoryError", "Cannot allocate memory")


def model_shape(size: str) -> tuple[int, int, int]:
    """(d_model, n_layer, n_head) of a size name or a dWIDTHlLAYERShHEADS string."""
    if size in SIZES:
        return SIZES[size]
    m = CUSTOM_SIZE.match(size)
    if not m:
        raise ValueError(f"--sizes: {size!r} is neither one of {', '.join(SIZES)} nor of the form d256l4h4")
    return int(m[1]), int(m[2]), int(m[3])


def parameters(size: str) -> int:
    """Parameter count of a size (tied embeddings counted once), from the model built on the meta device."""
    import torch

    sys.path.insert(0, str(REPO))
    from megagenome.config import ModelConfig
    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model import DNATransformer

    d, n_layer, n_head = model_shape(size)
    with torch.device("meta"):
        return DNATransformer(ModelConfig(d_model=d, n_layer=n_layer, n_head=n_head), VOCAB_SIZE).num_parameters()


def held_out(fasta: pathlib.Path, seq_len: int) -> list[str]:
    """--data.val_ranges: the end of the first contig, 5% of it but at least two windows (at most half of it)."""
    from megagenome.data.fasta import Genome  # indexes in megagenome's cache, never beside the user's FASTA

    with Genome(str(fasta)) as genome:
        name, length = next(iter(genome.lengths.items()))
    size = min(max(length // 20, 2 * (seq_len + 1)), length // 2)
    return [f"{name}:{length - size + 1}-{length}"]


def grid(args) -> list[dict]:
    """One dict per cell (world size, shape, engine, policy, batch), in running order within a world size."""
    cells = []
    combos = itertools.product(
        args.nproc, args.sizes, args.seq_lens, args.zero, args.checkpointing, args.micro, args.tp, args.pp
    )
    for world, size, seq, zero, policy, micro, tp, pp in combos:
        name = f"{size}_s{seq}_z{zero}_{policy}_m{micro}_tp{tp}_pp{pp}_w{world}"
        cells.append(
            {
                "cell": name,
                "world": world,
                "size": size,
                "seq_len": seq,
                "zero": zero,
                "checkpointing": policy,
                "micro": micro,
                "grad_accum": args.grad_accum,
                "tp": tp,
                "pp": pp,
                "precision": args.precision,
            }
        )
    return cells


def cell_config(cell: dict, run_dir: pathlib.Path, work: pathlib.Path, fasta: pathlib.Path, args) -> dict:
    """The root config of one cell, as nested dicts (parsed by the CLI's own parser in the worker)."""
    d, n_layer, n_head = model_shape(cell["size"])
    stage, policy, pp = cell["zero"], cell["checkpointing"], cell["pp"]
    ds_files = [str(REPO / "ds_configs" / f"zero{stage}.json")]
    if cell["precision"] == "bf16":
        ds_files.append(str(work / BF16_ONLY) if stage == 0 else str(REPO / "ds_configs" / "bf16.json"))
    model = {"d_model": d, "n_layer": n_layer, "n_head": n_head, "max_seq_len": cell["seq_len"]}
    parallel = {"tensor": cell["tp"], "pipeline": pp}
    if pp > 1 and policy in ("full", "every_k"):  # the pipeline engine runs the layers: its own recompute interval
        parallel["pipeline_checkpoint_interval"] = 1 if policy == "full" else args.checkpoint_every
        model["checkpointing"] = "none"
    else:
        model["checkpointing"] = policy
        model["checkpoint_every"] = args.checkpoint_every
    total = args.warmup + args.steps
    return {
        "model": model,
        "data": {
            "fasta": str(fasta),
            "seq_len": cell["seq_len"],
            "val_ranges": held_out(fasta, cell["seq_len"]),
            "eval_windows": 2,
        },
        "train": {
            "ds_config": ds_files,
            "micro_batch_size": cell["micro"],
            "grad_accum_steps": cell["grad_accum"],
            "max_steps": total,
            "warmup_steps": min(2, total),
            "log_interval": 1,
            "eval_interval": 0,
            "num_threads": args.num_threads,
            "hang_timeout_s": args.hang_timeout_s,
        },
        "parallel": parallel,
        "checkpoint": {"interval": 0, "resume": "none"},
        "log": {"run_dir": str(run_dir), "progress": False, "peak_tflops": args.peak_tflops},
    }


# ---------------------------------------------------------------------------------------------------- worker


def _proc_status(key: str) -> int:
    """A /proc/self/status memory line (VmRSS, VmHWM) in bytes; 0 where there is none."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak(gpu: bool) -> int:
    """Reset the peak-memory counter; returns the memory in use now (allocated on a GPU, RSS on CPU)."""
    import torch

    if gpu:
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())
    try:
        with open("/proc/self/clear_refs", "w") as fh:  # "5": reset the peak RSS (Linux >= 4.0)
            fh.write("5")
    except OSError:
        pass
    return _proc_status("VmRSS")


def _peak(gpu: bool) -> int:
    import torch

    if gpu:
        return int(torch.cuda.max_memory_allocated())
    return _proc_status("VmHWM") or _resource_peak()


def _resource_peak() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def oom_kind(error: BaseException) -> str | None:
    """Which out-of-memory an exception is ("cuda", "cpu allocator"), or None when it is not one."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return "cuda"
    text = str(error)
    if isinstance(error, (RuntimeError, MemoryError)) and (
        "can't allocate memory" in text or "out of memory" in text or isinstance(error, MemoryError)
    ):
        return "cpu allocator"
    return None


def _release(engines: list) -> None:
    """Destroy the engines a cell built (DeepSpeed's hooks keep a dropped engine alive) and free their memory."""
    import torch

    while engines:
        engine = engines.pop()
        try:
            engine.destroy()
        except Exception:  # a half-built or failed engine: freeing what can be freed is all that matters here
            traceback.print_exc()
        del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def worker(spec_path: pathlib.Path) -> None:
    import torch
    import torch.distributed as dist

    from megagenome.config import ConfigError
    from megagenome.config.load import config_from_dict
    from megagenome.run import pretrain
    from megagenome.train import checkpoint
    from megagenome.train import engine as ds

    spec = json.loads(spec_path.read_text())
    engines: list = []
    initialize = ds.initialize

    def captured(*args, **kwargs):  # pretrain.run calls ds.initialize: keep the engine to destroy after the cell
        engine = initialize(*args, **kwargs)
        engines.append(engine)
        return engine

    ds.initialize = captured
    if not spec["save_checkpoints"]:
        checkpoint.save = lambda *args, **kwargs: None  # the end-of-run checkpoint is not measured (docstring)
    rank = int(os.environ.get("RANK", "0"))
    gpu = torch.cuda.is_available()
    for cell in spec["cells"]:
        run_dir = pathlib.Path(cell["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / f"started_rank{rank}").write_text(str(time.time()))
        in_use = _reset_peak(gpu)
        started, status, kind, error = time.time(), "ok", None, None
        try:
            cfg = config_from_dict(cell["config"])
            pretrain.run(cfg, [], keep_process_group=True)
        except ConfigError as e:
            status, error = "invalid", "; ".join(e.problems)
        except Exception as e:
            kind = oom_kind(e)
            status = "oom" if kind else "error"
            error = f"{type(e).__name__}: {e}"
            print(f"{cell['cell']} {status} on rank {rank}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        peak = _peak(gpu)
        _release(engines)
        record = {
            "rank": rank,
            "status": status,
            "oom_kind": kind,
            "error": error,
            "peak_bytes": peak,
            "in_use_at_start_bytes": in_use,
            "wall_s": round(time.time() - started, 2),
            "device": "cuda" if gpu else "cpu",
        }
        (run_dir / f"cell_rank{rank}.json").write_text(json.dumps(record))
        if dist.is_initialized():
            ds.barrier()
    ds.shutdown()


# ---------------------------------------------------------------------------------------------------- driver


def launch(world: int, cells: list[dict], work: pathlib.Path, tag: str, timeout_s: float) -> tuple[int, str]:
    """One `deepspeed` launch of `world` ranks running `cells` in turn; returns (exit code, log tail)."""
    spec = work / f"spec_{tag}.json"
    spec.write_text(json.dumps({"cells": cells, "save_checkpoints": cells[0]["save_checkpoints"]}))
    bin_dir = pathlib.Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed blocks go back to the kernel: RSS follows live memory
    port = str(_free_port())
    cmd = [str(bin_dir / "deepspeed"), "--num_gpus", str(world), "--master_port", port, __file__, "--worker", str(spec)]
    log_path = work / f"worker_{tag}.log"
    rc = run_in_session(cmd, REPO, env, log_path, timeout_s)  # a hung worker is stopped with every rank
    return rc, log_path.read_text(errors="replace")[-4000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_records(run_dir: pathlib.Path, world: int) -> list[dict] | None:
    """Every rank's cell_rank<r>.json, or None when some rank did not finish the cell."""
    paths = [run_dir / f"cell_rank{r}.json" for r in range(world)]
    return [json.loads(p.read_text()) for p in paths] if all(p.exists() for p in paths) else None


def run_group(world: int, cells: list[dict], work: pathlib.Path, timeout_s: float) -> list[dict]:
    """Run `cells` (one world size) in as few launches as possible: after a worker dies or hangs, the cell it was
    in becomes a row with the reason and a new launch takes the cells after it. Returns launch records."""
    pending, launches = list(cells), []
    while pending:
        tag = f"w{world}_{len(launches)}"
        started = time.time()
        rc, tail = launch(world, pending, work, tag, timeout_s)
        launches.append({"tag": tag, "rc": rc, "wall_s": round(time.time() - started, 1), "cells": len(pending)})
        done = [rank_records(pathlib.Path(c["run_dir"]), world) is not None for c in pending]
        if all(done):
            break
        first = done.index(False)
        crashed = pending[first]
        run_dir = pathlib.Path(crashed["run_dir"])
        if not any(run_dir.glob("started_rank*")):  # the worker never reached it: give up on the rest
            for c in pending[first:]:
                _write_crash(c, world, rc, tail, "the worker ended before this cell started")
            break
        _write_crash(crashed, world, rc, tail, "the worker ended during this cell")
        pending = pending[first + 1 :]
    return launches


def _write_crash(cell: dict, world: int, rc: int, tail: str, what: str) -> None:
    oom = any(marker in tail for marker in OOM_MARKERS) or rc in (-9, 137)
    last = [line for line in tail.strip().splitlines() if line.strip()][-1:] or [""]
    record = {
        "status": "oom" if oom else "error",
        "oom_kind": "killed" if oom else None,
        "error": f"{what} (launcher exit code {rc}): {last[0][:300]}",
    }
    run_dir = pathlib.Path(cell["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "crash.json").write_text(json.dumps(record))


def _metrics(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "split" not in r]


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


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
    rows = _metrics(run_dir)
    timed = [r for r in rows if r["step"] > warmup]
    if status == "ok" and timed:
        for key in ("tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "hw_tflops_per_gpu", "mfu", "hfu"):
            out[key] = _median([r.get(key) for r in timed])
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
        d, n_layer, n_head = model_shape(cell["size"])
        row.update(d_model=d, n_layer=n_layer, n_head=n_head, parameters=cell["parameters"])
        row["dp"] = (
            cell["world"] // (cell["tp"] * cell["pp"]) if cell["world"] % (cell["tp"] * cell["pp"]) == 0 else None
        )
        row.update(status=status, oom_kind=failed.get("oom_kind"), error=failed.get("error"), repeats=len(runs))
        ok = [r for r in runs if r["status"] == "ok"]
        for key in ("tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "hw_tflops_per_gpu", "mfu", "hfu"):
            row[key] = _median([r.get(key) for r in ok]) if status == "ok" else None
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
    results.mkdir(parents=True, exist_ok=True)
    paths = {ext: results / f"{name}.{ext}" for ext in ("csv", "json", "md", "png")}
    table = [table_row(r) for r in rows]
    with open(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(table)
    png_note = plot(rows, meta, paths["png"])
    if png_note:
        paths.pop("png")
        if (results / f"{name}.png").exists():
            (results / f"{name}.png").unlink()  # a stale plot of another sweep must not sit beside these results
    paths["json"].write_text(
        json.dumps({"meta": {**meta, "png": png_note or "written"}, "rows": rows}, indent=1) + "\n"
    )
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    lines = [
        f"# Sweep: model size x seq len x ZeRO stage x checkpointing x micro batch x tp x pp ({name})",
        "",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- hardware: {meta['hardware']}",
        f"- software: {meta['software']}",
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
        "| cell | params | seq | ZeRO | ckpt | micro | tp | pp | dp | status | tokens/s | step s | TFLOP/s/dev "
        "| MFU | HFU | peak TFLOP/s (source) | peak GiB/rank | at start GiB/rank | model states GiB/rank | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, t in zip(rows, table):
        peak = f"{t['peak_tflops']} ({t['peak_source']})" if t["peak_tflops"] else ""
        status = r["status"] + (f" ({r['oom_kind']})" if r["oom_kind"] else "")
        lines.append(
            f"| {r['cell']} | {r['parameters']:,} | {r['seq_len']} | {r['zero']} | {r['checkpointing']} | "
            f"{r['micro']} | {r['tp']} | {r['pp']} | {t['dp']} | {status} | {t['tokens_per_s']} | {t['step_s']} | "
            f"{t['tflops_per_device']} | {t['mfu']} | {t['hfu']} | {peak} | {t['peak_gib_per_rank']} | "
            f"{t['in_use_at_start_gib_per_rank']} | {t['model_state_gib_per_rank']} | {t['error'][:160]} |"
        )
    lines += ["", *meta.get("notes", [])]
    paths["md"].write_text("\n".join(lines) + "\n")
    return paths


def plot(rows: list[dict], meta: dict, path: pathlib.Path) -> str | None:
    """Bar chart of tokens/s per cell (failed cells marked) and peak memory per rank; None, or why no PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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


def _list(kind):
    def parse(text: str) -> list:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=_list(str), default=["tiny"], help=f"model sizes: {', '.join(SIZES)} or d256l4h4")
    ap.add_argument("--seq_lens", type=_list(int), default=[512], help="sequence lengths")
    ap.add_argument("--zero", type=_list(int), default=[1], help="ZeRO stages (0-3)")
    ap.add_argument("--checkpointing", type=_list(str), default=["none"], help=f"policies: {', '.join(POLICIES)}")
    ap.add_argument("--checkpoint_every", type=int, default=2, help="blocks per segment for every_k")
    ap.add_argument("--micro", type=_list(int), default=[1], help="micro batch sizes")
    ap.add_argument("--grad_accum", type=int, default=1, help="gradient accumulation steps (every cell)")
    ap.add_argument("--tp", type=_list(int), default=[1], help="tensor-parallel degrees")
    ap.add_argument("--pp", type=_list(int), default=[1], help="pipeline-parallel degrees")
    ap.add_argument("--nproc", type=_list(int), default=[2], help="ranks (GPUs, or CPU processes) per launch")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="engine precision")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per cell (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps per cell")
    ap.add_argument("--repeats", type=int, default=1, help="runs of the whole grid, interleaved; median per cell")
    ap.add_argument("--fasta", type=pathlib.Path, default=ECOLI, help="genome to train on (copied to the work dir)")
    ap.add_argument("--num_threads", type=int, default=None, help="torch CPU threads per rank (default: cores/ranks)")
    ap.add_argument("--peak_tflops", type=float, default=None, help="per-device peak for MFU (default: metrics.py)")
    ap.add_argument(
        "--cpu_memory_budget_gb",
        type=float,
        default=None,
        help="CPU only: a cell whose peak RSS on some rank exceeds this is recorded as oom (simulated)",
    )
    ap.add_argument("--isolate", action="store_true", help="one launch per cell instead of one per world size")
    ap.add_argument("--save_checkpoints", action="store_true", help="keep the end-of-run checkpoint of every cell")
    ap.add_argument("--hang_timeout_s", type=float, default=600.0, help="hang watchdog of each cell")
    ap.add_argument("--launch_timeout_s", type=float, default=3600.0, help="wall-clock limit of one launch")
    ap.add_argument("--results_dir", type=pathlib.Path, default=RESULTS, help="where the results files go")
    ap.add_argument("--name", default="sweep", help="results file stem")
    ap.add_argument("--work_dir", type=pathlib.Path, default=None, help="run directories (default: a new temp dir)")
    ap.add_argument("--worker", type=pathlib.Path, help=argparse.SUPPRESS)  # the launched ranks: the spec file
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # appended by the deepspeed launcher
    args = ap.parse_args(argv)
    problems = [f"--checkpointing: {p!r} is not one of {', '.join(POLICIES)}" for p in args.checkpointing]
    problems = [p for p, policy in zip(problems, args.checkpointing) if policy not in POLICIES]
    problems += [f"--zero: {z} is not a ZeRO stage (0-3)" for z in args.zero if z not in (0, 1, 2, 3)]
    for size in args.sizes if not args.worker else []:
        try:
            model_shape(size)
        except ValueError as e:
            problems.append(str(e))
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        problems.append("--steps and --repeats must be >= 1 and --warmup >= 0")
    if problems:
        ap.error("; ".join(problems))
    return args


def plan(args) -> tuple[pathlib.Path, list[dict]]:
    """The work directory (FASTA copy, bf16 fragment) and the grid's cells with their run directories per repeat."""
    work = args.work_dir or pathlib.Path(tempfile.mkdtemp(prefix="mg-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    fasta = work / args.fasta.name
    if not fasta.exists():
        shutil.copy(args.fasta, fasta)  # pyfaidx writes its index beside the FASTA: never beside the checked-in one
    (work / BF16_ONLY).write_text(json.dumps({"bf16": {"enabled": True}}))
    cells = grid(args)
    counts = {size: parameters(size) for size in args.sizes}
    for cell in cells:
        cell["parameters"] = counts[cell["size"]]
        cell["run_dirs"] = [str(work / f"r{r}" / cell["cell"]) for r in range(args.repeats)]
    return work, cells


def run_cells(args, work: pathlib.Path, cells: list[dict]) -> list[dict]:
    """Launch every world size's cells (round after round for --repeats); returns the launch records."""
    started, launches = time.time(), []
    fasta = work / args.fasta.name
    for world in args.nproc:
        runs = []  # (cell, repeat) in running order: round after round through the grid
        for r in range(args.repeats):
            for cell in (c for c in cells if c["world"] == world):
                run_dir = pathlib.Path(cell["run_dirs"][r])
                config = cell_config(cell, run_dir, work, fasta, args)
                runs.append({"cell": cell["cell"], "run_dir": str(run_dir), "config": config})
                runs[-1]["save_checkpoints"] = args.save_checkpoints
        groups = [[run] for run in runs] if args.isolate else [runs]
        for group in groups:
            launches += run_group(world, group, work, args.launch_timeout_s)
            print(f"{len(launches)} launch(es), {(time.time() - started) / 60:.1f} min", flush=True)
    return launches


def report(
    args, argv: list[str], work: pathlib.Path, cells: list[dict], launches: list[dict], wall_s: float, load: str = ""
):
    """Summarise the cells' run directories and write the results files; returns their paths."""
    rows = summarise(cells, args.repeats, args.warmup, args.cpu_memory_budget_gb)
    env = next((r["env"] for r in rows if r.get("env")), None)
    for r in rows:
        r.pop("env", None)
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/sweep.py", *argv]),
        "hardware": hardware() + _gpus() + (f"; {load}" if load else ""),
        "software": software(),
        "env": env,
        "grid": {
            k: getattr(args, k) for k in ("sizes", "seq_lens", "zero", "checkpointing", "micro", "tp", "pp", "nproc")
        }
        | {"grad_accum": args.grad_accum},
        "precision": args.precision,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "isolate": args.isolate,
        "cpu_memory_budget_gb": args.cpu_memory_budget_gb,
        "launches": ", ".join(f"{x['tag']}: {x['cells']} cell(s), rc {x['rc']}, {x['wall_s']:.0f} s" for x in launches),
        "wall_s": wall_s,
        "work_dir": str(work),
        "notes": [
            "Notes:",
            "",
            "- Cells of one world size share one process group and run in grid order; each engine is destroyed "
            "after its cell, and the memory still in use when the next one starts is in the 'at start' column.",
            "- On CPU the ranks share the machine's cores (--num_threads, default cores / ranks), so absolute "
            "figures are this machine's only; compare cells within one sweep, and take absolute times from a GPU. "
            "The CPU peak that MFU divides by is a matmul rate measured at the start of each cell, so it moves with "
            "the load on the machine.",
        ],
    }
    return write_results(rows, meta, args.results_dir, args.name)


def main(argv: list[str] | None = None) -> dict[str, pathlib.Path]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return {}
    started, load_before = time.time(), os.getloadavg()[0]
    work, cells = plan(args)
    launches = run_cells(args, work, cells)
    load = f"1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)"
    paths = report(args, argv, work, cells, launches, time.time() - started, load)
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {(time.time() - started) / 60:.1f} min (work {work})")
    return paths


def _gpus() -> str:
    import torch

    if not torch.cuda.is_available():
        return ""
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"; GPUs: {', '.join(names)}"


if __name__ == "__main__":
    main()
