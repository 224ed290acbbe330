"""The planner's inference memory (layer L1): the peak bytes of one forward pass over a window without autograd
(eval, score-variants, embed), from the model family's cost model where it has an inference estimate (the Hyena
families: model/hyena/inference_memory.py); benchmarks/long_context_memory.py checks it against measured peaks."""

from __future__ import annotations

from megagenome.config import ModelConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model import family_of

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def inference_memory(cfg: ModelConfig, seq: int, batch: int = 1, dtype: str = "bf16", file_dtype: str = "fp32"):
    """{weights, tables, activations, forward, load, peak} bytes of one forward over `batch` windows of `seq` bases
    of cfg's model held in `dtype`, loaded from an export written in `file_dtype`. ValueError for a family without an
    inference estimate."""
    family = family_of(cfg)
    shape = family.costs(cfg, VOCAB_SIZE)
    if not hasattr(shape, "inference_bytes"):
        raise ValueError(f"--model.family={cfg.family}: no inference memory estimate (the Hyena families have one)")
    params = family.parameter_counts(cfg, VOCAB_SIZE)[0]
    return shape.inference_bytes(seq, batch, DTYPE_BYTES[dtype], DTYPE_BYTES[file_dtype], params, cfg.norm_form,
                                 cfg.mlp_activation)  # fmt: skip
