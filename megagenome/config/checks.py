"""Static checks of a run config and a data manifest (layer L0): every problem, each naming its flag.

Checks here need nothing but the config itself. Checks that need the world size (the parallel layout and the
batch identity: parallel/layout.py), the DeepSpeed JSON (engine/ds_config.py) or the files on disk (the FASTA,
the resume target: assembly.py) run later, before any process group starts; config/load.py points each message
at the YAML file and line that set the flag.
"""

from __future__ import annotations

import importlib.util
import math
import re
import signal

from megagenome.config.manifest import ManifestConfig
from megagenome.config.sections import (
    CheckpointConfig,
    DataConfig,
    LogConfig,
    ModelConfig,
    RootConfig,
    TrainConfig,
    parse_region,
)
from megagenome.config.shapes import form_problems

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
        model_problems(cfg.model)
        + _data_problems(cfg.data, cfg.model)
        + seq_warmup_problems(cfg)
        + _train_problems(cfg.train)
        + _checkpoint_problems(cfg.checkpoint, cfg.train)
        + _log_problems(cfg.log)
        + _distill_problems(cfg)
        + _spike_problems(cfg)
        + _compile_problems(cfg)
    )


def _compile_problems(cfg: RootConfig) -> list[str]:
    """--model.compile compiles DNATransformer's blocks (model/transformer/model.py compile_blocks): pipeline stages are
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


def model_problems(m: ModelConfig) -> list[str]:
    """The model section's family-neutral problems (validate runs them with the rest; `megagenome import` on what it
    mapped). A family's own keys are checked by its folder (model/__init__.py validate)."""
    problems = _positive(
        [("model.d_model", m.d_model), ("model.n_layer", m.n_layer), ("model.n_head", m.n_head)]
        + [("model.max_seq_len", m.max_seq_len)]
    )
    if m.d_model > 0 and m.n_head > 0 and m.d_model % m.n_head:
        problems.append(f"--model.d_model={m.d_model} is not divisible by --model.n_head={m.n_head}")
    if m.attention == "fa3" and m.dropout > 0:
        problems.append(f"--model.attention=fa3 with --model.dropout={m.dropout}: FlashAttention-3 has no dropout")
    if m.checkpointing == "every_k" and not 0 < m.checkpoint_every <= max(m.n_layer, 1):
        problems.append(
            f"--model.checkpoint_every={m.checkpoint_every}: must be within [1, --model.n_layer={m.n_layer}]"
        )
    if m.d_ff is not None and m.d_ff <= 0:
        problems.append(f"--model.d_ff={m.d_ff}: must be positive")
    return problems + _within_unit([("model.dropout", m.dropout)]) + _rope_problems(m) + form_problems(m)


def _rope_problems(m: ModelConfig) -> list[str]:
    """Rotary scaling (model/transformer/blocks.py rope_frequencies): a factor is a context multiple (>= 1), and neither
    it nor the trained context may be given without a scaling scheme, where they would silently do nothing."""
    problems = []
    if m.rope_scaling == "none":
        if m.rope_factor != 1.0:
            problems.append(
                f"--model.rope_factor={m.rope_factor} has no effect with --model.rope_scaling none: choose linear, ntk "
                "or yarn, or drop the factor"
            )
        if m.rope_original_max_len is not None:
            problems.append(
                f"--model.rope_original_max_len={m.rope_original_max_len} has no effect with --model.rope_scaling "
                "none: choose linear, ntk or yarn, or drop it"
            )
        return problems
    if not (m.rope_factor >= 1.0 and math.isfinite(m.rope_factor)):
        problems.append(
            f"--model.rope_factor={m.rope_factor}: must be a finite context multiple >= 1 (the extended context over "
            "the trained one)"
        )
    original = m.rope_original_max_len
    if original is not None and not 0 < original <= m.max_seq_len:
        problems.append(
            f"--model.rope_original_max_len={original}: the context trained at must be within [1, "
            f"--model.max_seq_len={m.max_seq_len}]"
        )
    elif m.rope_scaling == "yarn" and original and not math.isclose(original * m.rope_factor, m.max_seq_len):
        problems.append(  # transformers 4.x takes yarn's factor as max_position_embeddings / the original context
            f"--model.rope_original_max_len={original} x --model.rope_factor={m.rope_factor} must equal "
            f"--model.max_seq_len={m.max_seq_len} with yarn, so that an export loads as the same function in every "
            "transformers version (4.x reads the factor as their ratio); drop --model.rope_original_max_len"
        )
    head_dim = m.d_model // m.n_head if m.n_head > 0 else 0
    if m.rope_scaling == "ntk" and 0 < head_dim <= 2:
        problems.append(
            f"--model.rope_scaling ntk needs a head size above 2 (its base is rope_theta x factor^(d/(d-2))), got "
            f"{head_dim}: use linear or yarn"
        )
    return problems


