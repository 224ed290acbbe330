"""The DeepSpeed JSON as data (layer L2, no deepspeed import): read, merge, check, complete.

`--train.ds_config` names one JSON file or an ordered list of fragments. This module merges them deep (a leaf set
differently by two fragments is an error naming both files), rejects what DeepSpeed would silently ignore or get
wrong (unknown keys at every level, keys the run config owns, combinations DeepSpeed 0.19.8 refuses late or
mishandles), and reads what a merged dict says (ZeRO stage, precision, offload). engine/ds_final.py builds the exact
dict handed to deepspeed.initialize from it. It never imports deepspeed, so `megagenome plan` and `pretrain
--dry_run` merge and check a config without loading the engine;
engine/engine.py is the runtime seam.

Sections that DeepSpeed validates with its own pydantic models (zero_optimization with its offload blocks, bf16,
fp16) are checked against a copy of those models' fields (engine/ds_schema.py).

Ownership (docs/architecture.md, "Config"): the run config owns batch sizes, optimizer, schedule and clipping; the
DeepSpeed JSON owns engine knobs. A key set in both is an error naming both files.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from megagenome.config.sections import TrainConfig
from megagenome.engine import ds_schema
from megagenome.engine.ds_schema import unknown_key_problems as _unknown

# Top-level keys DeepSpeed 0.19 reads. DeepSpeed silently ignores anything else, so a typo such as
# "zero_optimisation" would train without ZeRO; we reject unknown keys instead.
DS_TOP_LEVEL_KEYS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "optimizer",
        "scheduler",
        "fp16",
        "bf16",
        "torch_autocast",
        "amp",
        "gradient_clipping",
        "prescale_gradients",
        "gradient_predivide_factor",
        "gradient_allreduce_op",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "zero_optimization",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "activation_checkpointing",
        "flops_profiler",
        "wall_clock_breakdown",
        "memory_breakdown",
        "steps_per_print",
        "dump_state",
        "disable_allgather",
        "disable_python_gc",
        "comms_logger",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "autotuning",
        "elasticity",
        "data_efficiency",
        "curriculum_learning",
        "checkpoint",
        "data_types",
        "aio",
        "dataloader_drop_last",
        "log_level",
        "pipeline",
        "hybrid_engine",
        "compile",
        "timers",
        "tensor_parallel",
        "expert_parallel",
        "weight_quantization",
        "compression_training",
        "sparse_attention",
        "sparse_gradients",
        "nebula",
        "managed_gradient_accumulation",
        "use_data_before_expert_parallelism",
    }
)

# Keys the run config writes into the merged dict, with the flag that owns each.
ROOT_OWNED_KEYS = {
    "train_batch_size": "--train.global_batch_size",
    "train_micro_batch_size_per_gpu": "--train.micro_batch_size",
    "gradient_accumulation_steps": "--train.grad_accum_steps",
    "gradient_clipping": "--train.grad_clip",
    "optimizer": "--train.lr and the other --train optimizer flags",
    "zero_allow_untested_optimizer": "--train.optimizer (set where a client optimizer may run under ZeRO)",
    "scheduler": "--train.schedule / --train.warmup_steps / --train.max_steps / --train.min_lr",
}

ACTIVATION_CHECKPOINTING_KEYS = frozenset(
    {
        "partition_activations",
        "contiguous_memory_optimization",
        "cpu_checkpointing",
        "number_checkpoints",
        "synchronize_checkpoint_boundary",
        "profile",
    }
)

# The names DeepSpeed's DtypeEnum accepts for each precision (data_types.grad_accum_dtype,
# communication_data_type), by our short name.
DTYPE_NAMES = {
    "fp16": ("torch.float16", "fp16", "float16", "half"),
    "fp32": ("torch.float32", "fp32", "float32", "float"),
    "bf16": ("torch.bfloat16", "bf16", "bfloat16"),
    "int8": ("torch.int8", "int8"),
}


# The "timers" section (DeepSpeed's utils/config.py get_timers_config): only "throughput", a
# DeepSpeedThroughputTimerConfig whose fields these are (tests/test_ds_config.py compares them with the installed
# DeepSpeed's model). DeepSpeed reads nothing else under "timers", so anything else is a typo. The shipped JSONs turn
# the timer off: enabled, it synchronises the device at every forward and optimizer step.
TIMERS_SCHEMA = {
    "throughput": {
        "type": "object",
        "nullable": False,
        "fields": {"enabled": {"type": "boolean"}, "synchronized": {"type": "boolean"}},
    }
}


class DSConfigError(ValueError):
    """A DeepSpeed JSON that cannot be read."""


def ds_config_files(train: TrainConfig) -> list[str]:
    """--train.ds_config as a list of files, in merge order."""
    return [train.ds_config] if isinstance(train.ds_config, str) else list(train.ds_config)


def load_ds_json(path: str) -> dict:
    """Read a DeepSpeed JSON file; syntax errors name the file, line and column."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise DSConfigError(f"--train.ds_config={path}: cannot read the DeepSpeed JSON ({e.strerror})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DSConfigError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise DSConfigError(f"{path}: the DeepSpeed JSON must be an object, found {type(value).__name__}")
    return value


