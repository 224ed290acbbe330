"""The DeepSpeed runtime seam (layer L2): process groups, deepspeed.initialize, collectives, and what can only be
asked of the installed DeepSpeed (its pydantic config models, whether its async I/O op builds here).

Everything that touches `deepspeed` lives here and in the other seams: engine/universal.py (universal
checkpoints), engine/memory.py (model-state bytes) and engine/pipeline.py. The DeepSpeed JSON as data (merge,
checks, the final dict) is engine/ds_config.py, which imports no deepspeed. The rest of the package sees a
DeepSpeed engine only through `engine(**batch)`, `backward`, `step`, `save_checkpoint` and `load_checkpoint`,
plus the small collective helpers below.
"""

from __future__ import annotations

import enum
import json
import os
import pathlib
import socket
import sys
import types
import typing
from typing import Any

from megagenome.engine import universal
from megagenome.engine.ds_schema import SCHEMA_FILE


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


# The sections engine/ds_config.py checks against ds_sections.json, and the DeepSpeed model that validates each.
CHECKED_SECTIONS = {
    "zero_optimization": "deepspeed.runtime.zero.config:DeepSpeedZeroConfig",
    "bf16": "deepspeed.runtime.precision_config:DeepSpeedBF16Config",
    "fp16": "deepspeed.runtime.precision_config:DeepSpeedFP16Config",
}


def section_schema() -> dict:
    """The fields of each checked section as the installed DeepSpeed's pydantic models declare them (names and
    aliases, types, nullability, numeric bounds, nested blocks): what ds_sections.json holds."""
    import importlib

    out = {}
    for section, where in CHECKED_SECTIONS.items():
        module, name = where.split(":")
        out[section] = _model_fields(getattr(importlib.import_module(module), name))
    return out


def write_section_schema(path: str = SCHEMA_FILE) -> None:
    """Rewrite ds_sections.json from the installed DeepSpeed (after an upgrade; tests/test_ds_config.py checks it)."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(section_schema(), fh, indent=1, sort_keys=True)
        fh.write("\n")


def _model_fields(model) -> dict:
    fields = {}
    for name, info in model.model_fields.items():
        spec = _type_spec(info.annotation)
        for bound in info.metadata:
            for attr, key in (
                ("ge", "minimum"),
                ("gt", "exclusive_minimum"),
                ("le", "maximum"),
                ("lt", "exclusive_maximum"),
            ):
                if getattr(bound, attr, None) is not None:
                    spec[key] = getattr(bound, attr)
        fields[name] = spec
        if info.alias and info.alias != name:  # DeepSpeed's models take a field by name or by alias
            fields[info.alias] = {**spec, "alias_of": name}
    return fields


def _type_spec(annotation) -> dict:
    """A field type as ds_config.py checks it: boolean, integer, number, string, enum, array, object, any."""
    from pydantic import BaseModel

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        nullable = len(args) < len(typing.get_args(annotation))
        specs = [_type_spec(a) for a in args]
        spec = specs[0] if len(specs) == 1 else {"type": sorted({s["type"] for s in specs})}
        return {**spec, "nullable": True} if nullable else spec
    if typing.get_origin(annotation) is list:
        return {"type": "array", "items": _type_spec(args[0]) if args else {"type": "any"}}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {"type": "object", "fields": _model_fields(annotation)}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"type": "enum", "values": [m.value for m in annotation]}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string", pathlib.Path: "string"}
    return {"type": simple.get(annotation, "any")}


def section_problems(ds: dict, sources: dict[str, str], path: str) -> list[str]:
    """Every problem of the checked sections of a (merged) DeepSpeed dict, as the installed DeepSpeed's own pydantic
    models find them, cross-field rules included (engine/ds_schema.py holds the deepspeed-free copy). sources maps a
    top-level key to the fragment that set it; path names the JSON otherwise."""
    import importlib

    from pydantic import ValidationError

    problems = []
    for section, where in CHECKED_SECTIONS.items():
        if section not in ds:
            continue
        src = sources.get(section, path)
        if not isinstance(ds[section], dict):
            problems.append(f"{src}: {section!r} must be an object")
            continue
        module, name = where.split(":")
        try:
            getattr(importlib.import_module(module), name)(**ds[section])
        except ValidationError as e:
            for err in e.errors():
                loc = f"{section}.{'.'.join(str(p) for p in err['loc'])}"
                unknown = err["type"] == "extra_forbidden"
                problems.append(f"{src}: unknown DeepSpeed key {loc!r}" if unknown else f"{src}: {loc}: {err['msg']}")
        except (ValueError, TypeError, AssertionError) as e:
            problems.append(f"{src}: {section}: {e}")
    return problems


def reports_grad_norm(engine) -> bool:
    """Whether DeepSpeed records the step's global gradient norm: under ZeRO or mixed precision, not for plain fp32
    ZeRO-0, where the step measures it itself (train/trainer.py Trainer.step)."""
    return bool(engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled())


def on_gpu() -> bool:
    """Whether this process will train on a CUDA device."""
    import torch

    return torch.cuda.is_available()


def deepspeed_logger():
    """DeepSpeed's logger ("DeepSpeed"; its handler writes to stdout), imported so that the handler exists: what
    console.RankLogs routes to the rank's log."""
    from deepspeed.utils.logging import logger

    return logger


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
    divides by sp x dp, ignoring the sequence-parallel size. The run multiplies the loss by this factor so
    the gradients come out right; tests/test_sequence_parallel.py compares every stage against sp = 1.
    """
    zero = ds_config.get("zero_optimization") or {}
    return sp if sp > 1 and zero.get("stage") == 3 else 1


def sequence_parallel_attention(group):
    """DeepSpeed-Ulysses attention over the sequence-parallel process group `group`, as the callable that
    a model's set_sequence_parallel installs (model/family.py): attention(core, q, k, v) with q, k, v of shape
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


def initialize(model, param_groups: list[dict], ds_config: dict, mpu=None, optimizer=None, lr_scheduler=None):
    """Wrap the model in a DeepSpeed engine that builds the optimizer and the schedule from ds_config, or takes the
    client `optimizer` / `lr_scheduler` (an object or a callable of the optimizer) where ds_config has no entry.

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
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups,
        config=ds_config,
        mpu=mpu,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
    )
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
        # DeepSpeed caches its groups (the world clone, data parallel, mpu) module-wide and drops them only when the
        # group is destroyed through deepspeed.comm; another world in this process (tests) would get stale ones.
        groups = sys.modules.get("deepspeed.utils.groups")
        if groups is not None and hasattr(groups, "_release_process_group_references"):
            groups._release_process_group_references(None)
