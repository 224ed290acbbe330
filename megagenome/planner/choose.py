"""The candidate grid, one configuration's prediction, the recommendation and the scaling table (layer L1).

A candidate is a ZeRO stage (0-3), offload (none; cpu at stages 2-3, ds_configs/zero{2,3}_offload.json), an
activation checkpointing policy and a micro batch; the global batch fixes the gradient accumulation. It fits when
its per-GPU total (model states, activations, buffers, runtime) stays under (1 - memory_margin) of the GPU's memory
and the offloaded states of a node's ranks under (1 - memory_margin) of its host memory. The recommendation is the
fitting candidate with the highest predicted throughput; candidates within 1% of it count as a tie, broken towards
fewer features: no offload, then the lower ZeRO stage, then less recomputation, then the larger micro batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megagenome.observe.metrics import gpu_memory_gib
from megagenome.parallel.layout import ParallelLayout
from megagenome.planner.states import (
    DS_DEFAULTS,
    STATES,
    Precision,
    gradient_buffer_elements,
    model_states,
    paper_bytes,
    persistent_params,
    resident_buffers,
    transient_buffers,
)
from megagenome.planner.timing import Cluster, step_time

GIB = 2**30
GRID_POLICIES = ("none", "selective", "full")
POLICY_RANK = {"none": 0, "selective": 1, "every_k": 2, "full": 3}
SCALING_GPUS = (8, 16, 32, 64, 128, 256, 512)
TIE = 0.01


@dataclass(frozen=True)
class Candidate:
    stage: int
    offload: bool
    policy: str
    micro: int
    every: int = 2


@dataclass
class Setup:
    """Everything fixed across candidates."""

    shape: object  # the model family's cost model (model/family.py ModelFamily.costs)
    seq: int
    global_batch: int
    precision: Precision
    cluster: Cluster
    peak_tflops: float
    tp: int = 1
    zero: dict = field(default_factory=dict)  # (stage, offload) -> zero_optimization knobs
    kernel: str = "flash"
    mask_bytes: int = 1  # CUDA dropout masks are bool
    comm_bytes: int | None = None
    optimizer_bytes: float = 8.0  # optimizer-state bytes per parameter (states.bytes_per_parameter)
    # A sequence-length warmup's stages before `seq` (data/curriculum.py): (window length, micro batch multiple: the
    # windows per sample slot in its tokens mode, 1 in windows mode). Activations are sized for the largest stage.
    warmup: tuple[tuple[int, int], ...] = ()

    def layout(self, gpus: int | None = None) -> ParallelLayout:
        """tensor x data parallelism over the cluster's GPUs (or `gpus` of them: the scaling table)."""
        return ParallelLayout(gpus or self.cluster.gpus, tensor=self.tp)

    @property
    def dp(self) -> int:
        return self.layout().data_parallel

    def knobs(self, stage: int, offload: bool) -> dict:
        return {**DS_DEFAULTS, **self.zero.get((stage, offload), {})}


