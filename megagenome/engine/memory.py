"""Per-rank model-state bytes (layer L2, a DeepSpeed seam): params, gradients, fp32 master weights and optimizer
states counted from the tensors a DeepSpeed engine holds, for memory.json (`MemoryProbe`) and the memory tests
and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

from megagenome.engine import ds_config as dsc
from megagenome.engine import engine as ds
from megagenome.observe.metrics import zero_model_state_bytes
from megagenome.observe.record import write_json

# Attributes of DeepSpeed 0.19's optimizer wrappers that hold gradients (besides any tensor's .grad), by class:
# BF16_Optimizer (ZeRO-1 with bf16 and fp32 gradient accumulation): the full-size fp32 accumulation buffer and
# its views; DeepSpeedZeroOptimizer (ZeRO-1/2): the reduced partition and its contiguous buffer, and the CPU
# accumulators of offload; DeepSpeedZeroOptimizer_Stage3: the flat partition buffer and its per-parameter views.
_GRADIENT_ATTRS = frozenset(
    {
        "fp32_groups_gradients_flat",
        "fp32_groups_gradients",
        "fp32_groups_actual_gradients_flat",
        "fp32_groups_gradient_flat_partition",
        "non_expert_gradients",
        "averaged_gradients",
        "grads_in_partition",
        "accumulated_grads_in_cpu",
        "offload_gradient_dict",
        "grad_partitions_flat_buffer",
        "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
        "lp_grad_partitions_flat_pin_buffers",
    }
)
# fp32 master weights, by class: FP16_Optimizer, BF16_Optimizer, ZeRO-1/2, ZeRO-3. The wrapped optimizer's
# param_groups name them too, except under ZeRO-3, which hands them to the optimizer only inside step().
_MASTER_ATTRS = frozenset(
    {
        "fp32_groups_flat",
        "fp32_groups_flat_partition",
        "single_partition_of_fp32_groups",
        "fp32_partitioned_groups_flat",
    }
)
MODEL_STATES = ("params", "grads", "master_params", "optimizer_states")


def model_state_bytes(engine) -> dict:
    """This rank's bytes of model states, counted from the tensors the engine holds (not from RSS).

    Categories (a storage shared by several tensors is counted once, in the first category that claims it):
      params            the model's parameters as this rank holds them: bf16/fp16 (or fp32 without mixed
                        precision) full tensors at ZeRO 0-2; at ZeRO-3 this rank's partition (`ds_tensor`) plus
                        parameters held whole (below stage3_param_persistence_threshold, or still gathered).
      grads             gradients: every parameter's .grad (and .grad of master weights) plus the optimizer
                        wrapper's gradient buffers (_GRADIENT_ATTRS): ZeRO-0 the full gradients; ZeRO-1 with
                        bf16 and fp32 accumulation (BF16_Optimizer) the bf16 .grad and a full fp32 buffer;
                        ZeRO-1/2 otherwise the reduced partition (in the accumulation dtype); ZeRO-3 the flat
                        partition buffer.
      master_params     fp32 master weights the optimizer updates when they are not the model's own tensors:
                        the full copy at ZeRO-0 with bf16/fp16, this rank's partition at ZeRO 1-3, none in plain
                        fp32 ZeRO-0 (the optimizer steps the parameters themselves).
      optimizer_states  the optimizer's state (AdamW exp_avg and exp_avg_sq, fp32, partitioned at ZeRO 1-3).
      buffers           not model states: every other tensor the optimizer wrapper holds (gradient reduction
                        buckets, offload staging buffers); reported so nothing is hidden, excluded from total.
    Gradients exist only between backward and the optimizer step, so call this there (pretrain.py does, at
    the second step of a run, when optimizer states exist too). Offloaded states count in their category; by_device
    splits the total by device type. Returns {category: bytes, "total": sum of MODEL_STATES, "by_device": {...}}.
    """
    import torch

    basic = getattr(engine, "basic_optimizer", None) or engine.optimizer
    candidates: list[tuple[str, torch.Tensor]] = []  # (category, tensor) in claiming order
    for p in engine.module.parameters():
        candidates.append(("params", p.data))
        if hasattr(p, "ds_tensor"):  # ZeRO-3 partition of this parameter
            candidates.append(("params", p.ds_tensor))
    for state in basic.state.values():
        candidates += [("optimizer_states", t) for v in state.values() for t in _inner_tensors(v)]
    candidates += [("master_params", p) for p in basic.state if isinstance(p, torch.Tensor)]
    for group in basic.param_groups:
        candidates += [("master_params", p) for p in group["params"]]
    grads, others = [], []
    for attr, t in _tensors_of(engine.optimizer):
        if attr in _MASTER_ATTRS:
            candidates.append(("master_params", t))
        else:
            (grads if attr in _GRADIENT_ATTRS else others).append(t)
    for p in engine.module.parameters():
        grads += [g for g in (p.grad, getattr(p, "grad_accum", None)) if isinstance(g, torch.Tensor)]
    candidates += [("grads", t) for t in grads]
    # .grad of anything found above that is a leaf (fp32 master partitions under offload, for example)
    candidates += [("grads", t.grad) for _, t in list(candidates) if t.is_leaf and t.grad is not None]
    candidates += [("buffers", t) for t in others]

    out = dict.fromkeys((*MODEL_STATES, "buffers"), 0)
    by_device: dict[str, int] = {}
    seen: set[tuple[str, int]] = set()
    for category, t in candidates:
        storage = t.untyped_storage()
        if t.device.type == "meta" or storage.nbytes() == 0:
            continue  # a released ZeRO-3 parameter holds no memory
        key = (str(t.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        out[category] += storage.nbytes()
        if category != "buffers":
            by_device[t.device.type] = by_device.get(t.device.type, 0) + storage.nbytes()
    out["total"] = sum(out[c] for c in MODEL_STATES)
    out["by_device"] = by_device
    return out


def _inner_tensors(value) -> list:
    """The plain tensors holding `value`: itself, or a tensor subclass's inner tensors (torchao's 8-bit optimizer
    states keep int8 codes and fp32 block scales behind a wrapper whose own storage is a placeholder)."""
    import torch

    if not isinstance(value, torch.Tensor):
        return []
    if type(value) is torch.Tensor or not hasattr(value, "__tensor_flatten__"):
        return [value]
    names, _ = value.__tensor_flatten__()
    return [t for name in names for t in _inner_tensors(getattr(value, name))]


def _tensors_of(obj, attr: str = "", depth: int = 0, seen: set | None = None):
    """(top-level attribute name, tensor) for every tensor reachable from a DeepSpeed/torch optimizer object."""
    import torch

    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        yield attr, obj
        return
    if depth > 8 or id(obj) in seen or isinstance(obj, (torch.nn.Module, type)):
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple, set)):
        children = [(attr, v) for v in obj]
    elif isinstance(obj, dict):
        children = [(attr, v) for v in obj.values()]
    elif type(obj).__module__.startswith(("deepspeed.", "torch.optim")) and hasattr(obj, "__dict__"):
        children = [(attr or name, v) for name, v in vars(obj).items()]
    else:
        return
    for name, value in children:
        yield from _tensors_of(value, name, depth + 1, seen)


def replica_state_bytes_per_parameter(ranks: list[dict], stage: int, dp_size: int) -> float:
    """Optimizer-state bytes one data-parallel replica set holds, over the parameters it holds: 8 for fp32 AdamW at
    every ZeRO stage, less for adafactor/muon/adam8bit. ranks: every rank's model_state_bytes plus its "parameters".
    At ZeRO-0 each of the dp replicas holds all states (their sum / dp); at ZeRO 1-3 the dp ranks partition one
    replica's states (their sum). A replica set's parameters: every rank's over dp (model parallelism splits them)."""
    states = sum(r["optimizer_states"] for r in ranks) / (dp_size if stage == 0 else 1)
    return states / max(1.0, sum(r["parameters"] for r in ranks) / dp_size)


