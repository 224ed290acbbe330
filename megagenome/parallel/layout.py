"""ParallelLayout: how a run's ranks split the work, validated once (layer L1, standard library only).

    world size = tensor x sequence x pipeline x data-parallel

In the spirit of torchtitan's ParallelDims: one value that every command takes (`pretrain`, `plan`,
`find-micro-batch`, `preflight`), built by `ParallelLayout.build`, which checks every rule about the degrees and
their combinations with the model, the window length and the ZeRO stage, and reports every problem at once.
Nothing else divides the world size or computes the batch identity

    global batch = micro batch x gradient accumulation x data-parallel size

(`batch`). The layout also names what a checkpoint records about the ranks that wrote it (`record`), so a resume
under another layout is refused before DeepSpeed is asked to load (weights/checkpoint.py).

ParallelState (parallel/state.py) turns a layout into process groups on a running world.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megagenome.config.checks import ConfigError
from megagenome.config.sections import ModelConfig, ParallelConfig, TrainConfig

PARTITION_METHODS = ("parameters", "uniform")  # or "type:<layer class regex>" (DeepSpeed's PipelineModule)


class LayoutError(ConfigError):
    """A parallel layout that cannot run; every problem names its flag."""


@dataclass(frozen=True)
class BatchSizes:
    """Windows per forward pass on one rank, micro batches per optimizer step, windows per optimizer step."""

    micro: int
    grad_accum: int
    global_batch: int


@dataclass(frozen=True)
class ParallelLayout:
    """tensor x sequence x pipeline x data-parallel ranks over world_size, and the ZeRO stage that partitions the
    optimizer (and at stage 3 the parameters) over the sequence x data-parallel ranks."""

    world_size: int
    tensor: int = 1
    sequence: int = 1
    pipeline: int = 1
    zero_stage: int = 0

    @property
    def replica(self) -> int:
        """Ranks that hold one copy of the model between them: tensor x sequence x pipeline."""
        return self.tensor * self.sequence * self.pipeline

    @property
    def data_parallel(self) -> int:
        """Replicas of the model, each training on its own share of the batch."""
        return self.world_size // self.replica

    def batch(self, train: TrainConfig) -> BatchSizes:
        """The batch identity of --train.micro_batch_size and --train.grad_accum_steps on this layout."""
        return self.batch_of(train.micro_batch_size, train.grad_accum_steps)

    def batch_of(self, micro: int, grad_accum: int) -> BatchSizes:
        """The batch identity: global = micro x accumulation x data-parallel size."""
        return BatchSizes(micro, grad_accum, micro * grad_accum * self.data_parallel)

    def global_batch(self, train: TrainConfig) -> int:
        """--train.global_batch_size when given (what a new micro batch must divide), else the batch identity's."""
        return train.global_batch_size or self.batch(train).global_batch

    def batch_problems(self, train: TrainConfig) -> list[str]:
        """A --train.global_batch_size that the batch identity does not give."""
        b = self.batch(train)
        if (
            train.global_batch_size is None
            or b.micro <= 0
            or b.grad_accum <= 0
            or train.global_batch_size == b.global_batch
        ):
            return []
        return [
            f"--train.global_batch_size={train.global_batch_size} is not --train.micro_batch_size={b.micro} x "
            f"--train.grad_accum_steps={b.grad_accum} x data-parallel size {self.data_parallel} = {b.global_batch}"
        ]

    def record(self) -> dict:
        """What a checkpoint records about the ranks that wrote it (weights/checkpoint.py LAYOUT_KEYS)."""
        return {
            "world_size": self.world_size,
            "tensor": self.tensor,
            "pipeline": self.pipeline,
            "sequence": self.sequence,
            "data_parallel": self.data_parallel,
            "zero_stage": self.zero_stage,
        }

    @classmethod
    def from_record(cls, record: dict) -> ParallelLayout:
        """The layout a checkpoint's record (record()) describes."""
        return cls(record["world_size"], record["tensor"], record["sequence"], record["pipeline"], record["zero_stage"])

    def describe(self) -> str:
        """'2 ranks (tensor 1 x pipeline 1 x sequence 1 x data 2, ZeRO stage 1)'."""
        n = self.world_size
        return (
            f"{n} rank{'s' if n != 1 else ''} (tensor {self.tensor} x pipeline {self.pipeline} x sequence "
            f"{self.sequence} x data {self.data_parallel}, ZeRO stage {self.zero_stage})"
        )

    @classmethod
    def build(
        cls,
        world_size: int,
        parallel: ParallelConfig,
        model: ModelConfig,
        seq_len: int,
        rules,
        zero: dict | None = None,
        zero_source: str = "the DeepSpeed JSON",
        warmup_lengths: tuple[int, ...] = (),
    ) -> ParallelLayout:
        """The layout of `parallel` over `world_size` ranks for this model and window length, with the ZeRO stage of
        `zero` (the DeepSpeed JSON's zero_optimization section, set in `zero_source`). rules: the model family's
        ParallelRules for this model (model/family.py: what each degree must divide); warmup_lengths: the shorter
        windows of a sequence-length warmup (--data.seq_warmup_lengths), whose chunks must hold the family's halo
        too. Raises LayoutError listing every problem."""
        stage = (zero or {}).get("stage", 0)
        layout = cls(
            world_size, parallel.tensor, parallel.sequence, parallel.pipeline, stage if isinstance(stage, int) else 0
        )
        problems = _degree_problems(layout)
        problems += [
            f"--parallel.{degree}={getattr(parallel, degree)} with --model.family={model.family}: {why}"
            for degree, why in rules.refused.items()
            if getattr(parallel, degree) > 1
        ]
        if not problems:
            problems += _sequence_problems(layout, rules, seq_len, warmup_lengths)
            problems += _tensor_problems(layout, rules)
        problems += _pipeline_problems(parallel, model, rules)
        problems += _zero_problems(layout, zero or {}, zero_source)
        if model.compile and layout.zero_stage == 3:
            problems.append(
                f"--model.compile with {zero_source}: zero_optimization.stage=3 gathers each layer's parameters in "
                "forward hooks that DeepSpeed 0.19 marks torch.compiler.disable, so a compiled block cannot run as "
                "one graph; use ZeRO stage 0-2 or drop --model.compile"
            )
        if problems:
            raise LayoutError(problems)
        return layout


