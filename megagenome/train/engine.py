"""The DeepSpeed seam (layer L2): engine JSON checks, the config merge, process groups, initialize.

Everything that touches `deepspeed` lives here and in the other seams: train/universal.py (universal
checkpoints), train/memory.py (model-state bytes) and parallel/pipeline.py. The rest of
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

from megagenome.config import RootConfig, batch_sizes, scaled_lr
from megagenome.train import universal

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


def _unknown(keys, allowed, where: str, path: str) -> list[str]:
    problems = []
    for key in keys:
        if key not in allowed:
            near = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            problems.append(f"{path}: unknown DeepSpeed key {where}{key!r}{hint}")
    return problems


def _pydantic_problems(model_cls, section: str, value, path: str) -> list[str]:
    """Validate one section with DeepSpeed's own pydantic model (it forbids unknown keys)."""
    from pydantic import ValidationError

    if not isinstance(value, dict):
        return [f"{path}: {section!r} must be an object"]
    try:
        model_cls(**value)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = f"{section}.{'.'.join(str(p) for p in err['loc'])}"
            if err["type"] == "extra_forbidden":
                problems.append(f"{path}: unknown DeepSpeed key {loc!r}")
            else:
                problems.append(f"{path}: {loc}: {err['msg']}")
        return problems
    except (ValueError, TypeError, AssertionError) as e:
        return [f"{path}: {section}: {e}"]
    return []


def check_ds_config(
    ds: dict, path: str, run_config_path: str, on_gpu: bool, sources: dict[str, str] | None = None
) -> list[str]:
    """Every problem with a (merged) DeepSpeed dict, before any process group exists.

    `sources` maps each top-level key to the fragment that set it, so messages name the right file.
    """
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    def src(key: str) -> str:
        return (sources or {}).get(key, path)

    problems = []
    for key in ds:
        problems += _unknown([key], DS_TOP_LEVEL_KEYS, "", src(key))
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
    for section, model_cls in [
        ("zero_optimization", DeepSpeedZeroConfig),
        ("bf16", DeepSpeedBF16Config),
        ("fp16", DeepSpeedFP16Config),
    ]:
        if section in ds:
            problems += _pydantic_problems(model_cls, section, ds[section], src(section))
    if _enabled(ds, "bf16") and _enabled(ds, "fp16"):
        problems.append(f"{src('bf16')} and {src('fp16')}: bf16.enabled and fp16.enabled cannot both be true")
    if _enabled(ds, "fp16") and not on_gpu:
        problems.append(
            f"{src('fp16')}: fp16.enabled needs a GPU; DeepSpeed's CPU accelerator cannot run fp16 "
            '("Type fp16 is not supported on your device"); use ds_configs/bf16.json on CPU'
        )
    problems += _accumulation_problems(ds, src)
    ac = ds.get("activation_checkpointing")
    if ac is not None:
        where = src("activation_checkpointing")
        if not isinstance(ac, dict):
            problems.append(f"{where}: 'activation_checkpointing' must be an object")
        else:
            problems += _unknown(ac, ACTIVATION_CHECKPOINTING_KEYS, "activation_checkpointing.", where)
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
    from deepspeed.runtime.config import DtypeEnum

    zero = ds.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    types = ds.get("data_types")
    accum = types.get("grad_accum_dtype") if isinstance(types, dict) else None
    if stage != 0 or accum is None:
        return []
    model = "fp16" if _enabled(ds, "fp16") else "bf16" if _enabled(ds, "bf16") else "fp32"
    try:
        accum_name = DtypeEnum(accum).name
    except ValueError:
        return []  # DeepSpeed's own config validation reports an unknown dtype name
    if accum_name == model:
        return []
    return [
        f"{src('data_types')}: data_types.grad_accum_dtype={accum!r} with {model} weights needs ZeRO stage 1 or "
        f"higher (zero_optimization.stage is 0 in {src('zero_optimization')}); at stage 0 DeepSpeed accumulates "
        f"gradients in the model's dtype only: drop data_types.grad_accum_dtype or use a ZeRO stage >= 1"
    ]


def _enabled(ds: dict, section: str) -> bool:
    value = ds.get(section)
    return isinstance(value, dict) and bool(value.get("enabled"))


def offload_devices(ds: dict) -> set[str]:
    """Devices ("cpu", "nvme") that ZeRO offloads parameters or optimizer states to."""
    zero = ds.get("zero_optimization") or {}
    return {
        (zero.get(k) or {}).get("device", "none")
        for k in ("offload_param", "offload_optimizer")
        if isinstance(zero.get(k), dict)
    } - {"none"}


