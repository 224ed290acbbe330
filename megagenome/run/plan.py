"""`megagenome plan`: predict per-GPU memory and step time before renting the GPUs (layer L4).

From the run config (model, data.seq_len, train batch sizes and DeepSpeed JSON, parallel.tensor) and a cluster
description it predicts, for every candidate (ZeRO stage 0-3 x offload x checkpointing none/selective/full x micro
batch), the per-GPU memory by component and the step time split into compute and gradient communication; it
recommends the cheapest candidate that fits and prints the predicted weak-scaling efficiency from 8 to 512 GPUs.
The arithmetic lives in megagenome/planner/ (pure functions); this module reads the config and the shipped
ds_configs/ fragments and prints. Nothing here starts a process group or touches a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import megagenome
from megagenome.config import RootConfig
from megagenome.config.checks import seq_warmup_problems
from megagenome.data.curriculum import Curriculum
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.engine import optimizers
from megagenome.engine.ds_config import (
    ds_config_files,
    dtype_name,
    load_ds_json,
    merge_fragments,
    offload_devices,
    weights_dtype,
    zero_stage,
)
from megagenome.model import family_of
from megagenome.observe.metrics import gpu_memory_gib, peak_tflops
from megagenome.parallel.layout import LayoutError, ParallelLayout
from megagenome.planner.breakdown import TERMS, Rates, breakdown, hbm_tbps
from megagenome.planner.choose import Candidate, Setup, evaluate, grid, recommend, scaling
from megagenome.planner.inference import inference_memory
from megagenome.planner.states import DTYPE_BYTES, STATES, Precision, bytes_per_parameter
from megagenome.planner.timing import Cluster

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(megagenome.__file__))), "ds_configs")
PROG = "megagenome plan"


class PlanError(ValueError):
    """A plan request that cannot be answered; each problem names its flag."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def shape_of(cfg: RootConfig):
    """The cost model of the run config's model (its family's: model/family.py costs), what the planner computes on."""
    return family_of(cfg.model).costs(cfg.model, VOCAB_SIZE)


def _problems(cfg: RootConfig, cluster: Cluster, global_batch: int | None) -> tuple[ParallelLayout | None, list[str]]:
    """The layout of the run config over --gpus (the planner models tensor x data parallelism) and every problem of
    the request."""
    problems = seq_warmup_problems(cfg)
    for flag in ("gpus", "gpus_per_node"):
        if getattr(cluster, flag) < 1:
            problems.append(f"--{flag}={getattr(cluster, flag)}: must be positive")
    if cluster.gpu_memory_gb is None:
        problems.append(f"--gpu={cluster.gpu!r}: its memory is not in the table of megagenome/observe/metrics.py; "
                        "give --gpu_memory_gb")  # fmt: skip
    for flag in ("gpu_memory_gb", "intra_node_gbps", "inter_node_gbps", "pcie_gbps", "cpu_adam_gparams_per_s"):
        if getattr(cluster, flag) is not None and not getattr(cluster, flag) > 0:
            problems.append(f"--{flag}={getattr(cluster, flag)}: must be positive")
    if not 0 < cluster.mfu <= 1:
        problems.append(f"--mfu={cluster.mfu}: must be within (0, 1]")
    if not 0 <= cluster.memory_margin < 1:
        problems.append(f"--memory_margin={cluster.memory_margin}: must be within [0, 1)")
    if cluster.latency_us < 0 or cluster.runtime_gb < 0 or cluster.cpu_memory_gb < 0:
        problems.append("--latency_us, --runtime_gb and --cpu_memory_gb must be non-negative")
    if cluster.peak_tflops is None and peak_tflops(cluster.gpu) is None:
        problems.append(
            f"--gpu={cluster.gpu!r}: not in the peak table of megagenome/observe/metrics.py; give --peak_tflops"
        )
    if cluster.peak_tflops is not None and not cluster.peak_tflops > 0:
        problems.append(f"--peak_tflops={cluster.peak_tflops}: must be positive")
    if cluster.hbm_tbps is not None and not cluster.hbm_tbps > 0:
        problems.append(f"--hbm_tbps={cluster.hbm_tbps}: must be positive")
    m, par = cfg.model, cfg.parallel
    family = family_of(m)
    shape_problems = family.shape_problems(m)
    problems += shape_problems
    shape_ok = not shape_problems
    if cfg.data.seq_len <= 0 or cfg.data.seq_len > m.max_seq_len:
        problems.append(f"--data.seq_len={cfg.data.seq_len}: must be within [1, --model.max_seq_len={m.max_seq_len}]")
    for flag, value in (("parallel.pipeline", par.pipeline), ("parallel.sequence", par.sequence)):
        if value != 1:
            problems.append(f"--{flag}={value}: plan models data and tensor parallelism only (set it to 1)")
    if not shape_ok or cluster.gpus < 1 or par.pipeline != 1 or par.sequence != 1:
        return None, problems
    try:
        rules, warmup = family.parallel_rules(m, VOCAB_SIZE), tuple(cfg.data.seq_warmup_lengths or ())
        layout = ParallelLayout.build(cluster.gpus, par, m, cfg.data.seq_len, rules, warmup_lengths=warmup)
    except LayoutError as e:
        return None, problems + e.problems
    if par.tensor > cluster.gpus_per_node:
        problems.append(
            f"--parallel.tensor={par.tensor}: must fit in a node (--gpus_per_node={cluster.gpus_per_node}): tensor "
            "parallelism all-reduces in every layer"
        )
    elif global_batch is not None and (global_batch < 1 or global_batch % layout.data_parallel):
        problems.append(
            f"--global_batch={global_batch}: must be a positive multiple of the data-parallel size "
            f"{layout.data_parallel} (--gpus / --parallel.tensor)"
        )
    return layout, problems


