"""Static checks of a run config and a data manifest (layer L0): every problem, each naming its flag.

Checks here need nothing but the config itself. Checks that need the world size (the parallel layout and the
batch identity: parallel/layout.py), the DeepSpeed JSON (train/ds_config.py) or the files on disk (the FASTA,
the resume target: assembly.py) run later, before any process group starts; config/load.py points each message
at the YAML file and line that set the flag.
"""

from __future__ import annotations

import importlib.util
import re
import signal

from megagenome.config.sections import (
    CheckpointConfig,
    DataConfig,
    LogConfig,
    ManifestConfig,
    ModelConfig,
    RootConfig,
    TrainConfig,
    parse_region,
)

_SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ConfigError(ValueError):
    """One or more configuration problems, each naming the flag (and file, line where known)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} configuration problem(s):\n{lines}")


def validate(cfg: RootConfig) -> list[str]:
    """Every static problem with the config, as messages naming the flag. Empty when valid."""
    return (
        _model_problems(cfg.model)
        + _data_problems(cfg.data, cfg.model)
        + _train_problems(cfg.train)
        + _checkpoint_problems(cfg.checkpoint, cfg.train)
        + _log_problems(cfg.log)
        + _distill_problems(cfg)
        + _spike_problems(cfg)
        + _compile_problems(cfg)
    )


def _compile_problems(cfg: RootConfig) -> list[str]:
    """--model.compile compiles DNATransformer's blocks (model/transformer.py compile_blocks): pipeline stages are
    built from the blocks by DeepSpeed's PipelineModule, where the flag would silently do nothing, and the tensor- and
    sequence-parallel communication inside a block is untested under torch.compile. (ZeRO-3 is refused with the
    DeepSpeed JSON, parallel/layout.py.)"""
    p = cfg.parallel
    if not cfg.model.compile:
        return []
    reasons = {
        "pipeline": "DeepSpeed's PipelineModule runs the blocks as its own layers, which are not compiled",
        "tensor": "the tensor-parallel all-reduces inside a block are not tested under torch.compile",
        "sequence": "the Ulysses all-to-alls inside a block are not tested under torch.compile",
    }
    return [
        f"--model.compile with --parallel.{name}={getattr(p, name)}: {why}; drop --model.compile"
        for name, why in reasons.items()
        if getattr(p, name) > 1
    ]


def _spike_problems(cfg: RootConfig) -> list[str]:
    """Under pipeline parallelism a spike is found only after its update (train/divergence.py): skipping it would go
    on from weights it changed."""
    t = cfg.train
    if t.spike_sigmas > 0 and t.on_spike == "skip" and cfg.parallel.pipeline > 1:
        return [
            f"--train.on_spike=skip with --parallel.pipeline={cfg.parallel.pipeline}: DeepSpeed's pipeline engine "
            "applies a step's update before its loss is known, so a spike cannot be skipped; use --train.on_spike "
            "rollback or stop"
        ]
    return []


def _distill_problems(cfg: RootConfig) -> list[str]:
    """Distillation runs the teacher beside a whole student on each rank: no model-parallel student."""
    if not cfg.train.distill_from:
        return []
    p = cfg.parallel
    if p.tensor * p.pipeline * p.sequence > 1:
        return [
            f"--train.distill_from needs a student without model parallelism (--parallel.tensor={p.tensor}, "
            f"--parallel.pipeline={p.pipeline}, --parallel.sequence={p.sequence}); use ZeRO 0-3 over data-parallel "
            "ranks instead"
        ]
    return []


def _positive(pairs: list[tuple[str, object]]) -> list[str]:
    return [f"--{flag}={value}: must be positive" for flag, value in pairs if value is None or value <= 0]


def _within_unit(pairs: list[tuple[str, float]]) -> list[str]:
    return [f"--{flag}={value}: must be within [0, 1]" for flag, value in pairs if not 0.0 <= value <= 1.0]


def _model_problems(m: ModelConfig) -> list[str]:
    problems = _positive(
        [("model.d_model", m.d_model), ("model.n_layer", m.n_layer), ("model.n_head", m.n_head)]
        + [("model.max_seq_len", m.max_seq_len)]
    )
    if m.d_model > 0 and m.n_head > 0:
        if m.d_model % m.n_head:
            problems.append(f"--model.d_model={m.d_model} is not divisible by --model.n_head={m.n_head}")
        elif (m.d_model // m.n_head) % 2:
            problems.append(
                f"head size --model.d_model/--model.n_head={m.d_model // m.n_head} must be even for rotary embeddings"
            )
    if m.attention == "fa3" and m.dropout > 0:
        problems.append(f"--model.attention=fa3 with --model.dropout={m.dropout}: FlashAttention-3 has no dropout")
    if m.checkpointing == "every_k" and not 0 < m.checkpoint_every <= max(m.n_layer, 1):
        problems.append(
            f"--model.checkpoint_every={m.checkpoint_every}: must be within [1, --model.n_layer={m.n_layer}]"
        )
    if m.d_ff is not None and m.d_ff <= 0:
        problems.append(f"--model.d_ff={m.d_ff}: must be positive")
    return problems + _within_unit([("model.dropout", m.dropout)])


def _data_problems(d: DataConfig, m: ModelConfig) -> list[str]:
    problems = _positive([("data.seq_len", d.seq_len), ("data.eval_windows", d.eval_windows)])
    if d.seq_len > m.max_seq_len:
        problems.append(f"--data.seq_len={d.seq_len} is above the model's maximum --model.max_seq_len={m.max_seq_len}")
    problems += _within_unit([("data.rc_prob", d.rc_prob), ("data.mlm_probability", d.mlm_probability)])
    if m.objective == "mlm" and not 0.0 < d.mlm_probability <= 1.0:
        problems.append(f"--data.mlm_probability={d.mlm_probability}: the mlm objective needs a positive masking rate")
    for flag, value in [
        ("data.softmask_weight", d.softmask_weight),
        ("data.eval_softmask_weight", d.eval_softmask_weight),
    ]:
        if value < 0:
            problems.append(f"--{flag}={value}: must be non-negative")
    if d.max_n_run < 0:
        problems.append(f"--data.max_n_run={d.max_n_run}: must be non-negative")
    if bool(d.fasta) == bool(d.prepared):
        problems.append(
            "give exactly one of --data.fasta (a FASTA file to train on) and --data.prepared (a directory written "
            "by `megagenome prepare`)"
        )
    if d.blend_period is not None and d.blend_period < 1:
        problems.append(f"--data.blend_period={d.blend_period}: must be positive")
    if d.group_aware and not d.prepared:
        problems.append("--data.group_aware needs --data.prepared: groups are defined by a prepare manifest")
    for flag, ranges in [("data.val_ranges", d.val_ranges), ("data.test_ranges", d.test_ranges)]:
        for r in ranges:
            try:
                parse_region(r)
            except ValueError as e:
                problems.append(f"--{flag}: {e}")
    split_flags = [f for f in ("val_contigs", "val_ranges", "test_contigs", "test_ranges") if getattr(d, f)]
    if d.prepared and split_flags:
        problems.append(
            f"--data.{split_flags[0]} does not apply with --data.prepared: the held-out split of prepared data is "
            "set per source in the prepare manifest"
        )
    if d.fasta and not (d.val_contigs or d.val_ranges):
        problems.append("--data.val_contigs or --data.val_ranges must name the held-out data used for evaluation")
    return problems


def _train_problems(t: TrainConfig) -> list[str]:
    problems = _positive(
        [("train.micro_batch_size", t.micro_batch_size), ("train.grad_accum_steps", t.grad_accum_steps)]
        + [("train.max_steps", t.max_steps), ("train.lr", t.lr), ("train.log_interval", t.log_interval)]
    )
    if t.min_lr < 0 or t.min_lr > t.lr:
        problems.append(f"--train.min_lr={t.min_lr}: must be within [0, --train.lr={t.lr}]")
    if t.warmup_steps < 0 or t.warmup_steps > t.max_steps:
        problems.append(f"--train.warmup_steps={t.warmup_steps}: must be within [0, --train.max_steps={t.max_steps}]")
    if t.lr_scaling != "none" and (t.reference_batch is None or t.reference_batch <= 0):
        problems.append(f"--train.lr_scaling={t.lr_scaling} needs a positive --train.reference_batch")
    if not t.ds_config:
        problems.append("--train.ds_config must name at least one DeepSpeed JSON file")
    if t.grad_clip < 0:
        problems.append(f"--train.grad_clip={t.grad_clip}: must be non-negative (0 disables clipping)")
    if not (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1):
        problems.append(f"--train.beta1={t.beta1} and --train.beta2={t.beta2} must be within [0, 1)")
    if t.stop_at is not None and not 0 < t.stop_at <= t.max_steps:
        problems.append(f"--train.stop_at={t.stop_at}: must be within [1, --train.max_steps={t.max_steps}]")
    if t.hang_timeout_s < 0:
        problems.append(f"--train.hang_timeout_s={t.hang_timeout_s:g}: must be >= 0 (0 disables the watchdog)")
    problems += _positive([("train.spike_window", t.spike_window), ("train.sync_interval", t.sync_interval)])
    if t.nonfinite_limit < 0 or t.max_restarts < 0:
        problems.append(
            f"--train.nonfinite_limit={t.nonfinite_limit} and --train.max_restarts={t.max_restarts}: must be >= 0"
        )
    if t.spike_sigmas < 0:
        problems.append(f"--train.spike_sigmas={t.spike_sigmas:g}: must be >= 0 (0 disables the spike detector)")
    if t.num_threads is not None and t.num_threads <= 0:
        problems.append(f"--train.num_threads={t.num_threads}: must be positive")
    if not 0 <= t.distill_alpha <= 1:
        problems.append(f"--train.distill_alpha={t.distill_alpha:g}: must be within [0, 1]")
    if not t.distill_temperature > 0:
        problems.append(f"--train.distill_temperature={t.distill_temperature:g}: must be positive")
    return problems


def _checkpoint_problems(c: CheckpointConfig, t: TrainConfig) -> list[str]:
    problems = _positive([("checkpoint.keep_last", c.keep_last)])
    if t.eval_interval < 0 or c.interval < 0:
        problems.append("--train.eval_interval and --checkpoint.interval must be non-negative (0: only at the end)")
    if not c.grace_s > 0:
        problems.append(f"--checkpoint.grace_s={c.grace_s:g}: must be positive (seconds)")
    try:
        signal_number(c.signal)
    except ValueError as e:
        problems.append(f"--checkpoint.signal={c.signal}: {e}")
    return problems


def _log_problems(log: LogConfig) -> list[str]:
    problems = []
    if log.peak_tflops is not None and not log.peak_tflops > 0:
        problems.append(f"--log.peak_tflops={log.peak_tflops:g}: must be positive (TFLOP/s of one device)")
    if log.wandb and importlib.util.find_spec("wandb") is None:
        problems.append("--log.wandb=true needs the wandb package: pip install 'megagenome[wandb]'")
    return problems


def signal_number(name: str | None) -> int | None:
    """The number of the signal named `name` (SIGUSR1, usr1, ...), None for none. ValueError if not catchable."""
    if name is None or name.strip().lower() in ("", "none"):
        return None
    key = name.strip().upper()
    key = key if key.startswith("SIG") else "SIG" + key
    uncatchable = {"SIGKILL", "SIGSTOP"}
    if key in uncatchable or key not in signal.Signals.__members__:
        raise ValueError("not a signal a process can catch: give a name such as SIGUSR1, SIGUSR2 or SIGTERM, or none")
    return int(signal.Signals[key])


def validate_manifest(m: ManifestConfig) -> list[str]:
    """Problems of a manifest, each naming the source and key."""
    problems = []
    if not m.sources:
        problems.append("sources: the manifest lists no source")
    if m.max_n_run < 0:
        problems.append(f"max_n_run={m.max_n_run}: must be >= 0")
    seen: set[str] = set()
    for i, src in enumerate(m.sources):
        where = f"sources[{i}]" + (f" ({src.name})" if src.name else "")
        if not _SOURCE_NAME.match(src.name):
            problems.append(f"{where}.name={src.name!r}: give a name of letters, digits, '.', '_' or '-'")
        elif re.search(r"\.hap\d+$", src.name):
            problems.append(f"{where}.name={src.name!r}: names ending in .hapN are kept for a VCF's haplotype shards")
        elif src.name in seen:
            problems.append(f"{where}.name: {src.name!r} is used by two sources")
        seen.add(src.name)
        if not src.fasta:
            problems.append(f"{where}.fasta: required")
        if src.weight is not None and not src.weight > 0:
            problems.append(f"{where}.weight={src.weight}: must be positive")
        if src.flank < 0:
            problems.append(f"{where}.flank={src.flank}: must be >= 0")
        if src.flank and not src.bed:
            problems.append(f"{where}.flank={src.flank} needs a bed file of intervals to flank")
        if src.sample is not None and not src.vcf:
            problems.append(f"{where}.sample={src.sample!r} needs a vcf")
        for key in ("val_ranges", "test_ranges"):
            for text in getattr(src, key):
                try:
                    parse_region(text)
                except ValueError as e:
                    problems.append(f"{where}.{key}: {e}")
    return problems
