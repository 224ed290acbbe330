"""A model config's derived shape (layer L0, standard library only): the MLP width d_ff, the operator of each layer
(layer_kinds), and the own checks of the Hyena, Caduceus and GPN families (config/checks.py runs them with the
rest)."""

from __future__ import annotations

from megagenome.config.sections import ModelConfig

# The operators of --model.layer_pattern (model/hyena/operators.py).
LAYER_KINDS = ("SE", "MR", "LI", "A")
# The masked-LM-only families and the kind of their every layer: "M" a BiMamba block (model/caduceus/), "C" a dilated
# convolution block (model/gpn/).
BIDIRECTIONAL = {"caduceus": "M", "gpn": "C"}


def layer_kinds(m: ModelConfig) -> list[str]:
    """The operator of each of the model's layers: "H" (HyenaDNA's operator) for every layer of the hyena family,
    --model.layer_pattern repeated to --model.n_layer layers for striped_hyena, "A" (attention) for the transformer."""
    if m.family == "hyena":
        return ["H"] * max(m.n_layer, 0)
    if m.family == "transformer":
        return ["A"] * max(m.n_layer, 0)
    if m.family in BIDIRECTIONAL:
        return [BIDIRECTIONAL[m.family]] * max(m.n_layer, 0)
    pattern = m.layer_pattern.replace(",", " ").split()
    return [pattern[i % len(pattern)] for i in range(max(m.n_layer, 0))] if pattern else []


def d_ff(model: ModelConfig) -> int:
    """Hidden width of the SwiGLU MLP (the LLaMA rule: 2/3 of 4*d, rounded up to 64); gpn's feed-forward: 4*d."""
    if model.d_ff is not None:
        return model.d_ff
    if model.family == "gpn":
        return 4 * model.d_model  # GPN's GELU feed-forward (intermediate_size 2048 at hidden_size 512)
    hidden = int(8 * model.d_model / 3)
    return 64 * ((hidden + 63) // 64)


def hyena_problems(m: ModelConfig) -> list[str]:
    """The Hyena families' own keys (model/hyena/): lengths positive, the layer pattern made of known operators."""
    if m.family == "transformer":
        return published_form_problems(m)
    if m.family in BIDIRECTIONAL:
        return bidirectional_problems(m)
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
    return problems + published_form_problems(m)


def bidirectional_problems(m: ModelConfig) -> list[str]:
    """caduceus' and gpn's own keys: sizes positive, and the masked objective (both read the whole window)."""
    keys = {
        "caduceus": ("state_size", "ssm_expand", "ssm_conv_len"),
        "gpn": ("first_kernel_size", "kernel_size", "dilation_base", "dilation_cycle", "dilation_double_every",
                "dilation_max"),
    }[m.family]  # fmt: skip
    problems = [f"--model.{k}={getattr(m, k)}: must be positive" for k in keys if getattr(m, k) <= 0]
    if m.family == "caduceus" and m.dt_rank is not None and m.dt_rank <= 0:
        problems.append(f"--model.dt_rank={m.dt_rank}: must be positive (or unset: ceil(d_model / 16))")
    if m.objective != "mlm":
        what = "runs Mamba over both directions" if m.family == "caduceus" else "convolves with centred kernels"
        problems.append(
            f"--model.objective={m.objective} with --model.family={m.family}: the model {what}, so every "
            "position sees the bases after it; use --model.objective mlm"
        )
    if m.compile:
        problems.append(f"--model.compile with --model.family={m.family}: only transformer blocks are compiled")
    return problems + published_form_problems(m)


# The options a published model's import sets (model/hyena/evo2.py, evo1.py, hyenadna.py), with their defaults: the
# transformer and Hyena blocks implement them; the bidirectional families' blocks have their own norms and no gated
# MLP.
PUBLISHED_FORM = {"norm_form": "rsqrt", "mlp_activation": "silu", "mlp_gated": True, "biases": [], "mr_decay": True,
                  "filter_inner_layers": 1, "filter_shared_sine": False, "filter_decay_shift": 0.0}  # fmt: skip
# The family each option of PUBLISHED_FORM belongs to where it is not the transformer's and the Hyena families'.
OWN_FAMILY = {"mr_decay": "striped_hyena", "filter_inner_layers": "hyena", "filter_shared_sine": "hyena",
              "filter_decay_shift": "hyena"}  # fmt: skip


def standard_form(m: ModelConfig) -> bool:
    """Whether every option of PUBLISHED_FORM has its default: what the Hugging Face forms' code computes (a model
    with an imported form's options is written back in its authors' layout instead: export --format)."""
    return all(getattr(m, key) == default for key, default in PUBLISHED_FORM.items())


def published_form_problems(m: ModelConfig) -> list[str]:
    """--model.norm_form, mlp_activation and biases are the transformer's and the Hyena families' (mr_decay
    striped_hyena's): set on another family they would do nothing, which is refused; and the grouped-query heads,
    Llama 3's rotary factors and a tokenizer's table (attention_problems, vocabulary_problems)."""
    problems = attention_problems(m) + vocabulary_problems(m)
    for key, default in PUBLISHED_FORM.items():
        value = getattr(m, key)
        families = (OWN_FAMILY[key],) if key in OWN_FAMILY else ("transformer", "hyena", "striped_hyena")
        if value != default and m.family not in families:
            problems.append(f"--model.{key}={value}: only for --model.family {' or '.join(families)} (not {m.family})")
    if "mlp" in m.biases and m.mlp_gated:
        problems.append("--model.biases mlp with the gated MLP: the MLP biases are the plain MLP's (HyenaDNA's); set "
                        "--model.mlp_gated false")  # fmt: skip
    if m.filter_inner_layers < 0:
        problems.append(f"--model.filter_inner_layers={m.filter_inner_layers}: must be 0 or more")
    return problems


def attention_problems(m: ModelConfig) -> list[str]:
    """--model.n_kv_head divides --model.n_head; the llama3 rotary factors are given only with it, low below high."""
    problems = []
    if m.n_kv_head is not None and m.family != "transformer":
        problems.append(f"--model.n_kv_head={m.n_kv_head}: grouped-query attention is the transformer family's "
                        f"(not {m.family})")  # fmt: skip
    elif m.n_kv_head is not None and (m.n_kv_head <= 0 or (m.n_head > 0 and m.n_head % m.n_kv_head)):
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
