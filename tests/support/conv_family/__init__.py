"""A sixth model family that lives outside the package: a tiny causal convolutional DNA LM (tests/test_new_family.py).

It proves the family seam: a family is its folder (this one: the module, model.py; the family, here) plus one line
in the registry, `FAMILIES[CONV.name] = CONV` (megagenome/model/__init__.py holds the five built in), and it trains,
checkpoints, resumes, evaluates and exports through the same commands as the others without an edit anywhere else.
The contract it implements is model/family.py's ModelFamily; docs/architecture.md "Adding a family" walks through it.
"""

from __future__ import annotations

from megagenome.config import ModelConfig
from megagenome.model.family import Divisible, ModelFamily, ParallelRules
from megagenome.model.stack import padded_vocab_size
from megagenome.model.vocabulary import table_rows

from .model import KERNEL, ConvLM

DNA_VOCAB_ROWS = 8  # the rows run_flops prices the head at (megagenome's tokens, padded to 8)


class ConvFamily(ModelFamily):
    """conv: embedding, n_layer blocks of a causal depthwise convolution and a SwiGLU-free MLP, RMSNorm, a tied head."""

    name = "conv"
    partition_dims = {"embed.weight": 0}  # no tensor parallelism (refused below): only the vocabulary rows named

    def build(self, cfg: ModelConfig, vocab_size: int, layers=None) -> ConvLM:
        return ConvLM(cfg, vocab_size, layers)

    def parameter_counts(self, cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
        """(whole model, one block), counted on the meta device (the tied head once)."""
        shapes = self.expected_shapes(cfg, vocab_size)
        total = sum(_numel(s) for k, s in shapes.items() if k not in self.tied_weights(cfg))
        block = sum(_numel(s) for k, s in shapes.items() if k.startswith("blocks.0."))
        return total, block

    def padded_vocab_size(self, vocab_size: int) -> int:
        return padded_vocab_size(vocab_size)

    def tied_weights(self, cfg: ModelConfig) -> dict[str, str]:
        return {"lm_head.weight": "embed.weight"} if cfg.tie_embeddings else {}

    def parallel_rules(self, cfg: ModelConfig, vocab_size: int) -> ParallelRules:
        rows = padded_vocab_size(table_rows(cfg, vocab_size))
        why = "the test family runs data-parallel only"
        return ParallelRules(
            tensor=(Divisible(f"the padded vocabulary ({rows} rows)", rows),),
            sequence=(),
            pipeline_units=("--model.n_layer", cfg.n_layer, "convolution block"),
            pipeline_classes=(("ConvBlock",), ("ConvBlock",)),
            refused={degree: why for degree in ("tensor", "sequence", "pipeline")},
        )

    def pipeline_prefixes(self, cfg: ModelConfig) -> list[str]:
        return ["embed.", *(f"blocks.{i}." for i in range(cfg.n_layer)), "norm.", "lm_head."]

    def costs(self, cfg: ModelConfig, vocab_size: int):
        raise NotImplementedError("the test family has no cost model: `megagenome plan` does not price it")

    def run_flops(
        self, cfg: ModelConfig, n_params: int, block_params: int, seq_len: int, early_stop: bool, pipeline: bool
    ) -> tuple[float, float, float, float]:
        """6 FLOPs per parameter per token (forward and backward of every weight; the depthwise taps each once per
        position), no attention: model and hardware counts alike (no recomputation priced)."""
        flops = 6.0 * n_params
        return flops, flops, flops, flops

    def quantizable(self, name: str) -> bool:
        return name.startswith("blocks.") and name.endswith(("up", "down"))

    def describe(self, cfg: ModelConfig) -> str:
        return f"conv: d_model {cfg.d_model}, {cfg.n_layer} causal convolution blocks (kernel {KERNEL})"

    def config_problems(self, cfg: ModelConfig) -> list[str]:
        if cfg.objective != "clm":
            return [f"--model.objective={cfg.objective} with --model.family=conv: its convolutions are causal"]
        return []


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


CONV = ConvFamily()
