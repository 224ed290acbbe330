"""The transformer's cost model (layer L1, pure arithmetic): its parameter tensors, saved-activation bytes per
checkpointing policy, elementwise bytes and FLOPs, for the planner (planner/) and the FLOP accounting.

The per-block formula is derived from what autograd saves for backward in blocks.py and model.py, tensor by tensor (the
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

Elementwise bytes per token and layer (e = 2 bytes of a bf16 activation, 4 of fp32; d = d_model, f = d_ff; every
kernel reads its inputs and writes its output once, as an unfused elementwise kernel does). "eager" is the block
unfused, as blocks.py was written before its fused paths (RMSNorm as fp32 ops, rotary per q and k, separate
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
replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megagenome.model.transformer import flops

POLICIES = ("none", "selective", "every_k", "full")
KERNELS = ("flash", "math")


@dataclass(frozen=True)
class TransformerShape:
    """The transformer's cost model: its config's shape plus the vocabulary (data-dependent), and the arithmetic the
    planner (planner/) asks every family's cost model for, as methods (the module functions below do the work)."""

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
    """Count attention FLOPs in the causal convention (Megatron-LM, flops.py): a clm model; False for mlm, or to
    reproduce a count that took every score (the Megatron-LM 2019 calibration in tests/test_plan.py)."""
    n_kv_head: int | None = None
    """Key/value heads of grouped-query attention (--model.n_kv_head); None: n_head."""

    @property
    def qkv_rows(self) -> int:
        """Output rows of the fused qkv projection: n_head query heads, n_kv_head key and value heads."""
        return self.d_model + 2 * (self.n_kv_head or self.n_head) * (self.d_model // self.n_head)

    def describe(self) -> str:
        """The shape as `megagenome plan` prints it."""
        kv = f" ({self.n_kv_head} key/value)" if self.n_kv_head not in (None, self.n_head) else ""
        return f"d_model {self.d_model}, {self.n_layer} layers, {self.n_head} heads{kv}, d_ff {self.d_ff}"

    def param_numels(self, tp: int = 1) -> list[int]:
        """Elements of each parameter tensor one of `tp` tensor-parallel ranks holds, in model order."""
        return param_numels(self, tp)

    def param_groups(self, tp: int = 1) -> tuple[list[int], list[int]]:
        """Elements of the parameters in the optimizer's two groups (decay, no decay), in model order."""
        return param_groups(self, tp)

    def param_shapes(self, tp: int = 1) -> list[tuple[tuple[int, ...], bool]]:
        """(shape, is a hidden matrix) of each parameter a rank holds: what optimizer-state bytes depend on."""
        return model_shapes(self.d_model, self.d_ff, self.n_layer, self.padded_vocab, self.tie_embeddings, tp,
                            self.qkv_rows)  # fmt: skip

    def n_params(self, tp: int = 1) -> int:
        return n_params(self, tp)

    def block_params(self, tp: int = 1) -> int:
        """Parameters of the repeated unit (one block): what ZeRO-3 gathers at once and what recomputation reruns."""
        return block_params(self, tp)

    def activation_bytes(self, seq: int, micro: int, policy: str, act_bytes: int, **kwargs) -> dict[str, int]:
        """Saved-activation bytes of one micro batch under a checkpointing policy (activation_bytes)."""
        return activation_bytes(self, seq, micro, policy, act_bytes, **kwargs)

    def flops_per_token(self, seq: int, causal: bool | None = None) -> float:
        """Model FLOPs per token (flops.py), in this shape's convention unless `causal` says otherwise."""
        return flops.flops_per_token(
            n_params(self), self.n_layer, self.d_model, seq, self.causal if causal is None else causal
        )

    def attention_flops_per_token(self, seq: int) -> float:
        """Forward FLOPs per token of the attention cores (what a flash kernel runs), in this shape's convention."""
        return flops.attention_core_forward_flops_per_token(self.n_layer, self.d_model, seq, self.causal)

    def recompute_flops_per_token(self, seq: int, policy: str, early_stop: bool = True) -> float:
        return recompute_flops_per_token(self, seq, policy, early_stop)

    def elementwise_bytes_per_token(self, fused: bool, tp: int = 1, forward_runs: int = 1) -> float:
        """Bytes per token moved by elementwise work (module docstring): every block's forward `forward_runs` times
        (2 when checkpointing reruns it) and its backward once, plus the final norm and the loss."""
        block = elementwise_bytes(self.d_model, self.d_ff, fused, tp)
        return self.n_layer * (forward_runs * block["forward"] + block["backward"]) + outside_bytes(self, fused, tp)

    def tensor_parallel_traffic(self, micro: int, seq: int, act_bytes: int, policy: str) -> tuple[int, int]:
        """(all-reduces per micro batch, bytes each) of tensor parallelism (Megatron's layout,
        parallel/tensor_parallel.py): two forward and two backward per block, two more per recomputed forward."""
        per_layer = 4 + (2 if policy in ("full", "every_k") else 0)
        return self.n_layer * per_layer, micro * seq * self.d_model * act_bytes


def _param_table(shape: TransformerShape, tp: int = 1) -> list[tuple[int, bool]]:
    """(elements one rank holds, is a matrix) of each parameter tensor in model order (tied weights once); matrices
    and the vocabulary-parallel embedding are split over `tp` tensor-parallel ranks, norm scales are replicated."""
    d, f = shape.d_model, shape.d_ff
    out = [(shape.padded_vocab * d // tp, True)]  # token embedding (a vocabulary block under tensor parallelism)
    for _ in range(shape.n_layer):
        out += [(d, False), (shape.qkv_rows * d // tp, True), (d * d // tp, True)]  # attn_norm, qkv, proj
        out += [(d, False), (d * f // tp, True), (d * f // tp, True), (f * d // tp, True)]  # mlp_norm, SwiGLU
    out.append((d, False))  # final norm
    if not shape.tie_embeddings:
        out.append((shape.padded_vocab * d // tp, True))
    return out


def param_numels(shape: TransformerShape, tp: int = 1) -> list[int]:
    """Elements of each parameter tensor one rank holds, in model order."""
    return [n for n, _ in _param_table(shape, tp)]


def n_params(shape: TransformerShape, tp: int = 1) -> int:
    return sum(param_numels(shape, tp))


def param_groups(shape: TransformerShape, tp: int = 1) -> tuple[list[int], list[int]]:
    """Elements of the parameters in the optimizer's two groups, in model order, as DNATransformer.param_groups
    builds them: matrices (embedding, linears; weight decay) and vectors (norm scales; no decay)."""
    table = _param_table(shape, tp)
    return [n for n, matrix in table if matrix], [n for n, matrix in table if not matrix]


def block_params(shape: TransformerShape, tp: int = 1) -> int:
    d, f = shape.d_model, shape.d_ff
    return 2 * d + ((shape.qkv_rows + d) * d + 3 * d * f) // tp


def block_terms(
    shape: TransformerShape,
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
    shape: TransformerShape,
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


def recompute_flops_per_token(shape: TransformerShape, seq: int, policy: str, early_stop: bool = True) -> float:
    """Extra FLOPs per token that recomputation adds: flops.recompute_flops_per_token (the one formula, also
    behind every run's HFU) for this shape, in its convention (shape.causal); early_stop: torch's checkpoint (the
    default without an activation_checkpointing block in the DeepSpeed JSON) skips the last w_down of each
    segment."""
    return flops.recompute_flops_per_token(
        n_params(shape),
        shape.n_layer,
        shape.d_model,
        seq,
        policy,
        block_params(shape),
        d_ff=shape.d_ff,
        early_stop=early_stop,
        dropout=shape.dropout,
        causal=shape.causal,
    )


def model_shapes(
    d_model: int, d_ff: int, n_layer: int, padded_vocab: int, tied: bool, tp: int = 1, qkv_rows: int | None = None
) -> list:
    """(shape, is a hidden matrix) of each parameter a rank holds, as DNATransformer builds them (tied once);
    qkv_rows: the fused projection's output rows (default 3 d_model, multi-head attention)."""
    d, f = d_model, d_ff
    qkv = 3 * d if qkv_rows is None else qkv_rows
    out = [((padded_vocab // tp, d), False)]
    block = [((d,), False), ((qkv // tp, d), True), ((d, d // tp), True), ((d,), False)]
    block += [((f // tp, d), True), ((f // tp, d), True), ((d, f // tp), True)]
    out += block * n_layer + [((d,), False)]
    return out if tied else out + [((padded_vocab // tp, d), False)]


LOSS_BYTES_PER_VOCAB = 32  # bf16 logits 2 + fp32 copy 2 + 4, log-softmax 8, its gradient 8 + cast back 8


def elementwise_bytes(d: int, f: int, fused: bool, tp: int = 1) -> dict[str, float]:
    """Bytes per token and layer moved by the block's elementwise work (module docstring), forward and backward:
    replicated (norms, residual adds) plus sharded over tensor-parallel ranks (rotary, layout copies, SwiGLU)."""
    if fused:
        forward, backward = 16 * d + (8 * d + 6 * f) / tp, 16 * d + (8 * d + 10 * f) / tp
    else:
        forward = 80 * d + 12 * d + (36 * d + 4 * d + 10 * f) / tp
        backward = 144 * d + 18 * d + (40 * d + 12 * d + 4 * d + 18 * f) / tp
    return {"forward": forward, "backward": backward}


def outside_bytes(shape: TransformerShape, fused: bool, tp: int = 1) -> float:
    """Bytes per token of the final norm and the loss (forward and backward)."""
    norm = 16 * shape.d_model if fused else 112 * shape.d_model
    return norm + LOSS_BYTES_PER_VOCAB * shape.padded_vocab / tp
