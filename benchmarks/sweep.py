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
import gc
import itertools
import json
import os
import pathlib
import re
import sys
import time
import traceback

import harness
from sweep_results import NOTES, rank_records, summarise, write_results

REPO = harness.REPO
# name -> (d_model, n_layer, n_head); parameter counts (tied embeddings, 8-token vocabulary) in the results.
SIZES = {
    "tiny": (128, 4, 4),  # configs/tiny_transformer.yaml, 0.85M
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
    from megagenome.model.transformer import DNATransformer

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
        ds_files.append(str(work / harness.BF16_ONLY) if stage == 0 else str(REPO / "ds_configs" / "bf16.json"))
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
    from megagenome.engine import engine as ds
    from megagenome.run import pretrain
    from megagenome.weights import checkpoint

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
    rank = harness.rank()
    gpu = torch.cuda.is_available()
    for cell in spec["cells"]:
        run_dir = pathlib.Path(cell["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / f"started_rank{rank}").write_text(str(time.time()))
        in_use = harness.reset_peak(gpu)
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
        peak = harness.peak(gpu)
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
    env = harness.child_env(defaults={"OMP_NUM_THREADS": "1", **harness.QUIET_MALLOC})
    # a hung worker is stopped with every rank
    return harness.launch_worker(__file__, world, spec, work / f"worker_{tag}.log", timeout_s, env=env, port=True)


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


def _list(kind):
    def parse(text: str) -> list:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, worker=True)
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
    ap.add_argument(
        "--fasta", type=pathlib.Path, default=harness.ECOLI, help="genome to train on (copied to the work dir)"
    )
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
    ap.add_argument("--results_dir", type=pathlib.Path, default=harness.RESULTS, help="where the results files go")
    ap.add_argument("--name", default="sweep", help="results file stem")
    ap.add_argument("--work_dir", type=pathlib.Path, default=None, help="run directories (default: a new temp dir)")
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
    work = harness.work_dir("mg-sweep-", args.work_dir)
    harness.copy_input(args.fasta, work, keep=True)  # pyfaidx writes its index beside the FASTA
    harness.write_bf16_only(work)
    cells = grid(args)
    counts = {size: parameters(size) for size in args.sizes}
    for cell in cells:
        cell["parameters"] = counts[cell["size"]]
        cell["d_model"], cell["n_layer"], cell["n_head"] = model_shape(cell["size"])
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
        "date": harness.today(),
        "command": harness.command("sweep.py", argv),
        "hardware": harness.hardware() + harness.gpus() + (f"; {load}" if load else ""),
        "software": harness.software(),
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
        "notes": NOTES,
    }
    return write_results(rows, meta, args.results_dir, args.name)


def main(argv: list[str] | None = None) -> dict[str, pathlib.Path]:
    argv = harness.argv_of(argv)
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return {}
    started, load_before = time.time(), harness.load_average()
    work, cells = plan(args)
    launches = run_cells(args, work, cells)
    after = harness.load_average()
    load = f"1-minute load average {load_before:.1f} before, {after:.1f} after ({os.cpu_count()} cores)"
    paths = report(args, argv, work, cells, launches, time.time() - started, load)
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {(time.time() - started) / 60:.1f} min (work {work})")
    return paths


if __name__ == "__main__":
    main()
