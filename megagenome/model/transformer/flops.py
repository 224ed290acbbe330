"""FLOPs per token of the transformer (layer L1, pure arithmetic): the counts behind every run's MFU and HFU
(observe/metrics.py divides them by the peak) and the planner's step times.

FLOPs per token, as docs/architecture.md fixes them (N: the parameter count, tied embeddings once; L layers, width d,
sequence length s; one FLOP is a multiply or an add, so a multiply-accumulate is 2), in two conventions:

- Model FLOPs (MFU), no recompute, causal=True (the headline, Megatron-LM's convention): 6N + 6*L*d*s. Each weight
  takes part in one matmul per token: 2N forward, 4N backward (gradients of the input and of the weight).
  Attention core: per layer and token, q.k^T over s keys and all heads is 2*d*s, the weighted sum of values (A.V)
  another 2*d*s; under a causal mask only the scores on or below the diagonal are needed, about half, so 2*d*s
  forward and 6*d*s with backward. Source: Megatron-LM megatron/training/training.py num_floating_point_operations,
  whose attention term is (1 + groups/heads + s/h/2) ("Only half of the attention matrix is non-zero and needs to
  be multiplied with V"); FlashAttention's benchmarks halve causal FLOPs the same way.
- causal=False (PaLM, Chowdhery et al. 2022, App. B): 6N + 12*L*d*s, every score counted as if the mask were not
  there; what a kernel that computes all s x s scores runs. The metrics rows carry it as *_full_attn. A masked
  (mlm, bidirectional) model computes every score, so both of its columns use causal=False.
- Norm scales and an untied embedding table are in N though they do no matmul; with a DNA vocabulary of 8 tokens
  and (2L+1)*d norm scales this overcounts by well under 1% (tests/test_metrics.py states the exact difference).
- Forward FLOPs: a third of that, 2N + 2*L*d*s (causal) or 2N + 4*L*d*s (full).
- Hardware FLOPs (HFU) = model FLOPs + the forward FLOPs that activation checkpointing reruns in backward
  (recompute_flops_per_token, in the same convention; its docstring derives each policy).
"""

from __future__ import annotations

import math

from megagenome.config import ModelConfig, d_ff

CHECKPOINTING = ("none", "full", "every_k", "selective")


def attention_core_forward_flops_per_token(n_layer: int, d_model: int, seq_len: int, causal: bool = True) -> float:
    """Forward FLOPs per token of the attention cores, q.k^T and A.V of every layer: 4*L*d*s counting every score
    (causal=False), half of it counting the causal triangle only (causal=True, Megatron-LM's convention)."""
    full = 4.0 * n_layer * d_model * seq_len
    return full / 2.0 if causal else full


