"""The planner's inference memory (layer L1, no torch): the peak bytes of one forward pass over a window without
autograd (eval, score-variants, embed), from a family's cost model where it has an inference estimate (the Hyena
families: model/hyena/inference_memory.py). run/plan.py inference_memory_of resolves a config's family and
parameter count; benchmarks/long_context_memory.py checks the estimate against measured peaks."""

from __future__ import annotations

from megagenome.planner.states import DTYPE_BYTES


def inference_memory(shape, params: int, seq: int, batch: int, dtype: str, file_dtype: str, norm: str,
                     activation: str, family: str) -> dict[str, int]:  # fmt: skip
    """{weights, tables, activations, forward, load, peak} bytes of one forward over `batch` windows of `seq` bases
    of a model of cost model `shape` and `params` parameters held in `dtype`, loaded from an export written in
    `file_dtype` (norm, activation: --model.norm_form, --model.mlp_activation). ValueError for a family whose cost
    model has no inference estimate, naming it."""
    if not hasattr(shape, "inference_bytes"):
        raise ValueError(f"--model.family={family}: no inference memory estimate (the Hyena families have one)")
    return shape.inference_bytes(seq, batch, DTYPE_BYTES[dtype], DTYPE_BYTES[file_dtype], params, norm, activation)
