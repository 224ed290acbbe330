"""The Hyena families' cost model (layer L1, pure arithmetic): parameter tensors and FLOPs per token of each
operator, for the planner (planner/) and the FLOP accounting behind MFU; activation and elementwise bytes are
activations.py's (HyenaShape's methods delegate to it).

Parameters, in model order (HyenaLM.named_parameters; tied head once), with d = d_model, f = d_ff, k =
short_filter_len, w = filter_width, S = state_size and t the tensor-parallel degree: the embedding (V/t, d); per
Hyena block its norm (d), the featurizer's taps (3d/t, k), D (d/t), in_proj (3d/t, d), the filter, out_proj (d, d/t),
the MLP's norm (d) and SwiGLU (f/t, d) x 2 + (d, f/t); per attention block the transformer's; the final norm (d).
Filters: SE and MR (d/t, filter length); LI log_rate and theta (d/t, S) and residues (d/t, S, 2); H the MLP
Linear(5, w) + bias, freq (1, w), Linear(w, w) + bias, freq (1, w), replicated, and its column-parallel out (d/t, w).
Weight decay as BlockStack.param_groups: matrices decay, vectors and every filter parameter (no_weight_decay) not.

FLOPs per token (a multiply-accumulate is 2 FLOPs; training = forward + backward = 3 x forward for every term, as the
transformer's 6N counts a weight's matmul, model/transformer/flops.py), with T the sequence length and n = 2T the
FFT length; "counted" marks what torch.utils.flop_counter.FlopCounterMode sees on the real model's forward
(mm, addmm, bmm, convolution; tests/test_hyena_costs.py checks those terms against it exactly):

    projections   2 x (3d^2 + d^2) forward: in_proj and out_proj of every Hyena layer (an attention layer's qkv and
                  proj are the same 4d^2); the SwiGLU MLP 2 x 3df; the LM head 2 x d x padded vocabulary (the
                  embedding is a lookup; it is counted only when it is the tied head, as the transformer's 6N does)
                  (counted)
    featurizer    2 x 3d x k: the depthwise causal convolution over the 3d projected channels (counted)
    SE, MR        at most DIRECT_MAX_TAPS taps (operators.py; SE's 7): 2 x d x taps, a direct causal convolution
                  per channel, every tap, also those past T (counted); longer (MR's 128): by FFT, as H and LI
    by FFT        per channel a real FFT of the input and an inverse one, 2.5 n log2 n FLOPs each (FFTW's
                  convention for a real transform of length n), and the spectrum product, 6 FLOPs per complex
                  multiply over n/2 + 1 bins, divided over the T tokens: (5 n log2 n + 6 (n/2 + 1)) d / T; the
                  filter's own transform (of its taps zero-padded to n), 2.5 n log2 n d / T (FlopCounterMode
                  counts no FFT: the test records the transforms and products that run and prices them with this
                  convention)
    filters       H's MLP over the T positions, 2 x (5w + w^2 + w d) per position (counted), and its decay
                  product, d; LI's modal sum, 10 FLOPs per channel, pole and position (two exponentials' worth of
                  work counted as 4, a cos and a sin as 4, the real part's products and sum 2), elementwise, not
                  counted; its kernel (operators.py _ModalKernel) reruns it in backward, which is not counted as
                  recomputation either (10dS per position: 0.3% of an LI block's FLOPs at Evo 2 1B's shape); MR's
                  decay product, d x taps per micro batch, left out
    gating        x1 . v, D u, + and . x2: 4d elementwise, not counted (as norms and residuals are not)
    attention     the transformer's cores, 2 x 2dT forward per attention layer counting every score, half causal
                  (counted with SDPA's flop formula)

Per sequence: the filters and the filter's transform are computed once per micro batch, whatever its size b, and
are counted per sequence, i.e. for b = 1 (an upper bound by (b - 1)/b of those terms; a micro batch of b runs
forward_flops_per_token - (1 - 1/b) per_micro_batch_flops per token). So the O(T log T) of a long convolution
against attention's O(T^2) is in the count itself.

6N against this count: a direct convolution's taps, the featurizer's and the H filter MLP's weights each do one
multiply-accumulate per token (per position), so 6N, which planner/breakdown.py prices at the matmul rate, holds them
exactly; it prices an MR filter by FFT as the direct convolution of its taps (2 x 128 d forward, where the
transforms do about 15 log2(2T) d: 216d at 8k, 276d at 131k) and LI's 4S parameters per channel for its 10S
elementwise FLOPs; the FFTs' bytes are in the elementwise term too (activations.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megagenome.config import ModelConfig, d_ff
from megagenome.model.hyena import activations
from megagenome.model.hyena.config import layer_kinds
from megagenome.model.hyena.operators import DIRECT_MAX_TAPS
from megagenome.model.param_table import ParamTable
from megagenome.model.stack import padded_vocab_size
from megagenome.model.transformer import flops as transformer_flops
from megagenome.model.vocabulary import table_rows

POSITION_FEATURES = 5  # operators.py: the implicit filter's input features
# Forward terms of operator_forward_flops that FlopCounterMode counts (matmuls and convolutions), that a selective
# checkpoint reruns (the operator's core: the long convolution and D u, the attention core), and that are computed
# once per micro batch (counted per sequence).
COUNTED_TERMS = ("featurizer", "direct_conv", "filter_mlp", "attention")
CORE_TERMS = ("fft_conv", "filter_fft", "direct_conv", "attention")
PER_MICRO_BATCH_TERMS = ("filter_fft", "filter_mlp", "filter")


@dataclass(frozen=True)
class HyenaShape(ParamTable):
    """The Hyena families' cost model: the config's shape plus the vocabulary (data-dependent)."""

    family: str
    kinds: tuple[str, ...]  # the operator of each layer: H, SE, MR, LI or A
    d_model: int
    n_head: int
    d_ff: int
    vocab_size: int
    padded_vocab: int
    short_filter_len: int
    se_filter_len: int
    mr_filter_len: int
    state_size: int
    filter_width: int
    tie_embeddings: bool = True
    max_seq_len: int = 1024
    dropout: float = 0.0
    causal: bool = True
    mlp_gated: bool = True
    """--model.mlp_gated: three MLP matrices (gate, up, down), or two (HyenaDNA's plain MLP)."""
    filter_inner_layers: int = 1
    """--model.filter_inner_layers: the H filter MLP's width x width layers. (The published forms' biases and LayerNorm
    shifts are vectors this cost model leaves out, and a shared sine it counts once per layer: under 0.1% of a
    model's parameters.)"""

    @classmethod
    def of(cls, cfg: ModelConfig, vocab_size: int) -> HyenaShape:
        return cls(
            family=cfg.family,
            kinds=tuple(layer_kinds(cfg)),
            d_model=cfg.d_model,
            n_head=cfg.n_head,
            d_ff=d_ff(cfg),
            vocab_size=vocab_size,
            padded_vocab=padded_vocab_size(table_rows(cfg, vocab_size)),
            short_filter_len=cfg.short_filter_len,
            se_filter_len=cfg.se_filter_len,
            mr_filter_len=cfg.mr_filter_len,
            state_size=cfg.state_size,
            filter_width=cfg.filter_width,
            tie_embeddings=cfg.tie_embeddings,
            max_seq_len=cfg.max_seq_len,
            dropout=cfg.dropout,
            mlp_gated=cfg.mlp_gated,
            filter_inner_layers=cfg.filter_inner_layers,
        )

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp_gated else 2

    @property
    def n_layer(self) -> int:
        return len(self.kinds)

    @property
    def n_attention(self) -> int:
        return self.kinds.count("A")

    def by_fft(self, kind: str) -> bool:
        """Whether a Hyena layer of `kind` convolves by FFT (operators.py by_fft): H and LI always, SE and MR above
        DIRECT_MAX_TAPS taps."""
        if kind in ("H", "LI"):
            return True
        return kind in ("SE", "MR") and self.taps(kind) > DIRECT_MAX_TAPS

    def taps(self, kind: str) -> int:
        """An explicit filter's length (SE, MR); the implicit ones (H, LI) have as many taps as positions."""
        return self.se_filter_len if kind == "SE" else self.mr_filter_len

    def inference_bytes(self, seq: int, batch: int, act_bytes: int, file_bytes: int, params: int, norm: str,
                        activation: str) -> dict[str, int]:  # fmt: skip
        """One forward's peak memory without autograd (inference_memory.py)."""
        from megagenome.model.hyena.inference_memory import inference_bytes

        return inference_bytes(self, seq, batch, act_bytes, file_bytes, params, norm, activation)

    def describe(self) -> str:
        """The shape as `megagenome plan` prints it."""
        counts = ", ".join(f"{self.kinds.count(k)} {k}" for k in ("H", "SE", "MR", "LI", "A") if k in self.kinds)
        return f"{self.family}: d_model {self.d_model}, {self.n_layer} layers ({counts}), d_ff {self.d_ff}"

    # ----- parameters ----------------------------------------------------------------------------------------------

    def param_table(self, tp: int = 1) -> list[tuple[tuple[int, ...], bool, bool]]:
        """(shape one of `tp` tensor-parallel ranks holds, decays, is a vocabulary matrix) of each parameter tensor in
        model order (module docstring)."""
        return param_table(self, tp)

    def block_params(self, tp: int = 1) -> int:
        """Parameters of the largest block (what ZeRO-3 gathers at once)."""
        return max(sum(math.prod(s) for s in block_param_shapes(self, kind, tp)) for kind in set(self.kinds))

    # ----- activation and elementwise bytes (activations.py) --------------------------------------------------------

    def activation_bytes(self, seq: int, micro: int, policy: str, act_bytes: int, **kwargs) -> dict[str, int]:
        """Saved-activation bytes of one micro batch under a checkpointing policy (activations.activation_bytes)."""
        return activations.activation_bytes(self, seq, micro, policy, act_bytes, **kwargs)

    def elementwise_bytes_per_token(self, fused: bool, tp: int = 1, forward_runs: int = 1) -> float:
        """Bytes per token moved by elementwise work, FFTs and depthwise convolutions included (activations.py):
        every block's forward `forward_runs` times and its backward once, plus the final norm and the loss."""
        return activations.elementwise_bytes_per_token(self, fused, tp, forward_runs)

    def tensor_parallel_traffic(self, micro: int, seq: int, act_bytes: int, policy: str) -> tuple[int, int]:
        """(all-reduces per micro batch, bytes each): as the transformer's, two forward (out_proj or proj, w_down)
        and two backward (in_proj or qkv, w_gate/w_up inputs) per block, two more per recomputed forward. The H
        filter MLP's column-parallel output adds one backward all-reduce of T x filter_width per H layer and micro
        batch, left out (filter_width / (b d) of a block's)."""
        per_layer = 4 + (2 if policy in ("full", "every_k") else 0)
        return self.n_layer * per_layer, micro * seq * self.d_model * act_bytes

    # ----- FLOPs ---------------------------------------------------------------------------------------------------

    def matmul_params(self) -> int:
        """Weights that take part in one matmul per token: projections, MLPs, the LM head (module docstring)."""
        d = self.d_model
        return self.n_layer * (4 * d * d + self.mlp_matrices * d * self.d_ff) + self.padded_vocab * d

    def operator_forward_flops(self, kind: str, seq: int) -> dict[str, float]:
        """Forward FLOPs per token of one layer's mixer beyond its projections, by term (module docstring); the
        PER_MICRO_BATCH_TERMS per sequence."""
        d = self.d_model
        if kind == "A":
            return {"attention": transformer_flops.attention_core_forward_flops_per_token(1, d, seq, self.causal)}
        out = {"featurizer": 2.0 * 3 * d * self.short_filter_len}
        if not self.by_fft(kind):
            out["direct_conv"] = 2.0 * d * self.taps(kind)
            return out
        n = 2 * seq
        fft = 2.5 * n * math.log2(n)  # one real transform of length n, per channel
        out["fft_conv"] = (2 * fft + 6.0 * (n // 2 + 1)) * d / seq
        out["filter_fft"] = fft * d / seq
        if kind in ("SE", "MR"):
            return out
        if kind == "LI":
            out["filter"] = 10.0 * d * self.state_size
        else:
            w = self.filter_width
            out["filter_mlp"] = 2.0 * (POSITION_FEATURES * w + self.filter_inner_layers * w * w + w * d)
            out["filter"] = float(d)
        return out

    def forward_flops_per_token(self, seq: int) -> float:
        """Forward FLOPs per token of the whole model at sequence length seq (micro batch 1 for the per-sequence
        terms: module docstring)."""
        mixers = sum(sum(self.operator_forward_flops(k, seq).values()) for k in self.kinds)
        return 2.0 * self.matmul_params() + mixers

    def per_micro_batch_flops(self, seq: int) -> float:
        """The forward FLOPs per token of forward_flops_per_token that are computed once per micro batch (the
        filters and their transforms), counted per sequence."""
        return sum(
            v for k in self.kinds for t, v in self.operator_forward_flops(k, seq).items() if t in PER_MICRO_BATCH_TERMS
        )

    def flops_per_token(self, seq: int, causal: bool | None = None) -> float:
        """Training FLOPs per token (3 x forward), attention in this shape's convention unless `causal` says."""
        shape = self if causal is None or causal == self.causal else replace(self, causal=causal)
        return 3.0 * shape.forward_flops_per_token(seq)

    def attention_flops_per_token(self, seq: int) -> float:
        """Forward FLOPs per token of the attention cores (the striped attention layers)."""
        return transformer_flops.attention_core_forward_flops_per_token(
            self.n_attention, self.d_model, seq, self.causal
        )

    def block_forward_flops(self, kind: str, seq: int) -> float:
        """Forward FLOPs per token of one block: projections, MLP and mixer."""
        d = self.d_model
        return 2.0 * (4 * d * d + self.mlp_matrices * d * self.d_ff) + sum(
            self.operator_forward_flops(kind, seq).values()
        )

    def recompute_flops_per_token(self, seq: int, policy: str, early_stop: bool = True, every: int = 1) -> float:
        """Forward FLOPs per token that --model.checkpointing reruns in backward: full and every_k rerun every block
        (early_stop: torch's checkpoint skips each segment's last w_down when there is no dropout), selective reruns
        each Hyena layer's core (the long convolution, the filter's transform included, and D u; the filter itself
        and the featurizer run once) and each attention core."""
        d = self.d_model
        if policy == "none":
            return 0.0
        if policy == "selective":
            return sum(
                sum(v for k, v in self.operator_forward_flops(kind, seq).items() if k in CORE_TERMS)
                for kind in self.kinds
            )
        extra = sum(self.block_forward_flops(kind, seq) for kind in self.kinds)
        if early_stop and self.dropout == 0:
            segments = self.n_layer if policy == "full" else math.ceil(self.n_layer / every)
            extra -= segments * 2.0 * d * self.d_ff
        return extra

    def run_flops(
        self, seq: int, policy: str, early_stop: bool, pipeline: bool, every: int = 1
    ) -> tuple[float, float, float, float]:
        """(model FLOPs per token causal, with every score counted, hardware FLOPs in the same two conventions) of a
        run at seq (model/family.py run_flops); pipeline: DeepSpeed's stages rerun the whole forward."""
        out = []
        for causal in (True, False):
            shape = replace(self, causal=causal)
            model = shape.flops_per_token(seq)
            rerun = shape.recompute_flops_per_token(seq, policy, early_stop, every)
            if pipeline:
                rerun += shape.forward_flops_per_token(seq)
            out.append((model, model + rerun))
        return out[0][0], out[1][0], out[0][1], out[1][1]


def filter_param_shapes(shape: HyenaShape, kind: str, tp: int = 1) -> list[tuple[int, ...]]:
    """The parameter shapes of one Hyena layer's filter on one rank, in model order (module docstring)."""
    c, w, S = shape.d_model // tp, shape.filter_width, shape.state_size
    if kind == "H":
        inner = [(w, w), (w,), (1, w)] * shape.filter_inner_layers  # each inner linear with its sine
        return [(w, POSITION_FEATURES), (w,), (1, w), *inner, (c, w)]
    if kind == "LI":
        return [(c, S), (c, S), (c, S, 2)]
    return [(c, shape.se_filter_len if kind == "SE" else shape.mr_filter_len)]


def block_param_table(shape: HyenaShape, kind: str, tp: int = 1) -> list[tuple[tuple[int, ...], bool]]:
    """(shape on one rank, decays) of one block's parameters in model order: a Hyena block (mixer_norm, the
    operator's short_filter, D, in_proj, filter, out_proj, then the MLP) or an attention block (the transformer's)."""
    d, f = shape.d_model, shape.d_ff
    mlp = [((d,), False), *[((f // tp, d), True)] * (shape.mlp_matrices - 1), ((d, f // tp), True)]
    if kind == "A":
        return [((d,), False), ((3 * d // tp, d), True), ((d, d // tp), True), *mlp]
    mixer = [((d,), False), ((3 * d // tp, shape.short_filter_len), False), ((d // tp,), False)]
    mixer.append(((3 * d // tp, d), True))
    mixer += [(s, False) for s in filter_param_shapes(shape, kind, tp)]  # no_weight_decay
    return [*mixer, ((d, d // tp), True), *mlp]


def block_param_shapes(shape: HyenaShape, kind: str, tp: int = 1) -> list[tuple[int, ...]]:
    return [s for s, _ in block_param_table(shape, kind, tp)]


def param_table(shape: HyenaShape, tp: int = 1) -> list[tuple[tuple[int, ...], bool, bool]]:
    """HyenaShape.param_table: embedding, blocks, final norm, untied head."""
    vocab = ((shape.padded_vocab // tp, shape.d_model), True, True)
    out = [vocab]
    for kind in shape.kinds:
        out += [(s, decays, False) for s, decays in block_param_table(shape, kind, tp)]
    out.append(((shape.d_model,), False, False))
    return out if shape.tie_embeddings else [*out, vocab]
