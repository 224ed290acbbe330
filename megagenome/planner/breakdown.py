"""A bottom-up GPU step time by kind of work (layer L1, pure arithmetic): what `megagenome plan` predicts a step of
one configuration costs on one GPU when each kind of work runs at its own, stated rate, and the MFU that implies.

timing.py predicts a step from all training FLOPs at one assumed MFU; this module instead splits the step into

    matmul        the weight matmuls, 6N FLOPs per token (+ what checkpointing reruns of them) at
                  MATMUL_EFFICIENCY x the dense bf16 peak
    attention     the attention cores as a flash kernel runs them: forward C = 2*L*d*s per token causal (4*L*d*s
                  full, mlm) at ATTENTION_FWD_EFFICIENCY x peak; backward 2.5 C (the kernel recomputes q.k^T and
                  runs four more products: FlashAttention's own count) at ATTENTION_BWD_EFFICIENCY x peak; one more
                  forward under any checkpointing policy
    elementwise   norms, rotary, SwiGLU, residual adds, layout copies and the loss: bytes moved (below) / (HBM
                  bandwidth x BANDWIDTH_EFFICIENCY), eager (the model as written) and fused (fused kernels or a
                  regionally compiled block); full and every_k rerun the forward part
    optimizer     the gradient accumulation every micro batch and fused AdamW once per step: bytes of gradients
                  and states read and written / the same bandwidth
    communication the exposed gradient, tensor-parallel and offload time of timing.step_time (its own model)

The elementwise bytes per token are the model family's (model/transformer/costs.py derives the transformer's,
eager and fused). Optimizer (fp32 master weights, Adam m and v, fp32 gradient accumulation: DeepSpeed's bf16 path):
every micro batch each parameter's 16-bit gradient is read and added into the accumulation buffer (p + 2g
bytes); once per step fused AdamW reads the fp32 gradient (also for the clipping norm, 2 x 4), master weight, m
and v and writes the last three (24), and the 16-bit weights are written (p): 32 + p bytes per parameter this
rank updates (its ZeRO partition at stages 1-3).
"""

from __future__ import annotations

from dataclasses import dataclass

from megagenome.observe import metrics

# Fraction of the dense bf16 peak the weight matmuls reach. Assumed: cuBLAS bf16 GEMMs of a 1B model's shapes
# (M = tokens >= 8192, K and N >= 2048) run at 650-800 TFLOP/s on H100 SXM (989 peak), e.g. Megatron-core's GEMMs
# in its published 41-48% MFU runs; to be replaced by benchmarks/gpu_check.py's measurement.
MATMUL_EFFICIENCY = 0.75
# Fractions of the peak a Hopper attention kernel reaches, in the kernel's own FLOP count (causal halved, backward
# 2.5 x forward). Assumed from FlashAttention-3 (Shah et al. 2024, H100 SXM5, bf16, head dim 128, sequences of
# 8k-16k): about 600-660 TFLOP/s forward, 450-550 backward; cuDNN's SDPA kernel is in the same range.
# FlashAttention-2 on H100 reaches about 35% forward: pass the fractions of the kernel you run.
ATTENTION_FWD_EFFICIENCY = 0.60
ATTENTION_BWD_EFFICIENCY = 0.45
# Fraction of the HBM bandwidth a streaming elementwise or optimizer kernel sustains (assumed; copy kernels reach
# 85-90% of the datasheet figure on Hopper, smaller and oddly shaped ones less).
BANDWIDTH_EFFICIENCY = 0.80
# Backward FLOPs of a flash attention kernel per forward FLOP (FlashAttention's benchmark convention).
ATTENTION_BWD_PER_FWD = 2.5

# Datasheet HBM bandwidth in TB/s by the table name metrics.gpu_peak gives a GPU (NVIDIA and AMD datasheets).
# H200 NVL: NVIDIA's H200 datasheet gives 4.8 TB/s for the NVL card as for the SXM module; 3.9 TB/s is H100 NVL's.
HBM_TBPS: dict[str, float] = {
    "H200 SXM": 4.8,
    "H200 NVL": 4.8,
    "H100 SXM": 3.35,
    "H100 NVL": 3.9,
    "H100 PCIe": 2.0,
    "GH200": 4.0,
    "B200": 8.0,
    "A100 SXM": 2.039,
    "A100 PCIe": 1.935,
    "MI300X": 5.3,
}

