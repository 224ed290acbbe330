"""DNATransformer (layer L1): token embedding, n_layer pre-norm Blocks, final RMSNorm and a (tied) LM head; the
transformer family's module (model/transformer/family.py). The loss, checkpointing policy, distillation and
parameter accounting are model/stack.py's BlockStack, which every family's module shares; here are what is the
transformer's own: its construction and initialisation, regional compilation and sequence parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn

from megagenome.config import ModelConfig
from megagenome.model.attention import resolve_before_compile
from megagenome.model.layers import DenseLayers, RMSNorm, init_normal_
from megagenome.model.stack import BlockStack
from megagenome.model.transformer.blocks import Block


class DNATransformer(BlockStack):
    """A LLaMA-style transformer for single-nucleotide DNA tokens (clm or mlm objective).

    layers: the factory of its linears, embedding, head and loss (model/layers.py): DenseLayers (the default) for a
    whole model, or a tensor-parallel factory for this rank's shard of it; the same seed gives the same weights.
    """

    context_limit = "the rotary tables end there"

    def __init__(self, cfg: ModelConfig, vocab_size: int, layers: DenseLayers | None = None):
        super().__init__()
        if cfg.n_head > 0 and cfg.d_model % cfg.n_head == 0 and (cfg.d_model // cfg.n_head) % 2:
            raise ValueError(f"head size --model.d_model/--model.n_head={cfg.d_model // cfg.n_head} must be even")
        layers = layers or DenseLayers()
        self.build(cfg, vocab_size, layers, lambda: [Block(cfg, layers, i) for i in range(cfg.n_layer)])
        self.apply(self._init_weights)
        # GPT-2 rule: each block adds two residual branches, so scaling the projections that write
        # into the residual stream by 1/sqrt(2 * n_layer) keeps its variance independent of depth.
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        for block in self.blocks:
            init_normal_(block.attn.proj, residual_std)
            init_normal_(block.mlp.w_down, residual_std)
        if cfg.compile:
            self.compile_blocks()

    def compile_blocks(self) -> None:
        """Regional compilation (--model.compile): torch.compile each Block in place, so inductor fuses the norms with
        the residual adds, the rotary embedding and SwiGLU into a few kernels per block.

        The repeated block is compiled, not the whole model (torch's recommended "regional compilation"): all blocks
        share one compiled graph, so compiling costs one block's worth whatever n_layer, and the embedding, the loss
        and the checkpointing policy stay in eager around it. Module.compile keeps parameter names (checkpoints, the
        export and tensor-parallel slicing see the same state dict). dynamic=False: shapes are fixed per run. The
        whole block is one graph (fullgraph) except with selective checkpointing, whose checkpoint function (torch's
        or DeepSpeed's) runs inside the block and may split it. Compilation happens at the first forward; call this
        before deepspeed.initialize, which only wraps the module.
        """
        resolve_before_compile()  # what attention's auto picks, probed eagerly: dynamo cannot trace the probes
        fullgraph = self.cfg.checkpointing != "selective"
        for block in self.blocks:
            block.compile(fullgraph=fullgraph, dynamic=False)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        else:
            init_normal_(module, self.cfg.init_std)

    def set_sequence_parallel(self, attention: Callable | None, rank: int = 0, size: int = 1, exchange=None) -> None:
        """Install sequence parallelism: this rank holds chunk `rank` of `size` equal chunks of every sequence.

        attention(core, q, k, v), with q, k, v of shape (B, n_head, T/size, head_dim), must return the output
        of `core` run over the whole sequence, in the same shape (parallel/sequence.py explains the scheme;
        the training engine builds it from DeepSpeed's DistributedAttention). Rotary positions are offset by
        rank * T/size. forward() then takes the chunk's tensors and the loss denominator of the whole
        sequences. None (or size 1) restores whole-sequence attention. The model does no communication itself.
        `exchange`, a Hyena family's convolution exchanges (parallel/sequence_conv.py), is unused: no convolutions.
        """
        if size > 1 and (attention is None or not 0 <= rank < size):
            raise ValueError(f"sequence parallelism needs an attention function and 0 <= rank < {size}, got {rank}")
        if size > 1 and self.cfg.n_head % size:
            raise ValueError(f"--model.n_head={self.cfg.n_head} is not divisible by --parallel.sequence={size}")
        self.sequence_parallel_size = size if attention is not None else 1
        for block in self.blocks:
            block.set_sequence_parallel(attention if size > 1 else None, rank if size > 1 else 0)
