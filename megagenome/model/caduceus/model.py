"""CaduceusLM (layer L1): the module of the caduceus family (family.py), a BlockStack (model/stack.py) of BiMamba
blocks (mamba.py), reverse-complement equivariant in one of Caduceus' two ways (--model.rc_equivariance):

    ps        Caduceus-PS: RC-PS parameter sharing. The embedding gives the 2d stream [E(x), flip_{T,ch}(E(rc(x)))],
              every block and the final norm act on its two halves with the same d_model-wide module, and the head
              reads both: logits = W a_t + W[complement] flip_ch(b_t) (W the tied embedding, as Caduceus). The stream
              is kept folded (rc.py): each block runs once per forward on the batch of both strands, (2B, T, d), and
              the logits are head(f(x)) + rc-mapped head(f(rc(x))), exactly equivariant by construction:
              logits(rc(x)) = flip_T(logits(x))[..., complement]. The parameters are a d_model model's; the
              activations and FLOPs are twice a plain model's.
    post_hoc  Caduceus-Ph: a plain BiMamba stack of d_model, trained on reverse-complement augmented data
              (--data.rc_prob); in eval mode logits() (so forward()'s loss) average the logits of both strands,
              rc-mapped, so inference is equivariant too. In training mode logits() are the plain model's.

hidden() and layer_states() give, for ps, the unfolded 2 x d_model stream (B, T, 2d): [the forward strand's, the
reverse strand's flipped over positions and channels]; for post_hoc the plain model's (B, T, d), never averaged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from megagenome.config import ModelConfig
from megagenome.model.caduceus import rc
from megagenome.model.caduceus.mamba import CaduceusBlock
from megagenome.model.family import PipelineLayers
from megagenome.model.layers import DenseLayers, RMSNorm, init_normal_
from megagenome.model.stack import BlockStack
from megagenome.model.vocabulary import vocabulary_of


class CaduceusLM(BlockStack):
    """A Caduceus masked language model for single-nucleotide DNA tokens (module docstring).

    layers: the layer factory (model/layers.py): DenseLayers, or TensorParallelLayers for one tensor-parallel rank's
    shard (mamba.py's layout; the embedding vocabulary-parallel, the tied head sharded alike but its logits gathered:
    the strand mapping permutes the vocabulary across the ranks' blocks, so the loss is the dense one on the whole
    logits, (2B, T, padded) on every rank)."""

    context_limit = "the cost model and the plan are sized to it; a Mamba model has no position table"

    def __init__(self, cfg: ModelConfig, vocab_size: int, layers: DenseLayers | None = None):
        super().__init__()
        layers = layers or DenseLayers()
        self.begin(cfg, vocab_size)
        self.parameter_sharing = cfg.rc_equivariance == "ps"
        # Built in this order (the seed's draws follow it): embedding, blocks, final norm, (tied) head.
        self.embed = layers.embedding(self.padded_vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(CaduceusBlock(cfg, layers) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        tied = self.embed if cfg.tie_embeddings else None
        self.lm_head = layers.head(cfg.d_model, self.padded_vocab_size, tied=tied, gather=True)
        self.register_buffer("complement", rc.complement_index(self.padded_vocab_size), persistent=False)
        # The complement in a published token table's rows (None: megagenome's, where rows are its ids).
        ids = vocabulary_of(cfg).ids  # plain ints: the buffer may be on the meta device (parameter counting)
        rows = None if self.token_rows is None else rc.row_complement_index(self.padded_vocab_size, ids)
        self.register_buffer("_row_complement", rows, persistent=False)
        self.finish_init(layers)
        self.token_loss = None  # the head gathers its logits: cross entropy of the whole logits
        self._init_weights()

    def _init_weights(self) -> None:
        """N(0, init_std) for the projections and the embedding, RMSNorm scales 1, out_proj at init_std /
        sqrt(n_layer) (GPT-2's residual rule with Mamba's one residual branch per block); the step projection, conv,
        A_log and D keep Mamba's initialisation (mamba.py)."""
        for name, module in self.named_modules():
            if name.endswith(".dt_proj"):
                continue
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            else:
                init_normal_(module, self.cfg.init_std)
        residual_std = self.cfg.init_std / math.sqrt(max(self.cfg.n_layer, 1))
        for block in self.blocks:
            for projection in block.residual_projections():
                init_normal_(projection, residual_std)

    def _both_strands(self) -> bool:
        """Whether logits() reads both strands: always under ps, in eval mode under post_hoc."""
        return self.parameter_sharing or not self.training

    def table_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, table_rows) masked-base logits over the token table. ps: the RC-PS head over both halves of the
        stream (a sum); post_hoc: in eval mode the average over both strands, in training mode the plain model's
        (module docstring)."""
        if not self._both_strands():
            return super().table_logits(input_ids)
        B = input_ids.shape[0]
        complement = self.complement if self._row_complement is None else self._row_complement
        both = self.lm_head(BlockStack.hidden(self, rc.strands(input_ids, self.complement)))  # (2B, T, padded)
        logits = both[:B] + rc.reverse_complement_logits(both[B:], complement)  # (B, T, padded)
        if not self.parameter_sharing:
            logits = logits / 2
        return logits[..., : self.table_rows]

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final norm's output: ps the RC-PS stream (B, T, 2 d_model), post_hoc the plain (B, T, d_model) of the
        forward strand (not averaged)."""
        if not self.parameter_sharing:
            return super().hidden(input_ids)
        return rc.unfold(super().hidden(rc.strands(input_ids, self.complement)))  # (B, T, 2d)

    def layer_states(self, input_ids: torch.Tensor, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """BlockStack.layer_states; ps: each state the RC-PS stream (B, T, 2 d_model), post_hoc (B, T, d_model) of
        the forward strand."""
        if not self.parameter_sharing:
            return super().layer_states(input_ids, layers)
        folded = super().layer_states(rc.strands(input_ids, self.complement), layers)
        return {layer: rc.unfold(state) for layer, state in folded.items()}

    def compile_blocks(self) -> None:
        raise ValueError(f"--model.compile is not supported with --model.family={self.cfg.family}")

    def set_sequence_parallel(self, attention: Callable | None, rank: int = 0, size: int = 1, exchange=None) -> None:
        """Whole sequences only: the scan's state would have to pass from rank to rank (family.py refuses
        --parallel.sequence above 1)."""
        if size > 1:
            raise ValueError(f"sequence parallelism is not implemented for --model.family={self.cfg.family}")
        self.sequence_parallel_size = 1

    def pipeline_layers(self) -> PipelineLayers:
        raise ValueError(
            f"pipeline parallelism is not implemented for --model.family={self.cfg.family}: the RC-PS stream and the "
            "strand-mapped head are not cut into pipeline layers"
        )
