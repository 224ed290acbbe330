"""The caduceus family (megagenome/model/caduceus/): the Mamba and BiMamba mixers against mambapy,
reverse-complement equivariance, and the LanguageModel protocol.

The oracle is mambapy 1.2.0's MambaBlock (mambapy/mamba.py, a port of Mamba's mamba_simple), configured as
MambaConfig(d_model, n_layers=1, d_state=N, expand_factor=E, d_conv=k, dt_rank=r, bias=False, conv_bias=True,
pscan=True). Our one-direction mixer (MambaMixer(bidirectional=False)) maps into it weight by weight; the mapping is
the specification of what our parameters mean in their terms:

    in_proj (2c, d), rows (u_0, z_0, u_1, z_1, ...)  ->  in_proj.weight (their x, z = chunk(2)): our row 2i is
                                               their row i, our row 2i + 1 their row c + i (deinterleave)
    fwd.conv_weight (c, k), tap j at lag k-1-j  ->  conv1d.weight (c, 1, k) as it is (their Conv1d pads k - 1 on
                                               both sides and keeps the first T outputs: a causal correlation)
    fwd.conv_bias (c,)                     ->  conv1d.bias
    fwd.x_proj (r + 2N, c), rows (dt, B, C) ->  x_proj.weight
    fwd.dt_proj (c, r), fwd.dt_bias (c,)   ->  dt_proj.weight, dt_proj.bias
    fwd.A_log (c, N), fwd.D (c,)           ->  A_log, D
    out_proj (d, c)                        ->  out_proj.weight

BiMamba (Caduceus' BiMambaWrapper with bidirectional_weight_tie, strategy "add") is then two such MambaBlocks whose
in_proj and out_proj are ours (the same weights in both) and whose other parameters are fwd.* and rev.*:
bimamba(x) = mamba_fwd(x) + flip_T(mamba_rev(flip_T(x))). Weights are redrawn at unit scale so that every path moves
the output by O(1); the deliberate mismatches (an unflipped conv, the x/z halves swapped, the reverse direction's
parameters taken from the forward) each move it by far more than the tolerance.

The selective scan's own tests (its three paths against a float64 loop) are tests/test_caduceus_scan.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from mambapy.mamba import MambaBlock, MambaConfig

from megagenome.config import ModelConfig
from megagenome.data import tokenizer
from megagenome.model import family_of
from megagenome.model.caduceus import rc
from megagenome.model.caduceus.mamba import MambaMixer
from megagenome.model.caduceus.model import CaduceusLM
from megagenome.model.distill import Teacher
from megagenome.model.layers import DenseLayers

V = tokenizer.VOCAB_SIZE
D_MODEL, N_STATE = 16, 4


def config(**kw) -> ModelConfig:
    base = dict(family="caduceus", objective="mlm", d_model=D_MODEL, n_layer=2, state_size=N_STATE, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def build(seed: int = 0, **kw) -> CaduceusLM:
    torch.manual_seed(seed)
    return CaduceusLM(config(**kw), V)


def unit_scale_(module: torch.nn.Module, seed: int = 1) -> None:
    """Every weight redrawn so each path matters: matrices N(0, 1/fan_in), vectors around 1, A_log as Mamba's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 4 + 0.5))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            else:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))


