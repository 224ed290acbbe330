"""The transformer's building blocks (layer L1): rotary position embedding (and its scalings), self-attention,
the SwiGLU MLP and the pre-norm Block.

A LLaMA-style pre-norm block without biases. Its linear layers (qkv, proj, w_gate, w_up, w_down) are made by the
layer factory it is given (model/layers.py), so the same code builds the dense model and a tensor-parallel shard.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megagenome.config import ModelConfig, d_ff
from megagenome.model.attention import attention
from megagenome.model.decoding import KVCache
from megagenome.model.layers import DenseLayers, RMSNorm

# YaRN's ramp bounds (Peng et al. 2023; transformers' defaults): frequencies turning more than BETA_FAST times over
# the trained context are extrapolated (kept), those turning fewer than BETA_SLOW times are interpolated (/ factor).
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


def rope_original_max_len(cfg: ModelConfig) -> float:
    """The context the model was trained at before an extension: --model.rope_original_max_len, default
    --model.max_seq_len / --model.rope_factor."""
    return cfg.rope_original_max_len if cfg.rope_original_max_len is not None else cfg.max_seq_len / cfg.rope_factor


def ntk_theta(theta: float, factor: float, head_dim: int) -> float:
    """The rotary base of NTK-aware scaling: theta x factor^(d/(d-2)), which stretches the lowest frequency's period
    by exactly `factor` and leaves the highest (position-resolving) one as it was."""
    return theta * factor ** (head_dim / (head_dim - 2))


def yarn_mscale(factor: float) -> float:
    """YaRN's attention factor: 0.1 ln(factor) + 1 (1 for factor <= 1), which cos and sin are multiplied by."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: str = "none",
    factor: float = 1.0,
    original_max_len: float | None = None,
    llama3_factors: tuple[float, float] = (1.0, 4.0),
) -> tuple[torch.Tensor, float]:
    """(inv_freq, mscale): the rotary frequencies, float64 (head_dim/2,), and the factor cos and sin are scaled by,
    of one scaling scheme (--model.rope_scaling, ModelConfig's docstrings):

        none    1 / theta^(2i/d), mscale 1 (the unscaled rotary embedding)
        linear  the same / factor: positions / factor (position interpolation)
        ntk     1 / ntk_theta(theta, factor, d)^(2i/d)
        yarn    per frequency, between interpolation (/ factor) and extrapolation (unchanged) by a linear ramp over
                the dimensions whose number of turns over original_max_len lies within [BETA_SLOW, BETA_FAST], bounds
                rounded outwards as transformers' _compute_yarn_parameters does; mscale = yarn_mscale(factor), the
                attention temperature sqrt(1/t) applied to q and k alike (so to their product squared)
        llama3  Llama 3.1's, with llama3_factors = (low, high): a frequency whose wavelength 2 pi / f exceeds
                original_max_len / low is divided by factor, one below original_max_len / high kept, those between
                blended linearly in original_max_len / wavelength (transformers' _compute_llama3_parameters);
                mscale 1
    """
    if scaling == "ntk":
        theta = ntk_theta(theta, factor, head_dim)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (head_dim/2,)
    if scaling in ("none", "ntk"):
        return inv_freq, 1.0
    if scaling == "linear":
        return inv_freq / factor, 1.0
    if scaling not in ("yarn", "llama3"):
        raise ValueError(f"--model.rope_scaling={scaling!r}: expected none, linear, ntk, yarn or llama3")
    if original_max_len is None:
        raise ValueError(f"{scaling} rotary scaling needs the trained context (--model.rope_original_max_len)")
    if scaling == "llama3":
        return llama3_frequencies(inv_freq, factor, original_max_len, *llama3_factors), 1.0

    def dimension(turns: float) -> float:  # the (fractional) dimension index whose frequency turns `turns` times
        return head_dim * math.log(original_max_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dimension(YARN_BETA_FAST)), 0)
    high = min(math.ceil(dimension(YARN_BETA_SLOW)), head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: / factor
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    return inv_freq, yarn_mscale(factor)


def llama3_frequencies(inv_freq: torch.Tensor, factor: float, original: float, low: float, high: float) -> torch.Tensor:
    """inv_freq under Llama 3.1's scaling (rope_frequencies): long wavelengths interpolated, short ones kept."""
    wavelength = 2 * math.pi / inv_freq
    smooth = ((original / wavelength - low) / (high - low)).clamp(0, 1)  # 0 at original/low, 1 at original/high
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelength > original / low, inv_freq / factor, blended)
    return torch.where(wavelength < original / high, inv_freq, out)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), "rotate_half" convention: dimension i pairs with i + head_dim/2.

    The cos/sin tables are computed once in float32 for max_seq_len positions. They are
    non-persistent buffers: they follow .to(device) but are not saved in checkpoints, since they
    are a pure function of the config. Only the half-width tables are kept (both halves of a head
    use the same frequencies), which halves their memory per layer. A rotary scaling (rope_frequencies)
    changes the frequencies and scales the tables by its mscale; with none (or factor 1 for linear and ntk) the
    tables are bit for bit the unscaled ones, so runs without scaling compute exactly what they did before.
    """

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int,
        theta: float = 10000.0,
        scaling: str = "none",
        factor: float = 1.0,
        original_max_len: float | None = None,
        llama3_factors: tuple[float, float] = (1.0, 4.0),
    ):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head size, got {head_dim}")
        if scaling in ("yarn", "llama3") and original_max_len is None:
            original_max_len = max_seq_len / factor
        scaled = (scaling, factor, original_max_len, llama3_factors)
        inv_freq, self.mscale = rope_frequencies(head_dim, theta, *scaled)
        # float64 angles so positions near max_seq_len keep their precision before the float32 cast.
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (max_seq_len, head_dim/2)
        cos, sin = angles.cos(), angles.sin()
        if self.mscale != 1.0:
            cos, sin = cos * self.mscale, sin * self.mscale
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)
        self._cast: tuple = (None, None)  # (key, (cos, sin)): the tables cast to another dtype (tables())

    def tables(self, dtype: torch.dtype, offset: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, (T, head_dim/2) in `dtype`, for positions offset..offset+T-1.

        Slices of the buffers (views, no kernel) when they already have the activation dtype, as under DeepSpeed's
        bf16/fp16, which casts buffers with the module; otherwise a cast of the whole tables made once per dtype
        and cached, instead of a slice-and-cast per use (torch.compile folds the cast into the rotation instead).
        """
        if offset + T > self.cos.size(0):
            raise ValueError(f"positions up to {offset + T} exceed the rotary tables ({self.cos.size(0)} positions)")
        cos, sin = self.cos, self.sin
        if cos.dtype != dtype:
            if torch.compiler.is_compiling():
                cos, sin = cos.to(dtype), sin.to(dtype)
            else:
                key = (dtype, cos.device, cos.data_ptr())  # a moved or re-cast buffer has another address
                if self._cast[0] != key:
                    self._cast = (key, (cos.to(dtype), sin.to(dtype)))
                cos, sin = self._cast[1]
        return cos[offset : offset + T], sin[offset : offset + T]  # 2 x (T, head_dim/2)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Rotate x, shape (B, H, T, head_dim), at positions offset..offset+T-1 (the model rotates its packed qkv
        with rotate_qkv instead; this form serves tests and callers holding separate q or k).

        A nonzero offset serves sequence parallelism: a rank holding chunk i of every sequence rotates its
        queries and keys at their global positions i*T.., so attention scores match the unsplit sequence.
        """
        cos, sin = self.tables(x.dtype, offset, x.size(-2))  # 2 x (T, head_dim/2)
        x1, x2 = x.chunk(2, dim=-1)  # 2 x (B, H, T, head_dim/2)
        # (x1 + i x2) * (cos + i sin), written out: the rotate_half form x*cos + rotate_half(x)*sin.
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (B, H, T, head_dim)

    def rotate_qkv(self, qkv: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries and key of each key/value group of the packed projection output qkv, (B, T, groups, g + 2,
        head_dim) (g query heads, then the key, then the value; multi-head attention: g = 1, groups = n_head),
        rotated together at positions offset..offset+T-1, and the values: q (B, T, groups x g, head_dim), k and v
        (B, T, groups, head_dim), views (head_dim contiguous; q a copy when g > 1), same math as forward.

        Eagerly this is one autograd node (_RotaryQK): q and k rotate in one set of elementwise ops, nothing is saved
        but the tables (the rotation's derivative is the inverse rotation), and backward writes the gradient of the
        packed qkv in place, where SDPA's separate dq, dk, dv would otherwise be stacked and re-laid out. Under
        torch.compile the plain formula is traced instead, for inductor to fuse with its neighbours.
        """
        cos, sin = self.tables(qkv.dtype, offset, qkv.size(1))  # 2 x (T, head_dim/2)
        cos, sin = cos[:, None, None], sin[:, None, None]  # 2 x (T, 1, 1, head_dim/2)
        g = qkv.size(3) - 2
        if torch.compiler.is_compiling():
            x1, x2 = qkv[..., : g + 1, :].chunk(2, dim=-1)  # 2 x (B, T, groups, g + 1, head_dim/2)
            qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (B, T, groups, g + 1, head_dim)
            q, k, v = qk[..., :g, :], qk[..., g, :], qkv[..., g + 1, :]
        else:
            q, k, v = _RotaryQK.apply(qkv, cos, sin)
        return q.reshape(*q.shape[:2], -1, q.size(-1)), k, v  # q a view for multi-head attention (g = 1)


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """out = x rotated by (cos, sin) in the rotate_half convention, written into out (a view) without a cat.

    out1 = x1*cos - x2*sin and out2 = x2*cos + x1*sin, each product rounded as RotaryEmbedding.forward rounds it, so
    the result is bit-identical to it; sin = -sin gives the inverse rotation.
    """
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]  # 2 x (..., head_dim/2)
    torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin)
    torch.mul(x2, cos, out=out[..., half:]).add_(x1 * sin)