def check_run_against_ds(cfg: RootConfig, ds: dict, path: str) -> list[str]:
    """Problems that need both the run config and the DeepSpeed dict."""
    problems = []
    has_ac = "activation_checkpointing" in ds
    pipeline_recomputes = cfg.parallel.pipeline > 1 and cfg.parallel.pipeline_checkpoint_interval > 0
    if has_ac and cfg.model.checkpointing == "none" and not pipeline_recomputes:
        problems.append(
            f"{path} configures activation_checkpointing but --model.checkpointing=none recomputes nothing; "
            "choose full, every_k or selective (or --parallel.pipeline_checkpoint_interval with pipeline stages)"
        )
    zero = ds.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if cfg.parallel.pipeline > 1 and isinstance(stage, int) and stage >= 2:
        problems.append(
            f"{path}: zero_optimization.stage={stage} cannot run with --parallel.pipeline={cfg.parallel.pipeline}: "
            "DeepSpeed's pipeline engine rejects ZeRO stages 2 and 3 (it reduces gradients itself, after the last "
            "micro batch); use ZeRO stage 0 or 1 (e.g. ds_configs/zero1.json)"
        )
    if cfg.parallel.sequence > 1 and stage == 3 and zero.get("reduce_scatter") is False:
        problems.append(
            f"{path}: zero_optimization.reduce_scatter=false at stage 3 cannot run with --parallel.sequence="
            f"{cfg.parallel.sequence}: DeepSpeed 0.19 then scales sequence-parallel gradients differently from one "
            "reduction bucket to the next (see sequence_parallel_grad_factor); drop the key (default true)"
        )
    if "nvme" in offload_devices(ds):
        zero = ds.get("zero_optimization", {})
        if any(
            isinstance(zero.get(k), dict) and "nvme_path" in zero[k] for k in ("offload_param", "offload_optimizer")
        ):
            problems.append(
                f"{path}: nvme_path is owned by the run config (--train.nvme_path); remove it from the JSON"
            )
        if not cfg.train.nvme_path:
            problems.append(f"{path} offloads to NVMe: set --train.nvme_path to a directory on a local NVMe drive")
        problems += nvme_problems()
    return problems


def nvme_problems() -> list[str]:
    """Whether DeepSpeed's async I/O op (needed by ZeRO-Infinity NVMe offload) can be built here."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if AsyncIOBuilder().is_compatible(verbose=False):
            return []
    except Exception as e:  # an op builder that cannot even be imported is the same answer
        return [f"NVMe offload needs DeepSpeed's async_io op, which cannot be loaded here: {e}"]
    return [
        "NVMe offload needs DeepSpeed's async_io op, which cannot be built here: install libaio "
        "(Debian/Ubuntu: apt install libaio-dev; RHEL: yum install libaio-devel) and a C++ compiler, then "
        "check with `ds_report`"
    ]


def build_ds_config(cfg: RootConfig, ds: dict, dp_size: int, on_gpu: bool) -> dict:
    """The exact dict given to deepspeed.initialize: the JSON plus the root-owned keys."""
    t = cfg.train
    micro, accum, global_batch = batch_sizes(t, dp_size)
    merged = json.loads(json.dumps(ds))  # deep copy; the JSON file's dict is never mutated
    merged.setdefault("steps_per_print", 10**9)  # our loop does the logging
    torch_adam = (not on_gpu) if t.torch_adam is None else t.torch_adam
    lr, min_lr = scaled_lr(t, global_batch)
    merged.update(
        {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum,
            "train_batch_size": global_batch,
            "gradient_clipping": t.grad_clip,
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": lr,
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
                    "cos_min_ratio": min_lr / lr,
                },
            },
        }
    )
    if cfg.checkpoint.universal:
        merged.setdefault("checkpoint", {})["load_universal"] = True
    if t.nvme_path:
        zero = merged.get("zero_optimization", {})
        for key in ("offload_param", "offload_optimizer"):
            if isinstance(zero.get(key), dict) and zero[key].get("device") == "nvme":
                zero[key]["nvme_path"] = t.nvme_path
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


def activation_checkpoint_function(ds_config: dict, mpu=None):
    """DeepSpeed's checkpoint function, configured from ds_config, when it has an activation_checkpointing
    block (partitioning over the tensor-parallel group of `mpu`, CPU checkpointing, ...); else None, and the
    model uses torch's checkpoint."""
    if "activation_checkpointing" not in ds_config:
        return None
    from deepspeed import checkpointing  # `import deepspeed.checkpointing` resolves to another module

    checkpointing.configure(mpu, deepspeed_config=ds_config)
    return checkpointing.checkpoint


