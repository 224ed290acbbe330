"""Evo 2's published checkpoints (layer L1): the vortex layout (Arc Institute's `vtx`, the code Evo 2's weights are
released for) as a striped_hyena model, and back (model/published.py).

An Evo 2 checkpoint is one torch.save'd state dict (evo2_1b_base.pt, evo2_7b.pt, ...; the larger ones split into
byte shards that are concatenated first) and a YAML config (vortex's configs/evo2-*.yml). What the vortex code
computes, and what the mapping below reproduces exactly:

- blocks by index: hcs_layer_idxs (Hyena-SE), hcm_layer_idxs (Hyena-MR), hcl_layer_idxs (Hyena-LI), attn_layer_idxs
  (attention) -> --model.layer_pattern, one entry per layer;
- RMSNorm x / (||x|| / sqrt(d) + eps) * scale (--model.norm_form divide), eps 1e-6; the MLP l3(act(l1 z) * l2 z)
  with GELU in block 0 and no activation after (evo2_style_activations: --model.mlp_activation gelu_first); biases
  on out_filter_dense and the attention out_proj only (--model.biases mixer_out attention_out);
- the Hyena projection's rows interleaved per channel, (x2, x1, v) of channel c at rows 3c, 3c+1, 3c+2 (interleave,
  no column split) -> our (n_head, 3, head_size) rows, a fixed permutation; the short filter (3d, 1, 3) applied by
  conv1d, a correlation -> our taps reversed, permuted alike;
- SE: h (groups, 1, 7) by conv1d (a correlation: reversed) and no D (D is 0 here); MR: h (groups, 1, 128) by FFT, a
  true convolution, with D and no decay applied (--model.mr_decay false); a group's filter is every channel of the
  group's (repeated; the way back refuses a model whose channels of a group have come apart in training);
- LI: h[c, t] = sum_s residues[c, s] exp(log_poles[c, s] t), real poles: our modal filter with log_rate =
  log(-log_poles), theta 0 and imaginary residues 0 (a pole with log_poles >= 0, a filter that does not decay, is
  refused; the way back refuses complex poles);
- attention: Wqkv stored (n_head, 3, head_dim) rows, ours as they are (vortex permutes them after loading), no
  qkv bias, rotate-half rotary of base rotary_emb_base, linear position scaling by rotary_emb_scaling_factor when
  use_interpolated_rotary_pos_emb (the 1M-context models) -> --model.rope_scaling linear;
- the embedding (512 byte rows, --model.vocabulary bytes) tied to the head.
"""

from __future__ import annotations

import torch

from megagenome.config import ModelConfig, d_ff
from megagenome.model.hyena.config import layer_kinds
from megagenome.model.hyena.striped_layout import block_names, shape_of
from megagenome.model.published import ImportRefused, PublishedFormat, Weights, expect, layers_by_index

KINDS = {"hcs_layer_idxs": "SE", "hcm_layer_idxs": "MR", "hcl_layer_idxs": "LI", "attn_layer_idxs": "A"}
CONTEXT = 8192  # the context of a config without max_seqlen


def _groups(config: dict, key: str, d: int) -> int:
    groups = int(config.get(key, d))
    if groups <= 0 or d % groups:
        raise ImportRefused(key, f"{groups} filter groups do not divide hidden_size {d}")
    return groups


