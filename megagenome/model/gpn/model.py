"""GPNLM (layer L1): GPN's dilated convolutional masked DNA language model (Benegas, Batra and Song 2023, its
"convnet" encoder), a BlockStack (model/stack.py) of ConvBlocks.

    embed     one-hot: token t -> the unit vector e_t of d_model channels (GPN's default embedding "one_hot": no
              parameters, so d_model must hold the padded vocabulary's rows)
    block i   x + dropout(conv_out(GELU(conv(LayerNorm(x)))))            the dilated convolution over positions,
              x + dropout(ffn_down(GELU(ffn_up(LayerNorm(x)))))          then the position-wise feed-forward
              conv: a full (d_model -> d_model) Conv1d of kernel first_kernel_size in block 0 and kernel_size after,
              dilated by the schedule of costs.py dilations(), "same" padding (the kernel is centred, so every
              position sees the bases on both sides: the mlm objective only)
    norm      the final LayerNorm (GPN's ln_f)
    lm_head   GPN's MLMHead: dense (d_model -> d_model), GELU, LayerNorm, then the decoder (d_model -> padded
              vocabulary rows); untied, as there is no embedding matrix to tie it to

No linear, convolution or LayerNorm has a bias (GPN's bias=False default); GELU is the exact (erf) one. GPN's
defaults: 25 blocks, d_model 512, d_ff 2048 (model/gpn/config.py d_ff: 4 x d_model), kernels 9 then 5,
dilations 1, 2, 4, ..., 128 repeated (a receptive field of 1 + 8 + 4 x 765 = 3,069 bases: costs.py
receptive_field). Initialisation is GPN's _init_weights: every linear N(0, init_std), every LayerNorm scale 1; the
convolutions keep torch's default (Kaiming uniform), as GPN's do.

Tensor parallelism (the layer factory's, Megatron's layout): the convolution column-parallel by output channels
(its normalised input copied to the region), conv_out row-parallel (all-reduced), ffn_up column-parallel, ffn_down
row-parallel: two all-reduces forward and two backward per block, as a transformer block's. The LayerNorms and the
head's dense layer are replicated (its LayerNorm needs the whole width; a d x d matrix), the decoder is split by
vocabulary rows and gathers its logits (the loss is the dense one). Sequence and pipeline parallelism are not
implemented (family.py parallel_rules refuses them before launch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megagenome.config import ModelConfig
from megagenome.model.family import PipelineLayers
from megagenome.model.gpn.config import d_ff
from megagenome.model.gpn.costs import dilations, kernels
from megagenome.model.layers import DenseLayers, init_normal_
from megagenome.model.stack import BlockStack


class OneHotEmbedding(nn.Module):
    """GPN's one_hot embedding: ids (B, T) -> (B, T, dim), row t of the identity. The identity's first `rows` rows
    are a buffer (not saved in the state dict, no gradient), cast to `dtype_of`'s dtype (the model's parameters':
    DeepSpeed's bf16 engine casts parameters, not buffers).

    requires_input_grad: mark the output as requiring a gradient. A reentrant checkpoint (DeepSpeed's, around the
    first segment of blocks under --model.checkpointing full or every_k) computes no parameter gradients inside a
    segment none of whose inputs requires one, and this embedding, unlike a learned one, gives an input that does
    not; GPNLM.set_checkpoint_function sets it for that case only (it costs the first convolution's input gradient)."""

    def __init__(self, rows: int, dim: int, dtype_of: nn.Parameter):
        super().__init__()
        if dim < rows:
            raise ValueError(
                f"--model.d_model={dim}: gpn's one-hot embedding needs at least the {rows} vocabulary rows"
            )
        self.register_buffer("identity", torch.eye(rows, dim), persistent=False)  # (rows, dim)
        self.dtype_of = [dtype_of]  # in a list: a reference, not a second registration of the parameter
        self.requires_input_grad = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(input_ids, self.identity.to(self.dtype_of[0].dtype))  # (B, T, dim)
        return out.requires_grad_() if self.requires_input_grad and torch.is_grad_enabled() else out


class ConvBlock(nn.Module):
    """One GPN ConvLayer (module docstring): the dilated convolution branch, then the feed-forward branch."""

    def __init__(self, cfg: ModelConfig, kernel: int, dilation: int, layers):
        super().__init__()
        d = cfg.d_model
        self.conv_norm = nn.LayerNorm(d, eps=cfg.norm_eps, bias=False)
        # "same": left padding dilation * (kernel - 1) // 2, the rest on the right (torch's rule, as GPN's).
        self.conv = layers.conv(d, d, kernel, dilation)  # Conv1d (d, d, kernel), or its block of output channels
        self.conv_out = layers.row(d, d)
        self.ffn_norm = nn.LayerNorm(d, eps=cfg.norm_eps, bias=False)
        self.ffn_up = layers.column(d, d_ff(cfg))
        self.ffn_down = layers.row(d_ff(cfg), d)
        self.dropout = nn.Dropout(cfg.dropout)
        self.recompute: Callable | None = None

    def set_recompute(self, fn: Callable | None) -> None:
        """Selective checkpointing: fn(function, x) reruns the convolution branch's norm, convolution and GELU in
        backward, keeping only the block input (costs.py: the convolution's FLOPs for the convolution's output and
        the normalised input); None keeps them."""
        self.recompute = fn

    def convolve(self, x: torch.Tensor) -> torch.Tensor:
        """GELU(conv(LayerNorm(x))): (B, T, d) -> (B, T, d) (d / tp under tensor parallelism); Conv1d runs over
        (B, d, T), transposed views."""
        h = self.conv(self.conv_norm(x).transpose(1, 2))  # (B, d, T)
        return F.gelu(h.transpose(1, 2))  # (B, T, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute is None or not torch.is_grad_enabled():
            h = self.convolve(x)  # (B, T, d)
        else:
            h = self.recompute(self.convolve, x)  # (B, T, d)
        x = x + self.dropout(self.conv_out(h))  # (B, T, d)
        x = x + self.dropout(self.ffn_down(F.gelu(self.ffn_up(self.ffn_norm(x)))))  # (B, T, d)
        return x


class MLMHead(nn.Module):
    """GPN's MLMHead: transform (dense, GELU, LayerNorm) then the decoder to the padded vocabulary's rows."""

    def __init__(self, cfg: ModelConfig, rows: int, layers):
        super().__init__()
        # Replicated under tensor parallelism: its LayerNorm needs the whole width.
        self.dense = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=False)
        self.decoder = layers.head(cfg.d_model, rows, gather=True)  # split by rows, the whole logits gathered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(x))))  # (B, T, rows)


