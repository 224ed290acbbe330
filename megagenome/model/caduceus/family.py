"""The caduceus family (layer L1): model/family.py's interface for CaduceusLM (model.py), Caduceus' BiMamba masked
language model, reverse-complement equivariant by parameter sharing (ps) or post hoc (post_hoc).

What the rest of megagenome knows of it is answered here. It runs data parallel and under ZeRO (every module runs
once per forward, both strands stacked along the batch, as ZeRO-3's parameter hooks want) and tensor parallel
(mamba.py's layout: a block of the inner channels per rank, in_proj column-parallel with its rows interleaved per
channel, x_proj and out_proj row-parallel, dt_proj column-parallel, the per-channel tensors by channel; the
embedding and tied head by vocabulary rows, the head's logits gathered for the strand mapping: partition_dims);
sequence and pipeline parallelism are refused before launch, each with its reason. INT8 takes the linears of the
blocks; the cost model is costs.py's.
"""

from __future__ import annotations

import math

from megagenome.config import ModelConfig
from megagenome.model.caduceus import config
from megagenome.model.caduceus.costs import CaduceusShape
from megagenome.model.caduceus.model import CaduceusLM
from megagenome.model.family import Divisible, ModelFamily, ParallelRules
from megagenome.model.stack import padded_vocab_size
from megagenome.model.vocabulary import table_rows

# The LM head's rows for megagenome's DNA vocabulary (data/tokenizer.py, 8 tokens): run_flops is given the parameter
# count, not the vocabulary.
DNA_VOCAB_ROWS = 8

REFUSED = {
    "sequence": "the selective scan's state would have to pass from each rank's chunk to the next (and backwards for "
    "the reverse direction), which is not implemented",
    "pipeline": "the RC-PS stream (both strands stacked along the batch) and the strand-mapped LM head are not cut "
    "into pipeline layers",
}


CHANNELS = ("conv_weight", "conv_bias", "dt_bias", "A_log", "D")  # a direction's per-channel tensors


class CaduceusFamily(ModelFamily):
    """caduceus (the module docstring)."""

    name = "caduceus"
    muon_refusal = "Mamba's A_log and conv taps (2-D per-channel tensors, not matrices)"
    # Which dimension tensor parallelism splits, by state-dict key suffix (mamba.py): the vocabulary rows of the
    # embedding and tied head, in_proj's rows (u and z of a rank's channels together), each direction's
    # per-channel tensors and dt_proj's rows, x_proj's and out_proj's input columns.
    partition_dims = {
        "embed.weight": 0,
        "lm_head.weight": 0,
        "mixer.in_proj.weight": 0,
        "mixer.out_proj.weight": 1,
        **{
            f"mixer.{direction}.{name}": dim
            for direction in ("fwd", "rev")
            for name, dim in {**dict.fromkeys(CHANNELS, 0), "dt_proj.weight": 0, "x_proj.weight": 1}.items()
        },
    }

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
        inner, rows = cfg.ssm_expand * cfg.d_model, padded_vocab_size(table_rows(cfg, vocab_size))
        tensor = (
            Divisible(f"the inner width ssm_expand x d_model = {inner} (--model.ssm_expand, --model.d_model)", inner,
                      ": each tensor-parallel rank holds a block of the BiMamba channels"),
            Divisible(f"the padded vocabulary ({rows} rows)", rows, ": each tensor-parallel rank holds an equal block "
                      "of embedding rows"),
        )  # fmt: skip
        untied = () if cfg.tie_embeddings else ("Linear",)
        dense = ("Embedding", "CaduceusBlock", "RMSNorm", *untied)
        sharded = ("VocabParallelEmbedding", "CaduceusBlock", "RMSNorm", *(f"ColumnParallel{c}" for c in untied))
        return ParallelRules(
            tensor, (), ("--model.n_layer", cfg.n_layer, "caduceus block"), (dense, sharded), refused=dict(REFUSED)
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

    def huggingface(self, cfg: ModelConfig):
        """The export's Hugging Face form: a masked LM of megagenome's weight names and remote code of its own
        (hf.py), since transformers has no architecture that computes this model."""
        from megagenome.model.caduceus.hf import CaduceusForm

        return CaduceusForm(cfg)

    def config_problems(self, cfg: ModelConfig) -> list[str]:
        return config.problems(cfg)

    def describe(self, cfg: ModelConfig) -> str:
        dt = cfg.dt_rank if cfg.dt_rank is not None else math.ceil(cfg.d_model / 16)
        return (
            f"caduceus ({cfg.rc_equivariance}): d_model {cfg.d_model}, {cfg.n_layer} BiMamba layers, expand "
            f"{cfg.ssm_expand}, state {cfg.state_size}, conv {cfg.ssm_conv_len}, dt_rank {dt}, "
            f"context {cfg.max_seq_len}"
        )


CADUCEUS = CaduceusFamily()
