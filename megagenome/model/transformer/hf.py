"""DNATransformer as a Hugging Face `LlamaForCausalLM` (layer L1): the weight-name and layout mapping both ways and
the config.json of the Llama architecture, the transformer family's Hugging Face form (LlamaForm). The export
writes the rest of the directory (tokenizer, generation config: after_training/hf_files.py), so that `megagenome
export` needs neither transformers nor tokenizers.

The two models compute the same function (tested to 1e-4 in fp32, tests/test_export.py; a published Llama's import
to 1e-5, tests/test_import_llama.py): both are pre-norm with RMSNorm computed in float32, rotary embeddings in the
rotate_half convention (dimension i pairs with i + head_dim/2; a rotary scaling as transformers names it,
rope_fields), multi-head or grouped-query attention scaled by 1/sqrt(head_dim), a SiLU (or GELU) gated MLP, and
biases on q, k, v and o_proj or none (llama_expressible). What differs is layout: megagenome's fused `attn.qkv` lays
its outputs out per key/value head as (n_kv_head, group + 2, head_dim), a group's query heads then its key and
value (multi-head: (n_head, 3, head_dim)); Llama has separate q_proj, k_proj, v_proj whose outputs are (heads,
head_dim). The embedding and LM head are cut to the vocabulary's rows (megagenome pads them to a multiple of 8, rows
that no input and no logit ever uses) so that the Llama model has exactly one logit per token and `generate` can
only produce real tokens.
"""

from __future__ import annotations

import torch

from megagenome.config import ModelConfig, d_ff
from megagenome.model.hf_form import pad_rows
from megagenome.model.stack import padded_vocab_size
from megagenome.model.transformer.blocks import (
    YARN_BETA_FAST,
    YARN_BETA_SLOW,
    ntk_theta,
    rope_original_max_len,
    yarn_mscale,
)
from megagenome.model.vocabulary import table_rows

# Per block: megagenome's name -> Llama's (inside model.layers.{i}.); qkv is split separately.
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
QKV = ("q_proj", "k_proj", "v_proj")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _groups(cfg: ModelConfig) -> tuple[int, int, int]:
    """(key/value heads, query heads per key/value head, head size) of cfg's attention."""
    kv = cfg.n_kv_head or cfg.n_head
    return kv, cfg.n_head // kv, cfg.d_model // cfg.n_head


def _split_qkv(fused: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """{q_proj, k_proj, v_proj: rows} of the fused projection's rows (weight or bias), laid out per key/value head as
    (n_kv_head, group + 2, head_dim) (blocks.py SelfAttention)."""
    kv, g, hd = _groups(cfg)
    rows = fused.view(kv, g + 2, hd, *fused.shape[1:])
    return {"q_proj": rows[:, :g].reshape(-1, *fused.shape[1:]), "k_proj": rows[:, g].reshape(-1, *fused.shape[1:]),
            "v_proj": rows[:, g + 1].reshape(-1, *fused.shape[1:])}  # fmt: skip


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The fused projection's rows of Llama's q_proj, k_proj and v_proj rows (the inverse of _split_qkv)."""
    kv, g, hd = _groups(cfg)
    rest = q.shape[1:]
    parts = [q.reshape(kv, g, hd, *rest), k.reshape(kv, 1, hd, *rest), v.reshape(kv, 1, hd, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def to_llama(state: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """Llama's state dict (contiguous tensors, no shared ones: the tied head is the embedding's rows) of a dense
    DNATransformer state dict."""
    out = {"model.embed_tokens.weight": state["embed.weight"][:vocab_size], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"][:vocab_size]
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for name, llama in BLOCK_NAMES.items():
            out[theirs + llama] = state[ours + name]
        for proj, rows in _split_qkv(state[ours + "attn.qkv.weight"], cfg).items():
            out[f"{theirs}self_attn.{proj}.weight"] = rows
        if "qkv" in cfg.biases:  # Llama's attention_bias: q, k, v and o_proj alike
            for proj, rows in _split_qkv(state[ours + "attn.qkv_bias"], cfg).items():
                out[f"{theirs}self_attn.{proj}.bias"] = rows
            out[f"{theirs}self_attn.o_proj.bias"] = state[ours + "attn.proj_bias"]
    return {k: v.contiguous() for k, v in out.items()}


def from_llama(state: dict[str, torch.Tensor], cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """DNATransformer's dense state dict of a Llama state dict (to_llama's, or a published LlamaForCausalLM's): qkv
    fused per key/value head again, the vocabulary rows padded back with zeros, lm_head.weight the embedding when
    tied."""
    missing = [k for k in llama_names(cfg) if k not in state]
    if missing:
        raise KeyError(f"the Llama weights lack {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    rows = padded_vocab_size(vocab_size)
    out = {
        "embed.weight": pad_rows(state["model.embed_tokens.weight"], rows),
        "norm.weight": state["model.norm.weight"],
    }
    out["lm_head.weight"] = out["embed.weight"] if cfg.tie_embeddings else pad_rows(state["lm_head.weight"], rows)
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for name, llama in BLOCK_NAMES.items():
            out[ours + name] = state[theirs + llama]
        parts = [state[f"{theirs}self_attn.{proj}.weight"] for proj in QKV]
        out[ours + "attn.qkv.weight"] = _fuse_qkv(*parts, cfg)
        if "qkv" in cfg.biases:
            out[ours + "attn.qkv_bias"] = _fuse_qkv(*(state[f"{theirs}self_attn.{p}.bias"] for p in QKV), cfg)
            out[ours + "attn.proj_bias"] = state[f"{theirs}self_attn.o_proj.bias"]
    return out


def llama_names(cfg: ModelConfig) -> list[str]:
    """The names of a LlamaForCausalLM's weights of cfg's shape."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if cfg.tie_embeddings else ["lm_head.weight"])
    biased = ("q_proj", "k_proj", "v_proj", "o_proj") if "qkv" in cfg.biases else ()
    for i in range(cfg.n_layer):
        names += [f"model.layers.{i}.{n}" for n in BLOCK_NAMES.values()]
        names += [f"model.layers.{i}.self_attn.{p}.weight" for p in QKV]
        names += [f"model.layers.{i}.self_attn.{p}.bias" for p in biased]
    return names