def merge_fragments(paths: list[str]) -> tuple[dict, dict[str, str], list[str]]:
    """Deep-merge JSON fragments in order. Returns (merged, source file of each top-level key, problems).

    Objects merge key by key; a leaf (or a leaf against an object) set to different values by two files is
    a conflict reported with the key path and both files, never a silent win for the later file.
    """
    merged: dict = {}
    origin: dict[str, str] = {}  # dotted key path -> file that set it
    problems: list[str] = []

    def merge(into: dict, new: dict, path: str, prefix: str) -> None:
        for key, value in new.items():
            dotted = f"{prefix}{key}"
            if key not in into:
                into[key] = json.loads(json.dumps(value))
                _record(origin, value, dotted, path)
            elif isinstance(into[key], dict) and isinstance(value, dict):
                merge(into[key], value, path, dotted + ".")
            elif into[key] != value:
                problems.append(
                    f"{dotted!r} is set to {into[key]!r} in {origin.get(dotted, '?')} and to {value!r} in {path}; "
                    "the fragments of --train.ds_config must not disagree"
                )

    for path in paths:
        try:
            merge(merged, load_ds_json(path), path, "")
        except DSConfigError as e:
            problems.append(str(e))
    top = {key.split(".")[0]: src for key, src in origin.items()}
    return merged, top, problems


def _record(origin: dict[str, str], value, dotted: str, path: str) -> None:
    origin[dotted] = path
    if isinstance(value, dict):
        for key, inner in value.items():
            _record(origin, inner, f"{dotted}.{key}", path)


def check_ds_config(
    ds: dict,
    path: str,
    run_config_path: str,
    on_gpu: bool,
    sources: dict[str, str] | None = None,
    sections: Callable[[dict, dict[str, str], str], list[str]] | None = None,
) -> list[str]:
    """Every problem with a (merged) DeepSpeed dict, before any process group exists.

    `sources` maps each top-level key to the fragment that set it, so messages name the right file. `sections`
    checks the sections DeepSpeed validates with pydantic: by default against the deepspeed-free copy
    (ds_schema.py); a launch passes DeepSpeed's own models (engine.py section_problems).
    """

    def src(key: str) -> str:
        return (sources or {}).get(key, path)

    problems = []
    for key in ds:
        problems += _unknown(key, DS_TOP_LEVEL_KEYS, "", src(key))
    for key, flag in ROOT_OWNED_KEYS.items():
        if key in ds:
            problems.append(
                f"{key!r} is set in both {src(key)} and the run config {run_config_path} ({flag}); "
                "the run config owns it: remove it from the JSON"
            )
    ckpt = ds.get("checkpoint")
    if isinstance(ckpt, dict) and "load_universal" in ckpt:
        problems.append(
            f"'checkpoint.load_universal' is set in both {src('checkpoint')} and the run config {run_config_path} "
            "(--checkpoint.universal); the run config owns it: remove it from the JSON"
        )
    problems += (sections or _copied_section_problems)(ds, sources or {}, path)
    if "timers" in ds:  # not a pydantic section of DeepSpeed's config: checked here at dry run and launch alike
        problems += ds_schema.section_problems(TIMERS_SCHEMA, ds["timers"], "timers", src("timers"))
    if _enabled(ds, "bf16") and _enabled(ds, "fp16"):
        problems.append(f"{src('bf16')} and {src('fp16')}: bf16.enabled and fp16.enabled cannot both be true")
    if _enabled(ds, "fp16") and not on_gpu:
        problems.append(
            f"{src('fp16')}: fp16.enabled needs a GPU; DeepSpeed's CPU accelerator cannot run fp16 "
            '("Type fp16 is not supported on your device"); use ds_configs/bf16.json on CPU'
        )
    problems += _accumulation_problems(ds, src)
    problems += _activation_checkpointing_problems(ds.get("activation_checkpointing"), src("activation_checkpointing"))
    return problems


