"""What every model family builds with (layer L1): the layer factory, RMSNorm and the initialisation rule.

A family's projections, token embedding, LM head and loss are made by a layer factory chosen at construction
(Megatron core's layer specs): DenseLayers here, or parallel/tensor_parallel.py's TensorParallelLayers, whose
column- and row-parallel layers hold one tensor-parallel rank's shard. A family's forward passes infer the number
of local heads and the local hidden width from the layers' outputs, so the same code runs both.

Every factory keeps one guarantee: with the same seed, a model built by any of them starts from the same weights
(a shard is the slice of the dense weight), because a sharded layer consumes the random stream exactly as its
dense counterpart does, at construction and at initialisation (`init_normal_`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class DenseLayers:
    """The layer factory of a model that lives whole on one rank: plain torch layers, no biases.

    A factory makes column(in, out) (a linear whose output features a tensor-parallel split would shard), row(in,
    out) (one whose input features it would), embedding(rows, dim), head(dim, rows, tied) (the LM head, sharing the
    embedding's weight when tied is given), token_loss(embedding, vocab_size) (the per-token loss of the head's
    output, None: cross entropy of the full logits, model/stack.py), channels(tensor, parameter) (a per-channel
    tensor, split by channel under tensor parallelism), conv(in, out, kernel, dilation) (a full "same" Conv1d whose
    output channels a split would shard), enter_region() (a module a replicated tensor passes through before each
    rank's channels consume it: identity here) and attention_dropout_rng (a context manager factory entered around
    attention dropout, None: the default generator). head(..., gather=True): a split head gathers its logits."""

    attention_dropout_rng = None

    def column(self, in_features: int, out_features: int) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=False)

    def row(self, in_features: int, out_features: int) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=False)

    def embedding(self, rows: int, dim: int) -> nn.Module:
        return nn.Embedding(rows, dim)

    def head(self, dim: int, rows: int, tied: nn.Module | None = None, gather: bool = False) -> nn.Module:
        head = self.column(dim, rows)  # built (and its random draws made) even when tied, as every factory does
        if tied is not None:
            head.weight = tied.weight
        return head

    def token_loss(self, embedding: nn.Module, vocab_size: int) -> Callable | None:
        return None

    def channels(self, tensor: torch.Tensor, parameter: bool = True) -> torch.Tensor:
        """A per-channel tensor (channels along dim 0, a Hyena filter's taps or poles) as this rank holds it: the
        whole tensor here (an nn.Parameter when `parameter`, else the tensor, for a buffer)."""
        return nn.Parameter(tensor) if parameter else tensor

    def conv(self, in_channels: int, out_channels: int, kernel: int, dilation: int = 1) -> nn.Module:
        """A bias-free Conv1d over (B, in, T), "same" padding (torch's default Kaiming-uniform initialisation)."""
        return nn.Conv1d(in_channels, out_channels, kernel, dilation=dilation, padding="same", bias=False)

    def enter_region(self) -> nn.Module:
        return nn.Identity()


def init_normal_(module: nn.Module, std: float) -> None:
    """Draw a linear or embedding weight from N(0, std^2): a dense layer in place; a sharded one (it has its own
    init_normal_) draws the dense weight the same way and keeps its shard. Other modules are left alone."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif hasattr(module, "init_normal_"):
        module.init_normal_(std)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale and no bias, computed in float32. form "divide" is StripedHyena's
    variant, x / (rms(x) + eps), and "layernorm" a LayerNorm with a bias (--model.norm_form), for the published
    models that were trained with them.

    Squaring bf16/fp16 activations loses precision (and can overflow in fp16), so the statistics
    and the scaling are done in float32 and the result is cast back to the input dtype. Runs as
    torch's fused rms_norm (one kernel forward and one backward on CUDA, instead of about ten).
    """

    def __init__(self, dim: int, eps: float = 1e-5, form: str = "rsqrt"):
        super().__init__()
        self.eps, self.form = eps, form
        self.weight = nn.Parameter(torch.ones(dim))
        # form "layernorm": LayerNorm, mean removed, with a bias (HyenaDNA's), in float32 like the others.
        self.bias = nn.Parameter(torch.zeros(dim)) if form == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            weight, bias = self.weight.float(), self.bias.float()
            return F.layer_norm(x.float(), weight.shape, weight, bias, self.eps).to(x.dtype)  # (..., dim)
        if self.form == "divide":  # StripedHyena's: x / (||x|| / sqrt(d) + eps) * scale, in float32
            xf = x.float()
            rms = xf.norm(2, dim=-1, keepdim=True) * x.size(-1) ** -0.5  # (..., 1)
            return (xf / (rms + self.eps) * self.weight.float()).to(x.dtype)  # (..., dim)
        # torch's rms_norm: one fused kernel on CUDA (statistics and scaling in float32, result in x's dtype), on CPU
        # the same float32 formula op by op; bit-identical to x.float() * rsqrt(mean(x^2) + eps) * weight, cast back.
        if self.weight.dtype == x.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # (..., dim)
        # A float32 scale with 16-bit activations: the fused kernel wants one dtype, so normalise in float32.
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)  # (..., dim)