def _degree_problems(layout: ParallelLayout) -> list[str]:
    problems = [
        f"--{flag}={value}: must be at least 1"
        for flag, value in [
            ("parallel.tensor", layout.tensor),
            ("parallel.pipeline", layout.pipeline),
            ("parallel.sequence", layout.sequence),
        ]
        if value < 1
    ]
    if not problems and layout.world_size % layout.replica:
        problems.append(
            f"world size {layout.world_size} is not divisible by --parallel.tensor={layout.tensor} x "
            f"--parallel.sequence={layout.sequence} x --parallel.pipeline={layout.pipeline} = {layout.replica}; the "
            f"data-parallel size would be {layout.world_size / layout.replica:g}"
        )
    return problems


def _indivisible(sizes, degree: int, flags: str) -> list[str]:
    """A problem for each of a family's sizes (model/family.py Divisible) that `degree` does not divide."""
    return [f"{d.what} is not divisible by {flags}{d.why}" for d in sizes if d.size % degree]


def _sequence_problems(layout: ParallelLayout, rules, seq_len: int, warmup_lengths: tuple[int, ...] = ()) -> list[str]:
    """Sequence parallelism (DeepSpeed-Ulysses, parallel/sequence.py) splits every window; each rank holds the
    sizes of the family's rules.sequence (attention heads for the transformer) whole."""
    sp, tp, pp = layout.sequence, layout.tensor, layout.pipeline
    if sp <= 1:
        return []
    problems = []
    if seq_len > 0 and seq_len % sp:
        problems.append(
            f"--data.seq_len={seq_len} is not divisible by --parallel.sequence={sp}: each sequence-parallel "
            "rank holds an equal chunk of every window"
        )
    least, why = rules.sequence_min_chunk
    for flag, length in [("--data.seq_len", seq_len), *(("--data.seq_warmup_lengths", n) for n in warmup_lengths)]:
        if length > 0 and not length % sp and length // sp < least:
            problems.append(
                f"{flag}={length} over --parallel.sequence={sp} leaves {length // sp} positions per rank, fewer than "
                f"{least}: {why}"
            )
    flags = f"--parallel.sequence={sp}" + (f" x --parallel.tensor={tp}" if tp > 1 else "")
    problems += _indivisible(rules.sequence, sp * tp, flags)
    if pp > 1:
        problems.append(
            f"--parallel.sequence={sp} with --parallel.pipeline={pp} is not supported: DeepSpeed's pipeline "
            "engine reduces gradients over the data-parallel group only, not over sequence-parallel ranks"
        )
    return problems