class GPNLM(BlockStack):
    """A GPN masked language model for single-nucleotide DNA tokens (mlm; module docstring).

    layers: the layer factory (model/layers.py); the same seed gives the same weights. --model.tie_embeddings is
    ignored: the one-hot embedding has no matrix, so the decoder is always a matrix of its own (family.py)."""

    context_limit = "the convolutions take any length, but the run's shapes and plan are checked against it"

    def __init__(self, cfg: ModelConfig, vocab_size: int, layers: DenseLayers | None = None):
        super().__init__()
        layers = layers or DenseLayers()
        self.begin(cfg, vocab_size)
        norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=False)  # made first: the embedding's dtype (no draws)
        self.embed = OneHotEmbedding(self.padded_vocab_size, cfg.d_model, norm.weight)
        schedule = zip(kernels(cfg), dilations(cfg), strict=True)
        self.blocks = nn.ModuleList(ConvBlock(cfg, k, dilation, layers) for k, dilation in schedule)
        self.norm = norm
        self.lm_head = MLMHead(cfg, self.padded_vocab_size, layers)
        self.finish_init(layers)
        self._init_weights()

    def _init_weights(self) -> None:
        """GPN's _init_weights: linears N(0, init_std), LayerNorm scales 1; the convolutions keep torch's default."""
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
            elif not isinstance(module, nn.Conv1d):
                init_normal_(module, self.cfg.init_std)

    def set_checkpoint_function(self, fn: Callable | None) -> None:
        """BlockStack's, and the embedding's output made to require a gradient where fn (DeepSpeed's checkpoint,
        reentrant) checkpoints whole segments of blocks (OneHotEmbedding)."""
        super().set_checkpoint_function(fn)
        self.embed.requires_input_grad = fn is not None and self.cfg.checkpointing in ("full", "every_k")

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters; exclude_embeddings drops the decoder, the only vocabulary matrix (the one-hot
        embedding has none)."""
        n = sum(p.numel() for p in self.parameters())
        return n - (self.lm_head.decoder.weight.numel() if exclude_embeddings else 0)

    def vocab_parameters(self) -> list[nn.Parameter]:
        """The decoder's weight: the one vocabulary matrix (what Muon leaves to AdamW)."""
        return [self.lm_head.decoder.weight]

    def pipeline_layers(self) -> PipelineLayers:
        raise ValueError("pipeline parallelism is not implemented for --model.family=gpn")

    def compile_blocks(self) -> None:
        raise ValueError(f"--model.compile is not supported with --model.family={self.cfg.family}")

    def set_sequence_parallel(self, attention: Callable | None, rank: int = 0, size: int = 1, exchange=None) -> None:
        """Whole sequences only: sequence parallelism would need each chunk's convolutions to read halos of the
        neighbouring chunks (family.py parallel_rules), which is not implemented. size 1 restores whole sequences."""
        if size > 1:
            raise ValueError("sequence parallelism is not implemented for --model.family=gpn")
        self.sequence_parallel_size = 1