def ids(B: int, T: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ----- the mixers against mambapy ----------------------------------------------------------------------------------


def deinterleave(weight: torch.Tensor) -> torch.Tensor:
    """Our in_proj rows (u_0, z_0, u_1, z_1, ...) as mamba_simple's (u; z): (2c, d) -> (2c, d)."""
    return weight.unflatten(0, (-1, 2)).transpose(0, 1).flatten(0, 1)


def oracle_of(cfg: ModelConfig, in_proj, core, out_proj) -> MambaBlock:
    """mambapy's MambaBlock with our in_proj, one direction's core and out_proj (module docstring)."""
    theirs = MambaBlock(
        MambaConfig(
            cfg.d_model, n_layers=1, d_state=cfg.state_size, expand_factor=cfg.ssm_expand, d_conv=cfg.ssm_conv_len,
            dt_rank=core.dt_proj.weight.shape[1], bias=False, conv_bias=True, pscan=True,
        )
    )  # fmt: skip
    with torch.no_grad():
        theirs.in_proj.weight.copy_(deinterleave(in_proj.weight))
        theirs.conv1d.weight.copy_(core.conv_weight.unsqueeze(1))
        theirs.conv1d.bias.copy_(core.conv_bias)
        theirs.x_proj.weight.copy_(core.x_proj.weight)
        theirs.dt_proj.weight.copy_(core.dt_proj.weight)
        theirs.dt_proj.bias.copy_(core.dt_bias)
        theirs.A_log.copy_(core.A_log)
        theirs.D.copy_(core.D)
        theirs.out_proj.weight.copy_(out_proj.weight)
    return theirs


def mixer(bidirectional: bool, **kw) -> MambaMixer:
    torch.manual_seed(0)
    m = MambaMixer(config(**kw), DenseLayers(), bidirectional=bidirectional)
    unit_scale_(m)
    return m


@pytest.mark.parametrize("T", [37, 64])
def test_mamba_mixer_is_mambapys_block(T):
    ours = mixer(False)
    theirs = oracle_of(config(), ours.in_proj, ours.fwd, ours.out_proj)
    x = torch.randn(3, T, D_MODEL, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = ours(x), theirs(x)
    print(f"Mamba vs mambapy T={T}: max error {(got - want).abs().max().item():.2e} of {want.abs().max().item():.2f}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def bimamba_oracle(ours: MambaMixer, x: torch.Tensor, rev_core=None) -> torch.Tensor:
    cfg = config()
    fwd = oracle_of(cfg, ours.in_proj, ours.fwd, ours.out_proj)
    rev = oracle_of(cfg, ours.in_proj, rev_core or ours.rev, ours.out_proj)
    return fwd(x) + rev(x.flip(1)).flip(1)


@pytest.mark.parametrize("dt_rank", [None, 3])
def test_bimamba_is_two_mambapy_blocks_sharing_in_and_out_projections(dt_rank):
    ours = mixer(True, dt_rank=dt_rank)
    x = torch.randn(2, 45, D_MODEL, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got, want = ours(x), bimamba_oracle(ours, x)
    print(f"BiMamba vs mambapy: max error {(got - want).abs().max().item():.2e} of {want.abs().max().item():.2f}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_deliberate_mismatches_are_caught():
    """Each wrong mapping moves the output by >> the oracle tolerance (1e-5): an unflipped conv, the halves of
    in_proj swapped, and the reverse direction given the forward's parameters."""
    ours = mixer(True)
    x = torch.randn(2, 45, D_MODEL, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ours(x)
        moved = {"same direction": (want - bimamba_oracle(ours, x, rev_core=ours.fwd)).abs().max()}
        ours.fwd.conv_weight.copy_(ours.fwd.conv_weight.flip(1))
        moved["unflipped conv"] = (ours(x) - want).abs().max()
        ours.fwd.conv_weight.copy_(ours.fwd.conv_weight.flip(1))
        ours.in_proj.weight.copy_(ours.in_proj.weight.roll(1, 0))  # (z_i, u_{i+1}) read as (u_i, z_i)
        moved["x/z swapped"] = (ours(x) - want).abs().max()
    print({k: f"{v.item():.2e}" for k, v in moved.items()})
    assert all(v > 1e-2 for v in moved.values()), moved


# ----- reverse-complement equivariance -----------------------------------------------------------------------------


def test_complement_table_is_the_tokenizers():
    assert rc.complement_index(V).tolist() == tokenizer._COMPLEMENT.tolist()
    assert rc.complement_index(16).tolist()[V:] == list(range(V, 16))


def rc_error(model: CaduceusLM, x: torch.Tensor) -> float:
    comp = model.complement
    with torch.no_grad():
        forward, reverse = model.logits(x), model.logits(rc.reverse_complement_ids(x, comp))
    return (reverse - rc.reverse_complement_logits(forward, comp)).abs().max().item()


@pytest.mark.parametrize("unit", [False, True], ids=["init", "unit-scale"])
def test_ps_is_exactly_equivariant(unit):
    """logits(rc(x)) = flip_T(logits(x))[..., complement] for several lengths and a batch, training mode too; the
    2d stream of hidden() flips over positions and channels."""
    model = build()
    if unit:
        unit_scale_(model)
    for T in (1, 9, 32, 50):
        x = ids(3, T)
        for train in (False, True):
            err = rc_error(model.train(train), x)
            print(f"ps T={T} train={train}: equivariance error {err:.1e}")
            assert err <= 3e-6  # a few float32 ulps of logits up to ~7 (unit scale): both strands' sums differ in order
    model.eval()
    with torch.no_grad():
        h, h_rc = model.hidden(x), model.hidden(rc.reverse_complement_ids(x, model.complement))
    assert h.shape == (3, 50, 2 * D_MODEL)
    torch.testing.assert_close(h_rc, h.flip(1, 2), rtol=0, atol=1e-6)


def test_post_hoc_averages_in_eval_mode_only():
    model = build(rc_equivariance="post_hoc")
    unit_scale_(model)
    x = ids(3, 40)
    assert rc_error(model.eval(), x) <= 1e-6
    assert rc_error(model.train(), x) > 1e-2  # training: the plain model, not equivariant
    with torch.no_grad():
        plain = model.lm_head(model.hidden(x))[..., :V]
        torch.testing.assert_close(model.logits(x), plain)
        model.eval()
        x_rc = rc.reverse_complement_ids(x, model.complement)
        mapped = rc.reverse_complement_logits(model.lm_head(model.hidden(x_rc)), model.complement)[..., :V]
        torch.testing.assert_close(model.logits(x), (plain + mapped) / 2, rtol=1e-5, atol=1e-6)
    assert model.hidden(x).shape == (3, 40, D_MODEL)


def test_every_module_runs_once_per_forward():
    """Both strands go through each block as one batch (ZeRO-3 gathers each module's parameters once)."""
    model = build()
    calls: dict[str, int] = {}
    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(lambda m, i, o, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    model(ids(2, 16), ids(2, 16, 8), torch.ones(2, 16))
    assert set(calls.values()) == {1}, {k: v for k, v in calls.items() if v != 1}


# ----- the LanguageModel protocol ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ps", "post_hoc"])
def test_loss_sums_and_backward(mode):
    model = build(rc_equivariance=mode).train()
    x, y = ids(2, 24), ids(2, 24, 8)
    w = torch.rand(2, 24)
    loss, nll, weight = model(x, y, w)
    ce = F.cross_entropy(model.logits(x).flatten(0, 1), y.flatten(), reduction="none")
    torch.testing.assert_close(nll, (ce * w.flatten()).sum())
    torch.testing.assert_close(weight, w.sum())
    torch.testing.assert_close(loss, nll / w.sum())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    states = model.layer_states(x, [0, 1, -1])
    width = 2 * D_MODEL if mode == "ps" else D_MODEL
    assert all(s.shape == (2, 24, width) for s in states.values())
    torch.testing.assert_close(states[-1], model.hidden(x))


def grads(policy: str) -> list[torch.Tensor]:
    model = build(checkpointing=policy, checkpoint_every=2, n_layer=3).train()
    model.set_checkpoint_function(None)
    loss, _, _ = model(ids(2, 20), ids(2, 20, 8), torch.ones(2, 20))
    loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("policy", ["full", "every_k", "selective"])
def test_checkpointing_gives_the_same_gradients(policy):
    for g, h in zip(grads(policy), grads("none")):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)


def test_bf16_forward_runs():
    model = build().to(torch.bfloat16).train()
    loss, _, _ = model(ids(2, 16), ids(2, 16, 8), torch.ones(2, 16))
    loss.backward()
    assert torch.isfinite(loss)
    fp32 = build().train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, _ = fp32(ids(2, 16), ids(2, 16, 8), torch.ones(2, 16))
    assert torch.isfinite(loss)


def test_build_is_deterministic_and_ps_has_post_hocs_parameters():
    a, b = build(seed=3).state_dict(), build(seed=3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ph = build(seed=3, rc_equivariance="post_hoc").state_dict()
    assert {k: v.shape for k, v in ph.items()} == {k: v.shape for k, v in a.items()}
    for tie in (True, False):
        ps, post = build(tie_embeddings=tie), build(rc_equivariance="post_hoc", tie_embeddings=tie)
        assert ps.num_parameters() == post.num_parameters()
        assert ps.num_parameters(exclude_embeddings=True) == post.num_parameters() - (2 - tie) * 8 * D_MODEL


def test_weight_decay_groups_and_mamba_initialisation():
    model = build()
    decay, no_decay = (g["params"] for g in model.param_groups(0.1))
    ids_no = {id(p) for p in no_decay}
    for core in (model.blocks[0].mixer.fwd, model.blocks[0].mixer.rev):
        assert id(core.A_log) in ids_no and id(core.D) in ids_no and id(core.x_proj.weight) not in ids_no
        torch.testing.assert_close(core.A_log[3], torch.log(torch.arange(1.0, N_STATE + 1)))
        step = F.softplus(core.dt_bias)
        assert step.min() >= 1e-3 * 0.999 and step.max() <= 0.1 * 1.001
    assert len(decay) + len(no_decay) == len(list(model.parameters()))
    assert model.vocab_parameters() == [model.embed.weight]


def test_distillation_and_refusals():
    model = build().train()
    model.set_teacher(Teacher(build(seed=1, rc_equivariance="post_hoc"), alpha=0.5, temperature=2.0))
    x = ids(2, 12)
    loss, nll, _ = model(x, x, torch.ones(2, 12))
    loss.backward()
    assert torch.isfinite(loss) and not torch.equal(loss, nll / 24)  # the blend, not the plain loss
    with pytest.raises(ValueError, match="compile"):
        model.compile_blocks()
    with pytest.raises(ValueError, match="sequence parallelism"):
        model.set_sequence_parallel(None, 0, 2)
    model.set_sequence_parallel(None, 0, 1)
    with pytest.raises(ValueError, match="pipeline"):
        model.pipeline_layers()


def test_family_answers():
    cfg = config()
    fam = family_of(cfg)
    model = fam.build(cfg, V)
    assert fam.parameter_counts(cfg, V) == (
        model.num_parameters(),
        sum(p.numel() for p in model.blocks[0].parameters()),
    )
    assert fam.expected_shapes(cfg, V) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    rules = fam.parallel_rules(cfg, V)
    assert set(rules.refused) == {"sequence", "pipeline"} and rules.pipeline_units[1] == 2
    assert [d.size for d in rules.tensor] == [2 * D_MODEL, 8]  # the inner channels, the padded vocabulary
    assert fam.tied_weights(cfg) == {"lm_head.weight": "embed.weight"}
    split = {k for k in model.state_dict() if fam.partition_dim(k) is not None}
    assert split == {k for k in model.state_dict() if "norm" not in k}, split  # every tensor but the norms'
    assert fam.partition_dim("blocks.1.mixer.rev.x_proj.weight") == 1 and fam.partition_dim("blocks.0.mixer.fwd.D") == 0
    assert fam.huggingface(cfg).weight_names == "megagenome-caduceus" and fam.shape_problems(cfg) == []
    assert fam.quantizable("blocks.0.mixer.in_proj") and not fam.quantizable("lm_head")
    assert "caduceus (ps)" in fam.describe(cfg)
    tp_like = type("TP", (DenseLayers,), {"token_loss": lambda self, e, v: functools.partial(F.mse_loss)})()
    assert CaduceusLM(cfg, V, tp_like).token_loss is None  # the gathered head: always the dense loss
