"""The fine-tuning configuration (layer L0): what `megagenome finetune` trains, from which pretrained model, on which
labelled sequences; standard library only, like sections.py. `megagenome finetune --help` prints every field's
docstring; a YAML file given with --config sets the same keys (unknown keys are errors).

    model       the pretrained backbone (a run or export directory), the layer and pooling the head reads, LoRA
    data        the labelled sequences: a Genomic Benchmarks directory, or a FASTA with BED files carrying labels
    train       batches, schedule, the DeepSpeed JSON, evaluation cadence and early stopping
    checkpoint  cadence (every evaluation) and resume
    log         the run directory and what the run shows
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

TASK_METRICS = {
    "classification": ("loss", "accuracy", "mcc", "auroc"),
    "regression": ("loss", "spearman", "pearson", "mse"),
    "per_base": ("loss", "accuracy", "mcc", "auroc"),
}
DEFAULT_METRIC = {"classification": "mcc", "regression": "spearman", "per_base": "mcc"}
LR_FRACTION = 0.25  # --train.lr unset: this fraction of the pretraining run's peak learning rate
LR_FALLBACK = 1e-4  # --train.lr unset and no pretraining config to read it from


@dataclass
class TaskModelConfig:
    """The pretrained model and the task head on it."""

    pretrained: str = ""
    """A `megagenome pretrain` run directory (its newest complete checkpoint, or --model.step) or a `megagenome
    export` directory: the backbone's shape and weights (any family, any checkpoint layout)."""
    step: int | None = None
    """Checkpoint step of --model.pretrained to start from (a run directory only; default: its newest)."""
    init: Literal["pretrained", "random"] = "pretrained"
    """pretrained: the backbone starts from --model.pretrained's weights. random: the same architecture with freshly
    initialised weights (seeded by --train.seed), trained on the task alone: the from-scratch control that shows what
    pretraining bought."""
    layer: int | None = None
    """Backbone layer the head reads: -1 the final norm's output (what the LM head reads), i in 1..n_layer block i's
    output (the layers past it are not run). Only -1 uses the DeepSpeed JSON's activation checkpointing. Unset: chosen
    on the validation split by linear probes of the final norm and up to 4 blocks before training
    (run/task_probe.py); the choice is in task.json and summary.json."""
    pooling: Literal["mean", "last", "centre"] | None = None
    """Sequence tasks: how the head sees a sequence: mean over its bases, its last base (for a causal model the one
    position that has seen the whole sequence) or its middle base. Per-base tasks read every position. Unset: chosen
    on validation with --model.layer (as above)."""
    rc_average: bool | None = None
    """Evaluate on both strands: validation, the test and an export's predictions average the outputs of each sequence
    and its reverse complement (per-base outputs mapped back onto the forward strand). Default: on when
    --data.rc_prob > 0 (the model trains on both strands), off otherwise."""
    head_dropout: float = 0.1
    """Dropout on the pooled features before the head's linear layer."""
    lora: bool = False
    """Train LoRA adapters (the peft library) on the backbone's block projections and the head, with the backbone's
    own weights frozen; `megagenome export` merges them into the weights. False: full fine-tuning."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is lora_alpha / lora_r x B A)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch's input."""
    freeze_backbone: bool = False
    """Train the head alone (a linear probe of the chosen layer); the backbone stays as pretrained."""