def _lengths(cfg: RootConfig) -> dict:
    """The Setup's window lengths: --data.seq_len, and a sequence-length warmup's stages before it as (length, micro
    batch multiple) (data/curriculum.py), so that activations are sized for the largest stage."""
    stages = Curriculum.from_config(cfg.data).stages[:-1]
    return {"seq": cfg.data.seq_len, "warmup": tuple((s.length, s.k) for s in stages)}


def _fragments(stage: int, offload: bool) -> tuple[str, dict]:
    """The shipped ZeRO fragment of a candidate and its zero_optimization knobs ({} when not shipped here)."""
    name = f"zero{stage}_offload.json" if offload else f"zero{stage}.json"
    path = os.path.join(SHIPPED, name)
    zero = load_ds_json(path).get("zero_optimization", {}) if os.path.exists(path) else {}
    return f"ds_configs/{name}", {k: v for k, v in zero.items() if not isinstance(v, dict)}


def optimizer_refusals(cfg: RootConfig, ds: dict, prec: Precision) -> dict[tuple[int, bool], str]:
    """(stage, offload) -> why --train.optimizer cannot run there (engine/optimizers.py problems), for the grid's
    candidates: the user's DeepSpeed JSON with the candidate's shipped ZeRO fragment and the plan's precision, so the
    plan never recommends a run that validation refuses. The bitsandbytes check belongs to the launching machine."""
    out = {}
    for stage in range(4):
        for offload in (False, True) if stage >= 2 else (False,):
            path = os.path.join(SHIPPED, _fragments(stage, offload)[0].split("/")[-1])
            zero = load_ds_json(path).get("zero_optimization", {}) if os.path.exists(path) else {}
            cand = {
                **ds,
                "zero_optimization": {**zero, "stage": stage},
                "fp16": {**(ds.get("fp16") or {}), "enabled": prec.weights == "fp16"},
                "bf16": {"enabled": prec.weights == "bf16"},
                "data_types": {**(ds.get("data_types") or {}), "grad_accum_dtype": prec.grad_accum},
            }
            problems = optimizers.problems(cfg, cand, on_gpu=False)
            if problems:
                out[(stage, offload)] = problems[0]
    return out


