"""GPN's own config (layer L1): its feed-forward width and the checks of its keys."""

from __future__ import annotations

from megagenome.config import ModelConfig
from megagenome.model.family import bidirectional_problems


def d_ff(m: ModelConfig) -> int:
    """The feed-forward width: --model.d_ff, else GPN's 4 x d_model (intermediate_size 2048 at hidden_size 512)."""
    return m.d_ff if m.d_ff is not None else 4 * m.d_model


def problems(m: ModelConfig) -> list[str]:
    """Kernel and dilation sizes positive, the masked objective (centred kernels), no --model.compile."""
    keys = ("first_kernel_size", "kernel_size", "dilation_base", "dilation_cycle", "dilation_double_every")
    keys += ("dilation_max",)
    problems = [f"--model.{k}={getattr(m, k)}: must be positive" for k in keys if getattr(m, k) <= 0]
    return problems + bidirectional_problems(m, "convolves with centred kernels")
