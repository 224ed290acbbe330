"""Llama-shaped published checkpoints (layer L1): a transformers LlamaForCausalLM directory (config.json, safetensors,
its tokenizer) as a transformer-family model, and back (model/published.py).

The weights map as megagenome's own Hugging Face export maps them (hf.py to_llama / from_llama: q, k and v fused
per key/value head). The config maps key by key:

    hidden_size, num_hidden_layers, num_attention_heads    --model.d_model, n_layer, n_head
    num_key_value_heads                                    --model.n_kv_head (grouped-query attention)
    intermediate_size, hidden_act (silu, gelu)             --model.d_ff, mlp_activation
    rms_norm_eps, tie_word_embeddings, max_position_embeddings   --model.norm_eps, tie_embeddings, max_seq_len
    attention_bias                                         --model.biases [qkv, attention_out]
    rope_parameters (transformers 5) or rope_theta + rope_scaling (4.x): default, linear, llama3 and yarn
                                                           --model.rope_theta, rope_scaling, rope_factor, ...

The token table is the checkpoint's tokenizer (tokenizer.json, vocab.json or vocab.txt, read by
after_training/importing.py): megagenome's data feeds single bases, so the tokenizer must have a token for each of
A, C, G and T (upper or lower case); N is its own token or the unknown one, <pad> the config's pad_token_id (else
the tokenizer's padding, unknown or end token), <sep> the end-of-sequence token (documents end there), <mask> the
padding row (a causal model has none). --model.vocabulary table keeps the whole table (model/vocabulary.py).

Refused, naming the key: another model_type, a head size other than hidden_size / num_attention_heads, biases in
the MLP, attention dropout, another activation, a rotary scaling megagenome does not compute (dynamic, longrope) or
a yarn whose parameters are not transformers' defaults, and a k-mer or BPE tokenizer without single-base tokens.
"""

from __future__ import annotations

import torch

from megagenome.config import ModelConfig
from megagenome.model.published import ImportRefused, PublishedFormat, Weights, expect, require
from megagenome.model.transformer.blocks import YARN_BETA_FAST, YARN_BETA_SLOW, yarn_mscale
from megagenome.model.transformer.hf import from_llama, llama_config, llama_expressible, llama_names, to_llama
from megagenome.model.vocabulary import MEGAGENOME_TOKENS, table_rows

UNKNOWN = ("<unk>", "[UNK]", "<UNK>")
PADDING = ("<pad>", "[PAD]", "<PAD>")
END = ("</s>", "[SEP]", "<eos>", "<|endoftext|>", "<|end_of_text|>", "[EOS]")
MASK = ("<mask>", "[MASK]", "<MASK>")
TOKENS = len(MEGAGENOME_TOKENS)  # megagenome's vocabulary size (data/tokenizer.py VOCAB)


def _first(tokenizer: dict[str, int], names: tuple[str, ...]) -> int | None:
    return next((tokenizer[n] for n in names if n in tokenizer), None)


def _config_id(config: dict, key: str) -> int | None:
    value = config.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) else None


def token_ids(config: dict, tokenizer: dict[str, int] | None) -> list[int]:
    """The row of each megagenome token (<pad> <mask> <sep> A C G T N) in the checkpoint's table (module docstring)."""
    if not tokenizer:
        raise ImportRefused("tokenizer", "the checkpoint has no tokenizer.json, vocab.json or vocab.txt: megagenome "
                            "needs the rows of the bases A, C, G and T")  # fmt: skip
    bases = []
    for base in "ACGT":
        row = tokenizer.get(base, tokenizer.get(base.lower()))
        if row is None:
            raise ImportRefused("tokenizer", f"no single-base token {base!r} ({len(tokenizer)} tokens; a k-mer or BPE "
                                "tokenizer, which megagenome's single-base data cannot feed)")  # fmt: skip
        bases.append(row)
    unknown = _first(tokenizer, UNKNOWN)
    n = tokenizer.get("N", tokenizer.get("n", unknown))
    if n is None:
        raise ImportRefused("tokenizer", "no token for N and no unknown token (<unk>, [UNK])")
    end = _config_id(config, "eos_token_id")
    end = end if end is not None else _first(tokenizer, END)
    pad = _config_id(config, "pad_token_id")
    pad = next((r for r in (pad, _first(tokenizer, PADDING), unknown, end) if r is not None), None)
    if pad is None:
        raise ImportRefused("pad_token_id", "unset, and the tokenizer has no padding, unknown or end token")
    mask = _first(tokenizer, MASK)
    return [pad, pad if mask is None else mask, pad if end is None else end, *bases, n]