def _data_problems(d: DataConfig, m: ModelConfig) -> list[str]:
    problems = _positive([("data.seq_len", d.seq_len), ("data.eval_windows", d.eval_windows)])
    if d.seq_len > m.max_seq_len:
        problems.append(f"--data.seq_len={d.seq_len} is above the model's maximum --model.max_seq_len={m.max_seq_len}")
    problems += _within_unit([("data.rc_prob", d.rc_prob), ("data.mlm_probability", d.mlm_probability)])
    if m.objective == "mlm" and not 0.0 < d.mlm_probability <= 1.0:
        problems.append(f"--data.mlm_probability={d.mlm_probability}: the mlm objective needs a positive masking rate")
    if m.objective == "mlm" and m.vocabulary == "bytes":
        problems.append(
            "--model.vocabulary bytes with --model.objective mlm: Evo's byte table has no mask token (its models are "
            "causal); use --model.objective clm"
        )
    for flag, value in [
        ("data.softmask_weight", d.softmask_weight),
        ("data.eval_softmask_weight", d.eval_softmask_weight),
    ]:
        if value < 0:
            problems.append(f"--{flag}={value}: must be non-negative")
    if d.max_n_run < 0:
        problems.append(f"--data.max_n_run={d.max_n_run}: must be non-negative")
    if d.fasta and d.prepared:
        problems.append(
            f"--data.fasta={d.fasta} and --data.prepared={d.prepared}: give one of them (prepared data replaces the "
            "FASTA, and its held-out split is the manifest's): use configs/tiny_prepared.yaml, or add "
            '--data.fasta "" --data.val_ranges "[]" to a config that sets them'
        )
    elif not d.fasta and not d.prepared:
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
            f'set per source in the prepare manifest; clear it with --data.{split_flags[0]} "[]"'
        )
    if d.fasta and not (d.val_contigs or d.val_ranges):
        problems.append("--data.val_contigs or --data.val_ranges must name the held-out data used for evaluation")
    return problems


def seq_warmup_problems(cfg: RootConfig) -> list[str]:
    """--data.seq_warmup_* (data/curriculum.py): stages of increasing lengths below --data.seq_len that the model
    takes, ending before --train.max_steps, in shapes every part of the run can change between steps."""
    d, par = cfg.data, cfg.parallel
    lengths, steps, flag = list(d.seq_warmup_lengths), list(d.seq_warmup_steps), "--data.seq_warmup_lengths"
    if not lengths and not steps:
        mode = d.seq_warmup_mode
        return [f"--data.seq_warmup_mode={mode} has no effect without {flag}"] if mode != "tokens" else []
    problems = []
    if len(lengths) != len(steps):
        problems.append(
            f"--data.seq_warmup_steps={steps} has {len(steps)} entries and {flag}={lengths} {len(lengths)}: give "
            "the steps of every stage"
        )
    if d.seq_warmup_mode not in ("tokens", "windows"):
        problems.append(f"--data.seq_warmup_mode={d.seq_warmup_mode!r}: must be tokens or windows")
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        problems.append(f"{flag}={lengths}: must be strictly increasing (the shortest windows first)")
    wrong = [L for L in lengths if not 0 < L < d.seq_len]
    if wrong:
        problems.append(f"{flag}={lengths}: {wrong} not within [1, --data.seq_len={d.seq_len}), the last stage")
    most = cfg.model.max_seq_len
    above = [L for L in lengths if L > most]
    if above:
        problems.append(f"{flag}={lengths}: {above} above the model's maximum --model.max_seq_len={most}")
    odd = [L for L in lengths if L > 0 and d.seq_len % L]
    if odd and d.seq_warmup_mode == "tokens":
        problems.append(
            f"{flag}={lengths}: {odd} do not divide --data.seq_len={d.seq_len}; --data.seq_warmup_mode tokens keeps "
            "the tokens per step with micro batches of --train.micro_batch_size x seq_len / length windows (or use "
            "--data.seq_warmup_mode windows)"
        )
    if any(n <= 0 for n in steps):
        problems.append(f"--data.seq_warmup_steps={steps}: every stage needs a positive number of steps")
    elif sum(steps) >= cfg.train.max_steps:
        problems.append(
            f"--data.seq_warmup_steps={steps}: the warmup's {sum(steps)} steps must end before --train.max_steps="
            f"{cfg.train.max_steps}, so that the run trains at --data.seq_len"
        )
    if par.pipeline > 1:
        problems.append(
            f"{flag} with --parallel.pipeline={par.pipeline}: DeepSpeed's pipeline engine sizes its micro batches and "
            "the buffers between stages once, from the first micro batch, so the window length cannot change in a run"
        )
    split = [L for L in lengths if L > 0 and L % par.sequence]
    if split and par.sequence > 1:
        problems.append(
            f"{flag}={lengths}: {split} not divisible by --parallel.sequence={par.sequence}: each sequence-parallel "
            "rank holds an equal chunk of every window"
        )
    return problems