def _copied_section_problems(ds: dict, sources: dict[str, str], path: str) -> list[str]:
    problems = []
    for section, fields in ds_schema.section_schema().items():
        if section in ds:
            problems += ds_schema.section_problems(fields, ds[section], section, sources.get(section, path))
    return problems


def _activation_checkpointing_problems(ac, where: str) -> list[str]:
    if ac is None:
        return []
    if not isinstance(ac, dict):
        return [f"{where}: 'activation_checkpointing' must be an object"]
    problems = []
    for key in ac:
        problems += _unknown(key, ACTIVATION_CHECKPOINTING_KEYS, "activation_checkpointing.", where)
    if ac.get("cpu_checkpointing") and not ac.get("partition_activations"):
        problems.append(
            f"{where}: activation_checkpointing.cpu_checkpointing needs partition_activations: true "
            "(DeepSpeed silently mishandles it otherwise)"
        )
    if ac.get("contiguous_memory_optimization") and not (
        ac.get("partition_activations") and ac.get("number_checkpoints")
    ):
        problems.append(
            f"{where}: activation_checkpointing.contiguous_memory_optimization needs partition_activations: "
            "true and number_checkpoints (the number of checkpointed segments)"
        )
    return problems


def _accumulation_problems(ds: dict, src) -> list[str]:
    """ZeRO stage 0 accumulates gradients only in the model's own dtype: DeepSpeed 0.19 refuses e.g. bf16 with
    data_types.grad_accum_dtype fp32 at initialize ("unsupported mix of model_dtype and grad_accum_dtype")."""
    types = ds.get("data_types")
    accum = types.get("grad_accum_dtype") if isinstance(types, dict) else None
    if zero_stage(ds) != 0 or accum is None:
        return []
    model = weights_dtype(ds)
    accum_name = dtype_name(accum)
    if accum_name is None or accum_name == model:
        return []  # an unknown dtype name is DeepSpeed's own config validation's to report
    return [
        f"{src('data_types')}: data_types.grad_accum_dtype={accum!r} with {model} weights needs ZeRO stage 1 or "
        f"higher (zero_optimization.stage is 0 in {src('zero_optimization')}); at stage 0 DeepSpeed accumulates "
        f"gradients in the model's dtype only: drop data_types.grad_accum_dtype or use a ZeRO stage >= 1"
    ]


def run_problems(
    ds: dict, path: str, checkpointing: str, pipeline_recomputes: bool, nvme_path: str | None
) -> list[str]:
    """Problems that need the run config as well as the DeepSpeed dict (the layout's are parallel/layout.py's):
    checkpointing: --model.checkpointing; pipeline_recomputes: pipeline stages with a checkpoint interval."""
    problems = []
    if "activation_checkpointing" in ds and checkpointing == "none" and not pipeline_recomputes:
        problems.append(
            f"{path} configures activation_checkpointing but --model.checkpointing=none recomputes nothing; "
            "choose full, every_k or selective (or --parallel.pipeline_checkpoint_interval with pipeline stages)"
        )
    block = ds.get("activation_checkpointing")
    if checkpointing == "selective" and isinstance(block, dict) and block.get("partition_activations"):
        # Measured after 6 steps: the transformer's weights off by 6e-3 (1 rank) and 1.2e-2 (tensor 2), a striped
        # Hyena model's backward fails (its emptied SE taps no longer broadcast).
        problems.append(
            f"{path}: activation_checkpointing.partition_activations with --model.checkpointing=selective: DeepSpeed "
            "splits every input of a checkpointed function over the tensor-parallel group as if it were replicated "
            "and empties the caller's tensor until backward, but selective recomputation checkpoints this rank's "
            "attention heads and a Hyena operator's filter and D parameters; use full or every_k with "
            "partition_activations, or selective with ds_configs/activation_checkpointing.json (no partitioning)"
        )
    if "nvme" in offload_devices(ds):
        zero = zero_section(ds)
        if any(
            isinstance(zero.get(k), dict) and "nvme_path" in zero[k] for k in ("offload_param", "offload_optimizer")
        ):
            problems.append(
                f"{path}: nvme_path is owned by the run config (--train.nvme_path); remove it from the JSON"
            )
        if not nvme_path:
            problems.append(f"{path} offloads to NVMe: set --train.nvme_path to a directory on a local NVMe drive")
    return problems