class _RotaryQK(torch.autograd.Function):
    """Rotary embedding of the queries and keys of a packed qkv, (B, T, groups, g + 2, head_dim): returns q (B, T,
    groups, g, head_dim) and k (views of one new (B, T, groups, g + 1, head_dim) tensor) and v (a view of qkv).
    Backward assembles d(qkv) in one buffer."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        g = qkv.size(3) - 2
        qk = qkv.new_empty(*qkv.shape[:3], g + 1, qkv.size(-1))  # (B, T, groups, g + 1, head_dim)
        _rotate_into(qk, qkv[..., : g + 1, :], cos, sin)
        ctx.save_for_backward(cos, sin)
        ctx.g = g
        return qk[..., :g, :], qk[..., g, :], qkv[..., g + 1, :]

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        cos, sin = ctx.saved_tensors
        g, like = ctx.g, next(d for d in (dk, dv, dq) if d is not None)
        grad = like.new_empty(*like.shape[:3], g + 2, like.size(-1))  # (B, T, groups, g + 2, head_dim)
        if dq is None:
            grad[..., :g, :].zero_()
        else:
            _rotate_into(grad[..., :g, :], dq, cos, -sin)  # cos, sin (T, 1, 1, head_dim/2) broadcast over g
        if dk is None:
            grad[..., g, :].zero_()
        else:
            _rotate_into(grad[..., g, :], dk, cos[..., 0, :], -sin[..., 0, :])  # (T, 1, head_dim/2) tables
        if dv is None:
            grad[..., g + 1, :].zero_()
        else:
            grad[..., g + 1, :].copy_(dv)
        return grad, None, None


class SelfAttention(nn.Module):
    """Multi-head (or grouped-query, --model.n_kv_head) self-attention with rotary q/k; causal for the clm objective,
    bidirectional for mlm."""

    def __init__(self, cfg: ModelConfig, layers: DenseLayers | None = None):
        super().__init__()
        layers = layers or DenseLayers()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"--model.d_model={cfg.d_model} is not divisible by --model.n_head={cfg.n_head}")
        self.head_dim = cfg.d_model // cfg.n_head
        # Grouped-query attention (--model.n_kv_head): `group` query heads share each key/value head.
        self.group = cfg.n_head // (cfg.n_kv_head or cfg.n_head)
        self.causal = cfg.objective == "clm"
        self.dropout = cfg.dropout
        self.kernel = cfg.attention
        # Fused projection whose outputs are laid out per key/value head as (n_kv_head, group + 2, head_dim): its
        # group query heads, its key, its value (multi-head: (n_head, 3, head_dim)), the Megatron layout: splitting
        # the output dimension into contiguous shards gives each tensor-parallel rank whole groups.
        rows = (cfg.n_head + 2 * (cfg.n_kv_head or cfg.n_head)) * self.head_dim
        self.qkv = layers.column(cfg.d_model, rows)
        # --model.biases qkv: one per output row, split by heads like the rows.
        self.qkv_bias = layers.channels(torch.zeros(rows)) if "qkv" in cfg.biases else None
        self.proj = layers.row(cfg.d_model, cfg.d_model)
        # --model.biases attention_out: a bias after the output projection (replicated; added once, after a
        # tensor-parallel row-parallel projection's reduction).
        self.proj_bias = nn.Parameter(torch.zeros(cfg.d_model)) if "attention_out" in cfg.biases else None
        scaling = (cfg.rope_scaling, cfg.rope_factor, rope_original_max_len(cfg))
        llama3 = (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor)
        self.rotary = RotaryEmbedding(self.head_dim, cfg.max_seq_len, cfg.rope_theta, *scaling, llama3)
        # Selective activation checkpointing: a checkpoint function (fn(function, *args)) that recomputes
        # only the attention core in backward; its saved tensors are the largest per FLOP. None: keep them.
        self.recompute_core: Callable | None = None
        # Sequence parallelism (installed from outside by DNATransformer.set_sequence_parallel): this rank
        # holds chunk `sequence_rank` of every sequence, and `sequence_parallel(core, q, k, v)` runs the local
        # attention core over the whole sequence for a subset of the heads (DeepSpeed-Ulysses all-to-alls).
        # None: the rank holds whole sequences.
        self.sequence_parallel: Callable | None = None
        self.sequence_rank = 0
        # Tensor parallelism (the factory's attention_dropout_rng): dropout_rng(device) is a context manager
        # entered around the attention core when dropout is on, so that ranks holding different heads draw
        # different attention-dropout masks. None: the default generator.
        self.dropout_rng: Callable | None = layers.attention_dropout_rng

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout_p = self.dropout if self.training else 0.0
        if dropout_p and self.dropout_rng is not None:
            with self.dropout_rng(q.device):
                return attention(q, k, v, causal=self.causal, dropout_p=dropout_p, kernel=self.kernel)
        return attention(q, k, v, causal=self.causal, dropout_p=dropout_p, kernel=self.kernel)

    def new_cache(self, batch: int, capacity: int, dtype, device) -> KVCache:
        """An empty key/value cache of `capacity` positions (model/decoding.py)."""
        groups = self.qkv.weight.size(0) // ((self.group + 2) * self.head_dim)  # this layer's (rank's) groups
        return KVCache.empty(batch, groups, capacity, self.head_dim, dtype, device)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model). With a cache (decoding, model/decoding.py): x holds positions
        start..start+T-1, their keys and values are written into it, and from start > 0 on the queries attend over
        every cached position up to their own."""
        B, T, _ = x.shape
        qkv = self.qkv(x)  # (B, T, 3 d_model)
        qkv = qkv if self.qkv_bias is None else qkv + self.qkv_bias.to(qkv.dtype)
        qkv = qkv.view(B, T, -1, self.group + 2, self.head_dim)  # (B, T, groups, group + 2, head_dim)
        offset = self.sequence_rank * T if cache is None else start  # global position of the first token
        q, k, v = self.rotary.rotate_qkv(qkv, offset)  # (B, T, n_head, head_dim), 2 x (B, T, groups, head_dim)
        if cache is not None:
            cache.write(k, v, start)
            if start > 0:
                return self._out(self._attend_cache(q.transpose(1, 2), cache, start + T))
        if self.group > 1:  # each key/value head repeated for its group's query heads (every kernel takes n_head)
            k, v = (x.unsqueeze(3).expand(-1, -1, -1, self.group, -1).reshape(q.shape) for x in (k, v))
        # Strided views in the kernels' (B, n_head, T, head_dim) layout: no copy, and flash-attn gets them back as
        # (B, T, n_head, head_dim) views.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # 3 x (B, n_head, T, head_dim)
        core = self._core
        if self.recompute_core is not None and torch.is_grad_enabled():
            # Only the local core is recomputed; sequence-parallel all-to-alls around it run once.
            core = functools.partial(self.recompute_core, self._core)
        if self.sequence_parallel is not None:
            y = self.sequence_parallel(core, q, k, v)  # (B, n_head, T, head_dim)
        else:
            y = core(q, k, v)  # (B, n_head, T, head_dim)
        return self._out(y)

    def _attend_cache(self, q: torch.Tensor, cache: KVCache, end: int) -> torch.Tensor:
        """Queries q (B, n_head, T, head_dim) at positions end-T..end-1 over the cached keys and values 0..end-1:
        (B, n_head, T, head_dim). One query (a decoding step) sees every cached position; several see up to their
        own."""
        B, H, T, hd = q.shape
        keys, values = (c[:, :, :end].unsqueeze(2).expand(-1, -1, self.group, -1, -1).reshape(B, H, end, hd)
                        for c in (cache.k, cache.v))  # fmt: skip
        if T == 1:
            return attention(q, keys, values, causal=False, kernel=self.kernel)
        mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(end - T, end, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # (B, n_head, T, head_dim)

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention output y (B, n_head, T, head_dim): (B, T, d_model)."""
        B, _, T, _ = y.shape
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_head * head_dim)
        out = self.proj(y)  # (B, T, d_model)
        return out if self.proj_bias is None else out + self.proj_bias.to(out.dtype)


# --model.mlp_activation -> the gate's activation of block `index` (None: no activation).
# --model.mlp_activation -> the activation of block `index` (None: no activation).
GATES = {
    "silu": lambda index: F.silu,
    "gelu": lambda index: F.gelu,
    "gelu_tanh": lambda index: functools.partial(F.gelu, approximate="tanh"),
    "gelu_first": lambda i: F.gelu if i == 0 else None,
}


class MLP(nn.Module):
    """Gated feed-forward: w_down(act(w_gate(x)) * w_up(x)), no biases; act by --model.mlp_activation (SwiGLU's silu
    by default) for the model's block `index`. --model.mlp_gated false: the plain w_down(act(w_up(x))) (no w_gate),
    with --model.biases mlp a bias after each linear (up_bias split like w_up's rows, down_bias replicated)."""

    def __init__(self, cfg: ModelConfig, layers: DenseLayers | None = None, index: int = 0):
        super().__init__()
        layers = layers or DenseLayers()
        hidden = d_ff(cfg)
        self.w_gate = layers.column(cfg.d_model, hidden) if cfg.mlp_gated else None
        self.w_up = layers.column(cfg.d_model, hidden)
        self.w_down = layers.row(hidden, cfg.d_model)
        biased = "mlp" in cfg.biases
        self.up_bias = layers.channels(torch.zeros(hidden)) if biased else None
        self.down_bias = nn.Parameter(torch.zeros(cfg.d_model)) if biased else None
        self.act = GATES[cfg.mlp_activation](index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w_gate is None:  # plain
            up = self.w_up(x)  # (B, T, d_ff)
            up = up if self.up_bias is None else up + self.up_bias.to(up.dtype)
            out = self.w_down(up if self.act is None else self.act(up))  # (B, T, d_model)
            return out if self.down_bias is None else out + self.down_bias.to(out.dtype)
        gate = self.w_gate(x)  # (B, T, d_ff)
        h = (gate if self.act is None else self.act(gate)) * self.w_up(x)  # (B, T, d_ff)
        return self.w_down(h)  # (B, T, d_model)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)), with residual dropout; `index` its place
    in the model (--model.mlp_activation gelu_first)."""

    def __init__(self, cfg: ModelConfig, layers: DenseLayers | None = None, index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_form)
        self.attn = SelfAttention(cfg, layers)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_form)
        self.mlp = MLP(cfg, layers, index)
        self.dropout = nn.Dropout(cfg.dropout)

    def set_recompute(self, fn: Callable | None) -> None:
        """Selective checkpointing (model/stack.py): fn recomputes the attention core in backward; None keeps it."""
        self.attn.recompute_core = fn

    def residual_projections(self) -> tuple[nn.Module, nn.Module]:
        """The projections writing into the residual stream (scaled at initialisation, GPT-2's rule)."""
        return self.attn.proj, self.mlp.w_down

    def set_sequence_parallel(self, attention: Callable | None, rank: int = 0) -> None:
        """Sequence parallelism (DNATransformer.set_sequence_parallel): this rank holds chunk `rank` of every
        sequence and attention(core, q, k, v) runs the core over the whole one; None: whole sequences."""
        self.attn.sequence_parallel = attention
        self.attn.sequence_rank = rank

    def new_cache(self, batch: int, capacity: int, dtype, device) -> KVCache:
        """The attention's key/value cache for decoding (model/decoding.py)."""
        return self.attn.new_cache(batch, capacity, dtype, device)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + self.dropout(self.attn(h) if cache is None else self.attn(h, cache=cache, start=start))  # (B, T, d)
        x = x + self.dropout(self.mlp(self.mlp_norm(x)))  # (B, T, d_model)
        return x
