"""Evo 1's published checkpoints (layer L1): Together's StripedHyena layout (the `stripedhyena` package; Evo 1's
Hugging Face repositories hold the same weights under `backbone.`) as a striped_hyena model, and back
(model/published.py).

What stripedhyena computes, and what the mapping reproduces:

- blocks by index: hyena_layer_idxs (Hyena-LI: a modal filter with complex poles) and attn_layer_idxs (attention);
- RMSNorm x / (||x|| / sqrt(d) + eps) * scale (--model.norm_form divide); the MLP l3(act(l1 z) * l2 z), act
  --model.mlp_activation (gelu for Evo 1); biases on the Hyena projections, the short filter, out_filter_dense, Wqkv
  and the attention out_proj (--model.biases, each as the config asks);
- the Hyena projection's rows per head (column_split_hyena: our layout as it is); the short filter (3d, 1, k) by
  conv1d, a correlation -> our taps reversed;
- LI: h[c, t] = Re(sum_s R[c, s] p[c, s]^t) with poles p and residues R stored as (re, im) pairs, one filter per
  channel (hyena_filter_groups 1, as Evo 1's; grouped filters are refused) -> our modal filter with lambda = log p:
  log_rate = log(-log|p|), theta = arg p (a pole on or outside the unit circle, a filter that does not decay, is
  refused);
- attention: Wqkv's rows (3, n_head, head_dim) (column_split false) -> ours (n_head, 3, head_dim); rotary of base
  rotary_emb_base, linearly interpolated positions when use_interpolated_rotary_pos_emb;
- the embedding (512 byte rows, --model.vocabulary bytes), tied to the head (unembed.weight, when present, must be
  the embedding).

stripedhyena's attention runs through flash-attn (CUDA only): tests/test_import_evo1.py checks the Hyena layers
against stripedhyena on a CPU, the attention layers' mapping is the published layout as described here.
"""

from __future__ import annotations

import torch

from megagenome.config import ModelConfig, d_ff
from megagenome.model.hyena.config import layer_kinds
from megagenome.model.hyena.striped_layout import block_names, shape_of
from megagenome.model.published import ImportRefused, PublishedFormat, Weights, expect, layers_by_index
from megagenome.model.stack import padded_vocab_size

KINDS = {"hyena_layer_idxs": "LI", "attn_layer_idxs": "A"}
PREFIX = "backbone."  # Evo 1's Hugging Face checkpoints (StripedHyenaModelForCausalLM.backbone)


