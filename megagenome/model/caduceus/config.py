"""Caduceus' own config checks (layer L1): its Mamba sizes and the masked objective."""

from __future__ import annotations

from megagenome.config import ModelConfig
from megagenome.model.family import bidirectional_problems


def problems(m: ModelConfig) -> list[str]:
    """Sizes positive, dt_rank positive when given, the masked objective (Mamba runs over both directions), no
    --model.compile."""
    keys = ("state_size", "ssm_expand", "ssm_conv_len")
    problems = [f"--model.{k}={getattr(m, k)}: must be positive" for k in keys if getattr(m, k) <= 0]
    if m.dt_rank is not None and m.dt_rank <= 0:
        problems.append(f"--model.dt_rank={m.dt_rank}: must be positive (or unset: ceil(d_model / 16))")
    return problems + bidirectional_problems(m, "runs Mamba over both directions")
