"""What every family's language model shares (layer L1): a token embedding, a stack of blocks, a final RMSNorm and
a (tied) LM head, with the loss, distillation, checkpointing policy and parameter accounting around them.

A family's module (model/transformer/model.py DNATransformer, model/hyena/model.py HyenaLM) subclasses BlockStack,
builds `embed`, `blocks`, `norm` and `lm_head` with its layer factory, and calls `finish_init`; its blocks take and
return (B, T, d_model) and offer `set_recompute(fn)` (selective checkpointing: fn(function, *args) recomputes the
block's costly core in backward; None keeps it).

forward() returns the weighted loss together with its numerator and denominator (nll_sum in nats, weight_sum), so
the training loop can sum them over micro-batches and ranks and report exact bits per base instead of averaging
per-batch means.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megagenome.config import ModelConfig
from megagenome.model.decoding import DecodeState
from megagenome.model.distill import Teacher, distill_sums
from megagenome.model.family import PipelineLayers
from megagenome.model.layers import RMSNorm
from megagenome.model.vocabulary import table_rows, vocabulary_of

# Embedding rows are padded to a multiple of this so the LM-head matmul has tensor-core friendly shapes.
VOCAB_MULTIPLE = 8
# layer_states' name for the final norm's output (the LM head's input); 0 is the embedding's, i block i's.
FINAL_NORM = -1


def padded_vocab_size(vocab_size: int) -> int:
    """Rows of the embedding and LM head: vocab_size rounded up to a multiple of VOCAB_MULTIPLE."""
    return VOCAB_MULTIPLE * math.ceil(vocab_size / VOCAB_MULTIPLE)


def layers_problem(layers: Sequence[int], n_blocks: int) -> str:
    """Why `layers` are not layers of BlockStack.layer_states for a stack of n_blocks blocks, or ''."""
    bad = sorted(set(layers) - {FINAL_NORM, *range(n_blocks + 1)})
    if bad or not layers:
        return (
            f"{', '.join(map(str, bad)) or 'none'}: the model has {n_blocks} blocks; a layer is 0 (the embedding "
            f"output), 1..{n_blocks} (the output of that block) or {FINAL_NORM} (the final norm, the LM head's input)"
        )
    return ""


class BlockStack(nn.Module):
    """embed -> blocks -> norm -> lm_head, and the LanguageModel protocol's methods over them (model/family.py)."""

    cfg: ModelConfig
    vocab_size: int
    padded_vocab_size: int
    embed: nn.Module
    blocks: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    # Why the context ends at --model.max_seq_len, for the error of a longer sequence (hidden()).
    context_limit = "the model's position tables end there"

    def build(self, cfg: ModelConfig, vocab_size: int, layers, blocks: Callable[[], list[nn.Module]]) -> None:
        """Check the shape, then build embed, blocks() (the family's), norm and the (tied) head in this order (the
        seed's draws follow it: the same seed gives the same weights) and finish_init."""
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"--model.d_model={cfg.d_model} is not divisible by --model.n_head={cfg.n_head}")
        self.begin(cfg, vocab_size)
        self.embed = layers.embedding(self.padded_vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(blocks())
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_form)
        self.lm_head = layers.head(cfg.d_model, self.padded_vocab_size, tied=self.embed if cfg.tie_embeddings else None)
        self.finish_init(layers)

    def begin(self, cfg: ModelConfig, vocab_size: int) -> None:
        """Check the vocabulary and keep the config, the vocabulary size (megagenome's tokens, what logits() returns),
        the token table's rows (--model.vocabulary, model/vocabulary.py) and their padded count: how build() starts,
        and what a family that makes its own embedding or head (caduceus, gpn) calls before making them."""
        if vocab_size <= 0:
            raise ValueError(f"vocab_size={vocab_size}: must be positive")
        self.cfg = cfg
        self.vocab_size = vocab_size
        vocabulary = vocabulary_of(cfg)
        self.table_rows = table_rows(cfg, vocab_size)
        self.padded_vocab_size = padded_vocab_size(self.table_rows)
        if not vocabulary.own and len(vocabulary.ids) != vocab_size:
            raise ValueError(
                f"--model.vocabulary={vocabulary.name}: maps {len(vocabulary.ids)} tokens, not {vocab_size}"
            )
        # The table's row of each megagenome token id (None: the identity, megagenome's own table).
        rows = None if vocabulary.own else torch.tensor(vocabulary.ids, dtype=torch.long)
        self.register_buffer("token_rows", rows, persistent=False)

    def table_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """megagenome token ids (any shape) as the token table's rows; -100 (an ignored label) stays -100."""
        if self.token_rows is None:
            return ids
        return torch.where(ids >= 0, self.token_rows[ids.clamp(min=0)], ids)

    def finish_init(self, layers) -> None:
        """Install the default checkpoint function, no sequence parallelism, no teacher, and the factory's loss."""
        self.set_checkpoint_function(None)
        self.sequence_parallel_size = 1
        self.teacher: Teacher | None = None  # knowledge distillation (set_teacher); not a submodule
        # Per-token loss fn(head_output, labels) -> (B*T,) float32 cross entropy: a tensor-parallel factory's
        # vocabulary-parallel one takes the LM head's output shard (B, T, padded_vocab / tp) as it is. None: cross
        # entropy of the full logits.
        self.token_loss: Callable | None = layers.token_loss(self.embed, self.table_rows)

    def set_checkpoint_function(self, fn: Callable | None) -> None:
        """Install the activation-checkpoint function fn(function, *args) used by --model.checkpointing.

        None means torch.utils.checkpoint (non-reentrant); the training engine passes DeepSpeed's
        checkpoint function instead when the DeepSpeed JSON has an activation_checkpointing block.
        """
        self._checkpoint = fn or functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        selective = self.cfg.checkpointing == "selective"
        for block in self.blocks:
            block.set_recompute(self._checkpoint if selective else None)

    def set_teacher(self, teacher: Teacher | None) -> None:
        """Train on the blend of the usual loss and a frozen teacher's soft predictions (model/distill.py). The
        teacher stays outside the module tree: no parameters of it are trained, partitioned or saved. A whole
        model only (no tensor-parallel head)."""
        if teacher is not None and self.token_loss is not None:
            raise ValueError("distillation needs the whole LM head on each rank (no tensor parallelism)")
        object.__setattr__(self, "teacher", teacher)

    def _run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The block stack under the checkpointing policy: full = segments of 1 block, every_k = of k."""
        policy = self.cfg.checkpointing
        if policy in ("none", "selective") or not torch.is_grad_enabled():
            for block in self.blocks:
                x = block(x)  # (B, T, d_model)
            return x
        size = 1 if policy == "full" else self.cfg.checkpoint_every
        for start in range(0, len(self.blocks), size):
            segment = functools.partial(_run_segment, self.blocks[start : start + size])
            x = self._checkpoint(segment, x)  # (B, T, d_model); only the segment input is kept
        return x

    def table_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits over every row of the token table, (B, T, table_rows), in the model's dtype: what the loss reads."""
        # Padded rows are never valid targets; slicing them off keeps them out of the softmax.
        return self.lm_head(self.hidden(input_ids))[..., : self.table_rows]  # (B, T, table_rows)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token (clm) or masked-token (mlm) logits of megagenome's tokens, (B, T, vocab_size), in the model's
        dtype: the token table's rows of them (model/vocabulary.py)."""
        logits = self.table_logits(input_ids)  # (B, T, table_rows)
        return logits if self.token_rows is None else logits[..., self.token_rows]  # (B, T, vocab_size)

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 log-probabilities of megagenome's tokens, (B, T, vocab_size), normalised over the whole token table
        (a published table's other rows keep their share, as in its authors' softmax)."""
        logp = F.log_softmax(self.table_logits(input_ids).float(), dim=-1)  # (B, T, table_rows)
        return logp if self.token_rows is None else logp[..., self.token_rows]  # (B, T, vocab_size)

    def _check_length(self, input_ids: torch.Tensor) -> None:
        T = input_ids.size(1) * self.sequence_parallel_size  # input_ids: (B, T / sequence-parallel size)
        if T > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {T} is above --model.max_seq_len={self.cfg.max_seq_len} "
                f"({self.context_limit}); raise it or shorten --data.seq_len"
            )

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The LM head's input: the final-norm hidden states, (B, T, d_model)."""
        self._check_length(input_ids)
        x = self.embed(self.table_ids(input_ids))  # (B, T, d_model)
        x = self._run_blocks(x)  # (B, T, d_model)
        return self.norm(x)  # (B, T, d_model)

    def can_cache(self) -> bool:
        """Whether every block decodes from a cache (model/decoding.py; a block that can has new_cache)."""
        return all(hasattr(block, "new_cache") for block in self.blocks)

    def decode_state(self, batch: int, capacity: int) -> DecodeState:
        """An empty DecodeState for `batch` sequences of up to `capacity` positions, on the model's device and
        dtype."""
        if capacity > self.cfg.max_seq_len:
            raise ValueError(f"{capacity} positions are above --model.max_seq_len={self.cfg.max_seq_len} "
                             f"({self.context_limit})")  # fmt: skip
        weight = self.embed.weight
        caches = [block.new_cache(batch, capacity, weight.dtype, weight.device) for block in self.blocks]
        return DecodeState(caches, capacity)

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """The table logits (B, T, table_rows) of the next ids (B, T) at positions state.position.., their caches
        written and the state advanced (model/decoding.py): the prompt's prefill, then one base per step."""
        start = state.position
        if start + input_ids.size(1) > state.capacity:
            raise ValueError(f"decoding past the cache's {state.capacity} positions")
        x = self.embed(self.table_ids(input_ids))  # (B, T, d_model)
        for block, cache in zip(self.blocks, state.caches, strict=True):
            x = block(x, cache=cache, start=start)  # (B, T, d_model)
        state.position = start + input_ids.size(1)
        return self.lm_head(self.norm(x))[..., : self.table_rows]  # (B, T, table_rows)

    def layer_states(self, input_ids: torch.Tensor, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """The hidden states at `layers` from one forward pass of input_ids (B, T): {layer: (B, T, d_model)} in the
        model's dtype, in the order asked. Layer 0 is the embedding output, i in 1..n_layer the output of block i
        (the residual stream, before the final norm), FINAL_NORM (-1) the final norm's output: exactly hidden(),
        what the LM head reads. Blocks past the deepest layer asked for are not run, and none is checkpointed
        (this is for inference)."""
        n = len(self.blocks)
        problem = layers_problem(layers, n)
        if problem:
            raise ValueError(problem)
        self._check_length(input_ids)
        wanted = set(layers)
        x = self.embed(self.table_ids(input_ids))  # (B, T, d_model)
        states = {0: x} if 0 in wanted else {}  # only the layers asked for stay alive, as in hidden()
        deepest = n if FINAL_NORM in wanted else max(wanted)
        for i, block in enumerate(self.blocks[:deepest], start=1):
            x = block(x)  # (B, T, d_model)
            if i in wanted:
                states[i] = x
        if FINAL_NORM in layers:
            states[FINAL_NORM] = self.norm(x)  # (B, T, d_model)
        return {layer: states[layer] for layer in layers}

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        loss_weight: torch.Tensor,
        weight_total: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, nll_sum, weight_sum) for input_ids and labels (B, T) int64 and loss_weight (B, T) float.

        nll_sum = sum(cross_entropy * loss_weight) in nats, weight_sum = sum(loss_weight) and
        loss = nll_sum / max(weight_sum, 1). Labels at weight-0 positions may be -100 (ignored).

        weight_total (a 0-d tensor), given under sequence parallelism, is the loss denominator of the whole
        sequences this batch is one chunk of (their max(weight_sum, 1)); loss = nll_sum / weight_total is then
        this chunk's share, and the shares of all chunks add up to the loss of the whole sequences.
        """
        logits = None
        targets = self.table_ids(labels)  # the token table's rows (the labels themselves for megagenome's)
        if self.token_loss is not None:
            ce = self.token_loss(self.lm_head(self.hidden(input_ids)), targets)  # (B*T,)
        else:
            logits = self.table_logits(input_ids).flatten(0, 1)  # (B*T, table_rows)
            # Float32 log-softmax: under bf16 the logits' rounding would bias the loss.
            ce = F.cross_entropy(logits.float(), targets.flatten(), reduction="none")  # (B*T,)
        weight = loss_weight.float().flatten()  # (B*T,)
        nll_sum = (ce * weight).sum()
        weight_sum = weight.sum()
        denominator = weight_sum.clamp(min=1.0) if weight_total is None else weight_total.float()
        numerator = nll_sum
        if self.teacher is not None and self.training:
            # The blend is what is optimised; nll_sum stays the plain cross entropy, so logged losses and bits per
            # base mean what they mean without a teacher.
            teacher_logits = self.teacher.logits(input_ids).flatten(0, 1)  # (B*T, vocab_size)
            student = logits if self.token_rows is None else logits[:, self.token_rows]  # (B*T, vocab_size)
            numerator = distill_sums(student, teacher_logits, ce, weight, self.teacher)
        loss = numerator / denominator
        return loss, nll_sum, weight_sum

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, tied weights counted once.

        exclude_embeddings drops the vocabulary matrices (the token embedding and, when untied, the
        LM head), the usual "non-embedding" count of scaling-law papers.
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once
        if exclude_embeddings:
            n -= self.embed.weight.numel()
            if self.lm_head.weight is not self.embed.weight:
                n -= self.lm_head.weight.numel()
        return n

    def vocab_parameters(self) -> list[nn.Parameter]:
        """The token embedding and the LM head weights (one tensor when tied): the vocabulary matrices."""
        return list({id(p): p for p in (self.embed.weight, self.lm_head.weight)}.values())

    def pipeline_layers(self) -> PipelineLayers:
        """The model as the pipeline's layer list: embedding, the blocks and the final norm, the LM head."""
        return PipelineLayers(self.embed, [*self.blocks, self.norm], self.lm_head, self.cfg.tie_embeddings)

    def parameter_depths(self) -> dict[int, int]:
        """Each parameter's (by id) depth from the input: 0 the embedding, i + 1 block i (what layer-wise
        learning-rate decay reads: model/heads.py lr_scales); the final norm and the head are not listed."""
        depths = {id(p): 0 for p in self.embed.parameters()}
        for i, block in enumerate(self.blocks):
            depths.update({id(p): i + 1 for p in block.parameters()})
        return depths

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW parameter groups: matrices (linears, embedding) decay; norm scales and other 1-D tensors do not, nor
        parameters marked no_weight_decay (the Hyena filters, as HyenaDNA trains them)."""
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 and not getattr(p, "no_weight_decay", False) else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _run_segment(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)  # (B, T, d_model)
    return x
