"""HyenaDNA's published checkpoints (layer L1): the original HyenaDNA model (Nguyen et al. 2023; the hyena-dna
repository's standalone HyenaDNAModel, which the LongSafari/hyenadna-*-seqlen repositories hold as config.json
beside weights.ckpt, keys under `backbone.`) as a hyena-family model, and back (model/published.py).

What HyenaDNA computes, and the options of the hyena family that reproduce it:

- pre-norm blocks x + mixer(LN(x)), x + mlp(LN(x)) with LayerNorm (a bias; --model.norm_form layernorm), a final
  LayerNorm, the head tied to the embedding;
- the MLP fc2(gelu_tanh(fc1 x)) with biases (--model.mlp_gated false, --model.mlp_activation gelu_tanh,
  --model.biases mlp);
- the order-2 Hyena operator: in_proj (a bias) -> rows [x0 | x1 | v], a depthwise causal short filter of 3 taps
  (a bias; conv1d correlates: our taps reversed), then y = x0 . (h * (x1 . v) + D . x1 . v), out_proj (a bias).
  Our in_proj lays its rows out per head (operators.py), so theirs are permuted into (n_head, 3, head_size);
- the implicit filter: Linear(5, w) -> Sin, num_inner_mlps x (Linear(w, w) -> Sin), Linear(w, d) with one Sin
  module reused after every layer (--model.filter_inner_layers, --model.filter_shared_sine), over positional
  features of l_max positions (their pos_emb.z, which must be the formula's: published configs train it with
  lr_pos_emb 0), times exp(-|delta| t) + shift (--model.filter_decay_shift; their deltas must be the default decay
  rates);
- the table: HyenaDNA's character tokenizer ([CLS] 0, [SEP] 1, [BOS] 2, [MASK] 3, [PAD] 4, [RESERVED] 5, [UNK] 6,
  A C G T N at 7..11), padded to pad_vocab_size_multiple rows, all of which the softmax covers: --model.vocabulary
  table with those rows.

Refused, naming the key: attention layers (attn_layer_idx), a Hyena order other than 2, positional features other
than 5 (emb_dim), no modulation, learned positional features or decay rates that differ from the formula, and the
-hf repositories' HyenaConfig layout (a config without a `layer` section). HyenaDNA's embedding dropout (0.1 in its
configs) has no counterpart: continued training runs without it.
"""

from __future__ import annotations

import math

import torch

from megagenome.config import ModelConfig, d_ff
from megagenome.model.hyena.operators import DECAY_TARGET, FAST_DECAY, POSITION_FEATURES, SLOW_DECAY, position_features
from megagenome.model.published import ImportRefused, PublishedFormat, Weights, expect, require
from megagenome.model.stack import padded_vocab_size
from megagenome.model.vocabulary import VOCABULARIES

CHARACTERS = list(VOCABULARIES["characters"].ids)  # megagenome's tokens' rows in HyenaDNA's character table
SHORT_TAPS = 3  # HyenaOperator's short filter: Conv1d(kernel_size=3, padding=2), whatever short_filter_order says
BIASES = ["mixer_in", "short_filter", "mixer_out", "mlp"]
# ours -> theirs, inside blocks.{i}. / backbone.layers.{i}.
BLOCK = {"mixer_norm.weight": "norm1.weight", "mixer_norm.bias": "norm1.bias", "mlp_norm.weight": "norm2.weight",
         "mlp_norm.bias": "norm2.bias", "mlp.w_up.weight": "mlp.fc1.weight", "mlp.up_bias": "mlp.fc1.bias",
         "mlp.w_down.weight": "mlp.fc2.weight", "mlp.down_bias": "mlp.fc2.bias",
         "mixer.out_proj.weight": "mixer.out_proj.weight", "mixer.out_bias": "mixer.out_proj.bias",
         "mixer.D": "mixer.filter_fn.bias",
         "mixer.filter.out.weight": "mixer.filter_fn.implicit_filter.{last}.weight"}  # fmt: skip
PROJECTED = {
    "mixer.in_proj.weight": "mixer.in_proj.weight",
    "mixer.in_bias": "mixer.in_proj.bias",
    "mixer.short_bias": "mixer.short_filter.bias",
}  # fmt: skip  rows permuted to our heads
OUTSIDE = {"embed.weight": "backbone.embeddings.word_embeddings.weight", "norm.weight": "backbone.ln_f.weight",
           "norm.bias": "backbone.ln_f.bias"}  # fmt: skip


def heads_of(d: int) -> int:
    """The n_head the import gives a width: the hyena family's in_proj layout unit (no attention), the most of 8, 4,
    2, 1 that divides it (tensor parallelism splits whole heads)."""
    return next(h for h in (8, 4, 2, 1) if d % h == 0)