def llama_expressible(cfg: ModelConfig) -> bool:
    """Whether LlamaForCausalLM computes cfg's model: a causal transformer with Llama's RMSNorm, a SiLU or GELU gated
    MLP (not the plain one), and biases on all of q, k, v and o_proj (Llama's attention_bias) or none."""
    return (
        cfg.family == "transformer"
        and cfg.objective == "clm"
        and cfg.norm_form == "rsqrt"
        and cfg.mlp_activation in ("silu", "gelu")
        and cfg.mlp_gated
        and sorted(cfg.biases) in ([], ["attention_out", "qkv"])
    )


def llama_config(cfg: ModelConfig, dtype: torch.dtype, vocab_size: int, pad_token_id: int) -> dict:
    """config.json of the LlamaForCausalLM that computes `cfg`'s model (every field that differs from Llama's
    defaults is spelled out; rope_theta also at the top level for transformers 4.x)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": d_ff(cfg),
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head or cfg.n_head,
        "head_dim": cfg.d_model // cfg.n_head,
        "hidden_act": cfg.mlp_activation,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        **rope_fields(cfg),
        "attention_bias": "qkv" in cfg.biases,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": pad_token_id,
        "dtype": DTYPE_NAMES[dtype],
    }


def rope_fields(cfg: ModelConfig) -> dict:
    """The rotary fields of config.json: transformers 5's rope_parameters, and for 4.x the top-level rope_theta and,
    when scaled, rope_scaling (what 4.x reads; 5.x reads it too and it equals rope_parameters). --model.rope_scaling
    as transformers names it: linear -> "linear" (inv_freq / factor); yarn -> "yarn" with the trained context, the
    beta bounds and the attention factor spelled out; ntk -> "default" at the changed base (transformers' "dynamic"
    NTK rescales with each input's length and leaves inputs up to max_position_embeddings unscaled, another
    function), so every scheme loads as the same function (tests/test_context_extension.py). transformers 4.x reads
    yarn's factor as max_position_embeddings / original_max_position_embeddings when the latter is given (5.x reads
    `factor`): config/checks.py requires --model.rope_original_max_len x --model.rope_factor = --model.max_seq_len,
    as the default original (max_seq_len / factor) is, so both read the same factor."""
    theta, scaling = cfg.rope_theta, cfg.rope_scaling
    if scaling == "ntk":
        theta, scaling = ntk_theta(theta, cfg.rope_factor, cfg.d_model // cfg.n_head), "none"
    if scaling == "none":
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_theta": theta}
    params = {"rope_type": scaling, "rope_theta": theta, "factor": float(cfg.rope_factor)}
    if scaling == "yarn":
        original = rope_original_max_len(cfg)
        params.update(
            original_max_position_embeddings=int(original) if float(original).is_integer() else original,
            beta_fast=YARN_BETA_FAST,
            beta_slow=YARN_BETA_SLOW,
            attention_factor=yarn_mscale(cfg.rope_factor),
            truncate=True,
        )
    if scaling == "llama3":
        params.update(
            original_max_position_embeddings=int(rope_original_max_len(cfg)),
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
        )
    return {"rope_parameters": params, "rope_theta": theta, "rope_scaling": dict(params)}


class LlamaForm:
    """The Hugging Face form of a causal transformer's export (model/family.py ModelFamily.huggingface):
    `LlamaForCausalLM` weights under Llama's names, its config.json, and back."""

    weight_names = "llama"  # megagenome.json's "weight_names" of an export in this form
    architecture = "LlamaForCausalLM"

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def to_hf(self, state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
        return to_llama(state, self.cfg, table_rows(self.cfg, vocab_size))

    def from_hf(self, weights: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
        return from_llama(weights, self.cfg, table_rows(self.cfg, vocab_size))

    def config(self, dtype: torch.dtype, vocab_size: int, pad_token_id: int) -> dict:
        return llama_config(self.cfg, dtype, table_rows(self.cfg, vocab_size), pad_token_id)