class Evo2Format(PublishedFormat):
    name = "evo2"
    family = "striped_hyena"
    title = "Evo 2 (Arc Institute's vortex layout: a torch.save'd state dict and its YAML config)"
    oracle = "vtx (pip vtx, Evo 2's vortex): vortex.model.model.StripedHyena"
    weights_file = "model.pt"  # vortex loads torch.load(path) into custom_load_state_dict
    config_file = "config.yml"

    def model_config(self, config: dict, tokenizer: dict[str, int] | None = None) -> ModelConfig:
        d, heads, factor = shape_of(config, "Evo 2")
        kinds = layers_by_index(config, KINDS)
        expect(config, "interleave", True, "the projection rows interleaved per channel", True)
        expect(config, "column_split_hyena", False, "Evo 2's Hyena projections are not split by head", False)
        expect(config, "hyena_flip_x1x2", False, "x1 and v in their usual order", False)
        expect(config, "short_filter_bias", False, "the short filter has no bias in megagenome", False)
        expect(config, "qkv_proj_bias", False, "Wqkv has no bias in megagenome", False)
        expect(config, "mlp_activation", ("gelu", "silu"), "the MLP's gate", "gelu")
        for key in ("hcs_filter_groups", "hcm_filter_groups"):
            _groups(config, key, d)
        activation = config.get("mlp_activation", "gelu")
        if config.get("evo2_style_activations", False):
            if activation != "gelu":
                raise ImportRefused("mlp_activation", f"{activation!r} with evo2_style_activations (GELU expected)")
            activation = "gelu_first"
        biases = [b for b, key in (("mixer_out", "hyena_out_proj_bias"), ("attention_out", "mha_out_proj_bias"))
                  if config.get(key, True)]  # fmt: skip
        return ModelConfig(
            family="striped_hyena",
            objective="clm",
            vocabulary="bytes",
            layer_pattern=" ".join(kinds),
            d_model=d,
            n_layer=len(kinds),
            n_head=heads,
            d_ff=int(config.get("inner_mlp_size") or d_ff(ModelConfig(d_model=d))),
            short_filter_len=int(config.get("short_filter_length", 3)),
            se_filter_len=int(config.get("hcs_filter_length", 7)),
            mr_filter_len=int(config.get("hcm_filter_length", 128)),
            state_size=int(config.get("state_size", 16)),
            max_seq_len=int(config.get("max_seqlen") or CONTEXT),
            rope_theta=float(config.get("rotary_emb_base", 10000)),
            rope_scaling="linear" if factor != 1.0 else "none",
            rope_factor=factor,
            norm_eps=float(config.get("eps", 1e-6)),
            norm_form="divide",
            mlp_activation=activation,
            biases=biases,
            mr_decay=False,
            tie_embeddings=True,
        )

    def to_ours(self, weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        w = Weights(weights, ignore=("_extra_state",))  # Transformer Engine's fp8 state: no weight of its own
        take = w.take
        d, hs = cfg.d_model, cfg.d_model // cfg.n_head
        embed = take("embedding_layer.weight")
        state = {"embed.weight": embed, "lm_head.weight": embed, "norm.weight": take("norm.scale")}
        for i, kind in enumerate(layer_kinds(cfg)):
            theirs, ours = f"blocks.{i}.", f"blocks.{i}."
            state |= {mine: take(name) for mine, name in block_names(i, kind).items()}
            if kind == "A":
                mha = theirs + "inner_mha_cls."
                state[ours + "attn.qkv.weight"] = take(mha + "Wqkv.weight")  # (n_head, 3, head_dim) rows: ours
                state[ours + "attn.proj.weight"] = take(mha + "out_proj.weight")
                if "attention_out" in cfg.biases:
                    state[ours + "attn.proj_bias"] = take(mha + "out_proj.bias")
                w.skip(mha + "rotary_emb.inv_freq")  # a buffer vortex saves; ours is computed from rope_theta
                continue
            m = ours + "mixer."
            state[m + "in_proj.weight"] = _rows_to_heads(take(theirs + "projections.weight"), cfg.n_head, hs)
            short = take(theirs + "filter.short_filter_weight")[:, 0].flip(-1)  # (3d, k): correlation -> taps
            state[m + "short_filter"] = _rows_to_heads(short, cfg.n_head, hs)
            state[m + "out_proj.weight"] = take(theirs + "out_filter_dense.weight")
            if "mixer_out" in cfg.biases:
                state[m + "out_bias"] = take(theirs + "out_filter_dense.bias")
            if kind == "LI":
                log_poles = take(theirs + "filter.log_poles")[..., 0]  # (d, S)
                if (log_poles >= 0).any():
                    raise ImportRefused(theirs + "filter.log_poles", "a pole with log >= 0 (a filter that does not "
                                        "decay) has no place in megagenome's modal filter")  # fmt: skip
                state[m + "filter.log_rate"] = torch.log(-log_poles)
                state[m + "filter.theta"] = torch.zeros_like(log_poles)
                residues = take(theirs + "filter.residues")  # (d, S), real
                state[m + "filter.residues"] = torch.stack([residues, torch.zeros_like(residues)], -1)
                state[m + "D"] = take(theirs + "filter.D")
            else:
                h = take(theirs + "filter.h")[:, 0]  # (groups, taps)
                if d % h.size(0):
                    raise ImportRefused(theirs + "filter.h", f"{h.size(0)} groups do not divide {d} channels")
                h = h.flip(-1) if kind == "SE" else h  # SE by conv1d (a correlation), MR by FFT (a convolution)
                state[m + "filter.h"] = h.repeat_interleave(d // h.size(0), 0)  # (d, taps)
                state[m + "D"] = take(theirs + "filter.D") if kind == "MR" else torch.zeros(d)
        w.leftover()
        return state

    def to_theirs(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
        wanted = (("family", "striped_hyena"), ("vocabulary", "bytes"), ("norm_form", "divide"), ("mr_decay", False))
        for key, value in wanted:
            if getattr(cfg, key) != value:
                raise ImportRefused(f"--model.{key}", f"{getattr(cfg, key)!r}: Evo 2's layout needs {value!r}")
        if cfg.rope_scaling not in ("none", "linear"):
            raise ImportRefused("--model.rope_scaling", f"{cfg.rope_scaling}: vortex scales positions linearly only")
        kinds, d, hs = layer_kinds(cfg), cfg.d_model, cfg.d_model // cfg.n_head
        out = {"embedding_layer.weight": state["embed.weight"][:512], "norm.scale": state["norm.weight"]}
        groups = {"SE": d, "MR": d}
        for i, kind in enumerate(kinds):
            ours, theirs = f"blocks.{i}.", f"blocks.{i}."
            out |= {name: state[mine] for mine, name in block_names(i, kind).items()}
            if kind == "A":
                mha = theirs + "inner_mha_cls."
                out[mha + "Wqkv.weight"] = state[ours + "attn.qkv.weight"]
                out[mha + "out_proj.weight"] = state[ours + "attn.proj.weight"]
                out[mha + "out_proj.bias"] = state.get(ours + "attn.proj_bias", torch.zeros(d))
                out[mha + "rotary_emb.inv_freq"] = 1.0 / cfg.rope_theta ** (torch.arange(0, hs, 2).float() / hs)
                continue
            m = ours + "mixer."
            out[theirs + "projections.weight"] = _heads_to_rows(state[m + "in_proj.weight"], cfg.n_head, hs)
            short = _heads_to_rows(state[m + "short_filter"], cfg.n_head, hs)
            out[theirs + "filter.short_filter_weight"] = short.flip(-1)[:, None]
            out[theirs + "out_filter_dense.weight"] = state[m + "out_proj.weight"]
            out[theirs + "out_filter_dense.bias"] = state.get(m + "out_bias", torch.zeros(d))
            if kind == "LI":
                if state[m + "filter.theta"].abs().max() > 0 or state[m + "filter.residues"][..., 1].abs().max() > 0:
                    raise ImportRefused(m + "filter", "complex poles (theta or imaginary residues not 0): Evo 2's "
                                        "Hyena-LI filters have real poles")  # fmt: skip
                out[theirs + "filter.log_poles"] = -state[m + "filter.log_rate"].exp()[..., None]
                out[theirs + "filter.residues"] = state[m + "filter.residues"][..., 0]
                out[theirs + "filter.D"] = state[m + "D"]
                continue
            h = state[m + "filter.h"]  # (d, taps)
            size = _group_size(h)
            groups[kind] = min(groups[kind], d // size)
            grouped = h[::size]
            out[theirs + "filter.h"] = (grouped.flip(-1) if kind == "SE" else grouped)[:, None]
            if kind == "MR":
                out[theirs + "filter.D"] = state[m + "D"]
            elif state[m + "D"].abs().max() > 0:
                raise ImportRefused(m + "D", "Evo 2's Hyena-SE layers have no D term; this model's is not 0")
        for i, kind in enumerate(kinds):  # every layer of a kind with the coarsest grouping all of them share
            key = f"blocks.{i}.filter.h"
            if kind in groups and out[key].size(0) != groups[kind]:
                raise ImportRefused(key, f"{kind} layers with different filter groupings")
        return _vortex_config(cfg, kinds, groups), {k: v.contiguous() for k, v in out.items()}


def _rows_to_heads(rows: torch.Tensor, n_head: int, head_size: int) -> torch.Tensor:
    """(3d, ...) rows interleaved per channel (c, 3) -> ours laid out per head (n_head, 3, head_size)."""
    rest = rows.shape[1:]
    return rows.reshape(n_head, head_size, 3, *rest).transpose(1, 2).reshape(-1, *rest)


def _heads_to_rows(ours: torch.Tensor, n_head: int, head_size: int) -> torch.Tensor:
    """_rows_to_heads' inverse."""
    rest = ours.shape[1:]
    return ours.reshape(n_head, 3, head_size, *rest).transpose(1, 2).reshape(-1, *rest)


def _group_size(h: torch.Tensor) -> int:
    """The largest run of channels that share one filter in every group of h (d, taps): Evo 2's grouping."""
    d = h.size(0)
    for groups in range(1, d + 1):
        if d % groups == 0 and torch.equal(h, h[:: d // groups].repeat_interleave(d // groups, 0)):
            return d // groups
    return 1


def _vortex_config(cfg: ModelConfig, kinds: list[str], groups: dict[str, int]) -> dict:
    """vortex's config (the YAML's keys) of the model."""
    index = {key: [i for i, k in enumerate(kinds) if k == kind] for key, kind in KINDS.items()}
    return {
        "model_name": "megagenome-export",
        "vocab_size": 512,
        "hidden_size": cfg.d_model,
        "num_filters": cfg.d_model,
        "num_layers": cfg.n_layer,
        **index,
        "hcs_filter_length": cfg.se_filter_len,
        "hcs_filter_groups": groups["SE"],
        "hcm_filter_length": cfg.mr_filter_len,
        "hcm_filter_groups": groups["MR"],
        "hcl_filter_groups": cfg.d_model,
        "short_filter_length": cfg.short_filter_len,
        "short_filter_bias": False,
        "num_attention_heads": cfg.n_head,
        "state_size": cfg.state_size,
        "eps": cfg.norm_eps,
        "inner_mlp_size": d_ff(cfg),
        "mlp_activation": "gelu" if cfg.mlp_activation in ("gelu", "gelu_first") else "silu",
        "evo2_style_activations": cfg.mlp_activation == "gelu_first",
        "proj_groups": 1,
        "hyena_filter_groups": 1,
        "column_split_hyena": False,
        "column_split": True,
        "interleave": True,
        "hyena_flip_x1x2": False,
        "tie_embeddings": True,
        "final_norm": True,
        "qkv_proj_bias": False,
        "mha_out_proj_bias": True,
        "hyena_out_proj_bias": True,
        "rotary_emb_base": cfg.rope_theta,
        "use_interpolated_rotary_pos_emb": cfg.rope_scaling == "linear",
        "rotary_emb_scaling_factor": cfg.rope_factor,
        "max_seqlen": cfg.max_seq_len,
        "model_parallel_size": 1,
        "inner_size_multiple_of": 16,
        "make_vocab_size_divisible_by": 8,
        "log_intermediate_values": False,
        "prefill_style": "fft",
        "use_flash_attn": True,
        "use_flashfft": False,
        "use_flash_depthwise": False,
        "use_flash_rmsnorm": False,
        "use_fp8_input_projections": True,
    }


EVO2_FORMAT = Evo2Format()
