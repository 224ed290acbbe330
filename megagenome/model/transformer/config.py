"""The transformer family's own config checks (layer L1): rotary attention needs an even head size."""

from __future__ import annotations

from megagenome.config import ModelConfig


def problems(m: ModelConfig) -> list[str]:
    """The transformer's own keys: every head's size even (rotary embeddings)."""
    if m.d_model > 0 and m.n_head > 0 and not m.d_model % m.n_head:
        return even_heads(m)
    return []


def even_heads(m: ModelConfig) -> list[str]:
    """Rotary embeddings rotate pairs of a head's channels: the head size must be even (the transformer's attention,
    and striped_hyena's attention layers)."""
    if (m.d_model // m.n_head) % 2:
        return [f"head size --model.d_model/--model.n_head={m.d_model // m.n_head} must be even for rotary embeddings"]
    return []
