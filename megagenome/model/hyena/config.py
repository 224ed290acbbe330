"""The Hyena families' own config (layer L1): the operator of each layer and the checks of their keys.

hyena runs HyenaDNA's operator ("H") in every layer; striped_hyena the operators of --model.layer_pattern, repeated
to --model.n_layer layers: SE, MR, LI (model/hyena/operators.py) and A (attention, model/transformer/blocks.py).
"""

from __future__ import annotations

from megagenome.config import ModelConfig
from megagenome.model.transformer.config import even_heads

LAYER_KINDS = ("SE", "MR", "LI", "A")  # the operators of --model.layer_pattern


def layer_kinds(m: ModelConfig) -> list[str]:
    """The operator of each of the model's layers: "H" for every layer of the hyena family, --model.layer_pattern
    repeated to --model.n_layer layers for striped_hyena."""
    if m.family == "hyena":
        return ["H"] * max(m.n_layer, 0)
    pattern = m.layer_pattern.replace(",", " ").split()
    return [pattern[i % len(pattern)] for i in range(max(m.n_layer, 0))] if pattern else []


def problems(m: ModelConfig) -> list[str]:
    """The Hyena families' own keys: lengths positive, the layer pattern made of known operators, rotary attention
    layers' head size even, the causal objective, no --model.compile."""
    lengths = ("short_filter_len", "se_filter_len", "mr_filter_len", "state_size", "filter_width")
    problems = [f"--model.{k}={getattr(m, k)}: must be positive" for k in lengths if getattr(m, k) <= 0]
    if m.family == "striped_hyena":
        tokens = m.layer_pattern.replace(",", " ").split()
        unknown = sorted({t for t in tokens if t not in LAYER_KINDS})
        if not tokens or unknown:
            problems.append(
                f"--model.layer_pattern={m.layer_pattern!r}: expected operators among {', '.join(LAYER_KINDS)} "
                f"separated by spaces or commas{'; unknown: ' + ', '.join(unknown) if unknown else ''}"
            )
    if m.d_model > 0 and m.n_head > 0 and not m.d_model % m.n_head and "A" in layer_kinds(m):
        problems += even_heads(m)
    if m.objective != "clm":
        problems.append(
            f"--model.objective={m.objective} with --model.family={m.family}: Hyena operators are causal "
            "convolutions; a masked objective needs a bidirectional family"
        )
    if m.compile:
        problems.append(
            f"--model.compile with --model.family={m.family}: the Hyena FFT convolutions work on complex spectra, "
            "which inductor does not compile as one graph; drop --model.compile"
        )
    return problems