def rope_config(config: dict) -> dict:
    """The ModelConfig's rotary fields of a Llama config's rope_parameters (or rope_theta and rope_scaling)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    if kind == "default":
        return {"rope_theta": theta}
    if kind not in ("linear", "llama3", "yarn"):
        raise ImportRefused(f"{key}.rope_type", f"{kind!r}: megagenome computes default, linear, llama3 and yarn")
    factor = float(params.get("factor", 1.0))
    out = {"rope_theta": theta, "rope_scaling": kind, "rope_factor": factor}
    original = params.get("original_max_position_embeddings")
    if kind == "llama3":
        require(params, "original_max_position_embeddings")
        out |= {"rope_original_max_len": int(original), "rope_low_freq_factor": float(params.get("low_freq_factor", 1)),
                "rope_high_freq_factor": float(params.get("high_freq_factor", 4))}  # fmt: skip
    if kind == "yarn":
        defaults = {"beta_fast": YARN_BETA_FAST, "beta_slow": YARN_BETA_SLOW, "attention_factor": yarn_mscale(factor),
                    "mscale": None, "mscale_all_dim": None, "truncate": True}  # fmt: skip
        for name, default in defaults.items():
            expect(params, name, default, "megagenome's yarn is transformers' default form", default)
        if original is not None:
            out["rope_original_max_len"] = int(original)
    return out


class LlamaFormat(PublishedFormat):
    name = "llama"
    family = "transformer"
    title = "Llama-shaped models (transformers' LlamaForCausalLM with a single-base tokenizer)"
    oracle = "transformers: LlamaForCausalLM"
    tokenizer = True

    def model_config(self, config: dict, tokenizer: dict[str, int] | None = None) -> ModelConfig:
        expect(config, "model_type", "llama", "a transformers LlamaConfig checkpoint")
        require(config, "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        if config.get("head_dim") not in (None, d // heads) or d % heads:
            raise ImportRefused("head_dim", f"{config.get('head_dim')}: megagenome's heads are hidden_size / "
                                f"num_attention_heads ({d} / {heads})")  # fmt: skip
        expect(config, "hidden_act", ("silu", "gelu"), "the gated MLP's gate: SiLU or GELU", "silu")
        expect(config, "mlp_bias", False, "megagenome's MLP has no biases", False)
        expect(config, "attention_dropout", (0, 0.0), "no attention dropout (only residual dropout)", 0.0)
        kv = int(config.get("num_key_value_heads") or heads)
        vocab_size = int(config["vocab_size"])
        return ModelConfig(
            family="transformer",
            objective="clm",
            d_model=d,
            n_layer=int(config["num_hidden_layers"]),
            n_head=heads,
            n_kv_head=None if kv == heads else kv,
            d_ff=int(config["intermediate_size"]),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            mlp_activation=config.get("hidden_act", "silu"),
            biases=["qkv", "attention_out"] if config.get("attention_bias") else [],
            init_std=float(config.get("initializer_range", 0.02)),
            vocabulary="table",
            vocabulary_size=vocab_size,
            vocabulary_ids=token_ids(config, tokenizer),
            **rope_config(config),
        )

    def to_ours(self, weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        w = Weights(weights, ignore=("rotary_emb.inv_freq",))  # a buffer of older transformers' checkpoints
        if cfg.tie_embeddings:
            w.skip("lm_head.weight")  # saved beside a tied embedding by some versions: the same tensor
        taken = {name: w.take(name) for name in llama_names(cfg)}
        w.leftover()
        return from_llama(taken, cfg, table_rows(cfg, TOKENS))

    def to_theirs(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
        if not llama_expressible(cfg):
            form = (
                f"{cfg.family} ({cfg.objective}, norm {cfg.norm_form}, MLP {cfg.mlp_activation}, biases {cfg.biases})"
            )
            raise ImportRefused("--model.family", f"{form}: Llama's layout needs a causal transformer with Llama's "
                                "norm, a SiLU or GELU MLP and biases on all of q, k, v, o or none")  # fmt: skip
        rows = table_rows(cfg, TOKENS)
        dtype = state["embed.weight"].dtype
        ids = cfg.vocabulary_ids if cfg.vocabulary == "table" else list(range(TOKENS))
        config = llama_config(cfg, dtype, rows, pad_token_id=ids[0])
        config["eos_token_id"] = ids[2]
        return config, to_llama(state, cfg, rows)


LLAMA_FORMAT = LlamaFormat()
