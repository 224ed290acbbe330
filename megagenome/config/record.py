"""What a checkpoint records of the run config, and what a resume may change (layer L0; standard library only).

resume_record is written into every checkpoint; config_differences compares it with a resuming run's config
(resume_checks.py, assembly.load), naming every key that differs; config_hash digests it.
"""

from __future__ import annotations

import hashlib
import json

from megagenome.config.sections import DataConfig, ModelConfig, RootConfig, to_dict

# Keys a resumed run may change: where the run started, how activations are recomputed, which attention kernel
# computes the same function, what evaluation scores, and where the training data lies (its content is compared
# instead: data/fingerprint.py). Every other model and data key must match the checkpoint's (resume_record,
# config_differences), the context keys unless allowed (CONTEXT_KEYS); the global batch is checked from the
# checkpoint's sample count.
RESUME_MAY_CHANGE = frozenset(
    {
        "data.fasta",
        "data.prepared",
        "model.init_from",
        "model.checkpointing",
        "model.checkpoint_every",
        "model.attention",
        "model.compile",
        "data.eval_windows",
        "data.eval_softmask_weight",
    }
)


# Keys added after checkpoints began recording their config: recorded only when not at their default, so that the
# record and config_hash of a run that does not use them are what they were before the keys existed (its older
# checkpoints still resume, assembly.load's hash check included); config_differences reads an absent key as its
# default.
RECORDED_WHEN_SET = frozenset(
    {
        "model.family",
        "model.layer_pattern",
        "model.short_filter_len",
        "model.se_filter_len",
        "model.mr_filter_len",
        "model.state_size",
        "model.filter_width",
        "model.rope_scaling",
        "model.rope_factor",
        "model.rope_original_max_len",
        "data.seq_warmup_lengths",
        "data.seq_warmup_steps",
        "data.seq_warmup_mode",
    }
)


def resume_record(cfg: RootConfig) -> dict:
    """The model and data keys a checkpoint depends on ({"model": {...}, "data": {...}}), recorded in every
    checkpoint so that a resume with another value is refused before anything starts, naming the key."""
    out = {}
    for section in ("model", "data"):
        defaults = to_dict(ModelConfig() if section == "model" else DataConfig())
        out[section] = {
            k: v
            for k, v in to_dict(getattr(cfg, section)).items()
            if f"{section}.{k}" not in RESUME_MAY_CHANGE
            and not (f"{section}.{k}" in RECORDED_WHEN_SET and v == defaults[k])
        }
    return out


# The keys that set the context a model trains at. They are recorded in every checkpoint (resume_record) and may
# differ from its values only with --checkpoint.allow_context_change: a run continued at a longer context, with or
# without rotary scaling (README "Context extension"). Nothing saved depends on them (the rotary tables are not
# saved); the sample sequence from the checkpoint's cursor on becomes the new window length's.
CONTEXT_KEYS = frozenset(
    {"model.max_seq_len", "data.seq_len", "model.rope_scaling", "model.rope_factor", "model.rope_original_max_len"}
)


def config_differences(saved: dict, cfg: RootConfig) -> list[str]:
    """'--model.d_model: checkpoint 32, this run 64' for every key of resume_record that differs; the context keys
    (CONTEXT_KEYS) only without --checkpoint.allow_context_change. A key the checkpoint does not record (it was
    written before the key existed) was at the key's default, which keeps the behaviour of that time."""
    current = resume_record(cfg)
    defaults = {"model": to_dict(ModelConfig()), "data": to_dict(DataConfig())}
    out = []
    for section, values in current.items():
        old = saved.get(section) or {}
        for key in sorted(set(values) | set(old)):
            name = f"{section}.{key}"
            if name in RESUME_MAY_CHANGE or (name in CONTEXT_KEYS and cfg.checkpoint.allow_context_change):
                continue
            before = old[key] if key in old else defaults[section].get(key)
            now = values.get(key, defaults[section].get(key))  # a key recorded only when set is at its default
            if before != now:
                hint = " (a context change: --checkpoint.allow_context_change true)" if name in CONTEXT_KEYS else ""
                out.append(f"--{name}: checkpoint {before!r}, this run {now!r}{hint}")
    return out


def config_hash(cfg: RootConfig) -> str:
    """SHA-256 of what a checkpoint depends on: model shape and data definition (resume_record)."""
    payload = json.dumps(resume_record(cfg), sort_keys=True)
    # The parallel layout is deliberately left out: a checkpoint converted to the universal format may be
    # loaded under another layout.
    return hashlib.sha256(payload.encode()).hexdigest()
