"""Caduceus' published checkpoints (layer L1): the kuleshov-group Hugging Face models (CaduceusForMaskedLM, remote
code; model_type "caduceus", weights under caduceus.backbone.) as a caduceus-family model, and back
(model/published.py). Caduceus-Ph only: the models trained with reverse-complement augmentation, post-hoc conjoined
at inference (--model.rc_equivariance post_hoc).

What the mapping reproduces (Schiff et al. 2024; their modeling_caduceus.py):

- pre-norm BiMamba blocks, residual + mixer(RMSNorm(residual)), no MLP, a final RMSNorm (rms_norm true), the MLM
  head tied to the embedding;
- BiMambaWrapper with the "add" strategy and bidirectional_weight_tie: mamba_rev's in_proj and out_proj are
  mamba_fwd's (one module each in ours), each direction's conv, x_proj, dt_proj, A_log and D its own;
- each Mamba as mamba_simple: in_proj rows (u; z) -> ours interleaved per channel (mamba.py), conv1d (c, 1, k) -> our
  (c, k) taps in the same order (both read t - k + 1 .. t), dt_proj's bias -> our dt_bias, no in/out biases;
- the character table ([CLS] 0, [SEP] 1, [BOS] 2, [MASK] 3, [PAD] 4, [RESERVED] 5, [UNK] 6, A C G T N at 7..11),
  padded to pad_vocab_size_multiple rows: --model.vocabulary table with those rows; the complement map's bases
  must pair A with T and C with G.

Refused, naming the key: RCPS (Caduceus-PS, rcps true). Its published code computes an RCPS block two ways: with
fused_add_norm, the published configs' setting and so what the checkpoints were trained with, each block's norm
reads the forward strand from the second half of the stream and the reverse strand from the first; the unfused path,
the paper's RC-PS and megagenome's (--model.rc_equivariance ps), reads them the other way round. A PS checkpoint
computes a function megagenome's RC-PS does not. Also refused: another bidirectional strategy or untied directions,
LayerNorm (rms_norm false), biases in the Mamba projections, and a conv without bias.
"""

from __future__ import annotations

import torch

from megagenome.config import ModelConfig
from megagenome.model.caduceus.mamba import dt_rank
from megagenome.model.published import ImportRefused, PublishedFormat, Weights, expect, require
from megagenome.model.stack import padded_vocab_size
from megagenome.model.vocabulary import VOCABULARIES

CHARACTERS = list(VOCABULARIES["characters"].ids)  # megagenome's tokens' rows in Caduceus' character table
DEFAULT_CONTEXT = 131_072  # the longest published Caduceus' windows (a Mamba has no position table)
PAIRS = {7: 10, 8: 9}  # A-T, C-G in the character table
# ours (inside blocks.{i}.mixer.{fwd,rev}.) -> theirs (inside backbone.layers.{i}.mixer.mamba_{fwd,rev}.)
CORE = {"conv_bias": "conv1d.bias", "dt_bias": "dt_proj.bias", "A_log": "A_log", "D": "D",
        "x_proj.weight": "x_proj.weight", "dt_proj.weight": "dt_proj.weight"}  # fmt: skip


def interleave(rows: torch.Tensor) -> torch.Tensor:
    """mamba_simple's in_proj rows (u; z), (2c, d), as ours (u_0, z_0, u_1, z_1, ...)."""
    return rows.unflatten(0, (2, -1)).transpose(0, 1).flatten(0, 1)


def deinterleave(rows: torch.Tensor) -> torch.Tensor:
    """The inverse of interleave."""
    return rows.unflatten(0, (-1, 2)).transpose(0, 1).flatten(0, 1)


