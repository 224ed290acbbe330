"""Parameter shapes and saved-activation bytes of the megagenome transformer (layer L1, pure arithmetic).

The per-block formula is derived from what autograd saves for backward in model/layers.py, tensor by tensor (the
bytes a torch.autograd.graph.saved_tensors_hooks count sees, one count per storage, parameters excluded). With
b the micro batch, s the sequence length, d = d_model, a = n_head, f = d_ff, e the activation element size (4 fp32,
2 bf16/fp16), N = b*s*d and H = b*s*f, one block without checkpointing keeps

    2 RMSNorms      2 x (8N + 4bs)         input (a float32 copy under bf16), 1/rms (fp32), normalised x (fp32):
                                             torch's rms_norm op by op, as on CPU (CUDA's fused kernel keeps less)
    qkv input       N*e                      the attention norm's output
    rotary tables   max_seq_len * head_dim * e   cos and sin, whole tables in the activation dtype (the buffers,
                                             or their cast cached once); q and k rotate with the same tables
    attention core  flash/SDPA-efficient: q, k, the fused qkv output (v is a view of it), output: 6N*e,
                    plus the log-sum-exp 4*b*a*s (fp32) -- no s x s term
                    math kernel (SDPA math, what CPU SDPA runs with dropout): scaled q, k^T and v copies 3N*c
                    plus c*b*a*s^2 per saved s x s tensor: softmax (1), and with dropout its mask and output (3);
                    c = 4 on CPU, where the math kernel computes in fp32 whatever the model dtype
    proj input      N*e                      heads transposed back (a copy) after the math kernel; none after
                                             flash/SDPA-efficient, which given q, k, v as (B, T, n_head, head_dim)
                                             strided views write their output in that layout, so proj reads it
    mlp input       N*e
    SwiGLU          4H*e                     gate pre-activation, silu(gate), up, and w_down's input
    dropout masks   2N*m                     the two residual dropouts when dropout > 0 (m = e on CPU, 1 on CUDA)

Against Korthikanti et al. 2022 (s*b*h*(34 + 5as/h) for GPT in fp16): flash attention removes the 5as/h term,
SwiGLU replaces the 4h GeLU MLP, and the fp32 RMSNorm statistics cost more than fp16 LayerNorm.

Checkpointing: full keeps each block's input (N*e) instead of S_block; every_k keeps the input of each segment of
k blocks; selective recomputes the attention core, keeping its inputs q, k and the fused qkv output (5N*e) instead
of what the core saves (after flash/SDPA-efficient, proj still keeps the core's output as its input). Outside the
blocks, whatever the policy: the token ids (8bs), the final norm, the LM head's input (N*e), the fp32 log-softmax
(4*b*s*vocab), labels (8bs), loss weights (4bs) and two fp32 scalars.

With tensor parallelism over t ranks (Megatron layout, no sequence parallelism) the core, the proj input and the
SwiGLU hidden states shrink by t; norms, block inputs, dropout masks and the qkv/mlp inputs are replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megagenome.observe import metrics

POLICIES = ("none", "selective", "every_k", "full")
KERNELS = ("flash", "math")


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model: its config's shape plus the vocabulary (data-dependent)."""

    d_model: int
    n_layer: int
    n_head: int
    d_ff: int
    vocab_size: int
    padded_vocab: int
    tie_embeddings: bool = True
    max_seq_len: int = 1024
    dropout: float = 0.0
    causal: bool = True
    """Count attention FLOPs in the causal convention (Megatron-LM, metrics.py): a clm model; False for mlm, or to
    reproduce a count that took every score (the Megatron-LM 2019 calibration in tests/test_plan.py)."""


