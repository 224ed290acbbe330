"""Step time: compute, tensor-parallel and data-parallel communication, offload traffic (layer L1, pure arithmetic).

Compute: per GPU and micro batch, (6N + 6*L*d*s + recomputation) FLOPs per token x tokens / tensor degree, run at `mfu`
x the GPU's dense bf16 peak: causal attention counted at half, as Megatron-LM does (model/transformer/flops.py; 6N +
12*L*d*s for a bidirectional mlm model, TransformerShape.causal False), so `mfu` is in that convention. Recomputed FLOPs
run at the same rate, so checkpointing costs time. breakdown.py splits a step bottom-up instead, each kind of work at
its own rate.

Data-parallel gradient communication, ring algorithms, bytes each rank sends for a message of S bytes over n ranks
(nccl-tests' bus-bandwidth convention, so `megagenome preflight`'s busbw plugs in directly):
all-reduce 2(n-1)/n S, reduce-scatter and all-gather (n-1)/n S, each collective also paying (steps x latency) per
bucket. With P the parameters one rank's data-parallel group reduces, c the communication dtype's bytes (DeepSpeed
communicates in the weights' dtype unless communication_data_type is set) and A micro batches per step:

    stage 0   all-reduce P*c once per step, after backward (not overlapped)
    stage 1   reduce-scatter P*c once per step + all-gather of the updated parameters P*p (not overlapped);
              with bf16 + fp32 accumulation (BF16_Optimizer) an all-reduce instead of the reduce-scatter
    stage 2   reduce-scatter P*c every micro batch, overlapped with that micro batch's backward when
              overlap_comm is true (only the excess is exposed), + all-gather P*p after the step
    stage 3   every micro batch: all-gather (P - P_persistent)*p in forward (prefetch hides it behind the forward),
              again in backward, and reduce-scatter P*c (both hidden behind the backward with overlap_comm); each
              gathered parameter tensor is its own collective and pays the ring latency
    offload   + PCIe: the gradient partition to the host every micro batch and the updated 16-bit partition back,
              + the optimizer step on the host CPU (cpu_adam_gparams_per_s per node, shared by its GPUs);
              counted as exposed

Bandwidth: a data-parallel group inside one node runs at intra_node_gbps; one that spans nodes at inter_node_gbps
(a node's all-reduce bus bandwidth across the network), shared by the `tp` data-parallel groups whose rings cross
the same network adapters. Tensor parallelism (intra-node): 4 all-reduces of b*s*d activations per layer and micro
batch (2 forward, 2 backward; 2 more forward with full recomputation), never overlapped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megagenome.planner.states import DS_DEFAULTS, Precision


@dataclass(frozen=True)
class Cluster:
    """The machines: GPUs, their memory and peak, and the links between them."""

    gpus: int = 8
    """Total GPUs of the run."""
    gpus_per_node: int = 8
    """GPUs per node; a data-parallel group larger than a node communicates over the inter-node network."""
    gpu_memory_gb: float | None = None
    """Memory per GPU in GiB (default: --gpu's, from the table of observe/metrics.py: H100 80, H200 141, L40S 48,
    V100 32, ...; a size in the name wins, "A100 40GB")."""
    gpu: str = "H100"
    """GPU name, looked up in the bf16 dense peak table of observe/metrics.py (A100, H100, H200, V100, ...)."""
    peak_tflops: float | None = None
    """Dense 16-bit peak TFLOP/s per GPU; overrides the table entry for --gpu."""
    intra_node_gbps: float = 360.0
    """All-reduce bus bandwidth inside a node in GB/s (nccl-tests convention, as `megagenome preflight` reports);
    the default is an assumption for 8 NVLink-4 H100s, measure yours."""
    inter_node_gbps: float = 100.0
    """All-reduce bus bandwidth across nodes in GB/s, i.e. what one node's network adapters sustain together
    (8 x 100 Gb/s InfiniBand = 100 GB/s); an assumption, measure yours with `megagenome preflight` on 2 nodes."""
    latency_us: float = 5.0
    """Per-step latency of a ring collective in microseconds (paid 2(n-1) times by an all-reduce, per bucket)."""
    mfu: float = 0.45
    """Fraction of the peak the GPU sustains on the training FLOPs, causal attention counted at half (Megatron-LM's
    convention; assumed, not measured; recomputed FLOPs run at the same rate). 0.3-0.5 is typical of well-tuned
    dense transformers."""
    hbm_tbps: float | None = None
    """HBM bandwidth per GPU in TB/s for the step-time breakdown's elementwise and optimizer terms; default: the
    datasheet figure of --gpu (planner/breakdown.py HBM_TBPS: H200 4.8, H100 SXM 3.35, A100 SXM 2.0, ...)."""
    cpu_memory_gb: float = 1024.0
    """Host memory per node in GiB (offloaded states of all the node's ranks must fit)."""
    pcie_gbps: float = 25.0
    """Host-device copy bandwidth per GPU in GB/s (PCIe 4 x16 sustains about 25)."""
    cpu_adam_gparams_per_s: float = 1.0
    """Optimizer step throughput of a node's CPUs in 1e9 parameters per second (offload), shared by its GPUs;
    an assumption."""
    memory_margin: float = 0.10
    """Fraction of GPU (and host) memory kept free for allocator fragmentation; a config fits below the rest."""
    runtime_gb: float = 1.0
    """GiB per GPU taken by the CUDA context, cuBLAS/NCCL workspaces and the like (an assumption)."""


def ring_volume(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring collective on a message of `nbytes` over `n` ranks."""
    if n <= 1:
        return 0.0
    factor = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}[kind]
    return factor * (n - 1) / n * nbytes


def collective_time(kind: str, nbytes: float, n: int, gbps: float, latency_us: float, buckets: int = 1) -> float:
    """Seconds of one ring collective: volume / bus bandwidth + ring steps x latency per bucket."""
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return ring_volume(kind, nbytes, n) / (gbps * 1e9) + buckets * steps * latency_us * 1e-6


def dp_bandwidth(cluster: Cluster, dp: int, tp: int) -> float:
    """Bus bandwidth (GB/s) of one data-parallel group's ring."""
    if dp * tp <= cluster.gpus_per_node:
        return cluster.intra_node_gbps
    return min(cluster.intra_node_gbps, cluster.inter_node_gbps / tp)


@dataclass(frozen=True)
class Step:
    """Seconds of one optimizer step on one GPU, by part."""

    compute: float
    tensor_comm: float
    dp_comm: float  # total data-parallel communication time
    dp_exposed: float  # the part not hidden behind backward/forward
    offload: float
    volume_bytes: float  # data-parallel bytes sent per rank per step

    @property
    def total(self) -> float:
        return self.compute + self.tensor_comm + self.dp_exposed + self.offload


def step_time(
    shape,
    seq: int,
    micro: int,
    accum: int,
    stage: int,
    precision: Precision,
    policy: str,
    cluster: Cluster,
    peak_tflops: float,
    dp: int,
    tp: int = 1,
    zero: dict | None = None,
    offload: bool = False,
    persistent: int = 0,
    comm_bytes: int | None = None,
    gathered_tensors: int = 1,
) -> Step:
    """Predicted step time of one configuration (module docstring for the model)."""
    knobs = {**DS_DEFAULTS, **(zero or {})}
    p_rank = shape.n_params(tp)
    prec = precision.at_stage(stage)
    c = comm_bytes or prec.p
    model_flops = shape.flops_per_token(seq)  # forward 1/3, backward 2/3
    seconds_per_token_flop = micro * seq / tp / (peak_tflops * 1e12 * cluster.mfu)
    t_micro = (model_flops + shape.recompute_flops_per_token(seq, policy)) * seconds_per_token_flop
    t_fwd = model_flops / 3.0 * seconds_per_token_flop
    t_bwd = t_micro - t_fwd  # recomputation runs inside the backward pass
    compute = accum * t_micro

    tensor = 0.0
    if tp > 1:
        count, act = shape.tensor_parallel_traffic(micro, seq, prec.p, policy)
        one = collective_time("all_reduce", act, tp, cluster.intra_node_gbps, cluster.latency_us)
        tensor = accum * count * one

    bw, lat = dp_bandwidth(cluster, dp, tp), cluster.latency_us
    grads, params = p_rank * c, p_rank * prec.p
    gathered = (p_rank - persistent) * prec.p
    buckets = max(1, math.ceil(p_rank / knobs["reduce_bucket_size"]))
    gather_buckets = max(1, math.ceil(p_rank / knobs["allgather_bucket_size"]))
    overlap = bool(knobs["overlap_comm"])
    if stage == 0:
        total = exposed = collective_time("all_reduce", grads, dp, bw, lat, buckets)
        volume = ring_volume("all_reduce", grads, dp)
    elif stage == 1:
        kind = "all_reduce" if prec.weights == "bf16" and prec.g == 4 else "reduce_scatter"
        total = exposed = collective_time(kind, grads, dp, bw, lat, buckets) + collective_time(
            "all_gather", params, dp, bw, lat, gather_buckets
        )
        volume = ring_volume(kind, grads, dp) + ring_volume("all_gather", params, dp)
    elif stage == 2:
        rs = collective_time("reduce_scatter", grads, dp, bw, lat, buckets)
        ag = collective_time("all_gather", params, dp, bw, lat, gather_buckets)
        total = accum * rs + ag
        exposed = accum * (max(0.0, rs - t_bwd) if overlap else rs) + ag
        volume = accum * ring_volume("reduce_scatter", grads, dp) + ring_volume("all_gather", params, dp)
    else:
        ag = collective_time("all_gather", gathered, dp, bw, lat, max(1, gathered_tensors))
        rs = collective_time("reduce_scatter", grads, dp, bw, lat, buckets)
        total = accum * (2 * ag + rs)
        hidden = (max(0.0, ag - t_fwd) + max(0.0, ag + rs - t_bwd)) if overlap else 2 * ag + rs
        exposed = accum * hidden
        volume = accum * (2 * ring_volume("all_gather", gathered, dp) + ring_volume("reduce_scatter", grads, dp))

    off = 0.0
    if offload:
        part = p_rank / dp
        pcie = (accum * part * c + part * prec.p) / (cluster.pcie_gbps * 1e9)
        adam = part / (cluster.cpu_adam_gparams_per_s * 1e9 / min(cluster.gpus_per_node, cluster.gpus))
        off = pcie + adam
    return Step(compute, tensor, total, exposed, off, volume)
