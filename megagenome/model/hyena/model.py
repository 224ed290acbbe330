"""HyenaLM (layer L1): the module of both Hyena families (model/hyena/family.py), a BlockStack (model/stack.py) of
Hyena blocks and, for striped_hyena, attention blocks in the order --model.layer_pattern gives.

A Hyena block is pre-norm like the transformer's: x + mixer(norm(x)), then x + mlp(norm(x)), the mixer a Hyena
operator (operators.py) and the MLP the transformer's SwiGLU (StripedHyena's ParallelGatedMLP); an attention block
(A) is the transformer's Block itself (rotary self-attention and SwiGLU). Embedding, final norm and tied head are
the transformer's, so the two families differ only in their mixers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megagenome.config import ModelConfig
from megagenome.model.hyena.config import layer_kinds
from megagenome.model.hyena.decoding import HyenaCache, cached_forward
from megagenome.model.hyena.operators import HyenaOperator
from megagenome.model.layers import DenseLayers, RMSNorm, init_normal_
from megagenome.model.stack import BlockStack
from megagenome.model.transformer.blocks import MLP, Block


class HyenaBlock(nn.Module):
    """Pre-norm block with a Hyena operator of `kind` as its mixer: x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, kind: str, layers, index: int = 0):
        super().__init__()
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_form)
        self.mixer = HyenaOperator(cfg, kind, layers)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_form)
        self.mlp = MLP(cfg, layers, index)
        self.dropout = nn.Dropout(cfg.dropout)

    def set_recompute(self, fn: Callable | None) -> None:
        """Selective checkpointing: fn recomputes the operator's long convolution in backward; None keeps it."""
        self.mixer.recompute_core = fn

    def residual_projections(self) -> tuple[nn.Module, nn.Module]:
        """The projections writing into the residual stream (scaled at initialisation)."""
        return self.mixer.out_proj, self.mlp.w_down

    def set_sequence_parallel(self, attention: Callable | None, rank: int = 0, exchange=None) -> None:
        """Sequence parallelism: the operator's convolutions across chunks through `exchange`; None: whole
        sequences. (attention and rank are the attention blocks'; a Hyena block needs neither.)"""
        self.mixer.exchange = exchange

    def new_cache(self, batch: int, capacity: int, dtype, device) -> HyenaCache:
        """The operator's decoding cache (decoding.py; model/decoding.py)."""
        return HyenaCache(self.mixer, batch, capacity, dtype, device)

    def forward(self, x: torch.Tensor, cache: HyenaCache | None = None, start: int = 0) -> torch.Tensor:
        h = self.mixer_norm(x)
        mixed = self.mixer(h) if cache is None else cached_forward(self.mixer, h, cache, start)
        x = x + self.dropout(mixed)  # (B, T, d_model)
        x = x + self.dropout(self.mlp(self.mlp_norm(x)))  # (B, T, d_model)
        return x


class HyenaLM(BlockStack):
    """A Hyena (hyena) or StripedHyena 2 (striped_hyena) language model for single-nucleotide DNA tokens (clm).

    layers: the layer factory (model/layers.py), DenseLayers for a whole model or a tensor-parallel one for this
    rank's shard; the same seed gives the same weights.
    """

    context_limit = "the implicit filters' positions end there"

    def __init__(self, cfg: ModelConfig, vocab_size: int, layers: DenseLayers | None = None):
        super().__init__()
        self.kinds = layer_kinds(cfg)
        layers = layers or DenseLayers()
        blocks = [(lambda i=i, kind=kind: Block(cfg, layers, i) if kind == "A" else HyenaBlock(cfg, kind, layers, i))
                  for i, kind in enumerate(self.kinds)]  # fmt: skip
        self.build(cfg, vocab_size, layers, lambda: [make() for make in blocks])
        self._init_weights()

    def _init_weights(self) -> None:
        """N(0, init_std) for the projections, MLPs and embedding, RMSNorm scales 1, and the GPT-2 residual rule
        (the projections writing into the residual stream at init_std / sqrt(2 n_layer)); the filters keep their own
        initialisation (operators.py), their MLP's linears included."""
        for name, module in self.named_modules():
            if ".filter" in name:
                continue
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            else:
                init_normal_(module, self.cfg.init_std)
        residual_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layer)
        for block in self.blocks:
            for projection in block.residual_projections():
                init_normal_(projection, residual_std)

    def compile_blocks(self) -> None:
        raise ValueError(f"--model.compile is not supported with --model.family={self.cfg.family}")

    def set_sequence_parallel(self, attention: Callable | None, rank: int = 0, size: int = 1, exchange=None) -> None:
        """Install sequence parallelism: this rank holds chunk `rank` of `size` equal chunks of every sequence.
        attention(core, q, k, v) is the attention blocks' (DNATransformer.set_sequence_parallel's), `exchange` the
        Hyena operators' (parallel/sequence_conv.py ConvExchange: halos for the direct convolutions, all-to-alls
        from sequence to channel split and back for the FFT ones). None (or size 1) restores whole sequences."""
        if size > 1 and (exchange is None or ("A" in self.kinds and attention is None) or not 0 <= rank < size):
            raise ValueError(
                f"sequence parallelism of --model.family={self.cfg.family} needs a convolution exchange (and an "
                f"attention function when it has attention layers) and 0 <= rank < {size}, got {rank}"
            )
        on = size > 1
        self.sequence_parallel_size = size if on else 1
        for block in self.blocks:
            if isinstance(block, HyenaBlock):
                block.set_sequence_parallel(None, 0, exchange if on else None)
            else:
                block.set_sequence_parallel(attention if on else None, rank if on else 0)
