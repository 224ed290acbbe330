"""Tensor and pipeline parallelism on 2 CPU ranks: parameter bytes, step time and communication per step.

Cells (fp32, ZeRO-0, 2 ranks, gloo): tp=1/pp=1 (2 data-parallel ranks, the baseline), tp=2/pp=1 and tp=1/pp=2;
tp=2 with pp=2 is refused by the run-config validation (recorded as a row with the message). Model: d_model 256,
4 layers, 4 heads, seq_len 512, micro batch 2 (x 2 accumulation under pp=2, so that the pipeline schedule has
micro batches), on tests/data/phiX174_NC_001422.1.fna, 6 steps logged every step. For each cell:

- per-rank parameter bytes: memory.json ranks[i]["params"] (written by every `megagenome pretrain` run);
- step time: seconds per step from the median metrics.jsonl tokens_per_s after the first 2 steps, and its
  ratio to the tp=1/pp=1 cell (the global batch differs: 4 sequences for tp=1/pp=1, 2 for tp=2, 4 for pp=2);
- communication per training step, by collective, process group (its global ranks) and calling file, counted
  by wrapping torch.distributed's collectives in the worker (megagenome's tensor-parallel layers call
  torch.distributed directly, which DeepSpeed's comms logger does not see), and DeepSpeed's comms logger
  totals (deepspeed.comm.comms_logger.comms_dict; enabled by a comms_logger fragment composed with
  zero0.json), both only inside the training step function (not evaluation, logging or start-up).

All cells run in one `deepspeed --num_gpus 2` launch of this script (a worker mode, like tests/ds_scenarios.py),
each through pretrain.run(cfg, [], keep_process_group=True).

    python benchmarks/parallel_sweep.py [--steps 6]

Writes benchmarks/results/parallel_sweep.{md,json}.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

from hardware import hardware, software  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
FASTA = REPO / "tests" / "data" / "phiX174_NC_001422.1.fna"
NPROC = 2
CELLS = [("tp1_pp1", 1, 1), ("tp2_pp1", 2, 1), ("tp1_pp2", 1, 2), ("tp2_pp2", 2, 2)]
BASELINE = "tp1_pp1"
SKIP_STEPS = 2
COMMS_FRAGMENT = {"comms_logger": {"enabled": True, "verbose": False, "prof_all": True}}
OPS = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter", "broadcast"]
OPS += ["send", "recv", "isend", "irecv", "reduce", "all_to_all_single", "gather", "scatter"]


def cell_config(work: pathlib.Path, name: str, tp: int, pp: int, steps: int) -> dict:
    return {
        "model": {"d_model": 256, "n_layer": 4, "n_head": 4, "max_seq_len": 512},
        "data": {"fasta": str(work / FASTA.name), "seq_len": 512, "val_ranges": ["NC_001422.1:4301-5386"]}
        | {"eval_windows": 2},
        "train": {
            "ds_config": [str(REPO / "ds_configs" / "zero0.json"), str(work / "comms_logger.json")],
            "micro_batch_size": 2,
            "grad_accum_steps": 2 if pp > 1 else 1,
            "max_steps": steps,
            "warmup_steps": 2,
            "log_interval": 1,
            "eval_interval": steps,
            "num_threads": 1,
        },
        "parallel": {"tensor": tp, "pipeline": pp},
        "checkpoint": {"interval": 0, "resume": "none"},
        "log": {"run_dir": str(work / name), "progress": False},
    }


# ---------------------------------------------------------------------------------------------------- worker

STATE = {"in_step": False, "steps": 0}
COUNTS: collections.Counter = collections.Counter()  # (op, group ranks, caller) -> bytes, inside training steps
CALLS: collections.Counter = collections.Counter()


def _nbytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(s in path for s in ("torch/distributed", "deepspeed/comm", "parallel_sweep.py")):
            parts = pathlib.Path(path).parts
            return "/".join(parts[-2:]) + f":{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _wrap(dist, op: str):
    original = getattr(dist, op)

    def counted(*args, **kwargs):
        if STATE["in_step"]:
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            payload = max([_nbytes(a) for a in args] + [_nbytes(v) for v in kwargs.values()] + [0])
            key = (op, ",".join(map(str, ranks)), _caller())
            COUNTS[key] += payload
            CALLS[key] += 1
        return original(*args, **kwargs)

    setattr(dist, op, counted)


def _ds_totals() -> dict:
    from deepspeed.comm import comm

    logger = getattr(comm, "comms_logger", None)
    totals = {}
    for name, sizes in (getattr(logger, "comms_dict", None) or {}).items():
        totals[name] = [sum(s * v[0] for s, v in sizes.items()), sum(v[0] for v in sizes.values())]
    return totals


DS_IN_STEP: collections.Counter = collections.Counter()
DS_CALLS: collections.Counter = collections.Counter()


def _in_step(make_step):
    def make(*args, **kwargs):
        run = make_step(*args, **kwargs)

        def step(*a, **k):
            before = _ds_totals()
            STATE["in_step"] = True
            try:
                return run(*a, **k)
            finally:
                STATE["in_step"] = False
                STATE["steps"] += 1
                for name, (nbytes, calls) in _ds_totals().items():
                    DS_IN_STEP[name] += nbytes - before.get(name, [0, 0])[0]
                    DS_CALLS[name] += calls - before.get(name, [0, 0])[1]

        return step

    return make


def worker(spec_path: pathlib.Path) -> None:
    import torch.distributed as dist

    from megagenome import cli, pretrain
    from megagenome.parallel import pipeline
    from megagenome.train import engine

    for op in OPS:
        if hasattr(dist, op):
            _wrap(dist, op)
    pretrain.forward_backward_step = _in_step(pretrain.forward_backward_step)
    pipeline.train_step = _in_step(pipeline.train_step)
    spec = json.loads(spec_path.read_text())
    parser = cli.pretrain_parser()
    rank = int(os.environ.get("RANK", "0"))
    for scenario in spec["scenarios"]:
        cfg = cli.root_config(parser.instantiate(parser.parse_object(scenario["config"])))
        COUNTS.clear(), CALLS.clear(), DS_IN_STEP.clear(), DS_CALLS.clear()
        STATE["steps"] = 0
        started, error = time.time(), None
        try:
            pretrain.run(cfg, [], keep_process_group=True)
        except Exception:
            error = traceback.format_exc()
            print(f"{scenario['name']} failed on rank {rank}:\n{error}", file=sys.stderr, flush=True)
        out = {
            "rank": rank,
            "wall_s": round(time.time() - started, 1),
            "error": error,
            "steps": STATE["steps"],
            "torch_dist": [
                {"op": k[0], "group": k[1], "caller": k[2], "bytes": v, "calls": CALLS[k]} for k, v in COUNTS.items()
            ],
            "comms_logger": {n: {"bytes": b, "calls": DS_CALLS[n]} for n, b in DS_IN_STEP.items() if DS_CALLS[n]},
        }
        os.makedirs(cfg.log.run_dir, exist_ok=True)
        (pathlib.Path(cfg.log.run_dir) / f"comms_rank{rank}.json").write_text(json.dumps(out, indent=1))
    engine.shutdown()


# ---------------------------------------------------------------------------------------------------- driver


def refusal(config: dict) -> list[str]:
    sys.path.insert(0, str(REPO))
    from megagenome import cli
    from megagenome.parallel import pipeline

    parser = cli.pretrain_parser()
    return pipeline.problems(cli.root_config(parser.instantiate(parser.parse_object(config))))


def summarise(work: pathlib.Path, name: str, tp: int, pp: int) -> dict:
    run = work / name
    row: dict = {"cell": name, "tp": tp, "pp": pp, "dp": NPROC // (tp * pp), "grad_accum": 2 if pp > 1 else 1}
    ranks = [json.loads(p.read_text()) for p in sorted(run.glob("comms_rank*.json"))]
    errors = [r["error"] for r in ranks if r["error"]]
    if errors or not ranks:
        row["error"] = (errors[0].strip().splitlines()[-1] if errors else "no output from the worker")[:300]
        return row
    memory = json.loads((run / "memory.json").read_text())
    row["param_bytes_per_rank"] = [r["params"] for r in memory["ranks"]]
    train = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in train if "split" not in r]
    row["global_batch_sequences"] = 2 * row["grad_accum"] * row["dp"]
    tokens_per_step = row["global_batch_sequences"] * 512
    row["tokens_per_s"] = [r["tokens_per_s"] for r in train]
    row["step_s"] = tokens_per_step / statistics.median(row["tokens_per_s"][SKIP_STEPS:])
    row["steps_counted"] = [r["steps"] for r in ranks]
    comms = []
    for r in ranks:
        for c in r["torch_dist"]:
            comms.append({"rank": r["rank"], **c, "bytes_per_step": c["bytes"] / max(r["steps"], 1)})
            comms[-1]["calls_per_step"] = c["calls"] / max(r["steps"], 1)
    row["torch_dist_per_step"] = sorted(comms, key=lambda c: (c["rank"], -c["bytes"]))
    row["torch_dist_bytes_per_step_per_rank"] = [
        sum(c["bytes_per_step"] for c in comms if c["rank"] == r["rank"]) for r in ranks
    ]
    row["comms_logger_per_step"] = [
        {"rank": r["rank"], "op": n, "bytes": v["bytes"] / max(r["steps"], 1), "calls": v["calls"] / max(r["steps"], 1)}
        for r in ranks
        for n, v in r["comms_logger"].items()
    ]
    row["comms_logger_bytes_per_step_per_rank"] = [
        sum(v["bytes"] for v in r["comms_logger"].values()) / max(r["steps"], 1) for r in ranks
    ]
    row["error"] = None
    return row


def mib(values) -> str:
    return "/".join(f"{v / 2**20:.2f}" for v in values) if values else ""


def write_results(rows: list[dict], meta: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "parallel_sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    base = next((r for r in rows if r["cell"] == BASELINE and not r.get("error")), None)
    lines = [
        "# Parallel sweep: tensor and pipeline parallelism on 2 CPU ranks",
        "",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- hardware: {meta['hardware']}",
        f"- software: {meta['software']}",
        f"- setup: d_model 256, 4 layers, 4 heads, seq_len 512, fp32, ZeRO-0 (ds_configs/zero0.json + comms_logger), "
        f"micro batch 2 (grad accum 2 under pp=2), phiX174, {meta['steps']} steps, 2 ranks (gloo); "
        f"launch wall time {meta['wall_s']:.0f} s, exit code {meta['rc']}",
        "",
        "Parameter bytes per rank: memory.json ranks[i].params (rank 0/rank 1). Step time: global tokens per step / "
        f"median metrics.jsonl tokens_per_s over steps {SKIP_STEPS + 1}-{meta['steps']}; ratio to tp1_pp1 (note the "
        "global batch column: tp2 has 1 data-parallel rank, so half the sequences per step). Communication: bytes "
        "per training step per rank (rank 0/rank 1), counted on torch.distributed's collectives (largest buffer of "
        "each call: the whole tensor for all-reduce, broadcast, send and recv) and by DeepSpeed's comms logger "
        "(deepspeed.comm only: it does not see megagenome's tensor-parallel collectives, which call "
        "torch.distributed directly).",
        "",
        "| cell | tp | pp | dp | global batch (seq) | param MiB/rank | step s | ratio vs tp1_pp1 "
        "| comm MiB/step/rank (torch.distributed) | comm MiB/step/rank (comms logger) | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['cell']} | {r['tp']} | {r['pp']} | | | | | | | | {r['error']} |")
            continue
        ratio = r["step_s"] / base["step_s"] if base else None
        lines.append(
            f"| {r['cell']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['global_batch_sequences']} | "
            f"{mib(r['param_bytes_per_rank'])} | {r['step_s']:.3f} | {f'{ratio:.2f}' if ratio else ''} | "
            f"{mib(r['torch_dist_bytes_per_step_per_rank'])} | {mib(r['comms_logger_bytes_per_step_per_rank'])} | |"
        )
    lines += ["", "## Communication per training step by collective, group and caller (torch.distributed)", ""]
    lines += ["| cell | rank | op | group ranks | caller | calls/step | MiB/step |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for c in r.get("torch_dist_per_step") or []:
            lines.append(
                f"| {r['cell']} | {c['rank']} | {c['op']} | {c['group']} | {c['caller']} | "
                f"{c['calls_per_step']:.1f} | {c['bytes_per_step'] / 2**20:.3f} |"
            )
    lines += ["", "## DeepSpeed comms logger per training step", ""]
    lines += ["| cell | rank | op | calls/step | MiB/step |", "|---|---|---|---|---|"]
    for r in rows:
        for v in r.get("comms_logger_per_step") or []:
            lines.append(f"| {r['cell']} | {v['rank']} | {v['op']} | {v['calls']:.1f} | {v['bytes'] / 2**20:.3f} |")
    lines += ["", "Notes:", ""]
    lines += [
        "- A group of one rank (e.g. the data-parallel group under tp=2 or pp=2) moves no bytes between ranks; "
        "DeepSpeed still calls all_reduce on it for the gradient bucket, so it is counted, with its group shown.",
        "- send/recv calls per step are not whole numbers: the counts are totals over all steps / steps.",
        "- tp=2 runs half the global batch of tp1_pp1 (1 data-parallel rank x micro 2), so its step-time ratio is "
        "per step, not per token; pp=2 runs the same 4 sequences per step (micro 2 x accumulation 2).",
    ]
    (RESULTS / "parallel_sweep.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="training steps per cell")
    ap.add_argument("--worker", type=pathlib.Path, help=argparse.SUPPRESS)  # the launched ranks: the spec file
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # appended by the deepspeed launcher
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    work = pathlib.Path(tempfile.mkdtemp(prefix="mg-parallel-sweep-"))
    shutil.copy(FASTA, work / FASTA.name)
    (work / "comms_logger.json").write_text(json.dumps(COMMS_FRAGMENT))
    refused, scenarios = {}, []
    for name, tp, pp in CELLS:
        config = cell_config(work, name, tp, pp, args.steps)
        problems = refusal(config)
        if problems:
            refused[name] = "refused by validation: " + "; ".join(problems)
        else:
            scenarios.append({"name": name, "config": config})
    (work / "spec.json").write_text(json.dumps({"scenarios": scenarios}))
    bin_dir = pathlib.Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [str(bin_dir / "deepspeed"), "--num_gpus", str(NPROC), __file__, "--worker", str(work / "spec.json")]
    started = time.time()
    with open(work / "worker.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900).returncode
    wall = time.time() - started
    rows = []
    for name, tp, pp in CELLS:
        if name in refused:
            rows.append({"cell": name, "tp": tp, "pp": pp, "error": refused[name]})
        else:
            rows.append(summarise(work, name, tp, pp))

    meta = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "hardware": hardware(),
        "software": software(),
        "steps": args.steps,
        "wall_s": wall,
        "rc": rc,
    }
    write_results(rows, meta)
    print(f"wrote {RESULTS}/parallel_sweep.{{md,json}} in {wall:.0f} s (rc {rc}, work dir {work})")


if __name__ == "__main__":
    main()
