"""Bytes autograd saves for backward: what activation checkpointing trades for recomputation (the checkpointing,
pipeline, tensor-parallel and planner tests, and benchmarks/plan_validation.py, count them here)."""

from __future__ import annotations

import torch


def saved_storage_bytes(forward, exclude: set[int]) -> tuple[int, int]:
    """(all, DeepSpeed's) bytes of the distinct storages kept for backward by `forward()`, minus the storages in
    `exclude` (the parameters').

    Autograd's saved tensors are seen by saved_tensors_hooks. DeepSpeed's checkpoint keeps its inputs on the
    autograd node instead (ctx.deepspeed_saved_tensors), out of the hooks' sight, and for partitioned or
    CPU-checkpointed inputs moves their data to a `saved_data` tensor, so the graph is walked too; the second figure
    is what those DeepSpeed-held tensors take.
    """
    storages: dict[int, int] = {}
    deepspeed: set[int] = set()

    def keep(t: torch.Tensor, held_by_deepspeed: bool = False) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude and storage.data_ptr() != 0:  # 0: an emptied storage
            storages[storage.data_ptr()] = storage.nbytes()
            if held_by_deepspeed:
                deepspeed.add(storage.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = forward()  # kept alive until counted, so no saved storage is freed and its address reused
    outputs = out if isinstance(out, tuple) else (out,)
    todo = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    visited = set()
    while todo:
        node = todo.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for t in getattr(node, "deepspeed_saved_tensors", None) or ():
            if isinstance(t, torch.Tensor):
                keep(t, held_by_deepspeed=True)
                if isinstance(getattr(t, "saved_data", None), torch.Tensor):
                    keep(t.saved_data, held_by_deepspeed=True)
        todo += [next_node for next_node, _ in node.next_functions]
    return sum(storages.values()), sum(storages[p] for p in deepspeed)


def saved_bytes(forward, exclude: set[int]) -> int:
    """All bytes of saved_storage_bytes."""
    return saved_storage_bytes(forward, exclude)[0]


def param_storages(module: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}
