"""Caduceus' own config checks (layer L1): its Mamba sizes and the masked objective."""

from __future__ import annotations

from megagenome.config import ModelConfig


def problems(m: ModelConfig) -> list[str]:
    """Sizes positive, dt_rank positive when given, the masked objective (Mamba runs over both directions), no
    --model.compile."""
    keys = ("state_size", "ssm_expand", "ssm_conv_len")
    problems = [f"--model.{k}={getattr(m, k)}: must be positive" for k in keys if getattr(m, k) <= 0]
    if m.dt_rank is not None and m.dt_rank <= 0:
        problems.append(f"--model.dt_rank={m.dt_rank}: must be positive (or unset: ceil(d_model / 16))")
    if m.objective != "mlm":
        problems.append(
            f"--model.objective={m.objective} with --model.family=caduceus: the model runs Mamba over both "
            "directions, so every position sees the bases after it; use --model.objective mlm"
        )
    if m.compile:
        problems.append("--model.compile with --model.family=caduceus: only transformer blocks are compiled")
    return problems