class Evo1Format(PublishedFormat):
    name = "evo1"
    family = "striped_hyena"
    title = "Evo 1 (Together's StripedHyena layout: stripedhyena's state dict, or Evo 1's Hugging Face checkpoint)"
    oracle = "stripedhyena (pip stripedhyena): stripedhyena.model.StripedHyena"

    def model_config(self, config: dict, tokenizer: dict[str, int] | None = None) -> ModelConfig:
        d, heads, factor = shape_of(config, "Evo 1")
        kinds = layers_by_index(config, KINDS)
        expect(config, "column_split_hyena", True, "the Hyena projection's rows per head", True)
        expect(config, "column_split", False, "Wqkv's rows as (3, heads, head_dim)", False)
        expect(config, "mlp_activation", ("gelu", "silu"), "the MLP's gate", "silu")
        expect(config, "use_flash_rmsnorm", False, "flash-attn's RMSNorm computes x * rsqrt(mean + eps)", False)
        expect(config, "hyena_filter_groups", 1, "one Hyena-LI filter per channel, as Evo 1's", 1)
        flags = (("mixer_in", None), ("short_filter", "short_filter_bias"), ("mixer_out", None),
                 ("qkv", "qkv_proj_bias"), ("attention_out", "mha_out_proj_bias"))  # fmt: skip
        biases = [b for b, key in flags if key is None or config.get(key, True)]
        multiple = int(config.get("inner_size_multiple_of", 64)) * int(config.get("model_parallel_size", 1))
        inner = config.get("inner_mlp_size") or multiple * -(-int(2 * d * 4 / 3) // multiple)
        return ModelConfig(
            family="striped_hyena",
            objective="clm",
            vocabulary="bytes",
            layer_pattern=" ".join(kinds),
            d_model=d,
            n_layer=len(kinds),
            n_head=heads,
            d_ff=int(inner),
            short_filter_len=int(config.get("short_filter_length", 3)),
            state_size=int(config.get("state_size", 2)),
            max_seq_len=int(config.get("max_seqlen") or 8192),
            rope_theta=float(config.get("rotary_emb_base", 10000)),
            rope_scaling="linear" if factor != 1.0 else "none",
            rope_factor=factor,
            norm_eps=float(config.get("eps", 1e-5)),
            norm_form="divide",
            mlp_activation=str(config.get("mlp_activation", "silu")),
            biases=biases,
            tie_embeddings=True,
        )

    def to_ours(self, weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        w = Weights({k.removeprefix(PREFIX): v for k, v in weights.items()})
        take = w.take
        d, hs = cfg.d_model, cfg.d_model // cfg.n_head
        embed = take("embedding_layer.weight")
        if "unembed.weight" in w and not torch.equal(take("unembed.weight"), embed):
            raise ImportRefused("unembed.weight", "differs from the embedding: an untied head is not supported")
        rows = padded_vocab_size(512)
        embed = torch.cat([embed, embed.new_zeros(rows - embed.size(0), d)])
        state = {"embed.weight": embed, "lm_head.weight": embed, "norm.weight": take("norm.scale")}
        biases = set(cfg.biases)
        for i, kind in enumerate(layer_kinds(cfg)):
            b = f"blocks.{i}."
            state |= {mine: take(name) for mine, name in block_names(i, kind).items()}
            if kind == "A":
                mha = b + "inner_mha_cls."
                qkv = take(mha + "Wqkv.weight")  # rows (3, n_head, head_dim) -> ours (n_head, 3, head_dim)
                state[b + "attn.qkv.weight"] = qkv.view(3, cfg.n_head, hs, d).transpose(0, 1).reshape(3 * d, d)
                if "qkv" in biases:
                    state[b + "attn.qkv_bias"] = (
                        take(mha + "Wqkv.bias").view(3, cfg.n_head, hs).transpose(0, 1).flatten()
                    )
                state[b + "attn.proj.weight"] = take(mha + "out_proj.weight")
                if "attention_out" in biases:
                    state[b + "attn.proj_bias"] = take(mha + "out_proj.bias")
                w.skip(*(k for k in w.weights if k.startswith(mha + "rotary_emb.")))  # buffers, ours from the config
                continue
            m = b + "mixer."
            state[m + "in_proj.weight"] = take(b + "projections.weight")
            state[m + "in_bias"] = take(b + "projections.bias")
            state[m + "short_filter"] = take(b + "filter.short_filter_weight")[:, 0].flip(-1)  # correlation -> taps
            if "short_filter" in biases:
                state[m + "short_bias"] = take(b + "filter.short_filter_bias")
            state[m + "out_proj.weight"] = take(b + "out_filter_dense.weight")
            state[m + "out_bias"] = take(b + "out_filter_dense.bias")
            state[m + "D"] = take(b + "filter.D")
            poles = torch.view_as_complex(take(b + "filter.poles")[:, :, 0].contiguous())  # (systems, S)
            residues = take(b + "filter.residues")[:, :, 0]  # (systems, S, 2)
            magnitude = poles.abs()
            if ((magnitude >= 1) | (magnitude == 0)).any():
                raise ImportRefused(b + "filter.poles", "a pole on or outside the unit circle (a filter that does "
                                    "not decay) has no place in megagenome's modal filter")  # fmt: skip
            state[m + "filter.log_rate"] = torch.log(-torch.log(magnitude))
            state[m + "filter.theta"] = poles.angle()
            state[m + "filter.residues"] = residues
            w.skip(*(k for k in w.weights if k.startswith(b + "filter.t")))  # a position buffer
        w.leftover()
        return state

    def to_theirs(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
        wanted = (("family", "striped_hyena"), ("vocabulary", "bytes"), ("norm_form", "divide"))
        for key, value in wanted:
            if getattr(cfg, key) != value:
                raise ImportRefused(f"--model.{key}", f"{getattr(cfg, key)!r}: Evo 1's layout needs {value!r}")
        kinds = layer_kinds(cfg)
        bad = sorted({k for k in kinds if k not in ("LI", "A")})
        if bad or cfg.mlp_activation == "gelu_first" or cfg.rope_scaling not in ("none", "linear"):
            raise ImportRefused("--model.layer_pattern", f"Evo 1's layout holds LI and A layers with one MLP "
                                f"activation and linear rotary scaling (got {bad or cfg.mlp_activation})")  # fmt: skip
        d, hs = cfg.d_model, cfg.d_model // cfg.n_head
        zeros = {"mixer_in": 3 * d, "short_filter": 3 * d, "mixer_out": d, "qkv": 3 * d, "attention_out": d}
        embed = state["embed.weight"][:512]
        out = {"embedding_layer.weight": embed, "unembed.weight": embed.clone(), "norm.scale": state["norm.weight"]}
        for i, kind in enumerate(kinds):
            b = f"blocks.{i}."
            out |= {name: state[mine] for mine, name in block_names(i, kind).items()}
            if kind == "A":
                mha = b + "inner_mha_cls."
                out[mha + "Wqkv.weight"] = state[b + "attn.qkv.weight"].view(cfg.n_head, 3, hs, d).transpose(0, 1)
                qkv_bias = state.get(b + "attn.qkv_bias", torch.zeros(zeros["qkv"]))
                out[mha + "Wqkv.bias"] = qkv_bias.view(cfg.n_head, 3, hs).transpose(0, 1).flatten()
                out[mha + "out_proj.weight"] = state[b + "attn.proj.weight"]
                out[mha + "out_proj.bias"] = state.get(b + "attn.proj_bias", torch.zeros(d))
                continue
            m = b + "mixer."
            out[b + "projections.weight"] = state[m + "in_proj.weight"]
            out[b + "projections.bias"] = state.get(m + "in_bias", torch.zeros(3 * d))
            out[b + "filter.short_filter_weight"] = state[m + "short_filter"].flip(-1)[:, None]
            out[b + "filter.short_filter_bias"] = state.get(m + "short_bias", torch.zeros(3 * d))
            out[b + "out_filter_dense.weight"] = state[m + "out_proj.weight"]
            out[b + "out_filter_dense.bias"] = state.get(m + "out_bias", torch.zeros(d))
            out[b + "filter.D"] = state[m + "D"]
            pole = torch.polar(torch.exp(-state[m + "filter.log_rate"].exp()), state[m + "filter.theta"])
            out[b + "filter.poles"] = torch.view_as_real(pole)[:, :, None]
            out[b + "filter.residues"] = state[m + "filter.residues"][:, :, None]
        config = {
            "vocab_size": 512, "hidden_size": d, "num_filters": d, "num_layers": cfg.n_layer,
            "hyena_layer_idxs": [i for i, k in enumerate(kinds) if k == "LI"],
            "attn_layer_idxs": [i for i, k in enumerate(kinds) if k == "A"],
            "num_attention_heads": cfg.n_head, "inner_mlp_size": d_ff(cfg), "state_size": cfg.state_size,
            "short_filter_length": cfg.short_filter_len, "short_filter_bias": True, "qkv_proj_bias": True,
            "mha_out_proj_bias": True, "hyena_filter_groups": 1, "column_split_hyena": True, "column_split": False,
            "proj_groups": 1, "eps": cfg.norm_eps, "mlp_activation": cfg.mlp_activation, "tie_embeddings": True,
            "final_norm": True, "rotary_emb_base": cfg.rope_theta, "max_seqlen": cfg.max_seq_len,
            "use_interpolated_rotary_pos_emb": cfg.rope_scaling == "linear",
            "rotary_emb_scaling_factor": cfg.rope_factor,
            "model_parallel_size": 1, "use_flashfft": False, "use_flash_rmsnorm": False, "prefill_style": "fft",
        }  # fmt: skip
        return config, {k: v.contiguous() for k, v in out.items()}


EVO1_FORMAT = Evo1Format()
