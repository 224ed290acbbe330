"""The Hyena families' saved-activation and elementwise bytes (layer L1, pure arithmetic), for costs.py's HyenaShape.

The per-block formula is derived, tensor by tensor, from what autograd saves for backward in operators.py and
model.py (the bytes a torch.autograd.graph.saved_tensors_hooks count sees, one count per storage, parameters
excluded; tests/test_hyena_costs.py measures every kind, policy and dtype against it, to the byte). With b the micro
batch, s the sequence length, d = d_model, c = d/t the channels of one of t tensor-parallel ranks, f = d_ff, k =
short_filter_len, L an explicit filter's length, S = state_size, w = filter_width, M = max_seq_len, e the activation
element size (4 fp32, 2 bf16), N = b*s*d and C = b*s*c, one Hyena block without checkpointing keeps

    2 RMSNorms      2 x (8N + 4bs)       as the transformer's (model/transformer/costs.py)
    in_proj input   N*e                  the norm's output
    featurizer      3bc(s + k - 1)*e + 3ck*e   its input, left-padded by F.pad, and the reversed taps (conv1d's)
    gating          6C*e                 the featurizer's output (x2, x1 and v, one storage: 3C*e) that x1 . v
                                         keeps, x2 reshaped from its head layout (a copy), the core's output cast
                                         back to e (kept by . x2) and out_proj's input (y transposed: a copy)
    core            4C                   u = x1 . v in float32, kept by D u; under 16-bit also D's float32 copy 4c
      by FFT        8C + 8bc(s + 1) + 8cs + 8c(s + 1)   u zero-padded to 2s (float32; torch's rfft keeps its
                                         input), its spectrum (complex64, s + 1 bins), and the same two of the filter
                                         (H, LI, and SE or MR above DIRECT_MAX_TAPS taps, whose L < 2s taps are
                                         zero-padded to 2s)
      direct        4bc(s + L - 1) + 4cL  u left-padded in float32 and the reversed taps (conv1d's)
    filter          per micro batch, whatever b:
      SE            0                    (the taps are the conv's, above)
      MR            4cL                  the decay that multiplies the taps
      LI            0                    operators.py _ModalKernel keeps only the parameters and recomputes the
                                         filter in backward, so its (channels, S, s) values, 20cSs bytes under plain
                                         autograd (80 GB for Evo 2 1B's 1920 channels at s = 131072, per layer), are
                                         never kept; a block of them is the transient below
      H             6sw*e + 5s*e + 4cs   the MLP's six (s, w) activations (each Linear's input, each Sine's input
                                         and product), its positional features (computed for the s positions at
                                         every call, in e as the first Linear reads them), and the float32 decay
                                         the filter is multiplied by (computed likewise)
    mlp input       N*e
    SwiGLU          4bsf*e / t           as the transformer's
    dropout masks   2N*m                 the two residual dropouts when dropout > 0 (m = e on CPU, 1 on CUDA)

An attention block (A) is the transformer's Block: its block_terms. Checkpointing: full keeps each block's input
(N*e), every_k the input of each segment of k blocks; selective recomputes each Hyena layer's core, keeping its
inputs u (C*e: the storage of x1 . v in e) and the filter h (float32: 4cs for FFT filters, 4cL for MR, for SE its
float32 copy 4cL under 16-bit and nothing in float32, where h is the parameter itself) instead of what the core
saves, and each attention core as the transformer's. Outside the blocks: the transformer's (ids, final norm, head
input, float32 log-softmax, labels, loss weights).

Transient: the recomputed segment (one block, the largest; for every_k the largest k consecutive blocks) plus the
loss working set, as the transformer's, and where there is an LI layer its modal kernel's backward working set: the
(block of channels, S, s) float32 tensors of one block recomputed under autograd, MODAL_WORKING_TENSORS of them
(five kept for its backward and the gradients in flight; estimated, not measured), of MODAL_BLOCK_ELEMENTS each
(operators.py) or one channel's S x s if that is more. module_buffers: the device buffers the filters and rotary
tables hold whole (H's and MR's channel indices, int64; each attention block's cos and sin tables) that `saved` does
not already count under the policy (it counts a buffer where a saved view of it is kept: no checkpointing).

Elementwise bytes per token and layer, eager (each kernel reads its inputs and writes its output once, bf16
activations, float32 operator internals) with the transformer's norms (80d forward, 144d backward), residual adds
(12d, 18d) and SwiGLU (10f, 18f / t):

    operator    pad and featurizer conv 12c + 12c, x1 . v 6c, x2's copy 4c, u to float32 6c (twice), D u 8c,
                + 12c, cast back 6c, . x2 6c, transpose for out_proj 4c: 82c
      FFT       pad to 2s 12c, rfft 16c, spectrum product 24c, irfft 16c: 68c (one pass per transform: a lower
                bound past the few thousand points cuFFT transforms in shared memory); the filter's pad and rfft
                28c per position (per micro batch; for an explicit filter its few taps' padding counts as a whole
                filter's, an upper bound)
      direct    pad 8c, conv 8c: 16c
    filters     LI 76cS per position (two products writing 4 each, exp, cos, sin and two products reading 4 and
                writing 4, a difference and a product reading 8, the sum over poles reading 4); H 16w + 24c (two
                products and two sines of w in bf16, the filter and decay to float32 and their product)
    backward    twice the operator's and filters' forward bytes (each op reads its output's gradient and its saved
                inputs and writes its inputs' gradients; the FFT convolution runs three transforms and two
                products against the forward's two and one), three times for LI's filter (its kernel reruns the
                forward first): an assumption, not derived op by op

Fused (one kernel for the operator, as FlashFFTConv or Evo 2's, with the transformer's fused norms and SwiGLU):
forward reads x2, x1, v (6c) and writes y (2c), backward reads dy and x2, x1, v (8c) and writes their gradients (6c);
the filters fused into one kernel each: LI writes h (4c forward, reads dh 4c backward), H its two (s, w) bf16
activations and h (4w + 4c forward, 8w + 8c backward). The filter terms are per position, counted per token of a
sequence (micro batch 1: an upper bound, as the FLOPs). Attention blocks and the outside: the transformer's.
"""