# ----- reading a (merged) dict ------------------------------------------------------------------------------------


def _enabled(ds: dict, section: str) -> bool:
    value = ds.get(section)
    return isinstance(value, dict) and bool(value.get("enabled"))


def zero_section(ds: dict) -> dict:
    """zero_optimization, or {} when absent or not an object."""
    zero = ds.get("zero_optimization")
    return zero if isinstance(zero, dict) else {}


def zero_stage(ds: dict) -> int:
    """The ZeRO stage (0 when unset, or when the value is not an integer: check_ds_config reports that)."""
    stage = zero_section(ds).get("stage", 0)
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else 0


def weights_dtype(ds: dict) -> str:
    """The weights' precision: "fp16", "bf16" or "fp32"."""
    return "fp16" if _enabled(ds, "fp16") else "bf16" if _enabled(ds, "bf16") else "fp32"


def dtype_name(value) -> str | None:
    """Our short name ("fp32", "bf16", "fp16", "int8") of a dtype as DeepSpeed's JSON spells it, else None."""
    text = str(value).lower()
    return next((name for name, spellings in DTYPE_NAMES.items() if text in spellings), None)


def offload_devices(ds: dict) -> set[str]:
    """Devices ("cpu", "nvme") that ZeRO offloads parameters or optimizer states to."""
    zero = zero_section(ds)
    return {
        (zero.get(k) or {}).get("device", "none")
        for k in ("offload_param", "offload_optimizer")
        if isinstance(zero.get(k), dict)
    } - {"none"}


# ----- the dict given to deepspeed.initialize ---------------------------------------------------------------------


def scaled_lr(train: TrainConfig, global_batch: int) -> tuple[float, float]:
    """(lr, min_lr) after the --train.lr_scaling rule for this global batch."""
    if train.lr_scaling == "none" or not train.reference_batch:
        return train.lr, train.min_lr
    ratio = global_batch / train.reference_batch
    factor = ratio if train.lr_scaling == "linear" else ratio**0.5
    return train.lr * factor, train.min_lr * factor


def optimizer_offloaded(ds: dict) -> bool:
    """True when ZeRO keeps the optimizer states and step on the host or NVMe (offload_optimizer: cpu or nvme)."""
    block = zero_section(ds).get("offload_optimizer")
    return isinstance(block, dict) and block.get("device") in ("cpu", "nvme")


def adam_choice(ds: dict, torch_adam: bool | None, on_gpu: bool) -> dict:
    """The optimizer params that pick which Adam DeepSpeed 0.19.8 builds (engine.py get_optimizer_configuration):
    "torch_adam": true makes it torch.optim.AdamW and forwards the other params to it, so "fused": true there is
    torch's single-kernel CUDA AdamW (prebuilt in torch; issue 14 estimates the foreach default ~3x slower at 1B,
    not measured here); false makes
    it DeepSpeed's FusedAdam, JIT-built on first use (~30 s, needs ninja and nvcc), or DeepSpeedCPUAdam when ZeRO
    offloads the optimizer.

    Default (torch_adam None): torch's AdamW, fused on a GPU; DeepSpeedCPUAdam where the optimizer is offloaded on a
    GPU run (its vectorised host step is what offload is built around). On CPU torch's AdamW as before, unfused:
    the CPU jobs' published numbers were measured with it.
    """
    offloaded = optimizer_offloaded(ds)
    use_torch = (not (on_gpu and offloaded)) if torch_adam is None else torch_adam
    params: dict = {"torch_adam": use_torch}
    if use_torch and on_gpu and not offloaded:
        params["fused"] = True
    return params