@dataclass
class TaskDataConfig:
    """The labelled sequences, read whole before training starts."""

    task: Literal["classification", "regression", "per_base"] = "classification"
    """classification: a class per sequence; regression: a value per sequence; per_base: a class per base."""
    benchmark: str = ""
    """A directory in the Genomic Benchmarks layout: train/ and test/, each with a folder of one-sequence .txt files
    per class, or a FASTA per class (<class>.fa), or train.csv and test.csv (columns seq, label). Classification."""
    fasta: str = ""
    """With BED files: the genome the intervals are cut from (plain or BGZF)."""
    train_bed: str = ""
    """BED of the training intervals over --data.fasta, the label in column --data.label_column (classification,
    regression), or the windows whose bases --data.annotation_bed labels (per_base)."""
    validation_bed: str = ""
    """BED of the validation intervals (default: --data.validation_fraction of the training set, held out)."""
    test_bed: str = ""
    """BED of the test intervals (with --data.benchmark, its test/ split)."""
    label_column: int = 4
    """1-based BED column holding the label (4: the name column)."""
    annotation_bed: str = ""
    """per_base: the features that label the bases of each window (their name, column 4, is the class; a base in
    none is "background")."""
    validation_fraction: float = 0.1
    """Fraction of the training set held out for validation (stratified by class, seeded) when no validation set is
    given."""
    max_len: int | None = None
    """Crop longer sequences to their central max_len bases (default: a sequence longer than the model's context
    --model.max_seq_len of the pretrained config is an error naming it)."""
    rc_prob: float = 0.5
    """Probability of training on a sequence's reverse complement (per-base labels reversed with it): a label that
    holds on either strand (a species, a GC content, a repeat). Set 0 for a strand-specific task, where the label
    belongs to the sequence as written (a promoter or splice site read 5' to 3' on its gene's strand)."""
    seed: int = 1234
    """Seed of the validation split, the training order and the reverse-complement draws."""


@dataclass
class TaskTrainConfig:
    """Batches, optimisation schedule, the DeepSpeed engine JSON, evaluation and early stopping."""

    ds_config: str | list[str] = "ds_configs/zero1_bf16.json"
    """DeepSpeed JSON (or an ordered list of fragments merged deep) with the engine knobs: ZeRO stage 0-3, offload,
    bf16/fp16, activation checkpointing. The keys this config owns (batch sizes, optimizer, scheduler, clipping)
    may not be set in it."""
    micro_batch_size: int = 16
    """Sequences per forward pass on one rank."""
    grad_accum_steps: int = 1
    """Micro batches per optimizer step; the global batch is micro x accumulation x ranks."""
    max_steps: int = 1000
    """Optimizer steps at most (early stopping may end the run sooner)."""
    stop_at: int | None = None
    """Stop this invocation after this step with a checkpoint (a later invocation resumes); default: max_steps."""
    lr: float | None = None
    """Peak learning rate (AdamW). Default: a quarter (LR_FRACTION) of the pretraining run's peak --train.lr, read
    from its config.yaml (the default job's 4e-3 gives 1e-3), or 1e-4 (LR_FALLBACK) when the pretrained directory
    records none (an export, an import, a fine-tuning run). benchmarks/results/finetune_recipes.md measures it."""
    head_lr_scale: float = 1.0
    """The head's peak learning rate as a multiple of --train.lr (the schedule scales both alike): the head starts
    from random weights where the backbone is pretrained."""
    layer_lr_decay: float = 1.0
    """Layer-wise learning-rate decay: block i of the backbone's n (0 next to the embedding) trains at --train.lr x
    decay^(n - i), the embedding at decay^(n + 1); the final norm and the head are not decayed. 1: off (the default:
    benchmarks/results/finetune_recipes.md measures 0.8)."""
    min_lr: float = 0.0
    """Learning rate at the end of the schedule."""
    warmup_steps: int | None = None
    """Linear warmup steps (default: 5% of --train.max_steps)."""
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """Learning-rate schedule after warmup, down to min_lr at max_steps."""
    weight_decay: float = 0.01
    """AdamW weight decay of matrices (biases and norms are not decayed)."""
    grad_clip: float = 1.0
    """Global gradient-norm clipping (0: off)."""
    eval_interval: int = 100
    """Evaluate on the validation set (and save a checkpoint) every N steps, and at the last step."""
    log_interval: int = 10
    """Write a training row to metrics.jsonl every N steps."""
    patience: int = 5
    """Stop after this many evaluations in a row without improving --train.metric (0: never stop early)."""
    metric: Literal["auto", "loss", "accuracy", "mcc", "auroc", "spearman", "pearson", "mse"] = "auto"
    """Validation metric that early stopping and the kept best checkpoint follow (auto: mcc for classification and
    per_base, spearman for regression)."""
    seed: int = 1234
    """Seed of the head's initialisation, LoRA's and dropout."""
    num_threads: int | None = None
    """CPU threads per rank (default: the cores divided by the ranks on this node)."""