def _precision_fragment(prec: Precision, stage: int) -> str | None:
    if prec.weights == "fp32":
        return None
    if prec.weights == "fp16":
        return "ds_configs/fp16.json"
    if prec.grad_accum == "fp32" and stage > 0:
        return "ds_configs/bf16.json"
    return '{"bf16": {"enabled": true}} (a JSON fragment of your own; ZeRO-0 accumulates in bf16 only)'


def _with_gpu_memory(cluster: Cluster) -> Cluster:
    """--gpu_memory_gb, or when not given the GPU's own by its name (observe/metrics.py gpu_memory_gib; None when
    unknown, which _problems reports)."""
    if cluster.gpu_memory_gb is not None:
        return cluster
    return dataclasses.replace(cluster, gpu_memory_gb=gpu_memory_gib(cluster.gpu))


def build(cfg: RootConfig, cluster: Cluster, global_batch=None, precision=None, grad_accum_dtype=None) -> dict:
    """Everything `megagenome plan` prints, as one JSON-ready dict. Raises PlanError naming the flags."""
    cluster = _with_gpu_memory(cluster)
    layout, problems = _problems(cfg, cluster, global_batch)
    files = ds_config_files(cfg.train)
    ds, _, merge_problems = merge_fragments(files)
    problems += merge_problems
    if problems:
        raise PlanError(problems)
    tp, dp = layout.tensor, layout.data_parallel
    if global_batch is None:
        global_batch = layout.global_batch(cfg.train)
        if global_batch % dp:
            raise PlanError(
                [f"--train.global_batch_size={global_batch} is not a multiple of the data-parallel size {dp}"]
            )
    weights = precision or weights_dtype(ds)
    grad_accum = grad_accum_dtype or dtype_name((ds.get("data_types") or {}).get("grad_accum_dtype")) or weights
    comm_name = dtype_name(ds.get("communication_data_type"))
    prec = Precision(weights, grad_accum)
    peak = cluster.peak_tflops or peak_tflops(cluster.gpu)
    zero = {(s, o): _fragments(s, o)[1] for s in range(4) for o in (False, True) if not (o and s < 2)}
    setup = Setup(
        shape=shape_of(cfg),
        **_lengths(cfg),
        global_batch=global_batch,
        precision=prec,
        cluster=cluster,
        peak_tflops=peak,
        tp=tp,
        zero=zero,
        comm_bytes=DTYPE_BYTES.get(comm_name),
        optimizer_bytes=_optimizer_bytes(cfg, tp),
    )
    refused = optimizer_refusals(cfg, ds, prec)
    candidates = [c for c in grid(setup) if (c.stage, c.offload) not in refused]
    rows = [evaluate(setup, c) for c in candidates]
    best = recommend(rows)
    notes = _notes(prec) + [
        f"ZeRO-{s}{' with offload' if o else ''} left out: {why}" for (s, o), why in sorted(refused.items())
    ]
    yours = _your_config(setup, cfg, ds, dp)
    out = {
        "model": _model_record(setup),
        "cluster": {**dataclasses.asdict(cluster), "peak_tflops": peak, "tensor_parallel": tp, "data_parallel": dp},
        "global_batch": global_batch,
        "curriculum": Curriculum.from_config(cfg.data).describe() if cfg.data.seq_warmup_lengths else None,
        "precision": {"weights": prec.weights, "grad_accum": prec.grad_accum},
        "optimizer": {"name": cfg.train.optimizer, "state_bytes_per_parameter": setup.optimizer_bytes},
        "ds_config": files,
        "candidates": rows,
        "notes": notes,
        "your_config": yours,
        "recommendation": None,
        "scaling": [],
        "breakdown": None,
    }
    if best is not None:
        stage, offload = best["stage"], best["offload"] != "none"
        fragments = [_fragments(stage, offload)[0]]
        fragments += [f for f in [_precision_fragment(prec, stage)] if f]
        if best["checkpointing"] != "none":
            fragments.append("ds_configs/activation_checkpointing.json (optional: DeepSpeed's recompute)")
        out["recommendation"] = {
            **best,
            "ds_config": fragments,
            "flags": [
                f"--model.checkpointing {best['checkpointing']}",
                f"--train.micro_batch_size {best['micro_batch']}",
                f"--train.grad_accum_steps {best['grad_accum']}",
            ],
        }
        cand = Candidate(stage, offload, best["checkpointing"], best["micro_batch"])
        out["scaling"] = scaling(setup, cand)
        stages = sorted({c.stage for c in candidates})
        by_stage = {s: scaling(setup, Candidate(s, False, best["checkpointing"], best["micro_batch"])) for s in stages}
        for i, row in enumerate(out["scaling"]):
            row["efficiency_by_stage"] = {str(s): by_stage[s][i]["efficiency"] for s in stages}
    out["breakdown"] = _breakdown(setup, yours or out["recommendation"], "your config" if yours else "recommendation")
    return out