class CaduceusFormat(PublishedFormat):
    name = "caduceus"
    family = "caduceus"
    title = "Caduceus-Ph (the kuleshov-group Hugging Face CaduceusForMaskedLM, without RCPS)"
    oracle = "helical (pip helical): helical.models.caduceus.modeling_caduceus, over a mambapy stand-in for mamba_ssm"

    def model_config(self, config: dict, tokenizer: dict[str, int] | None = None) -> ModelConfig:
        expect(config, "model_type", "caduceus", "a Caduceus checkpoint")
        if config.get("rcps"):
            why = (
                "its published fused_add_norm path, which its checkpoints were trained with, feeds each block's "
                "norm the stream's two halves swapped, a function megagenome's RC-PS does not compute"
            )
            raise ImportRefused("rcps", f"true: Caduceus-PS is not imported ({why}); Caduceus-Ph models import")
        require(config, "d_model", "n_layer", "vocab_size")
        expect(config, "bidirectional", True, "megagenome's caduceus is BiMamba", True)
        expect(config, "bidirectional_strategy", "add", "the two directions added", "add")
        expect(config, "bidirectional_weight_tie", True, "one in_proj and out_proj for both directions", True)
        expect(config, "rms_norm", True, "RMSNorm (megagenome's caduceus has no LayerNorm)", True)
        ssm = dict(config.get("ssm_cfg") or {})
        expect(ssm, "bias", False, "mamba_simple's in_proj and out_proj without biases", False)
        expect(ssm, "conv_bias", True, "the depthwise conv with its bias", True)
        self._check_complement(config)
        multiple = int(config.get("pad_vocab_size_multiple", 8))
        rows = multiple * -(-int(config["vocab_size"]) // multiple)
        rank = ssm.get("dt_rank", "auto")
        return ModelConfig(
            family="caduceus",
            objective="mlm",
            rc_equivariance="post_hoc",
            d_model=int(config["d_model"]),
            n_layer=int(config["n_layer"]),
            n_head=1,  # unused by BiMamba; 1 divides any width
            state_size=int(ssm.get("d_state", 16)),
            ssm_expand=int(ssm.get("expand", 2)),
            ssm_conv_len=int(ssm.get("d_conv", 4)),
            dt_rank=None if rank == "auto" else int(rank),
            max_seq_len=DEFAULT_CONTEXT,
            norm_eps=float(config.get("norm_epsilon", 1e-5)),
            tie_embeddings=True,
            vocabulary="table",
            vocabulary_size=rows,
            vocabulary_ids=CHARACTERS,
        )

    @staticmethod
    def _check_complement(config: dict) -> None:
        complement = config.get("complement_map")
        if complement is None:
            return
        complement = {int(k): int(v) for k, v in complement.items()}
        for a, b in PAIRS.items():
            if complement.get(a) != b or complement.get(b) != a:
                raise ImportRefused("complement_map", f"row {a} does not pair with {b}: not the character table's "
                                    "A-T, C-G (megagenome reads rows 7..11 as A C G T N)")  # fmt: skip

    def to_ours(self, weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        weights = {k[k.index("backbone.") :] if "backbone." in k else k: v for k, v in weights.items()}
        w = Weights(weights)
        embed = w.take("backbone.embeddings.word_embeddings.weight")
        if "lm_head.weight" in w and not torch.equal(w.take("lm_head.weight"), embed):
            raise ImportRefused("lm_head.weight", "differs from the embedding: Caduceus' MLM head is tied to it")
        rows = padded_vocab_size(cfg.vocabulary_size)
        state = {"embed.weight": torch.cat([embed, embed.new_zeros(rows - embed.size(0), embed.size(1))])}
        state["lm_head.weight"] = state["embed.weight"]
        state["norm.weight"] = w.take("backbone.norm_f.weight")
        for i in range(cfg.n_layer):
            ours, theirs = f"blocks.{i}.", f"backbone.layers.{i}."
            state[ours + "norm.weight"] = w.take(theirs + "norm.weight")
            fwd = theirs + "mixer.mamba_fwd."
            state[ours + "mixer.in_proj.weight"] = interleave(w.take(fwd + "in_proj.weight"))
            state[ours + "mixer.out_proj.weight"] = w.take(fwd + "out_proj.weight")
            for name in ("in_proj.weight", "out_proj.weight"):  # tied: saved once, or twice as the same tensor
                rev = theirs + "mixer.mamba_rev." + name
                if rev in w and not torch.equal(w.take(rev), w.take(fwd + name)):
                    raise ImportRefused(rev, "differs from mamba_fwd's: bidirectional_weight_tie shares it")
            for direction in ("fwd", "rev"):
                mine, mamba = f"{ours}mixer.{direction}.", f"{theirs}mixer.mamba_{direction}."
                state |= {mine + k: w.take(mamba + v) for k, v in CORE.items()}
                state[mine + "conv_weight"] = w.take(mamba + "conv1d.weight")[:, 0]  # (c, 1, k) -> (c, k)
        w.leftover()
        return state

    def to_theirs(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]:
        if cfg.family != "caduceus" or cfg.rc_equivariance != "post_hoc":
            raise ImportRefused("--model.rc_equivariance", f"{cfg.family} ({cfg.rc_equivariance}): Caduceus' layout "
                                "here is Caduceus-Ph's, a caduceus model with post_hoc equivariance")  # fmt: skip
        rows = cfg.vocabulary_size if cfg.vocabulary == "table" else len(CHARACTERS)
        weights = {"caduceus.backbone.embeddings.word_embeddings.weight": state["embed.weight"][:rows],
                   "caduceus.backbone.norm_f.weight": state["norm.weight"]}  # fmt: skip
        for i in range(cfg.n_layer):
            ours, theirs = f"blocks.{i}.", f"caduceus.backbone.layers.{i}."
            weights[theirs + "norm.weight"] = state[ours + "norm.weight"]
            for direction in ("fwd", "rev"):
                mine, mamba = f"{ours}mixer.{direction}.", f"{theirs}mixer.mamba_{direction}."
                weights |= {mamba + v: state[mine + k] for k, v in CORE.items()}
                weights[mamba + "conv1d.weight"] = state[mine + "conv_weight"][:, None]
                weights[mamba + "in_proj.weight"] = deinterleave(state[ours + "mixer.in_proj.weight"])
                weights[mamba + "out_proj.weight"] = state[ours + "mixer.out_proj.weight"].clone()  # tied: two copies
        complement = {i: i for i in range(rows)} | PAIRS | {b: a for a, b in PAIRS.items()}
        ssm = {"d_state": cfg.state_size, "d_conv": cfg.ssm_conv_len, "expand": cfg.ssm_expand,
               "dt_rank": dt_rank(cfg), "bias": False, "conv_bias": True}  # fmt: skip
        config = {"architectures": ["CaduceusForMaskedLM"], "model_type": "caduceus", "d_model": cfg.d_model,
                  "n_layer": cfg.n_layer, "vocab_size": rows, "ssm_cfg": ssm, "rms_norm": True,
                  "residual_in_fp32": False, "fused_add_norm": True, "pad_vocab_size_multiple": 1,
                  "norm_epsilon": cfg.norm_eps, "bidirectional": True, "bidirectional_strategy": "add",
                  "bidirectional_weight_tie": True, "rcps": False,
                  "complement_map": {str(k): v for k, v in sorted(complement.items())}}  # fmt: skip
        return config, {k: v.contiguous() for k, v in weights.items()}


CADUCEUS_FORMAT = CaduceusFormat()