def evaluate(setup: Setup, cand: Candidate, gpus: int | None = None) -> dict:
    """Memory by component (GPU and host, GiB) and step time of one candidate; `gpus` overrides the cluster size
    (the scaling table), keeping micro batch and accumulation."""
    shape, tp, layout = setup.shape, setup.tp, setup.layout(gpus)
    dp = layout.data_parallel
    accum = max(1, setup.global_batch // (setup.dp * cand.micro))
    prec = setup.precision.at_stage(cand.stage)
    knobs = setup.knobs(cand.stage, cand.offload)
    psi = shape.n_params(tp)
    threshold = knobs["stage3_param_persistence_threshold"]
    persistent = persistent_params(shape, threshold, tp)
    edges = max(gradient_buffer_elements(shape.param_groups(tp), dp))  # the rank with the most
    states = model_states(psi, persistent, cand.stage, dp, prec, cand.offload, edges, setup.optimizer_bytes)
    largest = max(shape.param_numels(tp))
    resident = resident_buffers(psi, cand.stage, dp, prec, knobs, largest, cand.offload)
    transient = transient_buffers(psi, cand.stage, prec, knobs, shape.block_params(tp))
    acts, act_seq = stage_activations(setup, cand, prec.p, tp)
    gpu = {name: states[name].gpu for name in STATES}
    # With the module buffers that the saved bytes do not already count (the attention layers' rotary tables under
    # checkpointing, the Hyena filters' channel indices; model/hyena/activations.py), where a family gives them.
    gpu["activations"] = acts["saved"] + acts["transient"] + acts.get("module_buffers", 0)
    gpu["buffers"] = resident.gpu + transient
    gpu["runtime"] = setup.cluster.runtime_gb * GIB
    gpu["total"] = sum(gpu.values())
    host = sum(states[name].cpu for name in STATES) + resident.cpu
    ranks_per_node = min(setup.cluster.gpus_per_node, gpus or setup.cluster.gpus)
    margin = 1.0 - setup.cluster.memory_margin
    memory_gb = setup.cluster.gpu_memory_gb or gpu_memory_gib(setup.cluster.gpu) or 0.0  # by name when not given
    fits_gpu = gpu["total"] <= margin * memory_gb * GIB
    fits_host = host * ranks_per_node <= margin * setup.cluster.cpu_memory_gb * GIB
    step = step_time(
        shape,
        setup.seq,
        cand.micro,
        accum,
        cand.stage,
        setup.precision,
        cand.policy,
        setup.cluster,
        setup.peak_tflops,
        dp,
        tp=tp,
        zero=knobs,
        offload=cand.offload,
        persistent=persistent,
        comm_bytes=setup.comm_bytes,
        gathered_tensors=sum(1 for n in shape.param_numels(tp) if n > threshold),
    )
    tokens = layout.batch_of(cand.micro, accum).global_batch * setup.seq
    return {
        "stage": cand.stage,
        "offload": "cpu" if cand.offload else "none",
        "checkpointing": cand.policy,
        "micro_batch": cand.micro,
        "grad_accum": accum,
        "gpus": dp * tp,
        "memory_gib": {k: v / GIB for k, v in gpu.items()},
        "host_gib_per_rank": host / GIB,
        "activations_saved_gib": acts["saved"] / GIB,
        "activations_seq_len": act_seq,  # the stage they are sized for (setup.warmup)
        "model_states_gib": sum(states[n].total for n in STATES) / GIB,
        "paper_model_states_gib": paper_bytes(psi, cand.stage, dp) / GIB,
        "fits": fits_gpu and fits_host,
        "fits_gpu": fits_gpu,
        "fits_host": fits_host,
        "step_s": step.total,
        "compute_s": step.compute,
        "tensor_comm_s": step.tensor_comm,
        "dp_comm_s": step.dp_comm,
        "dp_comm_exposed_s": step.dp_exposed,
        "offload_s": step.offload,
        "dp_bytes_per_rank": step.volume_bytes,
        "tokens_per_s": tokens / step.total,
        "tokens_per_s_per_gpu": tokens / step.total / (dp * tp),
    }


def stage_activations(setup: Setup, cand: Candidate, weight_bytes: int, tp: int) -> tuple[dict, int]:
    """(activation_bytes, window length) of the stage with the largest activation footprint: seq, or a warmup stage
    (its length, at cand.micro x its multiple), the longer length on a tie. In tokens mode every stage holds the same
    tokens: with flash attention every term is then equal (seq is reported), and the math kernel's s x s scores grow
    with the length; in windows mode a shorter stage holds fewer tokens."""
    sized = []
    for seq, k in ((setup.seq, 1), *setup.warmup):
        acts = setup.shape.activation_bytes(
            seq, cand.micro * k, cand.policy, weight_bytes, every=cand.every, kernel=setup.kernel,
            mask_bytes=setup.mask_bytes, tp=tp,
        )  # fmt: skip
        sized.append((acts["saved"] + acts["transient"], seq, acts))
    _, seq, acts = max(sized, key=lambda t: t[:2])  # ties: the longer length
    return acts, seq


def grid(setup: Setup, micro_batches: list[int] | None = None) -> list[Candidate]:
    """Stage 0-3 x offload (stages 2-3) x none/selective/full x micro batches dividing the per-rank batch. Stage 0
    is left out when gradients accumulate in another dtype than the weights: DeepSpeed refuses that mix there."""
    per_rank = setup.global_batch // setup.dp
    micros = micro_batches or [m for m in (2**i for i in range(20)) if m <= per_rank and per_rank % m == 0]
    out = []
    first = 1 if setup.precision.grad_accum != setup.precision.weights else 0
    for stage in range(first, 4):
        for offload in (False, True) if stage >= 2 else (False,):
            for policy in GRID_POLICIES:
                out += [Candidate(stage, offload, policy, m) for m in micros]
    return out


def features(row: dict) -> tuple:
    """Sort key of the tie-break: fewer features first."""
    return (row["offload"] != "none", row["stage"], POLICY_RANK[row["checkpointing"]], -row["micro_batch"])


def recommend(rows: list[dict]) -> dict | None:
    """The fitting row with the highest throughput; rows within TIE of it go to the one with fewer features."""
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        return None
    best = max(r["tokens_per_s"] for r in fitting)
    close = [r for r in fitting if r["tokens_per_s"] >= (1.0 - TIE) * best]
    return min(close, key=features)


def scaling(setup: Setup, cand: Candidate, sizes: tuple[int, ...] = SCALING_GPUS) -> list[dict]:
    """Weak scaling of one candidate from the first size: fixed micro batch and accumulation, so the global batch
    grows with the GPU count; efficiency = step time at the first size / step time at N (per-GPU throughput
    ratio). Memory is not rechecked: ZeRO's per-rank states only shrink as N grows."""
    usable = [n for n in sizes if n % setup.tp == 0]
    rows = [evaluate(setup, cand, gpus=n) for n in usable]
    base = rows[0]["step_s"] if rows else 0.0
    return [
        {
            "gpus": r["gpus"],
            "global_batch": setup.layout(r["gpus"]).batch_of(r["micro_batch"], r["grad_accum"]).global_batch,
            "step_s": r["step_s"],
            "compute_s": r["compute_s"],
            "comm_exposed_s": r["step_s"] - r["compute_s"],
            "comm_total_s": r["dp_comm_s"] + r["tensor_comm_s"] + r["offload_s"],
            "efficiency": base / r["step_s"],
        }
        for r in rows
    ]
