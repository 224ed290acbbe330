"""What a resume must agree with, checked before any process group starts (layer L4; assembly.validate calls it).

    checkpoint     --checkpoint.resume resolved to a complete checkpoint whose files verify against the list in
                   its COMPLETE marker (weights/checkpoint.py); with `auto`, a bad newest checkpoint is named and the
                   previous complete one taken, with a warning
    config         every model and data key of the checkpoint's recorded config (config.resume_record) equal to this
                   run's; the differing keys are listed with both values
    optimizer      --train.optimizer equal to the one that wrote the checkpoint (client_state.json "train_optimizer"; a
                   checkpoint without it was written by adamw): another optimizer cannot load its states
    data           the SHA-256 of the training data (data/fingerprint.py: the FASTA, or the prepared manifest and
                   each shard's recorded digest) equal to the checkpoint's, unless --checkpoint.allow_data_change
    layout         the parallel layout and global batch the checkpoint can resume under (weights/checkpoint.py); a
                   ZeRO 1-3 checkpoint of this run at another data-parallel size is converted to the universal
                   format when --checkpoint.convert_on_resize (Resume.convert), with the accumulation adjusted to
                   keep its global batch

Nothing is written here; pretrain.py converts (Resume.convert) once the ranks exist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from megagenome.config import RootConfig, config_differences, config_hash
from megagenome.data import fingerprint as data_fingerprint
from megagenome.files.run_files import UNIVERSAL
from megagenome.parallel.layout import ParallelLayout
from megagenome.weights import checkpoint


@dataclass
class Resume:
    """The checkpoint a run continues from and what was found on the way."""

    path: str | None = None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # printed by rank 0 (fallbacks, allowed data changes)
    data_changes: list[str] = field(default_factory=list)  # allowed by --checkpoint.allow_data_change
    convert: bool = False  # convert `path` to the universal format first (a data-parallel resize)
    cfg: RootConfig | None = None  # the run config to use (the accumulation adjusted for a resize), else unchanged


def resolve(cfg: RootConfig, layout: ParallelLayout | None, root: str, fingerprint: dict | None) -> Resume:
    """The checkpoint --checkpoint.resume names under `root`, checked against this run (module docstring)."""
    out = Resume(cfg=cfg)
    try:
        out.path, out.warnings = checkpoint.resolve_verified(cfg.checkpoint.resume, root, cfg.checkpoint.verify)
    except ValueError as e:
        out.problems.append(str(e))
        return out
    if out.path is None:
        if cfg.checkpoint.universal:
            out.problems.append(
                f"--checkpoint.universal true but --checkpoint.resume={cfg.checkpoint.resume} names no checkpoint "
                "to load: give the converted checkpoint's directory (<run dir>/checkpoints_universal by default)"
            )
        return out
    info = checkpoint.read_info(out.path)
    out.problems += _config_problems(out.path, info, cfg)
    out.problems += optimizer_problems(out.path, info, cfg)
    out.problems += _data_problems(out, info, cfg, fingerprint)
    if layout is not None:
        _layout_problems(
            out, info, cfg, layout, own=os.path.dirname(os.path.abspath(out.path)) == os.path.abspath(root)
        )
    return out


def _config_problems(path: str, info: dict, cfg: RootConfig) -> list[str]:
    saved = info.get("run_config")
    if saved is not None:
        diffs = config_differences(saved, cfg)
        if not diffs:
            return []
        return [
            f"checkpoint {path} was written with another model or data config ({len(diffs)} key(s) differ):\n    "
            + "\n    ".join(diffs)
            + "\n  restore these values to resume, or start a new --log.run_dir (nothing was written)"
        ]
    if info.get("config_hash") not in (None, config_hash(cfg)):  # a checkpoint that recorded only the hash
        return [
            f"checkpoint {path} was written with another model or data config (it records only a hash, so the keys "
            "cannot be named; its run directory's config.yaml of that time may): restore the original config or "
            "start a new --log.run_dir"
        ]
    return []


def optimizer_problems(path: str, info: dict, cfg: RootConfig) -> list[str]:
    """A resume with another --train.optimizer than the checkpoint's: its optimizer states (Adam moments, Muon
    momentum, 8-bit codes, Adafactor factors) are of another shape or kind, and DeepSpeed would fail half-way through
    loading or load them into the wrong slots. Checkpoints written before the field existed were adamw's."""
    saved = info.get("train_optimizer", "adamw")  # not "optimizer": DeepSpeed's own key in the client state
    if saved == cfg.train.optimizer:
        return []
    return [
        f"checkpoint {path} was written with --train.optimizer={saved}, this run has --train.optimizer="
        f"{cfg.train.optimizer}: its optimizer states cannot be loaded by another optimizer; resume with "
        f"--train.optimizer {saved}, or start a new --log.run_dir (nothing was written)"
    ]


