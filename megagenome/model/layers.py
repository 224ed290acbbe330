"""Transformer building blocks: RMSNorm, rotary position embedding, SwiGLU MLP, self-attention, Block, and the
layer factory they are built with.

A LLaMA-style pre-norm block without biases. Its linear layers (qkv, proj, w_gate, w_up, w_down), the token
embedding and the LM head are made by a layer factory chosen at construction (Megatron core's layer specs):
DenseLayers here, or parallel/tensor_parallel.py's TensorParallelLayers, whose column- and row-parallel layers
hold one tensor-parallel rank's shard. The forward passes infer the number of local heads and the local hidden
width from the layers' outputs, so the same code runs both.

Every factory keeps one guarantee: with the same seed, a model built by any of them starts from the same weights
(a shard is the slice of the dense weight), because a sharded layer consumes the random stream exactly as its
dense counterpart does, at construction and at initialisation (`init_normal_`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megagenome.config import ModelConfig, d_ff
from megagenome.model.attention import attention


class DenseLayers:
    """The layer factory of a model that lives whole on one rank: plain torch layers, no biases.

    A factory makes column(in, out) (a linear whose output features a tensor-parallel split would shard), row(in,
    out) (one whose input features it would), embedding(rows, dim), head(dim, rows, tied) (the LM head, sharing the
    embedding's weight when tied is given), token_loss(embedding, vocab_size) (the per-token loss of the head's
    output, None: cross entropy of the full logits, DNATransformer.forward) and attention_dropout_rng (a context
    manager factory entered around attention dropout, None: the default generator)."""

    attention_dropout_rng = None

    def column(self, in_features: int, out_features: int) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=False)

    def row(self, in_features: int, out_features: int) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=False)

    def embedding(self, rows: int, dim: int) -> nn.Module:
        return nn.Embedding(rows, dim)

    def head(self, dim: int, rows: int, tied: nn.Module | None = None) -> nn.Module:
        head = self.column(dim, rows)  # built (and its random draws made) even when tied, as every factory does
        if tied is not None:
            head.weight = tied.weight
        return head

    def token_loss(self, embedding: nn.Module, vocab_size: int) -> Callable | None:
        return None


def init_normal_(module: nn.Module, std: float) -> None:
    """Draw a linear or embedding weight from N(0, std^2): a dense layer in place; a sharded one (it has its own
    init_normal_) draws the dense weight the same way and keeps its shard. Other modules are left alone."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif hasattr(module, "init_normal_"):
        module.init_normal_(std)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale and no bias, computed in float32.

    Squaring bf16/fp16 activations loses precision (and can overflow in fp16), so the statistics
    and the scaling are done in float32 and the result is cast back to the input dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # (..., dim)
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., dim)
        return (xf * self.weight.float()).to(x.dtype)  # (..., dim)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), "rotate_half" convention: dimension i pairs with i + head_dim/2.

    The cos/sin tables are computed once in float32 for max_seq_len positions. They are
    non-persistent buffers: they follow .to(device) but are not saved in checkpoints, since they
    are a pure function of the config. Only the half-width tables are kept (both halves of a head
    use the same frequencies), which halves their memory per layer.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head size, got {head_dim}")
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (head_dim/2,)
        # float64 angles so positions near max_seq_len keep their precision before the float32 cast.
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (max_seq_len, head_dim/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Rotate x, shape (B, H, T, head_dim), at positions offset..offset+T-1.

        A nonzero offset serves sequence parallelism: a rank holding chunk i of every sequence rotates its
        queries and keys at their global positions i*T.., so attention scores match the unsplit sequence.
        """
        T = x.size(-2)
        if offset + T > self.cos.size(0):
            raise ValueError(f"positions up to {offset + T} exceed the rotary tables ({self.cos.size(0)} positions)")
        cos = self.cos[offset : offset + T].to(x.dtype)  # (T, head_dim/2)
        sin = self.sin[offset : offset + T].to(x.dtype)  # (T, head_dim/2)
        x1, x2 = x.chunk(2, dim=-1)  # 2 x (B, H, T, head_dim/2)
        # (x1 + i x2) * (cos + i sin), written out: the rotate_half form x*cos + rotate_half(x)*sin.
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (B, H, T, head_dim)


class SelfAttention(nn.Module):
    """Multi-head self-attention with rotary q/k; causal for the clm objective, bidirectional for mlm."""

    def __init__(self, cfg: ModelConfig, layers: DenseLayers | None = None):
        super().__init__()
        layers = layers or DenseLayers()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"--model.d_model={cfg.d_model} is not divisible by --model.n_head={cfg.n_head}")
        self.head_dim = cfg.d_model // cfg.n_head
        self.causal = cfg.objective == "clm"
        self.dropout = cfg.dropout
        self.kernel = cfg.attention
        # Fused projection whose 3*d outputs are laid out per head as (n_head, 3, head_dim), the
        # Megatron layout: splitting the output dimension into contiguous shards gives each
        # tensor-parallel rank whole heads with their own q, k and v.
        self.qkv = layers.column(cfg.d_model, 3 * cfg.d_model)
        self.proj = layers.row(cfg.d_model, cfg.d_model)
        self.rotary = RotaryEmbedding(self.head_dim, cfg.max_seq_len, cfg.rope_theta)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_dim)  # (B, T, n_head, 3, head_dim)
        qkv = qkv.permute(3, 0, 2, 1, 4)  # (3, B, n_head, T, head_dim)
        q, k, v = qkv.unbind(0)  # 3 x (B, n_head, T, head_dim)
        offset = self.sequence_rank * T  # global position of this chunk's first token
        q, k = self.rotary(q, offset), self.rotary(k, offset)  # (B, n_head, T, head_dim)
        core = self._core
        if self.recompute_core is not None and torch.is_grad_enabled():
            # Only the local core is recomputed; sequence-parallel all-to-alls around it run once.
            core = functools.partial(self.recompute_core, self._core)
        if self.sequence_parallel is not None:
            y = self.sequence_parallel(core, q, k, v)  # (B, n_head, T, head_dim)
        else:
            y = core(q, k, v)  # (B, n_head, T, head_dim)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_head * head_dim)
        return self.proj(y)  # (B, T, d_model)


class MLP(nn.Module):
    """SwiGLU feed-forward: w_down(silu(w_gate(x)) * w_up(x)), no biases."""

    def __init__(self, cfg: ModelConfig, layers: DenseLayers | None = None):
        super().__init__()
        layers = layers or DenseLayers()
        hidden = d_ff(cfg)
        self.w_gate = layers.column(cfg.d_model, hidden)
        self.w_up = layers.column(cfg.d_model, hidden)
        self.w_down = layers.row(hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.w_gate(x)) * self.w_up(x)  # (B, T, d_ff)
        return self.w_down(h)  # (B, T, d_model)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)), with residual dropout."""

    def __init__(self, cfg: ModelConfig, layers: DenseLayers | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = SelfAttention(cfg, layers)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg, layers)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x)))  # (B, T, d_model)
        x = x + self.dropout(self.mlp(self.mlp_norm(x)))  # (B, T, d_model)
        return x
