"""The caduceus family's cost model (layer L1, pure arithmetic): parameter tensors, FLOPs per token, recomputation,
activation and elementwise bytes of CaduceusLM, for the planner (planner/) and the FLOP accounting behind MFU.

Parameters, in model order (CaduceusLM.named_parameters; tied head once), with d = d_model, c = ssm_expand x d,
N = state_size, r = dt_rank, k = ssm_conv_len: the embedding (V, d); per block its norm (d), in_proj (2c, d), per
direction (forward, then reverse) the conv taps (c, k) and bias (c), dt_bias (c), A_log (c, N), D (c), x_proj
(r + 2N, c) and dt_proj (c, r), then out_proj (d, c); the final norm (d); the head (V, d) when untied. Weight decay as
BlockStack.param_groups: matrices decay (the conv taps too), vectors and A_log (no_weight_decay) not. ps and post_hoc
have the same parameters.

FLOPs per token of one strand (a multiply-accumulate is 2 FLOPs; training = 3 x forward), "counted" marking what
torch.utils.flop_counter.FlopCounterMode sees on the real forward with the fused scan, the path that runs on CPU and
(mamba_ssm's) on CUDA (tests/test_caduceus_costs.py checks them exactly):

    projections  2 x (2cd + cd) in_proj and out_proj, per direction 2 x (c(r + 2N) + rc) x_proj and dt_proj, the
                 head 2 x d x padded vocabulary (counted)
    conv         per direction 2ck, the depthwise causal convolution (inside the fused CPU kernel, so not counted on
                 CPU; torch's conv1d of the other paths is)
    readout      per direction 2cN, C_t . h_t (inside the fused scan, so not counted; the torch fallback's batched
                 matmul is)
    scan         per direction SCAN_FLOPS_PER_STATE = 6 per channel and state: exp(delta A) 2, delta B u 2 (delta u is
                 per channel), the recurrence's multiply-add 2; and SCAN_FLOPS_PER_CHANNEL = 5 per channel: dt + bias,
                 softplus (2), delta u, D u + (not counted; elementwise). This is the sequential recurrence's work,
                 what the fused kernels do; mambapy's parallel scan (the torch fallback) does about three times as much
    gating       SiLU of the conv output and of z, y * SiLU(z), the two directions' sum (not counted, as norms)

ps runs every term twice (both strands go through the blocks and the head as one batch of 2B); post_hoc's eval-mode
average does too, but training, what the plan prices, runs one strand.

Recomputation: full and every_k rerun every block's forward (early_stop: torch's checkpoint stops once the last
saved tensor is recomputed, so each segment's last out_proj, whose input is saved before it runs, is skipped when
there is no dropout); selective reruns each direction's scan (readout and elementwise work), keeping its inputs.

Activation bytes (what autograd saves with the fused scan; estimated from the tensors of mamba.py, scan.py and
scan_cpu.py, checked against the saved-tensor count within ACTIVATION_TOLERANCE in tests/test_caduceus_costs.py; the
block's terms are exact, the model's differ by the head's views). With b the micro batch (2b under ps), s the
sequence length, M = b*s, e the activation element size: per block the norm 8Md + 4M, in_proj's input Mde and its
u made contiguous once Mce (the fused conv's input, both directions'); per direction the conv + SiLU output Mce
(x_proj's input), x_proj's output M(r + 2N)e, and the scan's float32 internals: A twice 8cN, softplus' input and delta
8Mc, u in float32 4Mc under 16-bit (in float32 it is the conv's output), B and C made contiguous 8MN, the state
checkpoints 4bc ceil(s / SCAN_CHUNK) N (under 16-bit also D's float32 copy 4c, and the conv's of its taps and bias
4c(k + 1)); the gate: in_proj's output 2Mce, the directions' sum, SiLU(z) and out_proj's input 3Mce; dropout's
mask Md*m. Selective checkpointing keeps, of the scan, only dt (Mce) beyond what the block keeps anyway. Full keeps
each block's input (Mde), every_k each segment's; outside: the transformer's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megagenome.config import ModelConfig
from megagenome.model.caduceus.mamba import dt_rank
from megagenome.model.param_table import ParamTable
from megagenome.model.stack import padded_vocab_size
from megagenome.model.transformer import costs as transformer_costs
from megagenome.model.vocabulary import table_rows

POLICIES = transformer_costs.POLICIES
SCAN_FLOPS_PER_STATE = 6
SCAN_FLOPS_PER_CHANNEL = 5
DIRECTIONS = 2
SCAN_CHUNK = 32  # positions between the fused scan's state checkpoints (csrc/selective_scan_cpu.cpp's CHUNK)
ACTIVATION_TOLERANCE = 0.08  # relative; the blocks are exact, the head's views are 6% of a checkpointed total
# Elementwise bytes per token, per inner channel and direction (eager, bf16 activations, float32 scan): pad and conv
# 8c, SiLU 4c, the casts to float32 and softplus 16c, and per state the decay, drive, scan and readout 40 bytes
# (four float32 tensors of (c, N) written and read); backward twice the forward's.
CHANNEL_BYTES, STATE_BYTES = 28, 40


@dataclass(frozen=True)
class CaduceusShape(ParamTable):
    """The caduceus family's cost model: the config's shape plus the vocabulary (data-dependent)."""

    family: str
    rc_equivariance: str
    d_model: int
    n_layer: int
    inner: int  # c = ssm_expand x d_model
    state_size: int
    conv_len: int
    dt_rank: int
    vocab_size: int
    padded_vocab: int
    tie_embeddings: bool = True
    max_seq_len: int = 1024
    dropout: float = 0.0
    causal: bool = False  # no attention: both conventions agree

    @classmethod
    def of(cls, cfg: ModelConfig, vocab_size: int) -> CaduceusShape:
        return cls(
            family=cfg.family,
            rc_equivariance=cfg.rc_equivariance,
            d_model=cfg.d_model,
            n_layer=cfg.n_layer,
            inner=cfg.ssm_expand * cfg.d_model,
            state_size=cfg.state_size,
            conv_len=cfg.ssm_conv_len,
            dt_rank=dt_rank(cfg),
            vocab_size=vocab_size,
            padded_vocab=padded_vocab_size(table_rows(cfg, vocab_size)),
            tie_embeddings=cfg.tie_embeddings,
            max_seq_len=cfg.max_seq_len,
            dropout=cfg.dropout,
        )

    @property
    def strands(self) -> int:
        """Sequences the blocks run per training sequence: 2 under ps (both strands), 1 under post_hoc."""
        return 2 if self.rc_equivariance == "ps" else 1

    def describe(self) -> str:
        return (
            f"{self.family} ({self.rc_equivariance}): d_model {self.d_model}, {self.n_layer} BiMamba layers, "
            f"inner {self.inner}, state {self.state_size}"
        )

    # ----- parameters ----------------------------------------------------------------------------------------------

    def block_table(self, tp: int = 1) -> list[tuple[tuple[int, ...], bool]]:
        """(shape one of `tp` tensor-parallel ranks holds, decays) of one block's parameters in model order (module
        docstring): under tensor parallelism every inner-channel dimension c is c / tp (mamba.py)."""
        d, c, N, r, k = self.d_model, self.inner // tp, self.state_size, self.dt_rank, self.conv_len
        core = [((c, k), True), ((c,), False), ((c,), False), ((c, N), False), ((c,), False)]
        core += [((r + 2 * N, c), True), ((c, r), True)]  # a module's own parameters come before its submodules'
        return [((d,), False), ((2 * c, d), True), *core * DIRECTIONS, ((d, c), True)]

    def param_table(self, tp: int = 1) -> list[tuple[tuple[int, ...], bool, bool]]:
        """(shape, decays, is a vocabulary matrix) of each parameter tensor in model order."""
        vocab = ((self.padded_vocab // tp, self.d_model), True, True)  # vocabulary-parallel
        out = [vocab]
        for _ in range(self.n_layer):
            out += [(s, decays, False) for s, decays in self.block_table(tp)]
        out.append(((self.d_model,), False, False))
        return out if self.tie_embeddings else [*out, vocab]

    def block_params(self, tp: int = 1) -> int:
        return sum(math.prod(s) for s, _ in self.block_table(tp))

    # ----- FLOPs ---------------------------------------------------------------------------------------------------

    def block_forward_terms(self) -> dict[str, float]:
        """Forward FLOPs per token (one strand) of one block, by term (module docstring)."""
        d, c, N, r, k = self.d_model, self.inner, self.state_size, self.dt_rank, self.conv_len
        return {
            "projections": 2.0 * (3 * c * d + DIRECTIONS * (c * (r + 2 * N) + r * c)),
            "conv": DIRECTIONS * 2.0 * c * k,
            "readout": DIRECTIONS * 2.0 * c * N,
            "scan": DIRECTIONS * float(SCAN_FLOPS_PER_STATE * c * N + SCAN_FLOPS_PER_CHANNEL * c),
        }

    def counted_forward_flops_per_token(self) -> float:
        """The forward FLOPs per training token that FlopCounterMode counts on CPU (the matmuls; not the conv nor
        the readout, which run inside the fused kernels)."""
        terms = self.block_forward_terms()
        block = terms["projections"]
        return self.strands * (self.n_layer * block + 2.0 * self.d_model * self.padded_vocab)

    def forward_flops_per_token(self, seq: int) -> float:
        """Forward FLOPs per training token, every term (independent of seq: the scan is linear in T)."""
        terms = self.block_forward_terms()
        fused = terms["conv"] + terms["readout"] + terms["scan"]
        return self.counted_forward_flops_per_token() + self.strands * self.n_layer * fused

    def flops_per_token(self, seq: int, causal: bool | None = None) -> float:
        """Training FLOPs per token (3 x forward); no attention, so both conventions agree."""
        return 3.0 * self.forward_flops_per_token(seq)

    def attention_flops_per_token(self, seq: int) -> float:
        return 0.0

    def recompute_flops_per_token(self, seq: int, policy: str, early_stop: bool = True, every: int = 1) -> float:
        """Forward FLOPs per token that --model.checkpointing reruns in backward (module docstring)."""
        if policy == "none":
            return 0.0
        terms = self.block_forward_terms()
        if policy == "selective":
            return self.strands * self.n_layer * (terms["readout"] + terms["scan"])
        extra = self.n_layer * sum(terms.values())
        if early_stop and self.dropout == 0:
            segments = self.n_layer if policy == "full" else math.ceil(self.n_layer / every)
            extra -= segments * 2.0 * self.inner * self.d_model
        return self.strands * extra

    def run_flops(
        self, seq: int, policy: str, early_stop: bool, pipeline: bool, every: int = 1
    ) -> tuple[float, float, float, float]:
        """(model FLOPs per token, the same with every score counted, hardware FLOPs in both conventions): no
        attention, so each pair is equal; pipeline: stages rerun the whole forward."""
        model = self.flops_per_token(seq)
        rerun = self.recompute_flops_per_token(seq, policy, early_stop, every)
        rerun += self.forward_flops_per_token(seq) if pipeline else 0.0
        return model, model, model + rerun, model + rerun

    # ----- bytes ---------------------------------------------------------------------------------------------------

    def block_bytes(self, seq: int, micro: int, e: int, mask_bytes: int | None = None, tp: int = 1) -> tuple[int, int]:
        """(what one block saves without checkpointing, what it keeps under selective), for `micro` sequences as the
        blocks run them (module docstring); under tensor parallelism every (M, c) term holds c / tp channels, the
        norm, in_proj's input, x_proj's (all-reduced) output and the dropout mask stay whole."""
        b, s, d, c, N, r = micro, seq, self.d_model, self.inner // tp, self.state_size, self.dt_rank
        M, m = b * s, e if mask_bytes is None else mask_bytes
        base = 8 * M * d + 4 * M + M * d * e + M * c * e + 2 * M * c * e + 3 * M * c * e
        base += M * d * m if self.dropout > 0 else 0
        direction = M * c * e + M * (r + 2 * N) * e + (4 * c * (self.conv_len + 1) if e != 4 else 0)  # taps, bias
        checkpoints = 4 * b * c * math.ceil(s / SCAN_CHUNK) * N
        casts = 4 * M * c + 4 * c if e != 4 else 0  # u and D in float32
        scan = 8 * c * N + 8 * M * c + 8 * M * N + checkpoints + casts
        full = base + DIRECTIONS * (direction + scan)
        kept = M * c * e  # dt
        return full, base + DIRECTIONS * (direction + kept)

    def activation_bytes(
        self, seq: int, micro: int, policy: str, act_bytes: int, every: int = 2, kernel: str = "flash",
        math_bytes: int | None = None, mask_bytes: int | None = None, tp: int = 1,
    ) -> dict[str, int]:  # fmt: skip
        """Saved-activation bytes of one micro batch under a checkpointing policy, and the backward's transient, in
        the transformer's keys (model/transformer/costs.py activation_bytes) plus module_buffers."""
        if policy not in POLICIES:
            raise ValueError(f"checkpointing policy {policy!r}: must be one of {', '.join(POLICIES)}")
        b, e, L = micro * self.strands, act_bytes, self.n_layer
        block, selective = self.block_bytes(seq, b, e, mask_bytes, tp)
        block_input = b * seq * self.d_model * e
        kept = {"none": L * block, "selective": L * selective, "full": L * block_input}.get(policy)
        kept = math.ceil(L / every) * block_input if kept is None else kept
        head = self._head_shape(b)
        outside = transformer_costs.activation_bytes(head, seq, b, "none", e, kernel=kernel, mask_bytes=mask_bytes)
        loss_work = outside["transient"] - outside["block"]
        segment = (every if policy == "every_k" else 1) * block
        return {
            "block": block,
            "block_kept": kept // max(L, 1),
            "outside": outside["outside"],
            "saved": kept + outside["outside"],
            "transient": segment + loss_work,
            "module_buffers": 8 * self.padded_vocab,  # the complement table (int64)
        }

    def _head_shape(self, micro: int) -> transformer_costs.TransformerShape:
        """A one-block transformer of this width: its outside terms are the final norm, head and loss."""
        return transformer_costs.TransformerShape(
            self.d_model, 1, 1, self.inner, self.vocab_size, self.padded_vocab, self.tie_embeddings, self.max_seq_len
        )

    def elementwise_bytes_per_token(self, fused: bool, tp: int = 1, forward_runs: int = 1) -> float:
        """Bytes per token of elementwise work: per block the norm and residual add (the transformer's per norm),
        each direction's conv, casts and scan (CHANNEL_BYTES, STATE_BYTES), the gate; backward twice the forward.
        fused: the scan as mamba_ssm's kernel, which reads u, dt, B, C and writes y (12c bytes) and keeps the
        states on chip. Times the strands. Under tensor parallelism the channel work is c / tp per rank."""
        d, c, N = self.d_model, self.inner // tp, self.state_size
        norm_add = (40 * d + 6 * d, 72 * d + 9 * d) if not fused else (8 * d, 8 * d)
        per_direction = 12 * c if fused else CHANNEL_BYTES * c + STATE_BYTES * c * N
        forward = norm_add[0] + DIRECTIONS * per_direction + 10 * c
        backward = norm_add[1] + 2 * (DIRECTIONS * per_direction + 10 * c)
        blocks = self.n_layer * (forward_runs * forward + backward)
        return self.strands * (blocks + transformer_costs.outside_bytes(self._head_shape(1), fused))

    def tensor_parallel_traffic(self, micro: int, seq: int, act_bytes: int, policy: str) -> tuple[int, int]:
        """(all-reduces per micro batch, bytes each, on average) of mamba.py's layout, over the strands' M tokens: per
        block forward out_proj's (M x d) and each direction's x_proj (M x (r + 2N)), backward in_proj's input
        gradient (M x d) and each direction's dt_proj input (M x r) and B, C (M x 2N) gradients; full and every_k
        rerun the forward's. The head's logit gather (M x padded vocabulary / tp, an all-gather) is left out."""
        M, d, small = self.strands * micro * seq, self.d_model, self.dt_rank + 2 * self.state_size
        forward = (1 + DIRECTIONS, d + DIRECTIONS * small)  # (count, elements per token)
        backward = (1 + 2 * DIRECTIONS, d + DIRECTIONS * small)
        runs = 2 if policy in ("full", "every_k") else 1
        count = self.n_layer * (runs * forward[0] + backward[0])
        elements = self.n_layer * (runs * forward[1] + backward[1]) * M
        return count, elements * act_bytes // max(count, 1)
