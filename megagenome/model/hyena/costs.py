"""The Hyena families' cost model (layer L1, pure arithmetic): parameters and FLOPs per token of each operator, for
the planner (planner/) and the FLOP accounting behind MFU.

FLOPs per token (a multiply-accumulate is 2 FLOPs; training = forward + backward = 3 x forward for every term, as the
transformer's 6N counts a weight's matmul, model/transformer/flops.py), with d = d_model, f = d_ff, T the sequence
length, n = 2T the FFT length:

    projections   2 x (3d^2 + d^2) forward: in_proj and out_proj of every Hyena layer (an attention layer's qkv and
                  proj are the same 4d^2); the SwiGLU MLP 2 x 3df; the LM head 2 x d x padded vocabulary (the
                  embedding is a lookup; it is counted only when it is the tied head, as the transformer's 6N does)
    featurizer    2 x 3d x short_filter_len: the depthwise causal convolution over the 3d projected channels
    SE, MR        2 x d x filter length: a direct causal convolution per channel
    H, LI by FFT  per channel, a real FFT of the input and an inverse one, 2.5 n log2 n FLOPs each (the split-radix
                  count, 5/2 n log2 n for a real transform of length n), and the spectrum product, 6 FLOPs per
                  complex multiply over n/2 + 1 bins, divided over the T tokens: (5 n log2 n + 6 (n/2 + 1)) d / T.
                  The filter's own transform, once per micro batch and channel, is counted per sequence (for a
                  micro batch of 1, an upper bound): 2.5 n log2 n d / T
    filters       per micro batch: LI's modal sum, 10 FLOPs per channel, pole and tap (two exponentials' worth of
                  work counted as 4, a cos and a sin as 4, the real part's products and sum 2); H's MLP,
                  2 x (5w + w^2 + w d) per position plus its decay product d; both per sequence
    gating        x1 . v, D u, + and . x2: 4d elementwise, not counted (as norms and residuals are not)
    attention     the transformer's cores, 2 x 2dT forward per attention layer counting every score, half causal

so the O(T log T) of a long convolution against attention's O(T^2) is in the count itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megagenome.config import ModelConfig, d_ff, layer_kinds
from megagenome.model.stack import padded_vocab_size
from megagenome.model.transformer import flops as transformer_flops

POSITION_FEATURES = 5  # operators.py: the implicit filter's input features


@dataclass(frozen=True)
class HyenaShape:
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

    @classmethod
    def of(cls, cfg: ModelConfig, vocab_size: int) -> HyenaShape:
        return cls(
            family=cfg.family,
            kinds=tuple(layer_kinds(cfg)),
            d_model=cfg.d_model,
            n_head=cfg.n_head,
            d_ff=d_ff(cfg),
            vocab_size=vocab_size,
            padded_vocab=padded_vocab_size(vocab_size),
            short_filter_len=cfg.short_filter_len,
            se_filter_len=cfg.se_filter_len,
            mr_filter_len=cfg.mr_filter_len,
            state_size=cfg.state_size,
            filter_width=cfg.filter_width,
            tie_embeddings=cfg.tie_embeddings,
            max_seq_len=cfg.max_seq_len,
            dropout=cfg.dropout,
        )

    @property
    def n_layer(self) -> int:
        return len(self.kinds)

    @property
    def n_attention(self) -> int:
        return self.kinds.count("A")

    def describe(self) -> str:
        """The shape as `megagenome plan` prints it."""
        counts = ", ".join(f"{self.kinds.count(k)} {k}" for k in ("H", "SE", "MR", "LI", "A") if k in self.kinds)
        return f"{self.family}: d_model {self.d_model}, {self.n_layer} layers ({counts}), d_ff {self.d_ff}"

    # ----- FLOPs ---------------------------------------------------------------------------------------------------

    def matmul_params(self) -> int:
        """Weights that take part in one matmul per token: projections, MLPs, the LM head (module docstring)."""
        d = self.d_model
        return self.n_layer * (4 * d * d + 3 * d * self.d_ff) + self.padded_vocab * d

    def operator_forward_flops(self, kind: str, seq: int) -> dict[str, float]:
        """Forward FLOPs per token of one layer's mixer beyond its projections, by term (module docstring)."""
        d = self.d_model
        if kind == "A":
            return {"attention": transformer_flops.attention_core_forward_flops_per_token(1, d, seq, self.causal)}
        out = {"featurizer": 2.0 * 3 * d * self.short_filter_len}
        if kind in ("SE", "MR"):
            out["direct_conv"] = 2.0 * d * (self.se_filter_len if kind == "SE" else self.mr_filter_len)
            return out
        n = 2 * seq
        fft = 2.5 * n * math.log2(n)
        out["fft_conv"] = (2 * fft + 6.0 * (n // 2 + 1)) * d / seq + fft * d / seq
        if kind == "LI":
            out["filter"] = 10.0 * d * self.state_size
        else:
            w = self.filter_width
            out["filter"] = 2.0 * (POSITION_FEATURES * w + w * w + w * d) + d
        return out

    def forward_flops_per_token(self, seq: int) -> float:
        """Forward FLOPs per token of the whole model at sequence length seq."""
        mixers = sum(sum(self.operator_forward_flops(k, seq).values()) for k in self.kinds)
        return 2.0 * self.matmul_params() + mixers

    def flops_per_token(self, seq: int, causal: bool | None = None) -> float:
        """Training FLOPs per token (3 x forward), attention in this shape's convention unless `causal` says."""
        shape = self if causal is None or causal == self.causal else _with_causal(self, causal)
        return 3.0 * shape.forward_flops_per_token(seq)

    def attention_flops_per_token(self, seq: int) -> float:
        """Forward FLOPs per token of the attention cores (the striped attention layers)."""
        return transformer_flops.attention_core_forward_flops_per_token(
            self.n_attention, self.d_model, seq, self.causal
        )

    def block_forward_flops(self, kind: str, seq: int) -> float:
        """Forward FLOPs per token of one block: projections, MLP and mixer."""
        d = self.d_model
        return 2.0 * (4 * d * d + 3 * d * self.d_ff) + sum(self.operator_forward_flops(kind, seq).values())

    def recompute_flops_per_token(self, seq: int, policy: str, early_stop: bool = True, every: int = 1) -> float:
        """Forward FLOPs per token that --model.checkpointing reruns in backward: full and every_k rerun every block
        (early_stop: torch's checkpoint skips each segment's last w_down when there is no dropout), selective reruns
        each Hyena layer's long convolution (and each attention core)."""
        d = self.d_model
        if policy == "none":
            return 0.0
        if policy == "selective":
            core = ("fft_conv", "direct_conv", "attention")
            return sum(
                sum(v for k, v in self.operator_forward_flops(kind, seq).items() if k in core) for kind in self.kinds
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
            shape = _with_causal(self, causal)
            model = shape.flops_per_token(seq)
            rerun = shape.recompute_flops_per_token(seq, policy, early_stop, every)
            if pipeline:
                rerun += shape.forward_flops_per_token(seq)
            out.append((model, model + rerun))
        return out[0][0], out[1][0], out[0][1], out[1][1]


def _with_causal(shape: HyenaShape, causal: bool) -> HyenaShape:
    from dataclasses import replace

    return replace(shape, causal=causal)