from __future__ import annotations

import math

from megagenome.model.hyena.operators import MODAL_BLOCK_ELEMENTS
from megagenome.model.transformer import costs as transformer_costs

POLICIES = transformer_costs.POLICIES
POSITION_FEATURES = 5  # operators.py: the implicit filter's input features
MODAL_WORKING_TENSORS = 8  # float32 (block, S, T) tensors alive in _ModalKernel's backward (module docstring)


def attention_shape(shape) -> transformer_costs.TransformerShape:
    """One transformer block of the Hyena shape's width (an attention layer, and the head and loss outside)."""
    return transformer_costs.TransformerShape(
        shape.d_model, 1, shape.n_head, shape.d_ff, shape.vocab_size, shape.padded_vocab, shape.tie_embeddings,
        shape.max_seq_len, shape.dropout, shape.causal,
    )  # fmt: skip


def filter_terms(shape, kind: str, seq: int, e: int, tp: int = 1) -> int:
    """Bytes one Hyena layer's filter keeps for backward, per micro batch (module docstring)."""
    c, s = shape.d_model // tp, seq
    if kind == "MR":
        return 4 * c * shape.mr_filter_len
    if kind == "H":
        return 6 * s * shape.filter_width * e + POSITION_FEATURES * s * e + 4 * c * s
    return 0


def core_terms(shape, kind: str, seq: int, micro: int, e: int, tp: int = 1) -> int:
    """Bytes the operator's core (the long convolution and D u) keeps: what selective checkpointing recomputes."""
    b, s, c = micro, seq, shape.d_model // tp
    out = 4 * b * s * c + (4 * c if e != 4 else 0)  # u in float32, D's float32 copy under 16-bit
    if shape.by_fft(kind):
        return out + 8 * b * s * c + 8 * b * c * (s + 1) + 8 * c * s + 8 * c * (s + 1)
    L = shape.taps(kind)
    return out + 4 * b * c * (s + L - 1) + 4 * c * L


