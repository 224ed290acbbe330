"""A model config's family-neutral shape rules (layer L0, standard library only): the default MLP width d_ff, the
options a published model's import sets (PUBLISHED_FORM) and the checks that hold whatever the family. What one
family's keys mean and allow is its own folder's (model/<family>/config.py, run by model/__init__.py validate)."""

from __future__ import annotations

from megagenome.config.sections import ModelConfig


def d_ff(model: ModelConfig) -> int:
    """Hidden width of the SwiGLU MLP: --model.d_ff, else the LLaMA rule (2/3 of 4*d, rounded up to 64). A family
    with another rule has its own (model/gpn/config.py)."""
    if model.d_ff is not None:
        return model.d_ff
    hidden = int(8 * model.d_model / 3)
    return 64 * ((hidden + 63) // 64)


# The options a published model's import sets (model/hyena/evo2.py, evo1.py, hyenadna.py), with their defaults. A
# family names those its blocks implement (model/family.py ModelFamily.options); set on another, one is refused.
PUBLISHED_FORM = {"norm_form": "rsqrt", "mlp_activation": "silu", "mlp_gated": True, "biases": [], "mr_decay": True,
                  "filter_inner_layers": 1, "filter_shared_sine": False, "filter_decay_shift": 0.0}  # fmt: skip
# Every option a family may or may not read, with the value that means "not set": PUBLISHED_FORM and grouped-query
# attention's key/value heads.
FAMILY_OPTIONS = {**PUBLISHED_FORM, "n_kv_head": None}


def standard_form(m: ModelConfig) -> bool:
    """Whether every option of PUBLISHED_FORM has its default: what the Hugging Face forms' code computes (a model
    with an imported form's options is written back in its authors' layout instead: export --format)."""
    return all(getattr(m, key) == default for key, default in PUBLISHED_FORM.items())


def form_problems(m: ModelConfig) -> list[str]:
    """The published options' values among themselves, the grouped-query heads, Llama 3's rotary factors and a
    tokenizer's table (attention_problems, vocabulary_problems). Which family takes an option is the family's
    (model/__init__.py validate)."""
    problems = attention_problems(m) + vocabulary_problems(m)
    if "mlp" in m.biases and m.mlp_gated:
        problems.append("--model.biases mlp with the gated MLP: the MLP biases are the plain MLP's (HyenaDNA's); set "
                        "--model.mlp_gated false")  # fmt: skip
    if m.filter_inner_layers < 0:
        problems.append(f"--model.filter_inner_layers={m.filter_inner_layers}: must be 0 or more")
    return problems


def attention_problems(m: ModelConfig) -> list[str]:
    """--model.n_kv_head divides --model.n_head; the llama3 rotary factors are given only with it, low below high."""
    problems = []
    if m.n_kv_head is not None and (m.n_kv_head <= 0 or (m.n_head > 0 and m.n_head % m.n_kv_head)):
        problems.append(f"--model.n_kv_head={m.n_kv_head}: must be a positive divisor of --model.n_head={m.n_head} "
                        "(each key/value head serves a whole group of query heads)")  # fmt: skip
    factors = (m.rope_low_freq_factor, m.rope_high_freq_factor)
    if m.rope_scaling != "llama3" and factors != (1.0, 4.0):
        problems.append(f"--model.rope_low_freq_factor/--model.rope_high_freq_factor={factors}: only with "
                        "--model.rope_scaling llama3")  # fmt: skip
    elif not 0 < factors[0] < factors[1]:
        problems.append(f"--model.rope_low_freq_factor={factors[0]} must be positive and below "
                        f"--model.rope_high_freq_factor={factors[1]}")  # fmt: skip
    return problems


def vocabulary_problems(m: ModelConfig) -> list[str]:
    """--model.vocabulary table needs its size and the row of each of megagenome's eight tokens (<pad> <mask> <sep>
    A C G T N) within it; the two keys are refused with any other vocabulary, where they would do nothing."""
    if m.vocabulary != "table":
        given = [k for k in ("vocabulary_size", "vocabulary_ids") if getattr(m, k)]
        return [f"--model.{k}: only with --model.vocabulary table (not {m.vocabulary})" for k in given]
    size, ids = m.vocabulary_size, list(m.vocabulary_ids)
    if size is None or size <= 0:
        return [f"--model.vocabulary table needs --model.vocabulary_size (the table's rows), got {size}"]
    if len(ids) != 8 or not all(0 <= i < size for i in ids):
        return [f"--model.vocabulary_ids={ids}: expected the rows (0..{size - 1}) of megagenome's eight tokens, "
                "<pad> <mask> <sep> A C G T N in that order"]  # fmt: skip
    return []
