"""The test family's module: a BlockStack (model/stack.py) of causal depthwise-convolution blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megagenome.config import ModelConfig
from megagenome.model.layers import DenseLayers, init_normal_
from megagenome.model.stack import BlockStack

KERNEL = 4  # taps of each block's causal convolution


class ConvBlock(nn.Module):
    """x + down(gelu(up(norm(x) causally convolved over KERNEL positions, per channel)))."""

    def __init__(self, cfg: ModelConfig, layers):
        super().__init__()
        d = cfg.d_model
        self.norm = nn.LayerNorm(d, bias=False)
        self.taps = nn.Parameter(torch.randn(d, 1, KERNEL) / KERNEL)  # (d, 1, K) depthwise
        self.up = layers.column(d, 2 * d)
        self.down = layers.row(2 * d, d)
        self.recompute = None

    def set_recompute(self, fn) -> None:
        self.recompute = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(self.norm(x).transpose(1, 2), (KERNEL - 1, 0))  # (B, d, T + K - 1): only past positions
        h = F.conv1d(h, self.taps.to(h.dtype), groups=h.size(1)).transpose(1, 2)  # (B, T, d)
        return x + self.down(F.gelu(self.up(h)))  # (B, T, d)


class ConvLM(BlockStack):
    """embed -> ConvBlock x n_layer -> RMSNorm -> head (tied to the embedding by --model.tie_embeddings)."""

    context_limit = "the convolutions take any length; the run's windows are checked against it"

    def __init__(self, cfg: ModelConfig, vocab_size: int, layers: DenseLayers | None = None):
        super().__init__()
        layers = layers or DenseLayers()
        self.build(cfg, vocab_size, layers, lambda: [ConvBlock(cfg, layers) for _ in range(cfg.n_layer)])
        for module in self.modules():  # linears and the embedding N(0, init_std), as the built-in families
            init_normal_(module, cfg.init_std)