def _data_problems(out: Resume, info: dict, cfg: RootConfig, current: dict | None) -> list[str]:
    saved = info.get("data")
    if not saved or not current:
        return []
    diffs = data_fingerprint.differences(saved, current)
    if not diffs:
        return []
    if cfg.checkpoint.allow_data_change:
        out.data_changes = diffs
        out.warnings.append(
            f"--checkpoint.allow_data_change: the training data differs from checkpoint {out.path}'s:\n    "
            + "\n    ".join(diffs)
        )
        return []
    return [
        f"the training data differs from what checkpoint {out.path} was trained on:\n    "
        + "\n    ".join(diffs)
        + "\n  restore the original data, or resume knowingly with --checkpoint.allow_data_change true"
    ]


def _layout_problems(out: Resume, info: dict, cfg: RootConfig, layout: ParallelLayout, own: bool) -> None:
    """The layout and batch checks; a convertible data-parallel resize of the run's own checkpoint (own: it lies in
    this run's checkpoints/, where the conversion goes beside it) becomes Resume.convert. Another run's checkpoint,
    named by --checkpoint.resume, is only read: its resize is refused with the command that converts it."""
    current = layout.record()
    resized = own and _resizable(out.path, info, cfg, current)
    if resized:
        step, samples = info.get("step") or 0, info.get("samples_consumed")
        global_batch = samples // step if step and samples is not None else layout.batch(cfg.train).global_batch
        micro, dp = cfg.train.micro_batch_size, layout.data_parallel
        if global_batch % (micro * dp):
            out.problems.append(
                f"checkpoint {out.path} was trained with a global batch of {global_batch}; at data-parallel size {dp} "
                f"with --train.micro_batch_size={micro} no gradient accumulation gives it: choose a micro batch "
                f"that divides {global_batch // dp if global_batch % dp == 0 else global_batch} evenly"
            )
            return
        accum = global_batch // (micro * dp)
        train = replace(cfg.train, grad_accum_steps=accum, global_batch_size=global_batch)
        out.cfg = replace(cfg, train=train, checkpoint=replace(cfg.checkpoint, universal=True))
        out.convert = True
        saved = checkpoint.describe(info.get("layout") or {})
        out.warnings.append(
            f"checkpoint {out.path} was saved by {saved}; this run has {layout.describe()}: converting it to the "
            f"universal format (--checkpoint.convert_on_resize) and continuing with its global batch {global_batch} "
            f"(gradient accumulation {accum})"
        )
        return
    global_batch = layout.batch(cfg.train).global_batch
    out.problems += checkpoint.resume_problems(out.path, current, cfg.checkpoint.universal, global_batch)
    if cfg.data.group_aware:
        out.problems += _group_problems(out.path, info, cfg, layout)


def _resizable(path: str, info: dict, cfg: RootConfig, current: dict) -> bool:
    """Whether the checkpoint differs from this run only in its ZeRO data-parallel partitions, and may be converted."""
    saved = info.get("layout") or {}
    if not cfg.checkpoint.convert_on_resize or cfg.checkpoint.universal or checkpoint.is_universal(path):
        return False
    if "world_size" not in saved or cfg.data.group_aware:
        return False
    same_model_parallel = all(saved.get(k) == current[k] for k in ("tensor", "pipeline", "sequence"))
    zero = saved.get("zero_stage", 0) > 0 and current["zero_stage"] > 0
    return (
        same_model_parallel
        and zero
        and current["pipeline"] == 1
        and saved.get("data_parallel") != current["data_parallel"]
    )


def _group_problems(path: str, info: dict, cfg: RootConfig, layout: ParallelLayout) -> list[str]:
    problems = []
    batch = layout.batch(cfg.train)
    saved_dp = (info.get("layout") or {}).get("data_parallel", layout.data_parallel)
    if saved_dp != layout.data_parallel:
        problems.append(
            f"--data.group_aware: checkpoint {path} was trained with {saved_dp} data-parallel ranks, this run has "
            f"{layout.data_parallel}; groups are assigned to ranks by their number, so resume with {saved_dp}"
        )
    saved_micro = info.get("micro_batch", batch.micro)
    if saved_micro != batch.micro:
        problems.append(
            f"--data.group_aware: checkpoint {path} was trained with --train.micro_batch_size={saved_micro}, this "
            f"run has {batch.micro}; group-aware samples go to ranks in blocks of one micro batch, so keep "
            f"{saved_micro}"
        )
    return problems


def converted_path(path: str) -> str:
    """Where convert_on_resize puts the universal copy of `path` (convert-checkpoint's default place)."""
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    return os.path.join(run_dir, UNIVERSAL, os.path.basename(path.rstrip("/")))
