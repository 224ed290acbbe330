"""The model-family interface (layer L1): what a family of DNA language models gives the rest of megagenome.

A family (the transformer today, model/transformer/) is one object, an instance of ModelFamily, registered in
model/__init__.py FAMILIES under its --model.family name; `family_of(cfg)` finds it. Everything outside model/
reaches a model through it and through the methods of the module it builds, never through the module's
attributes (its blocks, attention, MLP or embedding): the engine, the parallel layers, the planner, checkpoint
consolidation, export, quantization and inference all ask the family. What it answers:

    build(cfg, vocab_size, layers)      the model as a torch module, dense or this tensor-parallel rank's shard:
                                        `layers` is a layer factory (model/layers.py DenseLayers, or
                                        parallel/tensor_parallel.py TensorParallelLayers) that makes every
                                        projection, the embedding, the head and the loss; the same seed gives the
                                        same weights whatever the factory (a shard is the slice of the dense weight)
    parameter_counts(cfg, vocab_size)   (the whole model's parameters, tied weights once; one repeated block's)
    padded_vocab_size(vocab_size)       rows of its embedding and head (padded for tensor cores)
    expected_shapes(cfg, vocab_size)    the dense state dict's tensor shapes (built on the meta device)
    tied_weights(cfg)                   {alias: source} of state-dict keys that are one tensor (a tied LM head)
    partition_dims                      state-dict key suffix -> the dimension tensor parallelism splits
    parallel_rules(cfg, vocab_size)     what the tensor, sequence and pipeline degrees must divide (ParallelRules,
                                        checked by parallel/layout.py before launch)
    pipeline_prefixes(cfg)              the state-dict prefix of each layer of the pipeline's layer list, in order
    costs(cfg, vocab_size)              the planner's arithmetic (a cost model, a frozen dataclass whose fields are
                                        the shape the plan's JSON records, with methods: FLOPs per token in both
                                        attention conventions, recomputation, activation bytes per checkpointing
                                        policy, elementwise bytes, parameter tensors per rank, tensor-parallel
                                        traffic, describe(); model/transformer/costs.py TransformerShape is one)
    shape_problems(cfg)                 what keeps the cost model from being defined (the planner reports it)
    run_flops(cfg, ...)                 a run's FLOPs per token, model and hardware, in both conventions (MFU, HFU)
    quantizable(name)                   which linears INT8 export quantizes
    huggingface(cfg)                    the Hugging Face form of an export (weight names and config.json both ways;
                                        a form with trust_remote_code also gives code_files(), the modeling and
                                        configuration files written into the export), or None when there is none
    describe(cfg)                       one line of the model's shape, for model cards and reports
    config_problems(cfg), options,      its own keys' checks, the optional keys it reads, why it refuses Muon
    muon_refusal                        (model/__init__.py validate runs them with config/checks.py's)

The module build() returns (the LanguageModel protocol below) is what training, evaluation and inference call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from megagenome.config import ModelConfig


@dataclass(frozen=True)
class Divisible:
    """A size a parallel degree must divide, as a refusal names it: "{what} is not divisible by {degree}{why}"."""

    what: str  # e.g. "--model.n_head=4", "the MLP width d_ff=384 (--model.d_ff, ...)"
    size: int
    why: str = ""  # e.g. ": each tensor-parallel rank computes whole attention heads"


@dataclass(frozen=True)
class ParallelRules:
    """A family's rules for the parallel degrees of one config, checked by parallel/layout.py before launch.

    tensor: sizes --parallel.tensor must divide (heads, hidden widths, vocabulary rows); sequence: sizes
    --parallel.sequence x --parallel.tensor must divide (what each sequence-parallel rank holds whole over the full
    sequence); pipeline_units: how many pipeline layers of the repeated kind there are and what one is called (every
    stage needs at least one); pipeline_classes: the class names of the pipeline's layers that
    --parallel.pipeline_partition type:NAME may match, dense and under tensor parallelism; sequence_min_chunk: the
    positions each sequence-parallel rank's chunk must hold at least, and why; refused: the parallel degrees the family
    does not run, with the reason."""

    tensor: tuple[Divisible, ...]
    sequence: tuple[Divisible, ...]
    pipeline_units: tuple[str, int, str]  # (flag, count, what one unit is): ("--model.n_layer", 4, "transformer block")
    pipeline_classes: tuple[tuple[str, ...], tuple[str, ...]]
    # (positions, why): the fewest positions a sequence-parallel chunk may hold (a convolution's halo), 0: any
    sequence_min_chunk: tuple[int, str] = (0, "")
    # {"tensor" | "sequence" | "pipeline": why}: the degrees this family does not run above 1, and the reason the
    # refusal gives before launch (e.g. "--parallel.sequence=2 with --model.family=gpn: ...")
    refused: dict[str, str] = field(default_factory=dict)


@dataclass
class PipelineLayers:
    """A model as DeepSpeed's pipeline runs it: embedding (token ids -> x), body (x -> x each, in order), head
    (x -> logits); tied: the head is the embedding's matrix (the pipeline ties them across its first and last
    stage, rebuilding the embedding as an nn.Embedding, or a VocabParallelEmbedding under tensor parallelism, of
    the model's padded_vocab_size rows and its weight's width). engine/pipeline.py builds the PipelineModule."""

    embedding: nn.Module
    body: list[nn.Module]
    head: nn.Module
    tied: bool


class LanguageModel(Protocol):
    """What a family's module offers the engine, the loop, evaluation and inference (DNATransformer is one)."""

    cfg: ModelConfig
    vocab_size: int
    padded_vocab_size: int
    token_loss: Callable | None  # a vocabulary-parallel loss of the head's output shard, None: dense cross entropy

    def forward(self, input_ids, labels, loss_weight, weight_total=None) -> tuple[torch.Tensor, ...]:
        """(loss, nll_sum in nats, weight_sum): exact sums, so bits per base add up over micro batches and ranks."""

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, vocab_size) next-base (clm) or masked-base (mlm) logits of megagenome's tokens."""

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, vocab_size) float32 log-probabilities of megagenome's tokens, normalised over the model's whole token
        table (--model.vocabulary, model/vocabulary.py)."""

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, d) the head's input."""

    def layer_states(self, input_ids: torch.Tensor, layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """{layer: (B, T, d)} in one pass: 0 the embedding output, i block i's, -1 the final norm (= hidden())."""

    def num_parameters(self, exclude_embeddings: bool = False) -> int: ...

    def param_groups(self, weight_decay: float) -> list[dict]: ...

    def vocab_parameters(self) -> list[nn.Parameter]:
        """The vocabulary matrices (embedding, untied head): what Muon leaves to AdamW."""

    def set_checkpoint_function(self, fn: Callable | None) -> None: ...

    def set_sequence_parallel(self, attention: Callable | None, rank: int = 0, size: int = 1, exchange=None) -> None:
        """Chunk `rank` of `size` of every sequence: attention(core, q, k, v) runs an attention core over the whole
        sequence (DeepSpeed-Ulysses), exchange (parallel/sequence_conv.py ConvExchange) carries convolutions
        across chunks; each family uses what its layers need."""

    def set_teacher(self, teacher) -> None: ...

    def compile_blocks(self) -> None: ...

    def pipeline_layers(self) -> PipelineLayers: ...


class ModelFamily(ABC):
    """One family of models (module docstring)."""

    name: str
    partition_dims: dict[str, int]
    # The optional --model keys (config/shapes.py FAMILY_OPTIONS) this family's blocks read; set on another family,
    # one is refused before launch (model/__init__.py validate).
    options: frozenset[str] = frozenset()
    # What Muon's orthogonalised update would wrongly take in for this family (its 2-D parameters that are not linear
    # maps), refusing --train.optimizer muon; None: Muon applies.
    muon_refusal: str | None = None

    def config_problems(self, cfg: ModelConfig) -> list[str]:
        """The family's own keys' problems (model/<family>/config.py), each naming its flag."""
        return []

    @abstractmethod
    def build(self, cfg: ModelConfig, vocab_size: int, layers=None) -> nn.Module: ...

    @abstractmethod
    def parameter_counts(self, cfg: ModelConfig, vocab_size: int) -> tuple[int, int]: ...

    @abstractmethod
    def padded_vocab_size(self, vocab_size: int) -> int: ...

    def expected_shapes(self, cfg: ModelConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
        """The dense state dict's shapes, of a model built on the meta device (no memory, random stream untouched)."""
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            return {k: tuple(v.shape) for k, v in self.build(cfg, vocab_size).state_dict().items()}

    @abstractmethod
    def tied_weights(self, cfg: ModelConfig) -> dict[str, str]: ...

    def tie(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """`state` with every tied alias pointing at its source tensor (a checkpoint or export stores it once)."""
        for alias, source in self.tied_weights(cfg).items():
            if source in state:
                state[alias] = state[source]
        return state

    def untie(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """`state` without the tied aliases (safetensors stores no shared tensors)."""
        aliases = self.tied_weights(cfg)
        return {k: v.contiguous() for k, v in state.items() if k not in aliases}

    def partition_dim(self, name: str) -> int | None:
        """The dimension tensor parallelism splits the tensor `name` (a state-dict key) along; None: replicated."""
        for suffix, dim in self.partition_dims.items():
            if name == suffix or name.endswith("." + suffix):
                return dim
        return None

    @abstractmethod
    def parallel_rules(self, cfg: ModelConfig, vocab_size: int) -> ParallelRules: ...

    @abstractmethod
    def pipeline_prefixes(self, cfg: ModelConfig) -> list[str]: ...

    @abstractmethod
    def costs(self, cfg: ModelConfig, vocab_size: int): ...

    def shape_problems(self, cfg: ModelConfig) -> list[str]:
        return []

    @abstractmethod
    def run_flops(
        self, cfg: ModelConfig, n_params: int, block_params: int, seq_len: int, early_stop: bool, pipeline: bool
    ) -> tuple[float, float, float, float]:
        """(model FLOPs per token in the objective's convention, with every score counted, hardware FLOPs in the
        same two conventions) of a run at seq_len; early_stop: torch's checkpoint, which stops recomputing early;
        pipeline: pipeline stages recompute their segments."""

    @abstractmethod
    def quantizable(self, name: str) -> bool: ...

    def huggingface(self, cfg: ModelConfig):
        """The Hugging Face form of this config's exports, or None (the default: no Hugging Face architecture)."""
        return None

    @abstractmethod
    def describe(self, cfg: ModelConfig) -> str: ...


def bidirectional_problems(cfg: ModelConfig, how: str) -> list[str]:
    """A masked-LM-only family's two refusals: the causal objective (every position sees the bases after it: `how`
    says why) and --model.compile (only transformer blocks are compiled)."""
    problems = []
    if cfg.objective != "mlm":
        problems.append(
            f"--model.objective={cfg.objective} with --model.family={cfg.family}: the model {how}, so every "
            "position sees the bases after it; use --model.objective mlm"
        )
    if cfg.compile:
        problems.append(f"--model.compile with --model.family={cfg.family}: only transformer blocks are compiled")
    return problems