def to_heads(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Their [x0 | x1 | v] rows (3d, ...) as ours, (n_head, 3, head_size) (operators.py HyenaOperator)."""
    return rows.reshape(3, n_head, -1, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def from_heads(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of to_heads."""
    return rows.reshape(n_head, 3, -1, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def decay_rates(d: int) -> torch.Tensor:
    """HyenaDNA's ExponentialModulation deltas with its defaults (operators.py exponential_decay)."""
    return torch.linspace(math.log(DECAY_TARGET) / SLOW_DECAY, math.log(DECAY_TARGET) / FAST_DECAY, d)


def _filter_names(cfg: ModelConfig) -> list[int]:
    """The implicit_filter Sequential's indices of its linears: 0, 2, 4, ... (a Sin after each but the last)."""
    return [2 * i for i in range(cfg.filter_inner_layers + 2)]


class HyenaDNAFormat(PublishedFormat):
    name = "hyenadna"
    family = "hyena"
    title = "HyenaDNA (the original HyenaDNAModel: config.json with its `layer` section, weights under backbone.)"
    oracle = "helical (pip helical): helical.models.hyena_dna.standalone_hyenadna.HyenaDNAModel"
    weights_file = "pytorch_model.bin"  # a flat state dict under backbone. (HyenaDNAModel.load_state_dict)

    def model_config(self, config: dict, tokenizer: dict[str, int] | None = None) -> ModelConfig:
        if not isinstance(config.get("layer"), dict):
            why = "the original HyenaDNA config (LongSafari/hyenadna-*-seqlen) has a `layer` section"
            raise ImportRefused("layer", f"missing: {why}; the -hf repositories' HyenaConfig layout is not supported")
        layer = config["layer"]
        require(config, "d_model", "n_layer", "vocab_size")
        require(layer, "l_max")
        expect(layer, "_name_", "hyena", "Hyena mixers", "hyena")
        expect(config, "attn_layer_idx", (None, []), "no attention layers in megagenome's hyena family", None)
        expect(layer, "order", 2, "the order-2 Hyena operator", 2)
        expect(layer, "emb_dim", POSITION_FEATURES, "5 positional features (t and two Fourier bands)", 3)
        expect(layer, "modulate", True, "the exponential decay of the implicit filter", True)
        for key, default in (("fast_decay_pct", FAST_DECAY), ("slow_decay_pct", SLOW_DECAY), ("target", DECAY_TARGET)):
            expect(layer, key, default, "HyenaDNA's default decay rates", default)
        d = int(config["d_model"])
        multiple = int(config.get("pad_vocab_size_multiple", 1))
        rows = multiple * -(-int(config["vocab_size"]) // multiple)
        return ModelConfig(
            family="hyena",
            objective="clm",
            d_model=d,
            n_layer=int(config["n_layer"]),
            n_head=heads_of(d),
            d_ff=int(config.get("d_inner") or 4 * d),
            max_seq_len=int(layer["l_max"]),
            short_filter_len=SHORT_TAPS,
            filter_width=int(layer.get("filter_order", 64)),
            filter_inner_layers=int(layer.get("num_inner_mlps", 2)),
            filter_shared_sine=True,
            filter_decay_shift=float(layer.get("shift", 0.05)),
            norm_form="layernorm",
            norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
            mlp_gated=False,
            mlp_activation="gelu_tanh",
            biases=list(BIASES),
            dropout=float(config.get("resid_dropout", 0.0)),
            tie_embeddings=True,
            vocabulary="table",
            vocabulary_size=rows,
            vocabulary_ids=CHARACTERS,
        )

    def to_ours(self, weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        weights = {k[k.index("backbone.") :] if "backbone." in k else k: v for k, v in weights.items()}
        w = Weights(weights)
        state = {ours: w.take(theirs) for ours, theirs in OUTSIDE.items()}
        if "lm_head.weight" in w:  # a head saved beside the tied embedding must be it
            if not torch.equal(w.take("lm_head.weight"), state["embed.weight"]):
                raise ImportRefused("lm_head.weight", "differs from the embedding: HyenaDNA's head is tied to it")
        rows = padded_vocab_size(cfg.vocabulary_size)
        embed = state["embed.weight"]
        state["embed.weight"] = torch.cat([embed, embed.new_zeros(rows - embed.size(0), embed.size(1))])
        state["lm_head.weight"] = state["embed.weight"]
        for i in range(cfg.n_layer):
            state |= self._block(w, cfg, i)
        w.leftover()
        return state

    def _block(self, w: Weights, cfg: ModelConfig, i: int) -> dict[str, torch.Tensor]:
        ours, theirs = f"blocks.{i}.", f"backbone.layers.{i}."
        linears = _filter_names(cfg)
        out = {ours + k: w.take(theirs + v.format(last=linears[-1])) for k, v in BLOCK.items()}
        for k, v in PROJECTED.items():
            out[ours + k] = to_heads(w.take(theirs + v), cfg.n_head)
        short = w.take(theirs + "mixer.short_filter.weight")  # (3d, 1, taps), a correlation
        out[ours + "mixer.short_filter"] = to_heads(short[:, 0].flip(-1), cfg.n_head)
        fn = theirs + "mixer.filter_fn."
        for j, index in enumerate(linears[:-1]):  # ours: mlp.0, (mlp.1 the sine), mlp.2, mlp.3, ...
            mine = 0 if j == 0 else j + 1
            out[f"{ours}mixer.filter.mlp.{mine}.weight"] = w.take(f"{fn}implicit_filter.{index}.weight")
            out[f"{ours}mixer.filter.mlp.{mine}.bias"] = w.take(f"{fn}implicit_filter.{index}.bias")
        sines = [w.take(f"{fn}implicit_filter.{index + 1}.freq") for index in linears[:-1]]
        if any(not torch.equal(s, sines[0]) for s in sines):
            raise ImportRefused(f"{fn}implicit_filter.3.freq", "differs from .1.freq: HyenaDNA's filter shares one Sin")
        out[f"{ours}mixer.filter.mlp.1.freq"] = sines[0]
        self._check_buffers(w, fn, cfg)
        return out

    def _check_buffers(self, w: Weights, fn: str, cfg: ModelConfig) -> None:
        """Their positional features and decay rates, which ours compute: refused unless they are the formula's."""
        z = w.take(fn + "pos_emb.z")[0]  # (l_max, 5)
        if z.shape != (cfg.max_seq_len, POSITION_FEATURES) or not torch.allclose(
            z, position_features(cfg.max_seq_len, cfg.max_seq_len), atol=1e-5
        ):
            raise ImportRefused(fn + "pos_emb.z", "positional features other than HyenaDNA's formula (trained with "
                                "lr_pos_emb > 0?), which megagenome computes instead of storing")  # fmt: skip
        if fn + "pos_emb.t" in w:
            w.take(fn + "pos_emb.t")  # linspace(0, 1, l_max): the first feature
        deltas = w.take(fn + "modulation.deltas").flatten()
        if not torch.allclose(deltas, decay_rates(cfg.d_model), rtol=1e-5):
            raise ImportRefused(fn + "modulation.deltas", "decay rates other than HyenaDNA's defaults")

    def to_theirs(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
        if cfg.family != "hyena" or cfg.norm_form != "layernorm" or cfg.mlp_gated or not cfg.filter_shared_sine:
            raise ImportRefused("--model.family", f"{cfg.family}: HyenaDNA's layout needs a hyena-family model in "
                                "HyenaDNA's form (an import of one: LayerNorm, plain MLP, shared sine)")  # fmt: skip
        if sorted(cfg.biases) != sorted(BIASES) or cfg.short_filter_len != SHORT_TAPS:
            raise ImportRefused("--model.biases", f"{cfg.biases}, short filter {cfg.short_filter_len}: HyenaDNA has "
                                f"{', '.join(BIASES)} and a {SHORT_TAPS}-tap short filter")  # fmt: skip
        rows = cfg.vocabulary_size if cfg.vocabulary == "table" else len(CHARACTERS)
        weights = {theirs: state[ours][:rows] for ours, theirs in OUTSIDE.items() if ours == "embed.weight"}
        weights |= {theirs: state[ours] for ours, theirs in OUTSIDE.items() if ours != "embed.weight"}
        linears = _filter_names(cfg)
        for i in range(cfg.n_layer):
            ours, theirs, fn = f"blocks.{i}.", f"backbone.layers.{i}.", f"backbone.layers.{i}.mixer.filter_fn."
            weights |= {theirs + v.format(last=linears[-1]): state[ours + k] for k, v in BLOCK.items()}
            weights |= {theirs + v: from_heads(state[ours + k], cfg.n_head) for k, v in PROJECTED.items()}
            short = from_heads(state[ours + "mixer.short_filter"], cfg.n_head).flip(-1)[:, None]
            weights[theirs + "mixer.short_filter.weight"] = short
            for j, index in enumerate(linears[:-1]):
                mine = 0 if j == 0 else j + 1
                weights[f"{fn}implicit_filter.{index}.weight"] = state[f"{ours}mixer.filter.mlp.{mine}.weight"]
                weights[f"{fn}implicit_filter.{index}.bias"] = state[f"{ours}mixer.filter.mlp.{mine}.bias"]
                weights[f"{fn}implicit_filter.{index + 1}.freq"] = state[f"{ours}mixer.filter.mlp.1.freq"]
            features = position_features(cfg.max_seq_len, cfg.max_seq_len)
            weights[fn + "pos_emb.z"] = features[None]
            weights[fn + "pos_emb.t"] = features[None, :, :1]
            weights[fn + "modulation.deltas"] = decay_rates(cfg.d_model)[None, None]
        layer = {"_name_": "hyena", "emb_dim": POSITION_FEATURES, "filter_order": cfg.filter_width,
                 "l_max": cfg.max_seq_len, "modulate": True, "shift": cfg.filter_decay_shift, "lr_pos_emb": 0.0,
                 "num_inner_mlps": cfg.filter_inner_layers, "order": 2}  # fmt: skip
        config = {"d_model": cfg.d_model, "n_layer": cfg.n_layer, "d_inner": d_ff(cfg), "vocab_size": rows,
                  "resid_dropout": cfg.dropout, "embed_dropout": 0.0, "layer_norm_epsilon": cfg.norm_eps,
                  "pad_vocab_size_multiple": 1, "layer": layer}  # fmt: skip
        return config, {k: v.contiguous() for k, v in weights.items()}


HYENADNA_FORMAT = HyenaDNAFormat()