def _param_table(shape: ModelShape, tp: int = 1) -> list[tuple[int, bool]]:
    """(elements one rank holds, is a matrix) of each parameter tensor in model order (tied weights once); matrices
    and the vocabulary-parallel embedding are split over `tp` tensor-parallel ranks, norm scales are replicated."""
    d, f = shape.d_model, shape.d_ff
    out = [(shape.padded_vocab * d // tp, True)]  # token embedding (a vocabulary block under tensor parallelism)
    for _ in range(shape.n_layer):
        out += [(d, False), (3 * d * d // tp, True), (d * d // tp, True)]  # attn_norm, qkv, proj
        out += [(d, False), (d * f // tp, True), (d * f // tp, True), (f * d // tp, True)]  # mlp_norm, SwiGLU
    out.append((d, False))  # final norm
    if not shape.tie_embeddings:
        out.append((shape.padded_vocab * d // tp, True))
    return out


def param_numels(shape: ModelShape, tp: int = 1) -> list[int]:
    """Elements of each parameter tensor one rank holds, in model order."""
    return [n for n, _ in _param_table(shape, tp)]


def n_params(shape: ModelShape, tp: int = 1) -> int:
    return sum(param_numels(shape, tp))


def param_groups(shape: ModelShape, tp: int = 1) -> tuple[list[int], list[int]]:
    """Elements of the parameters in the optimizer's two groups, in model order, as DNATransformer.param_groups
    builds them: matrices (embedding, linears; weight decay) and vectors (norm scales; no decay)."""
    table = _param_table(shape, tp)
    return [n for n, matrix in table if matrix], [n for n, matrix in table if not matrix]


def gradient_buffer_elements(groups: tuple[list[int], ...], dp: int, alignment: int = 2) -> list[int]:
    """Per rank, the elements of ZeRO-1/2's contiguous gradient buffer (grads_in_partition): DeepSpeed flattens each
    parameter group, pads it to a multiple of alignment x dp, cuts it into dp equal partitions and gives each rank
    the whole gradient of every parameter that overlaps its partition, so a rank whose partition starts or ends
    inside a parameter holds all of it."""
    out = [0] * dp
    for numels in groups:
        total = sum(numels)
        padded = math.ceil(total / (alignment * dp)) * alignment * dp
        size = padded // dp
        starts = [0]
        for n in numels:
            starts.append(starts[-1] + n)
        for rank in range(dp):
            lo, hi = rank * size, (rank + 1) * size
            out[rank] += sum(n for n, start in zip(numels, starts) if start < hi and start + n > lo)
    return out


def persistent_params(shape: ModelShape, threshold: int, tp: int = 1) -> int:
    """Elements ZeRO-3 keeps whole on every rank: parameters of at most stage3_param_persistence_threshold."""
    return sum(n for n in param_numels(shape, tp) if n <= threshold)


def block_params(shape: ModelShape, tp: int = 1) -> int:
    d, f = shape.d_model, shape.d_ff
    return 2 * d + (4 * d * d + 3 * d * f) // tp


def block_terms(
    shape: ModelShape,
    seq: int,
    micro: int,
    act_bytes: int,
    kernel: str = "flash",
    math_bytes: int | None = None,
    mask_bytes: int | None = None,
    tp: int = 1,
) -> dict[str, int]:
    """Bytes one block saves for backward without checkpointing, term by term (module docstring)."""
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r}: must be one of {', '.join(KERNELS)}")
    e, b, s, d, a = act_bytes, micro, seq, shape.d_model, shape.n_head
    c = e if math_bytes is None else math_bytes
    m = e if mask_bytes is None else mask_bytes
    n, h = b * s * d, b * s * shape.d_ff
    norm = 8 * n + 4 * b * s
    head_dim = d // a
    rope_rows, rope_bytes = shape.max_seq_len, e
    if kernel == "flash":
        core = 6 * n * e // tp + 4 * b * a * s // tp
    else:
        squares = 3 if shape.dropout > 0 else 1
        core = 3 * n * c // tp + squares * c * b * a * s * s // tp
    return {
        "norms": 2 * norm,
        "qkv_input": n * e,
        "rotary": rope_rows * head_dim * rope_bytes,
        "attention_core": core,
        "proj_input": n * e // tp if kernel != "flash" else 0,
        "mlp_input": n * e,
        "swiglu": 4 * h * e // tp,
        "dropout_masks": 2 * n * m if shape.dropout > 0 else 0,
    }


def activation_bytes(
    shape: ModelShape,
    seq: int,
    micro: int,
    policy: str,
    act_bytes: int,
    every: int = 2,
    kernel: str = "flash",
    math_bytes: int | None = None,
    mask_bytes: int | None = None,
    tp: int = 1,
) -> dict[str, int]:
    """Saved-activation bytes of one micro batch under a checkpointing policy, and the backward's transient.

    Returns block (S_block, no checkpointing), block_kept (what one block keeps under the policy, averaged for
    every_k), outside (embedding ids, final norm, head and loss), saved (everything kept through the forward pass)
    and transient (the recomputed segment, k blocks for every_k, one block otherwise, plus the loss working set:
    an assumption about the backward pass, not measured).
    """
    if policy not in POLICIES:
        raise ValueError(f"checkpointing policy {policy!r}: must be one of {', '.join(POLICIES)}")
    e, b, s, d = act_bytes, micro, seq, shape.d_model
    terms = block_terms(shape, seq, micro, act_bytes, kernel, math_bytes, mask_bytes, tp)
    block = sum(terms.values())
    n = b * s * d
    layers = shape.n_layer
    if policy == "none":
        kept = layers * block
    elif policy == "selective":
        # The core's output is no longer saved by the core; after flash/SDPA-efficient proj keeps it as its input.
        proj_keeps = n * e // tp if kernel == "flash" else 0
        kept = layers * (block - terms["attention_core"] + 5 * n * e // tp + proj_keeps)
    elif policy == "full":
        kept = layers * n * e
    else:
        kept = math.ceil(layers / every) * n * e
    vocab_cols = shape.vocab_size if tp == 1 else shape.padded_vocab // tp
    outside = (
        8 * b * s  # token ids (int64)
        + 8 * n
        + 4 * b * s  # final RMSNorm
        + n * e  # LM head input
        + 4 * b * s * vocab_cols  # fp32 log-softmax of the logits
        + 8 * b * s  # labels (int64)
        + 4 * b * s  # loss weights (fp32)
        + 8  # loss numerator and denominator scalars
    )
    segment = every if policy == "every_k" else 1
    loss_work = b * s * (shape.padded_vocab // tp) * (e + 4 + 4)  # logits, their fp32 copy, its gradient
    return {
        "block": block,
        "block_kept": kept // layers,
        "outside": outside,
        "saved": kept + outside,
        "transient": segment * block + loss_work,
    }


def recompute_flops_per_token(shape: ModelShape, seq: int, policy: str, early_stop: bool = True) -> float:
    """Extra FLOPs per token that recomputation adds: metrics.recompute_flops_per_token (the one formula, also
    behind every run's HFU) for this shape, in its convention (shape.causal); early_stop: torch's checkpoint (the
    default without an activation_checkpointing block in the DeepSpeed JSON) skips the last w_down of each
    segment."""
    return metrics.recompute_flops_per_token(
        n_params(shape),
        shape.n_layer,
        shape.d_model,
        seq,
        policy,
        metrics.block_parameters(shape.d_model, shape.d_ff),
        d_ff=shape.d_ff,
        early_stop=early_stop,
        dropout=shape.dropout,
        causal=shape.causal,
    )