def _train_problems(t: TrainConfig) -> list[str]:
    problems = _positive(
        [("train.micro_batch_size", t.micro_batch_size), ("train.grad_accum_steps", t.grad_accum_steps)]
        + [("train.max_steps", t.max_steps), ("train.lr", t.lr), ("train.log_interval", t.log_interval)]
    )
    if t.min_lr < 0 or t.min_lr > t.lr:
        problems.append(f"--train.min_lr={t.min_lr}: must be within [0, --train.lr={t.lr}]")
    if t.warmup_steps < 0 or t.warmup_steps > t.max_steps:
        problems.append(
            f"--train.warmup_steps={t.warmup_steps}: must be within [0, --train.max_steps={t.max_steps}] (to run only "
            f"the first {t.max_steps} steps of a longer schedule, keep its max_steps and give --train.stop_at "
            f"{t.max_steps})"
        )
    problems += _schedule_problems(t)
    if t.optimizer != "muon":  # Muon's flags would silently do nothing with another optimizer
        ignored = [f for f in ("muon_lr", "muon_momentum") if getattr(t, f) != getattr(TrainConfig(), f)]
        problems += [
            f"--train.{f} has no effect without --train.optimizer muon (this run's is {t.optimizer})" for f in ignored
        ]
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


def wsd_decay_steps(max_steps: int, fraction: float) -> int:
    """Steps of a wsd schedule's decay: fraction x max_steps rounded half up, at least 1. Never more steps for a
    smaller max_steps, so a longer run's stable phase covers a shorter one's (extending a run, engine/schedules.py)."""
    return max(1, math.floor(fraction * max_steps + 0.5))


def _schedule_problems(t: TrainConfig) -> list[str]:
    """--train.schedule and its wsd flags: the decay fits after the warmup, and the wsd flags are not set for
    another schedule (where they would silently do nothing)."""
    if t.schedule != "wsd":
        defaults = TrainConfig()
        ignored = [f for f in ("decay_fraction", "decay_shape") if getattr(t, f) != getattr(defaults, f)]
        return [f"--train.{f} applies to --train.schedule wsd only (this run's is {t.schedule})" for f in ignored]
    if not 0 < t.decay_fraction <= 1:
        return [f"--train.decay_fraction={t.decay_fraction:g}: must be within (0, 1] (the decaying share of max_steps)"]
    decay = wsd_decay_steps(t.max_steps, t.decay_fraction)
    if t.max_steps > 0 and t.warmup_steps + decay > t.max_steps:
        return [
            f"--train.warmup_steps={t.warmup_steps} plus the wsd decay's {decay} steps (--train.decay_fraction="
            f"{t.decay_fraction:g} of --train.max_steps={t.max_steps}) exceed max_steps: shorten the warmup or "
            f"the decay, or, to try the first steps of the run as configured, keep max_steps and give "
            f"--train.stop_at {t.max_steps} (it stops there, same schedule)"
        ]
    return []


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
        problems.append("--log.wandb=true needs the wandb package: pip install -e '.[wandb]' (the wandb extra)")
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
