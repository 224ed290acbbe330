"""The gpn family's cost model (layer L1, pure arithmetic): its dilation schedule, parameter tensors, FLOPs,
saved-activation and elementwise bytes, for the planner (planner/) and the FLOP accounting behind MFU.

With d = d_model, f = d_ff, V the padded vocabulary (8 rows for DNA), k_i and r_i block i's kernel and dilation:

Parameters, in model order (GPNLM.named_parameters; the one-hot embedding has none): per block its conv norm (d),
the convolution (d, d, k_i), conv_out (d, d), the feed-forward's norm (d), ffn_up (f, d) and ffn_down (d, f); the
final norm (d); the head's dense (d, d), its norm (d) and the decoder (V, d), the one vocabulary matrix. Weight
decay as BlockStack.param_groups: matrices and the convolutions decay, norm scales not. No tensor parallelism yet
(family.py refuses it): every method takes tp = 1 only.

FLOPs per token, forward (a multiply-accumulate is 2 FLOPs; training = 3 x forward, as 6N counts it: every weight
does exactly one multiply-accumulate per token here, so 6N is exact up to the norm scales), all counted by
torch.utils.flop_counter.FlopCounterMode (tests/test_gpn_costs.py checks it exactly):

    block i   2 d^2 k_i (the convolution: every position reads k_i taps of d channels into d, the zero padding of
              "same" included), 2 d^2 (conv_out), 4 d f (ffn_up, ffn_down)
    head      2 d^2 (dense) + 2 d V (decoder)

There is no attention: both FLOP conventions (causal and every score) are the same number. Recomputation:
selective reruns each block's convolution (2 d^2 k_i; its norm and GELU are elementwise); full and every_k rerun
every block, less each segment's last ffn_down when dropout is 0 (torch's checkpoint stops early: nothing of the
segment saves that matmul's output).

Saved activations of one block without checkpointing (the bytes a torch.autograd.graph.saved_tensors_hooks count
sees on the real model, one count per storage, parameters excluded; measured on CPU, tests/test_gpn_costs.py),
with b the micro batch, s the sequence length, N = b s d, e the activation element size, m a dropout mask's:

    2 LayerNorms    2 x (N e + 2 b s e)     input, mean and 1/std (CUDA keeps the two statistics in float32:
                                            4 b s more per norm under 16-bit, under 1/d of the norm)
    conv input      b d (s + p) e           the normalised input transposed to (B, d, T), a copy; p = 1 when
                                            r (k - 1) is odd (an even kernel at an odd dilation): torch then
                                            zero-pads a copy for "same", else 0
    GELU input      N e                     the convolution's output
    conv_out input  N e                     GELU's output, in the convolution's (B, d, T) layout, copied to rows
    ffn_up input    N e                     the second norm's output
    feed-forward    2 b s f e               GELU's input and ffn_down's input
    dropout masks   2 N m                   the two residual dropouts when dropout > 0 (m = e on CPU, 1 on CUDA)

Selective checkpointing reruns the convolution branch's norm, convolution and GELU, keeping its input (the block
input, which the norm keeps anyway) and GELU's output (conv_out's input): the conv input, the GELU input and the
first norm's statistics are not kept. full keeps each block's input (N e), every_k each segment's. Outside the blocks:
the final norm (N e + 2 b s e), the head's dense input, GELU input, norm (N e + 2 b s e) and decoder input (N e
each), the float32 log-softmax of the vocab_size logits (4 b s vocab), labels (8 b s), loss weights (4 b s) and two
float32 scalars; the one-hot lookup keeps nothing (its identity table needs no gradient). Transient: the recomputed
segment plus the loss working set, as the transformer's. module_buffers: the one-hot identity, V x d in e.

Elementwise bytes per token and layer (bf16, each kernel reads its inputs and writes its output once; an assumption
per op, as the transformer's, not measured). Eager: the two LayerNorms 2 x 4d forward and 2 x 6d backward, the layout
copies around the convolution 8d each way, GELU 4d + 4f forward and 6d + 6f backward, the residual adds 12d forward
and their gradient sums 12d backward: 32d + 4f forward, 38d + 6f backward. Fused (what a fused block would move:
add + LayerNorm in one kernel, the convolution reading and writing rows; gpn has no fused path today): 20d + 4f
forward, 22d + 6f backward. Outside: the final norm and the head's GELU and norm, 30d, and the loss, the
transformer's LOSS_BYTES_PER_VOCAB per vocabulary row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megagenome.config import ModelConfig
from megagenome.model.gpn.config import d_ff
from megagenome.model.param_table import ParamTable
from megagenome.model.stack import padded_vocab_size
from megagenome.model.transformer.costs import LOSS_BYTES_PER_VOCAB, POLICIES
from megagenome.model.vocabulary import table_rows

# Elementwise bytes per token and layer (module docstring): (d, f) coefficients, forward and backward.
EAGER_BYTES = {"forward": (32, 4), "backward": (38, 6)}
FUSED_BYTES = {"forward": (20, 4), "backward": (22, 6)}
OUTSIDE_BYTES_PER_WIDTH = 30


def dilations(cfg: ModelConfig) -> list[int]:
    """GPN's dilation schedule (gpn.modules.get_dilation_schedule): block i convolves at dilation
    min(dilation_max, dilation_base ** ((i mod dilation_cycle) // dilation_double_every))."""
    return [
        min(cfg.dilation_max, cfg.dilation_base ** ((i % cfg.dilation_cycle) // cfg.dilation_double_every))
        for i in range(max(cfg.n_layer, 0))
    ]


def kernels(cfg: ModelConfig) -> list[int]:
    """Each block's kernel: first_kernel_size for block 0, kernel_size after (GPN's rest_kernel_size)."""
    return [cfg.first_kernel_size if i == 0 else cfg.kernel_size for i in range(max(cfg.n_layer, 0))]


def receptive_field(kernel_sizes, dilation_schedule) -> int:
    """Bases one output position sees: 1 + sum over blocks of dilation x (kernel - 1)."""
    return 1 + sum(r * (k - 1) for k, r in zip(kernel_sizes, dilation_schedule, strict=True))


@dataclass(frozen=True)
class GPNShape(ParamTable):
    """The gpn family's cost model: the config's shape plus the vocabulary (data-dependent)."""

    d_model: int
    d_ff: int
    kernels: tuple[int, ...]
    dilations: tuple[int, ...]
    vocab_size: int
    padded_vocab: int
    max_seq_len: int = 1024
    dropout: float = 0.0
    family: str = "gpn"

    @classmethod
    def of(cls, cfg: ModelConfig, vocab_size: int) -> GPNShape:
        return cls(
            d_model=cfg.d_model,
            d_ff=d_ff(cfg),
            kernels=tuple(kernels(cfg)),
            dilations=tuple(dilations(cfg)),
            vocab_size=vocab_size,
            padded_vocab=padded_vocab_size(table_rows(cfg, vocab_size)),
            max_seq_len=cfg.max_seq_len,
            dropout=cfg.dropout,
        )

    @property
    def n_layer(self) -> int:
        return len(self.kernels)

    @property
    def receptive_field(self) -> int:
        return receptive_field(self.kernels, self.dilations)

    def describe(self) -> str:
        """The shape as `megagenome plan` prints it."""
        kernels = "/".join(map(str, dict.fromkeys(self.kernels)))
        return (
            f"gpn: d_model {self.d_model}, {self.n_layer} conv blocks (kernels {kernels}, dilations up to "
            f"{max(self.dilations, default=1)}), d_ff {self.d_ff}, receptive field {self.receptive_field:,} bases"
        )

    # ----- parameters ----------------------------------------------------------------------------------------------

    def block_table(self, i: int, tp: int = 1) -> list[tuple[tuple[int, ...], bool]]:
        """(shape one of `tp` tensor-parallel ranks holds, decays) of block i's parameters in model order: the
        convolution's and ffn_up's output channels, conv_out's and ffn_down's inputs split (model.py)."""
        d, f = self.d_model, self.d_ff
        conv = [((d,), False), ((d // tp, d, self.kernels[i]), True), ((d, d // tp), True)]
        return [*conv, ((d,), False), ((f // tp, d), True), ((d, f // tp), True)]

    def param_table(self, tp: int = 1) -> list[tuple[tuple[int, ...], bool, bool]]:
        """(shape, decays, is a vocabulary matrix) of each parameter tensor in model order (module docstring)."""
        d = self.d_model
        out = [(s, decays, False) for i in range(self.n_layer) for s, decays in self.block_table(i, tp)]
        out += [((d,), False, False), ((d, d), True, False), ((d,), False, False)]  # replicated head transform
        return [*out, ((self.padded_vocab // tp, d), True, True)]

    def block_params(self, tp: int = 1) -> int:
        """Parameters of the largest block (what ZeRO-3 gathers at once): the one with the longest kernel."""
        return max((sum(math.prod(s) for s, _ in self.block_table(i, tp)) for i in range(self.n_layer)), default=0)

    # ----- FLOPs ---------------------------------------------------------------------------------------------------

    def block_forward_flops(self, i: int) -> float:
        """Forward FLOPs per token of block i: the convolution, conv_out, the feed-forward."""
        d = self.d_model
        return 2.0 * d * d * self.kernels[i] + 2.0 * d * d + 4.0 * d * self.d_ff

    def head_forward_flops(self) -> float:
        return 2.0 * self.d_model * (self.d_model + self.padded_vocab)

    def forward_flops_per_token(self, seq: int) -> float:
        """Forward FLOPs per token (module docstring); no term depends on the sequence length."""
        return sum(self.block_forward_flops(i) for i in range(self.n_layer)) + self.head_forward_flops()

    def flops_per_token(self, seq: int, causal: bool | None = None) -> float:
        """Training FLOPs per token (3 x forward); no attention, so either convention gives the same."""
        return 3.0 * self.forward_flops_per_token(seq)

    def attention_flops_per_token(self, seq: int) -> float:
        return 0.0

    def recompute_flops_per_token(self, seq: int, policy: str, early_stop: bool = True, every: int = 1) -> float:
        """Forward FLOPs per token that --model.checkpointing reruns in backward (module docstring)."""
        d = self.d_model
        if policy == "none":
            return 0.0
        if policy == "selective":
            return sum(2.0 * d * d * k for k in self.kernels)
        extra = sum(self.block_forward_flops(i) for i in range(self.n_layer))
        if early_stop and self.dropout == 0:
            segments = self.n_layer if policy == "full" else math.ceil(self.n_layer / every)
            extra -= segments * 2.0 * d * self.d_ff
        return extra

    def run_flops(
        self, seq: int, policy: str, early_stop: bool, pipeline: bool, every: int = 1
    ) -> tuple[float, float, float, float]:
        """(model FLOPs per token causal, with every score counted, hardware FLOPs in the same two conventions) of a
        run at seq (model/family.py run_flops): the two conventions agree; pipeline: stages rerun the forward."""
        model = self.flops_per_token(seq)
        hardware = model + self.recompute_flops_per_token(seq, policy, early_stop, every)
        hardware += self.forward_flops_per_token(seq) if pipeline else 0.0
        return model, model, hardware, hardware

    # ----- activation and elementwise bytes ------------------------------------------------------------------------

    def block_terms(
        self, i: int, seq: int, micro: int, e: int, mask_bytes: int | None = None, tp: int = 1
    ) -> dict[str, int]:
        """Bytes block i saves for backward without checkpointing, term by term (module docstring); under tensor
        parallelism the convolution's output (GELU's input and output) and the feed-forward hold 1 / tp."""
        b, s, d = micro, seq, self.d_model
        n, m = b * s * d, e if mask_bytes is None else mask_bytes
        pad = self.dilations[i] * (self.kernels[i] - 1) % 2
        return {
            "norms": 2 * (n * e + 2 * b * s * e),
            "conv_input": b * d * (s + pad) * e,
            "gelu_input": n * e // tp,
            "conv_out_input": n * e // tp,
            "ffn_up_input": n * e,
            "feed_forward": 2 * b * s * self.d_ff * e // tp,
            "dropout_masks": 2 * n * m if self.dropout > 0 else 0,
        }

    def block_bytes(
        self, i: int, seq: int, micro: int, e: int, mask_bytes: int | None = None, tp: int = 1
    ) -> tuple[int, int]:
        """(what block i saves without checkpointing, what it keeps under selective checkpointing)."""
        terms = self.block_terms(i, seq, micro, e, mask_bytes, tp)
        dropped = terms["conv_input"] + terms["gelu_input"] + 2 * micro * seq * e  # and the first norm's statistics
        return sum(terms.values()), sum(terms.values()) - dropped

    def outside_bytes(self, seq: int, micro: int, e: int) -> int:
        """Saved bytes outside the blocks: final norm, head, loss (module docstring)."""
        b, s = micro, seq
        n = b * s * self.d_model
        return 5 * n * e + 4 * b * s * e + 4 * b * s * self.vocab_size + 8 * b * s + 4 * b * s + 8

    def activation_bytes(
        self, seq: int, micro: int, policy: str, act_bytes: int, every: int = 2, mask_bytes: int | None = None,
        tp: int = 1, **_kernel,
    ) -> dict[str, int]:  # fmt: skip
        """Saved-activation bytes of one micro batch under a checkpointing policy, and the backward's transient: the
        transformer's keys (block, block_kept, outside, saved, transient) and module_buffers (module docstring).
        The attention kernel arguments the planner passes every family (kernel, math_bytes) do not apply."""
        if policy not in POLICIES:
            raise ValueError(f"checkpointing policy {policy!r}: must be one of {', '.join(POLICIES)}")
        e, layers = act_bytes, self.n_layer
        per_block = [self.block_bytes(i, seq, micro, e, mask_bytes, tp) for i in range(layers)]
        blocks = [full for full, _ in per_block]
        block_input = micro * seq * self.d_model * e
        kept = {
            "none": sum(blocks),
            "selective": sum(kept for _, kept in per_block),
            "full": layers * block_input,
            "every_k": math.ceil(layers / every) * block_input,
        }[policy]
        outside = self.outside_bytes(seq, micro, e)
        size = every if policy == "every_k" else 1
        segment = max((sum(blocks[i : i + size]) for i in range(0, layers, size)), default=0)
        loss_work = micro * seq * self.padded_vocab * (e + 4 + 4)  # logits, their float32 copy, its gradient
        return {
            "block": max(blocks, default=0),
            "block_kept": kept // max(layers, 1),
            "outside": outside,
            "saved": kept + outside,
            "transient": segment + loss_work,
            "module_buffers": self.padded_vocab * self.d_model * e,
        }

    def elementwise_bytes_per_token(self, fused: bool, tp: int = 1, forward_runs: int = 1) -> float:
        """Bytes per token moved by elementwise work: every block's forward `forward_runs` times and its backward
        once, plus the final norm, the head's transform and the loss (module docstring). Under tensor parallelism
        the GELUs' work (4d + 4f forward, 6d + 6f backward) is 1 / tp per rank; norms, copies and adds stay whole."""
        d, f = self.d_model, self.d_ff
        rates = FUSED_BYTES if fused else EAGER_BYTES
        gelu = {"forward": 4, "backward": 6}
        forward, backward = ((a - gelu[k]) * d + (gelu[k] * d + c * f) / tp for k, (a, c) in rates.items())
        outside = OUTSIDE_BYTES_PER_WIDTH * d + LOSS_BYTES_PER_VOCAB * self.padded_vocab
        return self.n_layer * (forward_runs * forward + backward) + outside

    def tensor_parallel_traffic(self, micro: int, seq: int, act_bytes: int, policy: str) -> tuple[int, int]:
        """(all-reduces per micro batch, bytes each): Megatron's MLP layout twice per block, two forward (conv_out,
        ffn_down) and two backward (the convolution's and ffn_up's input gradients), two more per recomputed
        forward (full, every_k; selective reruns the convolution only); each of b x s x d. The decoder's input
        gradient and logit gather, once per micro batch, are left out."""
        per_layer = 4 + (2 if policy in ("full", "every_k") else 0)
        return self.n_layer * per_layer, micro * seq * self.d_model * act_bytes
