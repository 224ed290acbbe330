"""Tier 2: activation checkpointing policies recompute exactly, and keep fewer activations, than no checkpointing.

Two claims for every policy of --model.checkpointing (full, every_k, selective), with torch's checkpoint (the
default) and with DeepSpeed's (engine.activation_checkpoint_function, configured from
ds_configs/activation_checkpointing.json in a one-process gloo world):

1. Gradients are bit-identical to no checkpointing, with dropout on: the recomputation replays the same
   dropout masks because both checkpoint functions restore the RNG state.
2. Saved activations, counted deterministically: the bytes of every tensor autograd saves for backward during
   the forward pass (torch.autograd.graph.saved_tensors_hooks, one count per storage, parameters excluded).
   The theory follows from the model's shape, with the per-block term measured: without checkpointing each
   block saves S_block bytes (its internal activations: norms, q/k/v, attention weights, dropout masks, MLP
   hidden states); with full checkpointing each block keeps only its input, B*T*d elements; every_k keeps the
   input of every k-th block; selective drops what the attention core saves beyond its inputs. Outside the
   blocks (embedding indices, final norm, LM head, loss) nothing changes.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.helpers import REPO, final_ds_config, world_of_one
from support.saved import param_storages, saved_bytes

from megagenome.config import ModelConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model.transformer import DNATransformer
from megagenome.model.transformer.blocks import Block

B, T, D, LAYERS, K = 2, 64, 64, 4, 2
POLICIES = ["full", "every_k", "selective"]


def model_config(policy: str) -> ModelConfig:
    return ModelConfig(
        d_model=D, n_layer=LAYERS, n_head=4, max_seq_len=T, dropout=0.1, checkpointing=policy, checkpoint_every=K
    )


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB_SIZE, (B, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:], torch.ones(B, T)  # (B, T) each


def build(policy: str, checkpoint_fn=None) -> DNATransformer:
    torch.manual_seed(0)  # the same initial weights for every policy
    model = DNATransformer(model_config(policy), VOCAB_SIZE)
    model.set_checkpoint_function(checkpoint_fn)
    return model.train()


def gradients(policy: str, checkpoint_fn=None, dropout_seed: int = 1) -> dict[str, torch.Tensor]:
    model = build(policy, checkpoint_fn)
    torch.manual_seed(dropout_seed)
    loss, _, _ = model(*batch())
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def deepspeed_checkpoint():
    """DeepSpeed's checkpoint function in a world of one (gloo); the process group and env are undone after."""
    from megagenome.engine import engine

    with world_of_one():
        block = json.loads((REPO / "ds_configs" / "activation_checkpointing.json").read_text())
        ds_config = final_ds_config(block)  # as pretrain builds it
        yield engine.activation_checkpoint_function(ds_config)


@pytest.fixture(params=["torch", "deepspeed"])
def checkpoint_fn(request):
    return request.getfixturevalue("deepspeed_checkpoint") if request.param == "deepspeed" else None


