"""The caduceus family (layer L1): model/family.py's interface for CaduceusLM (model.py), Caduceus' BiMamba masked
language model, reverse-complement equivariant by parameter sharing (ps) or post hoc (post_hoc).

What the rest of megagenome knows of it is answered here. It runs whole on each rank, data parallel and under ZeRO
(every module runs once per forward, both strands stacked along the batch, as ZeRO-3's parameter hooks want): tensor,
sequence and pipeline parallelism are refused before launch, each with its reason. INT8 takes the linears of the
blocks; the cost model is costs.py's; there is no Hugging Face form yet.
"""

from __future__ import annotations

import math

from megagenome.config import ModelConfig
from megagenome.model.caduceus.costs import CaduceusShape
from megagenome.model.caduceus.model import CaduceusLM
from megagenome.model.family import ModelFamily, ParallelRules
from megagenome.model.stack import padded_vocab_size

# The LM head's rows for megagenome's DNA vocabulary (data/tokenizer.py, 8 tokens): run_flops is given the parameter
# count, not the vocabulary.
DNA_VOCAB_ROWS = 8

REFUSED = {
    "tensor": "tensor parallelism is not implemented for Caduceus yet (its linears are made by the layer factory, "
    "but the per-channel conv, A_log, D and step bias, and the strand-mapped head, are not split)",
    "sequence": "the selective scan's state would have to pass from each rank's chunk to the next (and backwards for "
    "the reverse direction), which is not implemented",
    "pipeline": "the RC-PS stream (both strands stacked along the batch) and the strand-mapped LM head are not cut "
    "into pipeline layers",
}


class CaduceusFamily(ModelFamily):
    """caduceus (the module docstring)."""

    name = "caduceus"
    partition_dims: dict[str, int] = {}  # no tensor parallelism yet

    def build(self, cfg: ModelConfig, vocab_size: int, layers=None) -> CaduceusLM:
        return CaduceusLM(cfg, vocab_size, layers)

    def parameter_counts(self, cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
        """(whole model, one block), from the cost model's table (tests check it against the built model)."""
        shape = self.costs(cfg, vocab_size)
        return shape.n_params(), shape.block_params()

    def padded_vocab_size(self, vocab_size: int) -> int:
        return padded_vocab_size(vocab_size)

    def tied_weights(self, cfg: ModelConfig) -> dict[str, str]:
        return {"lm_head.weight": "embed.weight"} if cfg.tie_embeddings else {}

    def parallel_rules(self, cfg: ModelConfig, vocab_size: int) -> ParallelRules:
        untied = () if cfg.tie_embeddings else ("Linear",)
        classes = ("Embedding", "CaduceusBlock", "RMSNorm", *untied)
        return ParallelRules(
            (), (), ("--model.n_layer", cfg.n_layer, "caduceus block"), (classes, classes), refused=dict(REFUSED)
        )

    def pipeline_prefixes(self, cfg: ModelConfig) -> list[str]:
        """The order of the layers a pipeline would cut (it is refused: REFUSED)."""
        return ["embed.", *(f"blocks.{i}." for i in range(cfg.n_layer)), "norm.", "lm_head."]

    def costs(self, cfg: ModelConfig, vocab_size: int) -> CaduceusShape:
        return CaduceusShape.of(cfg, vocab_size)

    def shape_problems(self, cfg: ModelConfig) -> list[str]:
        """What keeps the cost model from being defined (the planner reports it before anything else)."""
        sizes = ("d_model", "n_layer", "ssm_expand", "state_size", "ssm_conv_len")
        problems = [f"--model.{k}={getattr(cfg, k)}: must be positive" for k in sizes if getattr(cfg, k) <= 0]
        if cfg.dt_rank is not None and cfg.dt_rank <= 0:
            problems.append(f"--model.dt_rank={cfg.dt_rank}: must be positive (or unset: ceil(d_model / 16))")
        return problems

    def run_flops(
        self, cfg: ModelConfig, n_params: int, block_params: int, seq_len: int, early_stop: bool, pipeline: bool
    ) -> tuple[float, float, float, float]:
        return self.costs(cfg, DNA_VOCAB_ROWS).run_flops(
            seq_len, cfg.checkpointing, early_stop, pipeline, cfg.checkpoint_every
        )

    def quantizable(self, name: str) -> bool:
        """The linears of the blocks (in_proj, x_proj, dt_proj, out_proj); embedding, head and norms stay."""
        return name.startswith("blocks.")

    def describe(self, cfg: ModelConfig) -> str:
        dt = cfg.dt_rank if cfg.dt_rank is not None else math.ceil(cfg.d_model / 16)
        return (
            f"caduceus ({cfg.rc_equivariance}): d_model {cfg.d_model}, {cfg.n_layer} BiMamba layers, expand "
            f"{cfg.ssm_expand}, state {cfg.state_size}, conv {cfg.ssm_conv_len}, dt_rank {dt}, "
            f"context {cfg.max_seq_len}"
        )


CADUCEUS = CaduceusFamily()
