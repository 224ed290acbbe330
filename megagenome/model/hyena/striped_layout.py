"""What Evo 1's and Evo 2's published layouts share (layer L1): StripedHyena's module tree around the mixers, the
names of a block's two norms and its gated MLP (l1, l2, l3: gate, up, down), both ways, and the config keys both
check (model/hyena/evo1.py, evo2.py map the mixers themselves)."""

from __future__ import annotations

from megagenome.model.published import ImportRefused, expect, require

MLP = (("w_gate", "l1"), ("w_up", "l2"), ("w_down", "l3"))  # (ours, theirs): l3(act(l1 z) * l2 z)


def block_names(i: int, kind: str) -> dict[str, str]:
    """{our weight name: theirs} of block i's norms and MLP (kind "A": an attention block, else a Hyena one)."""
    b = f"blocks.{i}."
    norms = ("attn_norm", "mlp_norm") if kind == "A" else ("mixer_norm", "mlp_norm")
    out = {f"{b}{norms[0]}.weight": f"{b}pre_norm.scale", f"{b}{norms[1]}.weight": f"{b}post_norm.scale"}
    return out | {f"{b}mlp.{ours}.weight": f"{b}mlp.{theirs}.weight" for ours, theirs in MLP}


def shape_of(config: dict, who: str) -> tuple[int, int, float]:
    """(hidden size, attention heads, the rotary positions' linear scaling factor) of a StripedHyena config, after
    the checks both layouts share (`who` names the model in the reasons)."""
    require(config, "hidden_size", "num_layers", "num_attention_heads", "vocab_size")
    d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    expect(config, "vocab_size", 512, f"{who}'s byte tokens: --model.vocabulary bytes")
    expect(config, "proj_groups", 1, "grouped-query attention is not implemented", 1)
    expect(config, "tie_embeddings", True, "the head is the embedding", True)
    expect(config, "final_norm", True, "a final norm before the head", True)
    expect(config, "num_filters", d, "one filter channel per hidden channel", d)
    if d % heads:
        raise ImportRefused("num_attention_heads", f"{heads} does not divide hidden_size {d}")
    scaling = bool(config.get("use_interpolated_rotary_pos_emb", False))
    return d, heads, float(config.get("rotary_emb_scaling_factor", 1.0)) if scaling else 1.0