@dataclass
class MemoryProbe:
    """At step index `at_step`, with the step's gradients complete, gather every rank's model-state bytes
    (model_state_bytes) and have rank 0 write them to `path`, next to the ZeRO paper's formula
    (metrics.zero_model_state_bytes; docs/architecture.md, "Performance method"). The Trainer (train/trainer.py)
    calls record() at that step."""

    engine: object
    path: str
    at_step: int
    rank: int
    n_params: int
    dp_size: int
    ds_config: dict

    def record(self) -> None:
        engine, ds_config = self.engine, self.ds_config
        ranks = ds.all_gather_object({**model_state_bytes(engine), "parameters": self.n_params})
        if self.rank != 0:
            return
        stage = dsc.zero_stage(ds_config)
        record = {
            "step": self.at_step + 1,
            "world_size": len(ranks),
            "parameters": self.n_params,
            "zero_stage": stage,
            "offload": sorted(dsc.offload_devices(ds_config)),
            "precision": dsc.weights_dtype(ds_config),
            "grad_accum_dtype": ds_config.get("data_types", {}).get("grad_accum_dtype"),
            "optimizer": type(getattr(engine, "basic_optimizer", None) or engine.optimizer).__name__,
            "optimizer_state_bytes_per_parameter": replica_state_bytes_per_parameter(ranks, stage, self.dp_size),
            "formula_bytes_per_rank": zero_model_state_bytes(self.n_params, stage, self.dp_size),
            "ranks": ranks,
        }
        write_json(self.path, record)
