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

Elementwise bytes per token and layer (e = 2 bytes of a bf16 activation, 4 of fp32; d = d_model, f = d_ff; every
kernel reads its inputs and writes its output once, as an unfused elementwise kernel does). "eager" is the block
unfused, as model/layers.py wrote it before its fused paths (RMSNorm as fp32 ops, rotary per q and k, separate
SwiGLU and residual kernels): an upper bound. The eager model of today sits between the two columns on a GPU
(RMSNorm is torch's one fused rms_norm kernel, rotary one autograd node on the packed qkv, no layout copies; the
residual adds, SwiGLU and rotary's own products are still separate kernels); "fused" is --model.compile:

    forward   RMSNorm: x.float() 6d, pow 8d, mean 4d, x * rsqrt 8d, * weight 8d, .to(bf16) 6d = 40d, two    80d
              rotary of q and of k: 4 half-width products, a difference, a sum (1d each in elements), cat
              2d: 9d elements, 18d bytes, for q and for k                                              36d
              attention output transposed back to (B, T, d) (a copy)                                     4d
              residual adds (read two, write one) 6d, two                                               12d
              SwiGLU: silu(gate) 4f, * up 6f                                                            10f
    backward  RMSNorm: cast back 6d, * weight 8d (+ weight gradient 8d), * rsqrt 8d (+ its gradient 8d),
              mean 4d, pow 12d, the two input gradients summed 12d, .float() 6d = 72d, two            144d
              rotary: 4 products 4d, negation 1d, two sums 3d, the halves concatenated 2d: 20d, two    40d
              qkv gradient stacked from q, k and v (unbind's backward)                                  12d
              output gradient made contiguous for the kernel                                            4d
              residual gradient sums 2 x 6d, the MLP input's two gradients summed 6d                   18d
              SwiGLU: two products 12f, silu backward 6f                                                18f
    eager: 132d + 10f forward, 218d + 18f backward: 350d + 28f per token and layer.

    fused (a fused kernel or a regionally compiled block): add + RMSNorm in one kernel reading residual and
    branch and writing both outputs, 8d, two; rotary in place on the packed qkv (q and k read and written), 8d;
    attention output written in (B, T, heads, head_dim) order, 0; SwiGLU in one kernel reading g and u and
    writing h, 6f: 24d + 6f forward. Backward: add + RMSNorm 8d, two; rotary into the packed qkv gradient 8d;
    SwiGLU reading dh, g, u and writing dg, du 10f: 24d + 10f. fused: 48d + 16f per token and layer.

Outside the blocks: the final RMSNorm (112d eager, 16d fused) and the loss, LOSS_BYTES_PER_VOCAB x vocabulary
bytes per token (bf16 logits, their fp32 copy, log-softmax and its gradient; 8 DNA tokens make it negligible).
Under tensor parallelism over t ranks the rotary, layout and SwiGLU bytes shrink by t; norms and residuals are
replicated. Optimizer (fp32 master weights, Adam m and v, fp32 gradient accumulation: DeepSpeed's bf16 path):
every micro batch each parameter's 16-bit gradient is read and added into the accumulation buffer (p + 2g
bytes); once per step fused AdamW reads the fp32 gradient (also for the clipping norm, 2 x 4), master weight, m
and v and writes the last three (24), and the 16-bit weights are written (p): 32 + p bytes per parameter this
rank updates (its ZeRO partition at stages 1-3).
"""

from __future__ import annotations

from dataclasses import dataclass

from megagenome.observe import metrics
from megagenome.planner.activations import ModelShape, n_params, recompute_flops_per_token

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
LOSS_BYTES_PER_VOCAB = 32  # bf16 logits 2 + fp32 copy 2 + 4, log-softmax 8, its gradient 8 + cast back 8

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


def elementwise_bytes(d: int, f: int, fused: bool, tp: int = 1) -> dict[str, float]:
    """Bytes per token and layer moved by the block's elementwise work (module docstring), forward and backward:
    replicated (norms, residual adds) plus sharded over tensor-parallel ranks (rotary, layout copies, SwiGLU)."""
    if fused:
        forward, backward = 16 * d + (8 * d + 6 * f) / tp, 16 * d + (8 * d + 10 * f) / tp
    else:
        forward = 80 * d + 12 * d + (36 * d + 4 * d + 10 * f) / tp
        backward = 144 * d + 18 * d + (40 * d + 12 * d + 4 * d + 18 * f) / tp
    return {"forward": forward, "backward": backward}


def outside_bytes(shape: ModelShape, fused: bool, tp: int = 1) -> float:
    """Bytes per token of the final norm and the loss (forward and backward)."""
    norm = 16 * shape.d_model if fused else 112 * shape.d_model
    return norm + LOSS_BYTES_PER_VOCAB * shape.padded_vocab / tp


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
    shape: ModelShape,
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
    L, d, causal = shape.n_layer, shape.d_model, shape.causal
    tokens = micro * accum * seq  # this GPU's tokens per step (a tensor-parallel group shares them)
    psi = n_params(shape)
    cores = metrics.attention_core_forward_flops_per_token(L, d, seq, causal)  # L*C
    rerun = policy != "none"  # every policy reruns the cores once; full and every_k whole blocks
    weight_rerun = recompute_flops_per_token(shape, seq, policy) - (cores if rerun else 0.0)
    matmul = (6.0 * psi + weight_rerun) * tokens / tp / rates.flop_s(rates.matmul)
    fwd = cores * (1 + rerun) / rates.flop_s(rates.attention_fwd)
    attention = (fwd + ATTENTION_BWD_PER_FWD * cores / rates.flop_s(rates.attention_bwd)) * tokens / tp
    block = elementwise_bytes(d, shape.d_ff, fused, tp)
    forward_reruns = 2 if policy in ("full", "every_k") else 1
    per_token = L * (forward_reruns * block["forward"] + block["backward"]) + outside_bytes(shape, fused, tp)
    elementwise = per_token * tokens / rates.bytes_s
    p_rank = n_params(shape, tp)
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
    model_flops = tokens * metrics.flops_per_token(psi, L, d, seq, causal) / tp
    full_flops = tokens * metrics.flops_per_token(psi, L, d, seq, causal=False) / tp
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