def flops_per_token(n_params: int, n_layer: int, d_model: int, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs per token: 6N for the weight matmuls (fwd + bwd) + the attention cores' forward and backward,
    6*L*d*s when causal (Megatron-LM) or 12*L*d*s counting every score (causal=False, PaLM)."""
    return 6.0 * n_params + 3.0 * attention_core_forward_flops_per_token(n_layer, d_model, seq_len, causal)


def forward_flops_per_token(n_params: int, n_layer: int, d_model: int, seq_len: int, causal: bool = True) -> float:
    """Forward FLOPs per token: 2N + 2*L*d*s (causal) or 2N + 4*L*d*s (causal=False), a third of flops_per_token."""
    return 2.0 * n_params + attention_core_forward_flops_per_token(n_layer, d_model, seq_len, causal)


def block_parameters(d_model: int, d_ff: int) -> int:
    """Parameters of one transformer block (blocks.py Block): fused qkv 3d^2, output projection d^2,
    SwiGLU gate, up and down 3*d*d_ff, two RMSNorm scales 2d; no biases."""
    return 4 * d_model * d_model + 3 * d_model * d_ff + 2 * d_model


def recompute_flops_per_token(
    n_params: int,
    n_layer: int,
    d_model: int,
    seq_len: int,
    checkpointing: str = "none",
    block_params: int | None = None,
    *,
    d_ff: int | None = None,
    checkpoint_every: int = 1,
    early_stop: bool = False,
    dropout: float = 0.0,
    pipeline_segments: bool = False,
    causal: bool = True,
) -> float:
    """Forward FLOPs per token that activation checkpointing runs a second time, in backward, with the attention
    cores counted in the convention `causal` picks (module docstring): C = 2*d*s per layer causal, 4*d*s full.

    --model.checkpointing, as model.py and blocks.py run it (P = block_params, the parameters
    of one block: block_parameters(d_model, d_ff) or counted on the model):

    - none: 0.
    - full: every block is a checkpointed segment, so each block's forward reruns once: L*(2P + C).
    - every_k: the blocks are cut into consecutive segments of k = checkpoint_every from block 0, the last one
      possibly shorter, and every segment is checkpointed: each block still reruns once, L*(2P + C) as for
      full (k sets the activations kept, and below the number of segments).
    - selective: only the attention core (scaled-dot-product attention of q, k, v) is checkpointed; per layer it
      reruns q.k^T and A.V: L*C (4*L*d*s full, 2*L*d*s causal: a causal kernel reruns only the triangle).
      Projections, rotary, norms and MLP run once. This assumes a fused kernel (flash-attn, SDPA's flash or
      memory-efficient kernels, the CPU flash kernel), one op that reruns whole; SDPA's math fallback is a chain
      of ops, and with early_stop only its scores q.k^T rerun.

    early_stop: the checkpoint function is torch's non-reentrant checkpoint with early stopping (the model's
    default when the DeepSpeed JSON has no activation_checkpointing block; DeepSpeed's checkpoint is reentrant and
    reruns the whole segment). It stops recomputing a segment once every tensor backward needs is rebuilt. A
    block ends with w_down, whose output only feeds the residual add (which saves nothing) when dropout is 0, so
    without dropout the last block of each segment skips w_down: 2*d*d_ff less per segment (L segments for full,
    ceil(L/k) for every_k; d_ff is needed then). With dropout the residual dropout saves its mask and w_down reruns.

    pipeline_segments (--parallel.pipeline > 1 with --parallel.pipeline_checkpoint_interval > 0): DeepSpeed's
    PipelineModule checkpoints every segment of layers that holds parameters, which is all of them (embedding,
    blocks, final norm, head), so the whole forward reruns, 2N + L*C, on top of the policy's own term
    (selective reruns the core once more, inside the recomputed segment). Counted whole: an upper bound when the
    segment function stops early.

    Not counted, as in the model FLOPs: ops other than matmuls, and the score recomputation that fused attention
    kernels do inside their own backward.
    """
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r}: must be one of {', '.join(CHECKPOINTING)}")
    L, d, s = n_layer, d_model, seq_len
    cores = attention_core_forward_flops_per_token(L, d, s, causal)  # L*C
    extra = 0.0
    if checkpointing in ("full", "every_k"):
        if block_params is None or block_params <= 0:
            raise ValueError(f"checkpointing={checkpointing} recomputes whole blocks: give block_params")
        extra += L * 2.0 * block_params + cores
        if early_stop and dropout == 0:
            if d_ff is None or checkpoint_every < 1:
                raise ValueError("early_stop without dropout skips each segment's last w_down: give d_ff")
            segments = L if checkpointing == "full" else math.ceil(L / checkpoint_every)
            extra -= segments * 2.0 * d * d_ff
    elif checkpointing == "selective":
        extra += cores
    if pipeline_segments:
        extra += forward_flops_per_token(n_params, L, d, s, causal)
    return extra


def hardware_flops_per_token(
    n_params: int,
    n_layer: int,
    d_model: int,
    seq_len: int,
    checkpointing: str = "none",
    block_params: int | None = None,
    *,
    causal: bool = True,
    **recompute,
) -> float:
    """FLOPs per token the hardware runs (HFU): flops_per_token + recompute_flops_per_token (same arguments, the
    same convention).

    E.g. full checkpointing with DeepSpeed's (reentrant) checkpoint, causal: 6N + 6*L*d*s + L*(2P + 2*d*s)
    = 6N + 2*N_blocks + 8*L*d*s with N_blocks = L*P (full count: 6N + 2*N_blocks + 16*L*d*s)."""
    return flops_per_token(n_params, n_layer, d_model, seq_len, causal) + recompute_flops_per_token(
        n_params, n_layer, d_model, seq_len, checkpointing, block_params, causal=causal, **recompute
    )


def run_flops(
    model: ModelConfig, n_params: int, block_params: int, seq_len: int, early_stop: bool, pipeline_segments: bool
) -> tuple[float, float, float, float]:
    """The FLOPs per token of a run of `model` at seq_len, as the loop's plan takes them: model FLOPs in the
    objective's convention (clm: causal attention at half, the headline; mlm computes every score) and with every
    score counted, then hardware FLOPs (the checkpointing policy's recomputation added) in the same two conventions.
    early_stop: torch's checkpoint (stops recomputing early), not DeepSpeed's; pipeline_segments: pipeline stages
    checkpoint their segments (recompute_flops_per_token)."""
    causal = model.objective == "clm"

    def hardware(causal: bool) -> float:
        return hardware_flops_per_token(
            n_params,
            model.n_layer,
            model.d_model,
            seq_len,
            model.checkpointing,
            block_params,
            causal=causal,
            d_ff=d_ff(model),
            checkpoint_every=model.checkpoint_every,
            early_stop=early_stop,
            dropout=model.dropout,
            pipeline_segments=pipeline_segments,
        )

    flops = [flops_per_token(n_params, model.n_layer, model.d_model, seq_len, c) for c in (causal, False)]
    return flops[0], flops[1], hardware(causal), hardware(False)