def _tensor_problems(layout: ParallelLayout, rules) -> list[str]:
    """Tensor parallelism (parallel/tensor_parallel.py) splits what the family's rules.tensor names (heads, the
    MLP width and the vocabulary rows for the transformer)."""
    tp = layout.tensor
    return _indivisible(rules.tensor, tp, f"--parallel.tensor={tp}") if tp > 1 else []


def _pipeline_problems(par: ParallelConfig, m: ModelConfig, rules) -> list[str]:
    """Pipeline stages (engine/pipeline.py): the partition method, recomputation, layers per stage."""
    out = []
    method = par.pipeline_partition
    if method not in PARTITION_METHODS:
        # DeepSpeed matches type:NAME as a case-insensitive regex against the layers' class names.
        classes = list(rules.pipeline_classes[1 if par.tensor > 1 else 0])
        name = method[len("type:") :] if method.startswith("type:") else ""
        try:
            found = bool(name) and any(re.search(name, c, re.IGNORECASE) for c in classes)
        except re.error:
            found = False
        if not found:
            example = classes[1] if len(classes) > 1 else classes[0]  # the repeated layer, after the embedding
            out.append(
                f"--parallel.pipeline_partition={method!r}: use parameters, uniform or type:NAME with NAME "
                f"matching a layer class ({', '.join(classes)}), e.g. type:{example}"
            )
    if par.pipeline_checkpoint_interval < 0:
        out.append(f"--parallel.pipeline_checkpoint_interval={par.pipeline_checkpoint_interval}: must be >= 0")
    if par.pipeline <= 1:
        if par.pipeline_checkpoint_interval > 0:
            out.append(
                f"--parallel.pipeline_checkpoint_interval={par.pipeline_checkpoint_interval} only applies with "
                "--parallel.pipeline > 1; use --model.checkpointing without pipeline parallelism"
            )
        return out
    flag, units, unit = rules.pipeline_units
    if units < par.pipeline:
        out.append(f"{flag}={units} is below --parallel.pipeline={par.pipeline}: every stage needs at least one {unit}")
    if m.checkpointing in ("full", "every_k"):
        out.append(
            f"--model.checkpointing={m.checkpointing} is not run by the pipeline engine (it runs the layers "
            "itself): with --parallel.pipeline > 1 use --parallel.pipeline_checkpoint_interval N instead "
            "(recompute segments of N layers); --model.checkpointing selective still works"
        )
    return out


def _zero_problems(layout: ParallelLayout, zero: dict, source: str) -> list[str]:
    """ZeRO stages that DeepSpeed cannot combine with pipeline or sequence parallelism."""
    stage = zero.get("stage", 0)
    problems = []
    if layout.pipeline > 1 and isinstance(stage, int) and stage >= 2:
        problems.append(
            f"{source}: zero_optimization.stage={stage} cannot run with --parallel.pipeline={layout.pipeline}: "
            "DeepSpeed's pipeline engine rejects ZeRO stages 2 and 3 (it reduces gradients itself, after the last "
            "micro batch); use ZeRO stage 0 or 1 (e.g. ds_configs/zero1.json)"
        )
    if layout.sequence > 1 and stage == 3 and zero.get("reduce_scatter") is False:
        problems.append(
            f"{source}: zero_optimization.reduce_scatter=false at stage 3 cannot run with --parallel.sequence="
            f"{layout.sequence}: DeepSpeed 0.19 then scales sequence-parallel gradients differently from one "
            "reduction bucket to the next (see engine/engine.py sequence_parallel_grad_factor); drop the key "
            "(default true)"
        )
    return problems