def test_dropout_is_on():
    """Otherwise the equalities below would not show that dropout masks are replayed."""
    a, b = gradients("none", dropout_seed=1), gradients("none", dropout_seed=2)
    assert any(not torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_equal_no_checkpointing(policy, checkpoint_fn):
    reference = gradients("none")
    got = gradients(policy, checkpoint_fn)
    assert sorted(got) == sorted(reference)
    worst = max(float((got[n] - reference[n]).abs().max()) for n in got)
    assert all(torch.equal(got[n], reference[n]) for n in got), f"{policy}: max difference {worst:.3g}"


def model_saved_bytes(policy: str, checkpoint_fn=None) -> int:
    model = build(policy, checkpoint_fn)
    torch.manual_seed(1)
    return saved_bytes(lambda: model(*batch()), param_storages(model))


def block_saved_bytes() -> int:
    """S_block: what one block saves without checkpointing, for an input of shape (B, T, d)."""
    torch.manual_seed(0)
    block = Block(model_config("none")).train()
    x = torch.randn(B, T, D, requires_grad=True)  # (B, T, d_model)
    torch.manual_seed(1)
    return saved_bytes(lambda: block(x), param_storages(block))


def core_bytes_in_a_block() -> tuple[int, int]:
    """In a block without checkpointing: bytes the attention core saves, and bytes of its inputs' storages.

    Measured inside a real block, so q, k and v have the model's layout: q and k are fresh rotary outputs,
    v is a view of the fused qkv projection's output (B, T, 3d).
    """
    torch.manual_seed(0)
    block = Block(model_config("none")).train()
    core = block.attn._core
    found = {}

    def measured_core(q, k, v):
        found["inputs"] = sum(
            {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (q, k, v)}.values()
        )
        out = {}

        def run():
            out["y"] = core(q, k, v)  # (B, n_head, T, head_dim)
            return out["y"]

        found["saved"] = saved_bytes(run, exclude=set())
        return out["y"]

    block.attn._core = measured_core
    torch.manual_seed(1)
    block(torch.randn(B, T, D, requires_grad=True))
    return found["saved"], found["inputs"]


def test_saved_activations_match_the_theory(checkpoint_fn):
    block_input = B * T * D * 4  # fp32, the only thing a fully checkpointed block keeps
    s_block = block_saved_bytes()
    s_none = model_saved_bytes("none")
    outside = s_none - LAYERS * s_block  # embedding indices, final norm, LM head and loss
    assert 0 < outside < s_none
    measured = {p: model_saved_bytes(p, checkpoint_fn) for p in POLICIES}
    theory_full = outside + LAYERS * block_input
    theory_every_k = outside + (LAYERS // K) * block_input
    # Selective drops what the attention core saves and keeps the core's inputs instead: q and k (B*T*d each)
    # and v, whose storage is the whole fused qkv output (3*B*T*d): 5*B*T*d per block.
    core_saved, core_inputs = core_bytes_in_a_block()
    assert core_inputs == 5 * block_input
    theory_selective = s_none - LAYERS * (core_saved - core_inputs)
    kept = ", ".join(f"{p} {b} B ({b / s_none:.3f} of none)" for p, b in measured.items())
    theory = f"full {theory_full / s_none:.3f}, every_k {theory_every_k / s_none:.3f}"
    print(
        f"S_block {s_block} B, block input {block_input} B (per-block ratio {block_input / s_block:.4f}); outside "
        f"the blocks {outside} B; none {s_none} B; {kept}; core saves {core_saved} B, inputs {core_inputs} B; "
        f"theory {theory}, selective {theory_selective / s_none:.3f}"
    )
    # Full keeps exactly the block inputs, so it keeps the theoretical fraction (outside + L*B*T*d*4) / S_none.
    assert measured["full"] == theory_full
    assert measured["every_k"] == theory_every_k < measured["full"]
    assert measured["selective"] == theory_selective
    assert measured["full"] < measured["selective"] < s_none


# ----- the Hyena families (model/hyena/): the same policies over their blocks --------------------------------------

# hyena: H layers (implicit filters by FFT); striped_hyena: every operator (SE, MR direct; LI by FFT) and attention.
HYENA = {
    "hyena": {"family": "hyena", "filter_width": 16},
    "striped_hyena": {"family": "striped_hyena", "layer_pattern": "SE MR LI A", "mr_filter_len": 16},
}


def hyena_model(family: str, policy: str, checkpoint_fn=None):
    from megagenome.model import family_of

    cfg = ModelConfig(**(vars(model_config(policy)) | HYENA[family]))
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg, VOCAB_SIZE)
    model.set_checkpoint_function(checkpoint_fn)
    return model.train()


@pytest.mark.parametrize("family", list(HYENA))
@pytest.mark.parametrize("policy", POLICIES)
def test_hyena_families_recompute_exactly_and_keep_less(family, policy, checkpoint_fn):
    """Dropout on: gradients bit-identical to no checkpointing (full and every_k recompute whole blocks, selective
    each operator's long convolution, whose D skip weight passes through the checkpoint), and fewer bytes kept for
    backward than without checkpointing, so the equality is not that of two unrecomputed runs."""
    grads, kept = {}, {}
    for p in ("none", policy):
        model = hyena_model(family, p, checkpoint_fn)
        torch.manual_seed(1)
        kept[p] = saved_bytes(lambda m=model: m(*batch()), param_storages(model))
        torch.manual_seed(1)
        model(*batch())[0].backward()
        grads[p] = {n: q.grad for n, q in model.named_parameters()}
    reference, got = grads["none"], grads[policy]
    worst = max(float((got[n] - reference[n]).abs().max()) for n in got)
    assert all(torch.equal(got[n], reference[n]) for n in got), f"{family} {policy}: max difference {worst:.3g}"
    print(f"{family} {policy}: saved activations {kept['none']} -> {kept[policy]} bytes")
    assert kept[policy] < kept["none"], kept