@dataclass
class TaskCheckpointConfig:
    """Checkpoints: one at every evaluation; the best by --train.metric is kept until the run ends."""

    resume: str = "auto"
    """auto: continue from the run directory's newest complete checkpoint if there is one; none: start afresh (an
    existing checkpoint is refused); or a checkpoint directory."""
    keep_last: int = 2
    """Newest checkpoints kept besides the best one (at least --train.patience + 1 are kept while it may matter)."""


@dataclass
class TaskLogConfig:
    """Where the run writes and what it shows."""

    run_dir: str = "runs/finetune"
    """Run directory: config.yaml, ds_config.json, task.json, metrics.jsonl, predictions, checkpoints/."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    tensorboard: bool = True
    """Write TensorBoard event files of every metrics row into <run dir>/tensorboard."""


@dataclass
class FinetuneConfig:
    """Everything a fine-tuning run needs."""

    model: TaskModelConfig = field(default_factory=TaskModelConfig)
    """The pretrained model and the head."""
    data: TaskDataConfig = field(default_factory=TaskDataConfig)
    """The labelled sequences."""
    train: TaskTrainConfig = field(default_factory=TaskTrainConfig)
    """Batches, schedule, engine JSON, evaluation, early stopping."""
    checkpoint: TaskCheckpointConfig = field(default_factory=TaskCheckpointConfig)
    """Checkpoint resume and retention."""
    log: TaskLogConfig = field(default_factory=TaskLogConfig)
    """Run directory and console output."""


def rc_average(cfg: FinetuneConfig) -> bool:
    """Whether evaluation averages both strands (--model.rc_average, by default whether --data.rc_prob > 0)."""
    return cfg.model.rc_average if cfg.model.rc_average is not None else cfg.data.rc_prob > 0


def metric_of(cfg: FinetuneConfig) -> str:
    """The validation metric early stopping follows (--train.metric, auto resolved by the task)."""
    return DEFAULT_METRIC[cfg.data.task] if cfg.train.metric == "auto" else cfg.train.metric


def finetune_problems(cfg: FinetuneConfig) -> list[str]:
    """Every problem of the config alone (files and the pretrained model are checked by run/finetune.py), each
    naming its flag."""
    m, d, t, c = cfg.model, cfg.data, cfg.train, cfg.checkpoint
    out = []
    if not m.pretrained:
        out.append("--model.pretrained: give the pretraining run or export directory to fine-tune")
    if m.init == "random" and (m.lora or m.freeze_backbone):
        which = "--model.lora" if m.lora else "--model.freeze_backbone"
        out.append(f"--model.init random with {which}: the from-scratch control trains every weight of the backbone "
                   "(a frozen or adapted random backbone is not one); drop one of them")  # fmt: skip
    if bool(d.benchmark) == bool(d.train_bed):
        out.append("--data.benchmark or --data.train_bed (with --data.fasta): give exactly one")
    if d.train_bed and not d.fasta:
        out.append("--data.fasta: the BED intervals need the genome they are cut from")
    if d.task == "per_base" and not d.annotation_bed:
        out.append("--data.annotation_bed: a per_base task labels bases by the features of this BED")
    if d.task != "per_base" and d.annotation_bed:
        out.append(f"--data.annotation_bed applies to --data.task per_base, not {d.task}")
    if d.benchmark and d.task != "classification":
        out.append(f"--data.benchmark holds class folders: --data.task must be classification, not {d.task}")
    if d.benchmark and (d.validation_bed or d.test_bed):
        out.append("--data.validation_bed / --data.test_bed go with --data.train_bed, not --data.benchmark")
    if not 0.0 <= d.validation_fraction < 1.0:
        out.append(f"--data.validation_fraction={d.validation_fraction} must be in [0, 1)")
    if not d.validation_bed and d.validation_fraction == 0.0:
        out.append("--data.validation_fraction=0 with no --data.validation_bed: early stopping needs a validation set")
    if not 0.0 <= d.rc_prob <= 1.0:
        out.append(f"--data.rc_prob={d.rc_prob} must be in [0, 1]")
    if d.max_len is not None and d.max_len < 1:
        out.append(f"--data.max_len={d.max_len} must be positive")
    if d.label_column < 1:
        out.append(f"--data.label_column={d.label_column} is 1-based")
    metric = metric_of(cfg)
    if metric not in TASK_METRICS[d.task]:
        allowed = ", ".join(TASK_METRICS[d.task])
        out.append(f"--train.metric={metric} is not a {d.task} metric (one of {allowed}, or auto)")
    for flag, value in (
        ("--train.micro_batch_size", t.micro_batch_size),
        ("--train.grad_accum_steps", t.grad_accum_steps),
        ("--train.max_steps", t.max_steps),
        ("--train.eval_interval", t.eval_interval),
        ("--train.log_interval", t.log_interval),
        ("--model.lora_r", m.lora_r),
    ):
        if value < 1:
            out.append(f"{flag}={value} must be at least 1")
    if t.patience < 0:
        out.append(f"--train.patience={t.patience} must be 0 (off) or more")
    if t.stop_at is not None and not 1 <= t.stop_at <= t.max_steps:
        out.append(f"--train.stop_at={t.stop_at} must be in 1..--train.max_steps={t.max_steps}")
    if t.warmup_steps is not None and not 0 <= t.warmup_steps <= t.max_steps:
        out.append(f"--train.warmup_steps={t.warmup_steps} must be in 0..--train.max_steps={t.max_steps}")
    if (t.lr is not None and t.lr <= 0) or t.min_lr < 0 or (t.lr is not None and t.min_lr > t.lr):
        out.append(f"--train.lr={t.lr} and --train.min_lr={t.min_lr}: need 0 <= min_lr <= lr, lr > 0")
    if t.head_lr_scale <= 0:
        out.append(f"--train.head_lr_scale={t.head_lr_scale} must be positive")
    if not 0 < t.layer_lr_decay <= 1:
        out.append(f"--train.layer_lr_decay={t.layer_lr_decay} must be in (0, 1]")
    if m.lora and m.freeze_backbone:
        out.append("--model.lora and --model.freeze_backbone: LoRA already freezes the backbone's weights; pick one")
    if not 0.0 <= m.head_dropout < 1.0 or not 0.0 <= m.lora_dropout < 1.0:
        out.append("--model.head_dropout and --model.lora_dropout must be in [0, 1)")
    if c.keep_last < 1:
        out.append(f"--checkpoint.keep_last={c.keep_last} must be at least 1")
    return out


def with_lr(cfg: FinetuneConfig, pretraining_lr: float | None) -> tuple[FinetuneConfig, list[str]]:
    """cfg with --train.lr resolved (given, or LR_FRACTION of the pretraining run's peak, or LR_FALLBACK), and the
    problems of the resolved value (a --train.min_lr above it)."""
    t = cfg.train
    if t.lr is None:
        lr = LR_FALLBACK if pretraining_lr is None else pretraining_lr * LR_FRACTION
        t = dataclasses.replace(t, lr=lr)
    problems = []
    if t.min_lr > t.lr:
        origin = "" if cfg.train.lr is not None else " (the default: a quarter of the pretraining run's peak)"
        problems.append(f"--train.min_lr={t.min_lr} is above --train.lr={t.lr:g}{origin}: lower it or set --train.lr")
    return dataclasses.replace(cfg, train=t), problems


def warmup_steps(cfg: FinetuneConfig) -> int:
    """--train.warmup_steps, or 5% of --train.max_steps when not given."""
    t = cfg.train
    return t.warmup_steps if t.warmup_steps is not None else t.max_steps // 20


def finetune_dict(cfg: FinetuneConfig) -> dict:
    """Plain nested dict of the config (what the run's config.yaml holds)."""
    return dataclasses.asdict(cfg)