def core_inputs(shape, kind: str, seq: int, micro: int, e: int, tp: int = 1) -> int:
    """Bytes selective checkpointing keeps of the core's inputs: u (in e) and the filter h (float32)."""
    c = shape.d_model // tp
    if kind in ("H", "LI"):
        h = 4 * c * seq
    elif kind == "MR" or e != 4:
        h = 4 * c * shape.taps(kind)
    else:
        h = 0  # SE in float32: h is the parameter itself
    return micro * seq * c * e + h


def hyena_block_terms(shape, kind, seq, micro, act_bytes, mask_bytes=None, tp=1) -> dict[str, int]:
    """Bytes one Hyena block saves for backward without checkpointing, term by term (module docstring)."""
    e, b, s, d = act_bytes, micro, seq, shape.d_model
    m = e if mask_bytes is None else mask_bytes
    c, k = d // tp, shape.short_filter_len
    n, nc = b * s * d, b * s * c
    return {
        "norms": 2 * (8 * n + 4 * b * s),
        "in_proj_input": n * e,
        "featurizer": 3 * b * c * (s + k - 1) * e + 3 * c * k * e,
        "gating": 6 * nc * e,
        "core": core_terms(shape, kind, seq, micro, e, tp),
        "filter": filter_terms(shape, kind, seq, e, tp),
        "mlp_input": n * e,
        "swiglu": 4 * b * s * shape.d_ff * e // tp,
        "dropout_masks": 2 * n * m if shape.dropout > 0 else 0,
    }


def block_bytes(shape, kind, seq, micro, act_bytes, policy, kernel, math_bytes, mask_bytes, tp) -> tuple[int, int]:
    """(what one block of `kind` saves without checkpointing, what it keeps under selective checkpointing)."""
    if kind == "A":
        acts = transformer_costs.activation_bytes(
            attention_shape(shape), seq, micro, "selective", act_bytes, kernel=kernel, math_bytes=math_bytes,
            mask_bytes=mask_bytes, tp=tp,
        )  # fmt: skip
        return acts["block"], acts["block_kept"]
    block = sum(hyena_block_terms(shape, kind, seq, micro, act_bytes, mask_bytes, tp).values())
    core = core_terms(shape, kind, seq, micro, act_bytes, tp)
    return block, block - core + core_inputs(shape, kind, seq, micro, act_bytes, tp)