def sequence_parallel_grad_factor(ds_config: dict, sp: int) -> int:
    """What DeepSpeed's gradient reduction under-counts sequence-parallel gradients by: sp at ZeRO-3, else 1.

    Sequence-parallel ranks hold shares of one loss, so their gradients must be summed (and averaged over data
    parallelism only). ZeRO 0-2 do that: they all-reduce over the sp x dp group and divide by dp. ZeRO-3's
    reduce-scatter (`__avg_scatter_grads`, used whenever zero_optimization.reduce_scatter is true, the default)
    divides by sp x dp, ignoring the sequence-parallel size. pretrain.py multiplies the loss by this factor so
    the gradients come out right; tests/test_sequence_parallel.py compares every stage against sp = 1.
    """
    zero = ds_config.get("zero_optimization") or {}
    return sp if sp > 1 and zero.get("stage") == 3 else 1


def sequence_parallel_attention(group):
    """DeepSpeed-Ulysses attention over the sequence-parallel process group `group`, as the callable that
    DNATransformer.set_sequence_parallel installs: attention(core, q, k, v) with q, k, v of shape
    (B, n_head, T/sp, head_dim) on each rank returns core's output for this rank's positions, having run core
    over all T positions for n_head/sp heads (see parallel/sequence.py)."""
    from deepspeed.sequence.layer import DistributedAttention

    def local(q, k, v, core):  # (B, T, n_head/sp, head_dim): DistributedAttention's batch-first layout
        y = core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, n_head/sp, T, head_dim)
        return y.transpose(1, 2)  # (B, T, n_head/sp, head_dim)

    # scatter_idx 2 / gather_idx 1: q, k, v scatter heads and gather the sequence; the output does the reverse.
    # The wrapper is held in a closure, not registered as a submodule, so the model's state dict is unchanged.
    ulysses = DistributedAttention(local, group, scatter_idx=2, gather_idx=1)

    def attention(core, q, k, v):  # (B, n_head, T/sp, head_dim) each
        y = ulysses(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None, core)  # (B, T/sp, n_head, hd)
        return y.transpose(1, 2)  # (B, n_head, T/sp, head_dim)

    return attention


def initialize(model, param_groups: list[dict], ds_config: dict, mpu=None):
    """Wrap the model in a DeepSpeed engine that builds AdamW and the schedule from ds_config.

    mpu (a ParallelState) tells DeepSpeed which ranks form the data-parallel group ZeRO partitions over
    and which form the tensor-parallel group gradient norms are reduced across.
    """
    import deepspeed

    zero = ds_config.get("zero_optimization") or {}
    if mpu is not None and mpu.get_sequence_parallel_world_size() > 1 and zero.get("stage") == 3:
        # DeepSpeed 0.19 partitions the parameters of a model not built under zero.Init over
        # mpu.get_data_parallel_group(), but reduce-scatters gradients and partitions the optimizer over the
        # sequence-data-parallel group; with sequence parallelism the two differ and the fp32 partitions end up
        # whole on every rank (zero_to_fp32 then fails). Partition over sp x dp up front, as Megatron-DeepSpeed
        # does by building its model under zero.Init(sequence_data_parallel_group=...).
        offload = zero.get("offload_param") or {}
        deepspeed.zero.Init(
            module=model,
            data_parallel_group=mpu.get_sequence_data_parallel_group(),
            config_dict_or_path=ds_config,
            pin_memory=bool(offload.get("pin_memory", False)),
            mpu=mpu,
        )
    if getattr(model, "universal_checkpoint_info", None) is None:
        model.universal_checkpoint_info = universal.universal_checkpoint_info(model)  # saved in every checkpoint
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups, config=ds_config, mpu=mpu)
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


def time_all_reduce(nbytes: int, iters: int, warmup: int = 2) -> float:
    """Median seconds of one all-reduce (sum) of an fp32 tensor of `nbytes` over every rank, on this rank's device
    (NCCL on GPUs, gloo on CPU); every rank must call it with the same arguments."""
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    t = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device())
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        get_accelerator().synchronize()
        started = time.perf_counter()
        dist.all_reduce(t)
        get_accelerator().synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    # The slowest rank's time is the collective's time.
    return max(all_gather_object(statistics.median(times)))


def shutdown() -> None:
    """Tear the process group down deterministically, so no rank aborts at interpreter exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
