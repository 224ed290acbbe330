"""The DeepSpeed seam (layer L2): engine JSON checks, the config merge, process groups, initialize.

Everything that touches `deepspeed` lives here (and, later, in parallel/pipeline.py). The rest of
the package sees a DeepSpeed engine only through `engine(**batch)`, `backward`, `step`,
`save_checkpoint` and `load_checkpoint`, plus the small collective helpers below.

Ownership (DESIGN.md): the run config owns batch sizes, optimizer, schedule and clipping; the
DeepSpeed JSON owns engine knobs. A key set in both is an error naming both files.
"""

from __future__ import annotations

import difflib
import json
import os
import socket
from typing import Any

from megagenome.config import RootConfig, batch_sizes

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
    "scheduler": "--train.warmup_steps / --train.max_steps / --train.min_lr",
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
PRECISION_KEYS = {
    "bf16": frozenset(
        {
            "enabled",
            "immediate_grad_update",
            "check_grad_overflow",
            "bf16_master_weights_and_grads",
            "bf16_optimizer_states",
        }
    ),
    "fp16": frozenset(
        {
            "enabled",
            "auto_cast",
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "consecutive_hysteresis",
            "min_loss_scale",
            "fp16_master_weights_and_grads",
        }
    ),
}


class DSConfigError(ValueError):
    """A DeepSpeed JSON that cannot be read."""


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


def _unknown(keys, allowed, where: str, path: str) -> list[str]:
    problems = []
    for key in keys:
        if key not in allowed:
            near = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.append(f"{path}: unknown DeepSpeed key {where}{key!r}{hint}")
    return problems


def check_ds_config(ds: dict, path: str, run_config_path: str, on_gpu: bool) -> list[str]:
    """Every problem with a DeepSpeed JSON, before any process group exists."""
    problems = _unknown(ds, DS_TOP_LEVEL_KEYS, "", path)
    for key, flag in ROOT_OWNED_KEYS.items():
        if key in ds:
            problems.append(
                f"{key!r} is set in both {path} and the run config {run_config_path} ({flag}); "
                "the run config owns it: remove it from the JSON"
            )
    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        problems.append(f"{path}: 'zero_optimization' must be an object")
    else:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from pydantic import ValidationError

        try:
            DeepSpeedZeroConfig(**zero)
        except ValidationError as e:
            for err in e.errors():
                loc = ".".join(str(p) for p in err["loc"])
                problems.append(f"{path}: zero_optimization.{loc}: {err['msg']}")
    for section, allowed in PRECISION_KEYS.items():
        if isinstance(ds.get(section), dict):
            problems += _unknown(ds[section], allowed, f"{section}.", path)
    if ds.get("bf16", {}).get("enabled") and ds.get("fp16", {}).get("enabled"):
        problems.append(f"{path}: bf16.enabled and fp16.enabled cannot both be true")
    if ds.get("fp16", {}).get("enabled") and not on_gpu:
        problems.append(
            f"{path}: fp16.enabled needs a GPU; DeepSpeed's CPU accelerator cannot run fp16 (use a bf16 JSON on CPU)"
        )
    ac = ds.get("activation_checkpointing")
    if isinstance(ac, dict):
        problems += _unknown(ac, ACTIVATION_CHECKPOINTING_KEYS, "activation_checkpointing.", path)
    return problems


def build_ds_config(cfg: RootConfig, ds: dict, dp_size: int, on_gpu: bool) -> dict:
    """The exact dict given to deepspeed.initialize: the JSON plus the root-owned keys."""
    t = cfg.train
    micro, accum, global_batch = batch_sizes(t, dp_size)
    merged = json.loads(json.dumps(ds))  # deep copy; the JSON file's dict is never mutated
    merged.setdefault("steps_per_print", 10**9)  # our loop does the logging
    torch_adam = (not on_gpu) if t.torch_adam is None else t.torch_adam
    merged.update(
        {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum,
            "train_batch_size": global_batch,
            "gradient_clipping": t.grad_clip,
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": t.lr,
                    "betas": [t.beta1, t.beta2],
                    "eps": t.adam_eps,
                    "weight_decay": t.weight_decay,
                    "torch_adam": torch_adam,
                },
            },
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {
                    "total_num_steps": t.max_steps,
                    "warmup_num_steps": max(1, t.warmup_steps),
                    "warmup_type": "linear",
                    "warmup_min_ratio": 0.0,
                    "cos_min_ratio": t.min_lr / t.lr,
                },
            },
        }
    )
    return merged


def on_gpu() -> bool:
    """Whether this process will train on a CUDA device."""
    import torch

    return torch.cuda.is_available()


def init_distributed() -> tuple[int, int, int]:
    """Start the default process group (one process works too); returns (rank, local_rank, world_size)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # A plain `python -m megagenome pretrain` has no launcher environment: make it a world of one.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if get_accelerator().device_name() == "cpu":
        # The shared-memory comm op only serves inference all-reduce, and building it needs a
        # C++ toolchain and ~25 s at every start; training on gloo does not use it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), auto_mpi_discovery=False)
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(local_rank)
    return dist.get_rank(), local_rank, dist.get_world_size()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device():
    """The torch device of this rank."""
    import torch
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def initialize(model, param_groups: list[dict], ds_config: dict):
    """Wrap the model in a DeepSpeed engine that builds AdamW and the schedule from ds_config."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups, config=ds_config)
    return engine


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few floats over all ranks (float64 so token counts stay exact)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device())
    dist.all_reduce(t)
    return t.tolist()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank src's `obj` on every rank."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def shutdown() -> None:
    """Tear the process group down deterministically, so no rank aborts at interpreter exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