def activation_bytes(
    shape,
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
    """Saved-activation bytes of one micro batch under a checkpointing policy, and the backward's transient: the
    transformer's keys (block: the largest block's S_block; block_kept: what a block keeps under the policy,
    averaged; outside; saved; transient) and module_buffers (module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"checkpointing policy {policy!r}: must be one of {', '.join(POLICIES)}")
    args = (seq, micro, act_bytes, policy, kernel, math_bytes, mask_bytes, tp)
    per_kind = {kind: block_bytes(shape, kind, *args) for kind in set(shape.kinds)}
    blocks = [per_kind[kind][0] for kind in shape.kinds]
    layers, block_input = shape.n_layer, micro * seq * shape.d_model * act_bytes
    if policy == "none":
        kept = sum(blocks)
    elif policy == "selective":
        kept = sum(per_kind[kind][1] for kind in shape.kinds)
    elif policy == "full":
        kept = layers * block_input
    else:
        kept = math.ceil(layers / every) * block_input
    head = transformer_costs.activation_bytes(
        attention_shape(shape), seq, micro, "none", act_bytes, kernel=kernel, math_bytes=math_bytes,
        mask_bytes=mask_bytes, tp=tp,
    )  # fmt: skip
    loss_work = head["transient"] - head["block"]
    size = every if policy == "every_k" else 1
    segment = max(sum(blocks[i : i + size]) for i in range(0, layers, size))
    return {
        "block": max(blocks),
        "block_kept": kept // layers,
        "outside": head["outside"],
        "saved": kept + head["outside"],
        "transient": segment + loss_work + modal_working_set(shape, seq, tp),
        "module_buffers": module_buffers(shape, policy, act_bytes, tp),
    }


def modal_working_set(shape, seq: int, tp: int = 1) -> int:
    """Bytes of LI's modal kernel in backward, where the model has an LI layer (module docstring)."""
    if "LI" not in shape.kinds:
        return 0
    per_channel = shape.state_size * seq
    channels = min(shape.d_model // tp, max(1, MODAL_BLOCK_ELEMENTS // per_channel))
    return MODAL_WORKING_TENSORS * 4 * channels * per_channel


def module_buffers(shape, policy: str, e: int, tp: int = 1) -> int:
    """Bytes of the filters' and rotary tables' buffers on the device (in the model's dtype e) that `saved` does not
    count under `policy`: all of them under full and every_k; under none and selective those no saved view keeps
    (the float32 copies that 16-bit models multiply by instead)."""
    c, M = shape.d_model // tp, shape.max_seq_len
    kept = policy in ("none", "selective")
    out = 0
    for kind in shape.kinds:
        if kind in ("H", "MR"):
            out += 8 * c  # the filter's channel indices (int64, never cast): its features and decay are computed
        elif kind == "A":
            out += 0 if kept else M * (shape.d_model // shape.n_head) * e  # cos and sin, M x head_dim/2 each
    return out


# Elementwise bytes per token and layer (module docstring), per channel of this rank, bf16 activations: the
# operator eager (common to every kind, then the FFT convolution with the filter's transform, or the direct one) and
# fused (forward, backward), and LI's filter per pole.
OPERATOR_BYTES, FFT_BYTES, FILTER_FFT_BYTES, DIRECT_BYTES = 82, 68, 28, 16
FUSED_OPERATOR_BYTES = (8, 14)
LI_BYTES_PER_POLE = 76


def operator_bytes(shape, kind: str, fused: bool, tp: int = 1) -> dict[str, float]:
    """Bytes per token of one Hyena layer's operator and filter, forward and backward (module docstring)."""
    c, w = shape.d_model / tp, shape.filter_width
    if fused:
        forward, backward = (n * c for n in FUSED_OPERATOR_BYTES)
        if kind == "LI":
            forward, backward = forward + 4 * c, backward + 4 * c
        elif kind == "H":
            forward, backward = forward + 4 * w + 4 * c, backward + 8 * w + 8 * c
        return {"forward": forward, "backward": backward}
    conv = FFT_BYTES + FILTER_FFT_BYTES if shape.by_fft(kind) else DIRECT_BYTES
    forward = (OPERATOR_BYTES + conv) * c
    backward = 2 * forward
    if kind == "LI":
        modal = LI_BYTES_PER_POLE * c * shape.state_size
        forward, backward = forward + modal, backward + 3 * modal
    elif kind == "H":
        forward, backward = forward + 16 * w + 24 * c, backward + 2 * (16 * w + 24 * c)
    return {"forward": forward, "backward": backward}


def elementwise_bytes_per_token(shape, fused: bool, tp: int = 1, forward_runs: int = 1) -> float:
    """Bytes per token moved by elementwise work, FFTs and depthwise convolutions: every block's forward
    `forward_runs` times and its backward once, plus the final norm and the loss (module docstring)."""
    d, f = shape.d_model, shape.d_ff
    attention = transformer_costs.elementwise_bytes(d, f, fused, tp)
    if fused:  # the transformer's fused norms and residual adds, and SwiGLU
        common = {"forward": 16 * d + 6 * f / tp, "backward": 16 * d + 10 * f / tp}
    else:
        common = {"forward": 80 * d + 12 * d + 10 * f / tp, "backward": 144 * d + 18 * d + 18 * f / tp}
    total = 0.0
    for kind in shape.kinds:
        if kind == "A":
            block = attention
        else:
            op = operator_bytes(shape, kind, fused, tp)
            block = {k: common[k] + op[k] for k in common}
        total += forward_runs * block["forward"] + block["backward"]
    return total + transformer_costs.outside_bytes(attention_shape(shape), fused, tp)