TERMS = ("matmul", "attention", "elementwise", "optimizer", "communication")


def hbm_tbps(gpu: str) -> float | None:
    """Datasheet HBM bandwidth (TB/s) of a GPU name, None when the table does not have it."""
    found = metrics.gpu_peak(gpu)
    return None if found is None else HBM_TBPS.get(found[0])


@dataclass(frozen=True)
class Rates:
    """The GPU's rates: dense peak (TFLOP/s) and HBM bandwidth (TB/s), and the stated efficiencies."""

    peak_tflops: float
    hbm_tbps: float
    matmul: float = MATMUL_EFFICIENCY
    attention_fwd: float = ATTENTION_FWD_EFFICIENCY
    attention_bwd: float = ATTENTION_BWD_EFFICIENCY
    bandwidth: float = BANDWIDTH_EFFICIENCY

    def flop_s(self, efficiency: float) -> float:
        return self.peak_tflops * 1e12 * efficiency

    @property
    def bytes_s(self) -> float:
        return self.hbm_tbps * 1e12 * self.bandwidth


def breakdown(
    shape,
    seq: int,
    micro: int,
    accum: int,
    stage: int,
    policy: str,
    rates: Rates,
    dp: int = 1,
    tp: int = 1,
    comm_s: float = 0.0,
    fused: bool = False,
    weight_bytes: int = 2,
    grad_accum_bytes: int = 4,
) -> dict:
    """Seconds of one optimizer step on one GPU by term (TERMS), their sum, each term's share, and the MFU the sum
    implies in both conventions (module docstring for every formula). comm_s: the exposed communication and offload
    seconds of timing.step_time for the same configuration."""
    tokens = micro * accum * seq  # this GPU's tokens per step (a tensor-parallel group shares them)
    psi = shape.n_params()
    cores = shape.attention_flops_per_token(seq)  # L*C
    rerun = policy != "none"  # every policy reruns the cores once; full and every_k whole blocks
    weight_rerun = shape.recompute_flops_per_token(seq, policy) - (cores if rerun else 0.0)
    matmul = (6.0 * psi + weight_rerun) * tokens / tp / rates.flop_s(rates.matmul)
    fwd = cores * (1 + rerun) / rates.flop_s(rates.attention_fwd)
    attention = (fwd + ATTENTION_BWD_PER_FWD * cores / rates.flop_s(rates.attention_bwd)) * tokens / tp
    forward_reruns = 2 if policy in ("full", "every_k") else 1
    per_token = shape.elementwise_bytes_per_token(fused, tp, forward_reruns)
    elementwise = per_token * tokens / rates.bytes_s
    p_rank = shape.n_params(tp)
    updated = p_rank / dp if stage >= 1 else p_rank
    optimizer_bytes = accum * p_rank * (weight_bytes + 2 * grad_accum_bytes) + updated * (32 + weight_bytes)
    seconds = {
        "matmul": matmul,
        "attention": attention,
        "elementwise": elementwise,
        "optimizer": optimizer_bytes / rates.bytes_s,
        "communication": comm_s,
    }
    total = sum(seconds.values())
    model_flops = tokens * shape.flops_per_token(seq) / tp
    full_flops = tokens * shape.flops_per_token(seq, causal=False) / tp
    return {
        "fused": fused,
        "ms": {k: 1e3 * v for k, v in seconds.items()},
        "share": {k: v / total for k, v in seconds.items()},
        "step_ms": 1e3 * total,
        "elementwise_bytes_per_token": per_token,
        "optimizer_bytes": optimizer_bytes,
        "tokens_per_s_per_gpu": tokens / tp / total,
        "mfu": model_flops / total / rates.flop_s(1.0),
        "mfu_full_attn": full_flops / total / rates.flop_s(1.0),
    }
