"""The DNA language model (layer L1): plain torch, no data, training or deepspeed imports."""

from megagenome.model.attention import attention_backend, attention_summary
from megagenome.model.transformer import DNATransformer

__all__ = ["DNATransformer", "attention_backend", "attention_summary"]
