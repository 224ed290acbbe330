"""Tensor and pipeline parallelism on 2 and 4 CPU ranks: parameter and activation bytes, step time, communication.

Two launches (fp32, ZeRO-0, gloo), each running its cells in one process group at one global batch, so step times
compare per token: 2 ranks (global batch 4 sequences): tp=1/pp=1 (2 data-parallel ranks, the baseline), tp=2 and
pp=2; 4 ranks (global batch 8): tp=1/pp=1 (4 data-parallel ranks), tp=2 x dp=2, pp=2 x dp=2 and tp=2 x pp=2.
Micro batch 2; gradient accumulation makes up the global batch (and gives the pipeline schedule its micro
batches). Model: d_model 256, 4 layers, 4 heads, seq_len 512, on tests/data/phiX174_NC_001422.1.fna, 6 steps
logged every step. The machine has 2 cores: the 4-rank launch runs 2 ranks per core, so its step times carry that
oversubscription equally in every cell. For each cell:

- per-rank parameter bytes: memory.json ranks[i]["params"] (written by every `megagenome pretrain` run);
- per-rank activation bytes: the peak, over a training step, of the bytes autograd holds for backward (distinct
  storages packed through torch.autograd.graph.saved_tensors_hooks and not yet released, parameters excluded);
  under pp=2 that is every micro batch in flight in DeepSpeed's schedule;
- step time: seconds per step from the median metrics.jsonl tokens_per_s after the first 2 steps, and its
  ratio to the same launch's tp=1/pp=1 cell;
- communication per training step by parallel dimension (tp, pp, dp, or a group of one rank), collective and
  calling file, from DeepSpeed's comms logger (a comms_logger fragment composed with zero0.json). megagenome's
  tensor-parallel layers call torch.distributed; this worker points their module at deepspeed.comm, which has the
  same functions, so the logger sees them too. A second count wraps torch.distributed's collectives themselves
  (largest buffer of each call), labelled with the parallel dimension of each call's group.
  Both count only inside the training step function (not evaluation, logging or start-up).

All cells of a launch run in one `deepspeed --num_gpus N` launch of this script (a worker mode, like
tests/support/worker.py), each through pretrain.run(cfg, [], keep_process_group=True).

    python benchmarks/parallel_sweep.py [--steps 6]

Writes benchmarks/results/parallel_sweep.{md,json}.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

import harness

FASTA = harness.PHIX
# world size -> (global batch in sequences, cells (name, tp, pp))
LAUNCHES = {
    2: (4, [("w2_tp1_pp1", 1, 1), ("w2_tp2_pp1", 2, 1), ("w2_tp1_pp2", 1, 2)]),
    4: (8, [("w4_tp1_pp1", 1, 1), ("w4_tp2_pp1", 2, 1), ("w4_tp1_pp2", 1, 2), ("w4_tp2_pp2", 2, 2)]),
}
MICRO = 2
SKIP_STEPS = 2
LAUNCH_TIMEOUT_S = 1800
COMMS_FRAGMENT = {"comms_logger": {"enabled": True, "verbose": False, "prof_all": True}}
OPS = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter", "broadcast"]
OPS += ["send", "recv", "isend", "irecv", "reduce", "all_to_all_single", "gather", "scatter"]


def cell_config(work: pathlib.Path, name: str, world: int, tp: int, pp: int, steps: int) -> dict:
    dp = world // (tp * pp)
    return {
        "model": {"d_model": 256, "n_layer": 4, "n_head": 4, "max_seq_len": 512},
        "data": {"fasta": str(work / FASTA.name), "seq_len": 512, "val_ranges": ["NC_001422.1:4301-5386"]}
        | {"eval_windows": 2},
        "train": {
            "ds_config": [str(harness.REPO / "ds_configs" / "zero0.json"), str(work / "comms_logger.json")],
            "micro_batch_size": MICRO,
            "grad_accum_steps": LAUNCHES[world][0] // (MICRO * dp),
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

STATE = {"in_step": False, "steps": 0, "live": 0, "peak": 0}
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


class _Saved:
    """A tensor autograd keeps for backward, counted in STATE["live"] (once per storage) until released."""

    storages: dict[int, list[int]] = {}  # storage address -> [bytes, tensors saved from it]

    def __init__(self, tensor):
        self.tensor, storage = tensor, tensor.untyped_storage()
        self.key = storage.data_ptr()
        entry = self.storages.setdefault(self.key, [storage.nbytes(), 0])
        if entry[1] == 0:
            STATE["live"] += entry[0]
            STATE["peak"] = max(STATE["peak"], STATE["live"])
        entry[1] += 1

    def __del__(self):
        entry = self.storages[self.key]
        entry[1] -= 1
        if entry[1] == 0:
            STATE["live"] -= entry[0]
            del self.storages[self.key]


def _saved_tensor_hooks(params: set[int]):
    import torch

    def pack(t):
        return t if t.untyped_storage().data_ptr() in params else _Saved(t)

    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _in_step(step_method):
    """Trainer.step counting what DeepSpeed communicates inside it and the activations it saves."""

    def step(self, *a, **k):
        if not hasattr(self, "sweep_params"):  # the parameters' storages, once per Trainer (not inside any step)
            self.sweep_params = {p.untyped_storage().data_ptr() for p in self.engine.module.parameters()}
        params = self.sweep_params
        before = _ds_totals()
        STATE["in_step"] = True
        try:
            with _saved_tensor_hooks(params):
                return step_method(self, *a, **k)
        finally:
            STATE["in_step"] = False
            STATE["steps"] += 1
            for name, (nbytes, calls) in _ds_totals().items():
                DS_IN_STEP[name] += nbytes - before.get(name, [0, 0])[0]
                DS_CALLS[name] += calls - before.get(name, [0, 0])[1]

    return step


def worker(spec_path: pathlib.Path) -> None:
    import torch.distributed as dist

    from megagenome.config.load import config_from_dict
    from megagenome.engine import engine
    from megagenome.run import pretrain
    from megagenome.train.trainer import Trainer

    for op in OPS:
        if hasattr(dist, op):
            _wrap(dist, op)
    import deepspeed.comm

    from megagenome.parallel import tensor_parallel

    tensor_parallel.dist = deepspeed.comm  # the same collectives, seen by DeepSpeed's comms logger (docstring)
    Trainer.step = _in_step(Trainer.step)  # the one step of every layout, pipeline stages included
    spec = json.loads(spec_path.read_text())
    me = harness.rank()
    for scenario in spec["scenarios"]:
        cfg = config_from_dict(scenario["config"])
        COUNTS.clear(), CALLS.clear(), DS_IN_STEP.clear(), DS_CALLS.clear()
        STATE.update(steps=0, peak=0)
        started, error = time.time(), None
        try:
            pretrain.run(cfg, [], keep_process_group=True)
        except Exception:
            error = traceback.format_exc()
            print(f"{scenario['name']} failed on rank {me}:\n{error}", file=sys.stderr, flush=True)
        out = {
            "rank": me,
            "wall_s": round(time.time() - started, 1),
            "error": error,
            "steps": STATE["steps"],
            "peak_activation_bytes": STATE["peak"],
            "torch_dist": [
                {"op": k[0], "group": k[1], "caller": k[2], "bytes": v, "calls": CALLS[k]} for k, v in COUNTS.items()
            ],
            "comms_logger": {n: {"bytes": b, "calls": DS_CALLS[n]} for n, b in DS_IN_STEP.items() if DS_CALLS[n]},
        }
        os.makedirs(cfg.log.run_dir, exist_ok=True)
        (pathlib.Path(cfg.log.run_dir) / f"comms_rank{me}.json").write_text(json.dumps(out, indent=1))
    engine.shutdown()


# ---------------------------------------------------------------------------------------------------- driver


def dimension_of(world: int, tp: int, pp: int):
    """Group ranks "0,1" -> the parallel dimension whose group it is: tp, pp, dp, model (tp x pp), world, or self."""
    sys.path.insert(0, str(harness.REPO))
    from megagenome.parallel.state import group_ranks

    kinds = group_ranks(world, tp, pp)
    by_ranks = {}
    for kind in ("model", "dp", "pp", "tp"):  # later kinds win where two coincide (e.g. tp = model when pp = 1)
        for ranks in kinds[kind]:
            if len(ranks) > 1:
                by_ranks[",".join(map(str, ranks))] = kind
    by_ranks[",".join(map(str, range(world)))] = by_ranks.get(",".join(map(str, range(world))), "world")

    def name(group: str, op: str) -> str:
        if op in ("send", "recv", "isend", "irecv"):  # between neighbouring stages, over the global group
            return "pp"
        return "self" if "," not in group else by_ranks.get(group, "?")

    return name


def summarise(work: pathlib.Path, world: int, name: str, tp: int, pp: int) -> dict:
    run = work / name
    dp = world // (tp * pp)
    accum = LAUNCHES[world][0] // (MICRO * dp)
    row: dict = {"cell": name, "world": world, "tp": tp, "pp": pp, "dp": dp, "grad_accum": accum}
    ranks = [json.loads(p.read_text()) for p in sorted(run.glob("comms_rank*.json"))]
    errors = [r["error"] for r in ranks if r["error"]]
    if errors or not ranks:
        row["error"] = (errors[0].strip().splitlines()[-1] if errors else "no output from the worker")[:300]
        return row
    memory = json.loads((run / "memory.json").read_text())
    row["param_bytes_per_rank"] = [r["params"] for r in memory["ranks"]]
    row["activation_bytes_per_rank"] = [r["peak_activation_bytes"] for r in ranks]
    train, _ = harness.run_rows(run)
    row["global_batch_sequences"] = MICRO * accum * dp
    tokens_per_step = row["global_batch_sequences"] * 512
    row["tokens_per_s"] = [r["tokens_per_s"] for r in train]
    row["step_s"] = tokens_per_step / statistics.median(row["tokens_per_s"][SKIP_STEPS:])
    row["steps_counted"] = [r["steps"] for r in ranks]
    dimension = dimension_of(world, tp, pp)
    comms = []
    for r in ranks:
        steps = max(r["steps"], 1)
        for c in r["torch_dist"]:
            per_step = {"dimension": dimension(c["group"], c["op"]), "bytes_per_step": c["bytes"] / steps}
            comms.append({"rank": r["rank"], **c, **per_step, "calls_per_step": c["calls"] / steps})
    row["torch_dist_per_step"] = sorted(comms, key=lambda c: (c["rank"], -c["bytes"]))
    row["by_dimension"] = {}  # dimension -> MiB per step per rank (mean over ranks), from torch.distributed
    for c in comms:
        row["by_dimension"][c["dimension"]] = row["by_dimension"].get(c["dimension"], 0.0) + c["bytes_per_step"]
    row["by_dimension"] = {k: v / len(ranks) for k, v in sorted(row["by_dimension"].items())}
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
    harness.write_json(harness.RESULTS / "parallel_sweep.json", {"meta": meta, "rows": rows})
    lines = [
        "# Parallel sweep: tensor and pipeline parallelism on 2 and 4 CPU ranks",
        "",
        *harness.header(meta),
        f"- setup: d_model 256, 4 layers, 4 heads, seq_len 512, fp32, ZeRO-0 (ds_configs/zero0.json + comms_logger), "
        f"micro batch {MICRO}, global batch 4 sequences on 2 ranks and 8 on 4 ranks (gradient accumulation makes up "
        f"the rest), phiX174, {meta['steps']} steps, gloo; launches: "
        + ", ".join(f"{w} ranks {v['wall_s']:.0f} s (exit code {v['rc']})" for w, v in meta["launches"].items()),
        "",
        "Per-rank figures are listed rank 0/rank 1/... Parameter bytes: memory.json ranks[i].params. Activation "
        "bytes: peak bytes autograd holds for backward during a training step (distinct storages, parameters "
        f"excluded). Step time: global tokens per step / median metrics.jsonl tokens_per_s over steps "
        f"{SKIP_STEPS + 1}-{meta['steps']}; ratio to the tp1_pp1 cell of the same launch (same global batch). "
        "Communication: bytes per training step per rank, from DeepSpeed's comms logger (it sees megagenome's "
        "tensor-parallel collectives because the worker routes them through deepspeed.comm) and from a count on "
        "torch.distributed's collectives (largest buffer of each call). They agree except for all-gathers, where "
        "the logger counts the input slice and the count the gathered output. The 4-rank launch runs 2 ranks per "
        "core.",
        "",
        *cell_table(rows),
        *communication_tables(rows),
        "",
        "Notes:",
        "",
        "- Activations: tensor parallelism without sequence parallelism splits only what lies inside the attention "
        "and MLP (heads, d_ff); the block inputs, norms and residual stream stay replicated on every tensor rank, "
        "so tp=2 keeps well over half the dense run's bytes. Under pp=2 the first stage holds more than the last: "
        "DeepSpeed's 1F1B schedule keeps up to (stages - stage index) micro batches in flight per stage.",
        "- send/recv calls per step need not be whole numbers: the counts are totals over all steps / steps.",
        "- pipeline stages send activations (and receive gradients) once per micro batch; under tp x pp DeepSpeed "
        "sends each tensor rank a 1/tp slice and all-gathers it over the tensor group on arrival.",
    ]
    harness.write_text(harness.RESULTS / "parallel_sweep.md", "\n".join(lines) + "\n")


def cell_table(rows: list[dict]) -> list[str]:
    """One line per cell: its bytes per rank, step time (and ratio to its launch's tp1_pp1) and communication."""
    base = {r["world"]: r for r in rows if r["tp"] == r["pp"] == 1 and not r.get("error")}
    lines = [
        "| cell | ranks | tp | pp | dp | accum | param MiB/rank | activation MiB/rank | step s | ratio vs tp1_pp1 "
        "| comm MiB/step/rank (comms logger) | comm MiB/step/rank (torch.distributed) | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['cell']} | {r['world']} | {r['tp']} | {r['pp']} | | | | | | | | | {r['error']} |")
            continue
        b = base.get(r["world"])
        ratio = f"{r['step_s'] / b['step_s']:.2f}" if b else ""
        lines.append(
            f"| {r['cell']} | {r['world']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['grad_accum']} | "
            f"{mib(r['param_bytes_per_rank'])} | {mib(r['activation_bytes_per_rank'])} | {r['step_s']:.3f} | {ratio} | "
            f"{mib(r['comms_logger_bytes_per_step_per_rank'])} | {mib(r['torch_dist_bytes_per_step_per_rank'])} | |"
        )
    return lines


def communication_tables(rows: list[dict]) -> list[str]:
    """Communication per step by parallel dimension, the comms logger's per op, and torch.distributed's by caller."""
    dims = sorted({d for r in rows for d in r.get("by_dimension") or {}})
    by_dim = [[r["cell"], *(f"{r['by_dimension'].get(d, 0.0) / 2**20:.3f}" for d in dims)] for r in rows]
    logger = [
        [r["cell"], v["rank"], v["op"], f"{v['calls']:.1f}", f"{v['bytes'] / 2**20:.3f}"]
        for r in rows
        for v in r.get("comms_logger_per_step") or []
    ]
    calls = [
        [r["cell"], c["rank"], c["dimension"], c["op"], c["group"], c["caller"], f"{c['calls_per_step']:.1f}"]
        + [f"{c['bytes_per_step'] / 2**20:.3f}"]
        for r in rows
        for c in r.get("torch_dist_per_step") or []
    ]
    return [
        "",
        "## Communication per training step by parallel dimension (MiB per rank, mean over ranks)",
        "",
        "| cell | " + " | ".join(dims) + " |",
        "|---|" + "---|" * len(dims),
        *("| " + " | ".join(row) + " |" for row, r in zip(by_dim, rows) if r.get("by_dimension")),
        "",
        "Dimensions: tp, pp, dp are the groups of ParallelState (send/recv between stages count as pp, though "
        "DeepSpeed issues them on the global group); model is tp x pp (DeepSpeed's gradient-norm group under "
        "pipelining); world is every rank; self is a group of one rank (DeepSpeed still calls all_reduce on a "
        "data-parallel group of one: no bytes move).",
        "",
        "## DeepSpeed comms logger per training step",
        "",
        *harness.table(["cell", "rank", "op", "calls/step", "MiB/step"], logger),
        "",
        "## torch.distributed collectives per training step by dimension, group and caller",
        "",
        *harness.table(["cell", "rank", "dimension", "op", "group ranks", "caller", "calls/step", "MiB/step"], calls),
    ]


def launch(work: pathlib.Path, world: int, steps: int) -> dict:
    """One deepspeed launch of `world` ranks running that launch's cells; returns its wall time and exit code."""
    scenarios = [
        {"name": name, "config": cell_config(work, name, world, tp, pp, steps)} for name, tp, pp in LAUNCHES[world][1]
    ]
    spec = work / f"spec_w{world}.json"
    spec.write_text(json.dumps({"scenarios": scenarios}))
    started, env = time.time(), harness.child_env(OMP_NUM_THREADS="1")
    rc, _ = harness.launch_worker(__file__, world, spec, work / f"worker_w{world}.log", LAUNCH_TIMEOUT_S, env=env)
    return {"wall_s": time.time() - started, "rc": rc}


def main() -> None:
    ap = harness.parser(__doc__, worker=True)
    ap.add_argument("--steps", type=int, default=6, help="training steps per cell")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    work = harness.work_dir("mg-parallel-sweep-")
    harness.copy_input(FASTA, work)
    (work / "comms_logger.json").write_text(json.dumps(COMMS_FRAGMENT))
    launches = {world: launch(work, world, args.steps) for world in LAUNCHES}
    rows = [summarise(work, world, *cell) for world, (_, cells) in LAUNCHES.items() for cell in cells]
    meta = {
        "date": harness.today(),
        "command": harness.command("parallel_sweep.py", harness.argv_of(None)),
        "hardware": harness.hardware(),
        "software": harness.software(),
        "steps": args.steps,
        "launches": launches,
    }
    write_results(rows, meta)
    print(f"wrote {harness.RESULTS}/parallel_sweep.{{md,json}} (launches {launches}, work dir {work})")


if __name__ == "__main__":
    main()