def _model_record(setup: Setup) -> dict:
    """The plan's "model": the cost model's fields (the family's shape), its description, parameters, window."""
    shape = setup.shape
    described = {"shape": shape.describe(), "parameters": shape.n_params(), "seq_len": setup.seq}
    return {**dataclasses.asdict(shape), **described}


def _notes(prec: Precision) -> list[str]:
    if prec.grad_accum == prec.weights:
        return []
    return [
        f"ZeRO-0 left out: DeepSpeed accumulates gradients only in the weights' dtype ({prec.weights}) at stage 0, "
        f"and the config accumulates in {prec.grad_accum}; pass --grad_accum_dtype {prec.weights} to include it"
    ]


def _optimizer_bytes(cfg: RootConfig, tp: int) -> float:
    """Optimizer-state bytes per parameter of --train.optimizer for this model (planner/states.py)."""
    return bytes_per_parameter(cfg.train.optimizer, shape_of(cfg).param_shapes(tp))


def _breakdown(setup: Setup, row: dict | None, which: str) -> dict | None:
    """The bottom-up step time (planner/breakdown.py) of `row`, eager and fused, or None without a row or without
    an HBM bandwidth for the GPU."""
    bandwidth = setup.cluster.hbm_tbps or hbm_tbps(setup.cluster.gpu)
    if row is None or bandwidth is None:
        return None
    prec = setup.precision.at_stage(row["stage"])
    comm_s = row["dp_comm_exposed_s"] + row["tensor_comm_s"] + row["offload_s"]
    rates = Rates(setup.peak_tflops, bandwidth)
    args = (setup.shape, setup.seq, row["micro_batch"], row["grad_accum"], row["stage"], row["checkpointing"], rates)
    kw = {"dp": row["gpus"] // setup.tp, "tp": setup.tp, "comm_s": comm_s, "weight_bytes": prec.p}
    return {
        "for": which,
        "hbm_tbps": bandwidth,
        "assumptions": {k: v for k, v in dataclasses.asdict(rates).items() if k not in ("peak_tflops", "hbm_tbps")},
        "top_down_step_ms": 1e3 * row["step_s"],
        **{kind: breakdown(*args, **kw, fused=kind == "fused", grad_accum_bytes=prec.g) for kind in ("eager", "fused")},
    }


def _your_config(setup: Setup, cfg: RootConfig, ds: dict, dp: int) -> dict | None:
    """The run config as given, with its own DeepSpeed knobs (None when its micro batch does not fit the batch)."""
    micro = cfg.train.micro_batch_size
    if micro < 1 or (setup.global_batch // dp) % micro:
        return None
    zero = ds.get("zero_optimization") or {}
    stage = zero_stage(ds)
    offload = bool(offload_devices(ds))
    if offload and stage < 2:
        return None
    knobs = {k: v for k, v in zero.items() if not isinstance(v, dict)}
    own = dataclasses.replace(setup, zero={**setup.zero, (stage, offload): knobs})
    cand = Candidate(stage, offload, cfg.model.checkpointing, micro, cfg.model.checkpoint_every)
    return evaluate(own, cand)


def _row_text(r: dict) -> str:
    mem = r["memory_gib"]
    parts = " ".join(f"{mem[k]:6.2f}" for k in (*STATES, "activations", "buffers", "total"))
    fits = "yes" if r["fits"] else ("no (host)" if r["fits_gpu"] else "no")
    return (
        f"{r['stage']:>5} {r['offload']:>7} {r['checkpointing']:>9} {r['micro_batch']:>5} {r['grad_accum']:>5} | "
        f"{parts} | {r['step_s']:8.3f} {r['compute_s']:8.3f} {r['dp_comm_exposed_s'] + r['tensor_comm_s']:7.3f} "
        f"{r['offload_s']:7.3f} {r['tokens_per_s_per_gpu']:12,.0f}  {fits}"
    )


def render(plan: dict) -> str:
    m, c, p = plan["model"], plan["cluster"], plan["precision"]
    budget = c["gpu_memory_gb"] * (1 - c["memory_margin"])
    lines = [
        f"model: {m['parameters']:,} parameters ({m['shape']}), seq_len {m['seq_len']}, global batch "
        f"{plan['global_batch']} sequences "
        f"({plan['global_batch'] * m['seq_len']:,} tokens)",
        *([f"curriculum: {plan['curriculum']}; activations sized for its largest stage"] if plan["curriculum"] else []),
        f"cluster: {c['gpus']} x {c['gpu']} ({c['gpu_memory_gb']:g} GiB, {c['peak_tflops']:g} TFLOP/s peak, assumed "
        f"MFU {c['mfu']:g}), {c['gpus_per_node']} per node; all-reduce bus bandwidth {c['intra_node_gbps']:g} GB/s "
        f"in a node, {c['inter_node_gbps']:g} GB/s across nodes; tensor x data parallel = "
        f"{c['tensor_parallel']} x {c['data_parallel']}",
        f"precision: {p['weights']} weights, {p['grad_accum']} gradient accumulation (from "
        f"{', '.join(plan['ds_config'])} unless overridden)",
        f"optimizer: {plan['optimizer']['name']}, {plan['optimizer']['state_bytes_per_parameter']:.2f} bytes of "
        "optimizer state per parameter (the adam column)"
        + (
            "; 8-bit on each tensor that torchao quantizes (>= 4096 elements, a multiple of 256); under ZeRO, "
            "partitions whose size is not a multiple of 256 keep fp32 moments (8)"
            if plan["optimizer"]["name"] == "adam8bit"
            else ""
        ),
        "assumptions: gradient reduce-scatter hidden behind backward where overlap_comm is true (stages 2-3 as "
        "shipped), stage 0-1 reductions and all-gathers exposed; flash attention (no s x s scores); memory budget "
        f"{budget:.1f} GiB per GPU ({c['memory_margin']:.0%} kept for fragmentation; runtime {c['runtime_gb']:g} GiB "
        "included in totals)",
        "",
        "Per-GPU memory (GiB) and predicted step time (s) per candidate; comm = exposed gradient + tensor-parallel "
        "communication",
        "stage offload      ckpt micro accum | params  grads master   adam activ buffer  total |     step  compute"
        "    comm offload  tokens/s/GPU  fits",
    ]
    lines += [_row_text(r) for r in plan["candidates"]]
    lines += [f"note: {n}" for n in plan["notes"]]
    if plan["your_config"] is not None:
        lines += ["", "your config:", _row_text(plan["your_config"])]
    if plan["breakdown"] is not None:
        lines += ["", *_breakdown_text(plan["breakdown"])]
    rec = plan["recommendation"]
    lines.append("")
    if rec is None:
        lines.append("recommendation: nothing fits; add GPUs, shorten --data.seq_len or raise --parallel.tensor")
        return "\n".join(lines) + "\n"
    lines += [
        f"recommendation: ZeRO-{rec['stage']}, offload {rec['offload']}, checkpointing {rec['checkpointing']}, micro "
        f"batch {rec['micro_batch']} x {rec['grad_accum']} accumulation: {rec['memory_gib']['total']:.1f} GiB per "
        f"GPU, {rec['step_s']:.3f} s per step ({rec['compute_s']:.3f} compute, "
        f"{rec['step_s'] - rec['compute_s']:.3f} communication/offload), {rec['tokens_per_s']:,.0f} tokens/s",
        f"  --train.ds_config '[{', '.join(f for f in rec['ds_config'] if ' ' not in f)}]' " + " ".join(rec["flags"]),
        *[f"  note: {f}" for f in rec["ds_config"] if " " in f],
        f"  model states {rec['model_states_gib']:.2f} GiB per GPU as DeepSpeed 0.19.8 holds them; the ZeRO paper's "
        f"formula gives {rec['paper_model_states_gib']:.2f} GiB",
        "",
        f"Predicted weak scaling of the recommendation (micro batch {rec['micro_batch']} x {rec['grad_accum']} fixed, "
        "global batch grows with the GPUs): efficiency = step time at the first size / step time at N",
        "  GPUs  global batch   step s  compute s  comm exposed s  efficiency   ZeRO-0  ZeRO-1  ZeRO-2  ZeRO-3",
    ]
    for r in plan["scaling"]:
        by_stage = r["efficiency_by_stage"]
        stages = "  ".join(f"{by_stage[str(s)]:6.1%}" if str(s) in by_stage else f"{'-':>6}" for s in range(4))
        lines.append(
            f"  {r['gpus']:>4} {r['global_batch']:>13} {r['step_s']:8.3f} {r['compute_s']:10.3f} "
            f"{r['comm_exposed_s']:15.3f} {r['efficiency']:11.1%}  {stages}"
        )
    return "\n".join(lines) + "\n"


def _breakdown_text(b: dict) -> list[str]:
    """The breakdown table: each term in ms and % of the step, eager and fused, and the MFU the step implies."""
    a, eager, fused = b["assumptions"], b["eager"], b["fused"]
    lines = [
        f"Predicted step time of {b['for']} by kind of work, per GPU (bottom-up, megagenome/planner/breakdown.py; "
        f"predicted, not measured): weight matmuls at {a['matmul']:.0%} of the peak, attention kernels at "
        f"{a['attention_fwd']:.0%} forward / {a['attention_bwd']:.0%} backward, elementwise and optimizer at "
        f"{a['bandwidth']:.0%} of {b['hbm_tbps']:g} TB/s HBM",
        f"  {'term':<14} {'eager ms':>10} {'%':>6}  {'fused ms':>10} {'%':>6}",
    ]
    for term in TERMS:
        lines.append(
            f"  {term:<14} {eager['ms'][term]:10.1f} {eager['share'][term]:6.1%}  "
            f"{fused['ms'][term]:10.1f} {fused['share'][term]:6.1%}"
        )
    lines += [
        f"  {'step':<14} {eager['step_ms']:10.1f} {'':>6}  {fused['step_ms']:10.1f}",
        f"  {'MFU causal':<14} {eager['mfu']:10.1%} {'':>6}  {fused['mfu']:10.1%}   "
        "(causal attention at half: Megatron-LM's)",
        f"  {'MFU full attn':<14} {eager['mfu_full_attn']:10.1%} {'':>6}  {fused['mfu_full_attn']:10.1%}   "
        "(every score counted: PaLM's)",
        f"  the top-down prediction at the assumed MFU above: {b['top_down_step_ms']:.1f} ms",
    ]
    return lines


def run(cfg: RootConfig, cluster: Cluster, global_batch=None, precision=None, grad_accum_dtype=None, as_json=False):
    """Print the plan; 0 on success, 2 on a bad request (each problem on stderr, naming its flag)."""
    try:
        plan = build(cfg, cluster, global_batch, precision, grad_accum_dtype)
    except PlanError as e:
        for problem in e.problems:
            print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    if as_json:
        sys.stdout.write(json.dumps(plan, indent=1) + "\n")
    else:
        sys.stdout.write(render(plan))
    return 0


def inference_memory_of(m, seq: int, batch: int = 1, dtype: str = "bf16", file_dtype: str = "fp32") -> dict[str, int]:
    """planner/inference.py's estimate for the ModelConfig m: its family's cost model and parameter count."""
    family = family_of(m)
    params = family.parameter_counts(m, VOCAB_SIZE)[0]
    shape = family.costs(m, VOCAB_SIZE)
    return inference_memory(shape, params, seq, batch, dtype, file_dtype, m.norm_form, m.mlp_activation, m.family)
