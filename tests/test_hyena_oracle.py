"""Our Hyena operators against code we did not write (model/hyena/operators.py).

LI: Together's stripedhyena 0.2.2 (StripedHyena 1's inference code, installed by the README's test command with
--no-deps: its model path without attention layers needs only torch and einops) is the oracle. A striped_hyena model
whose every layer is LI is mapped weight by weight into stripedhyena.model.StripedHyena, and the two must give the
same logits. The mapping is the specification of what our parameters mean in their terms:

    in_proj rows (n_head, 3, head_size) = (x2, x1, v)  ->  projections, read by their column_split_hyena
    short_filter[c, s], tap s at lag s                 ->  short_filter_weight[c, 0, k-1-s] (conv1d correlates)
    lambda = -exp(log_rate) + i theta                  ->  poles = exp(lambda) as (re, im), their h uses log(poles)
    residues (d, S, 2)                                 ->  residues (d, S, 1, 2)
    D, out_proj, norms' scales, SwiGLU (gate, up, down) -> D, out_filter_dense, scale, (l1, l2, l3)

with their biases (projections, out_filter_dense, short filter) zero and hyena_filter_groups=1 (their channels per
filter group: hidden_size / groups systems, so 1 gives one filter per channel; their default shares one filter over
every channel). Their RMSNorm is x / (||x|| / sqrt(d) + eps) * scale, ours x * rsqrt(mean(x^2) + eps) * scale: for
activations of rms r they differ by about eps (1/r - 1/(2 r^2)) relative, so with eps = 1e-12 in both (r ~ 1 here)
by ~1e-12, far below float32 rounding; at our default 1e-5 the logits would differ by 1.2e-5 of their largest, a
real difference of formula, three times the float32 noise.

The weights are redrawn at unit gain (N(0, 1/fan_in), embedding N(0, 1), norm scales and D around 1): at our
initialisation (N(0, 0.02), residual projections smaller) the mixers are a small term of the residual stream, and
a 1e-3 rad error in every pole's angle moves logits of ~0.8 by only 1.4e-4; here every path moves them by O(1),
and each deliberate mismatch below (a wrong layout, an unflipped short filter, conjugated poles, that angle error,
a circular instead of linear convolution in our FFT) moves them by at least 100x the tolerance.

SE, MR and H (HyenaDNA), which stripedhyena does not have, are checked against a reference written here from the
papers, in float64 with plain loops and einsum and no FFT: y[t] = sum_{s <= t} h[s] u[t - s] over the per-head
column-split projections, gated as (h * (x1 v) + D x1 v) x2; H's filter is HyenaDNA's (Nguyen et al. 2023, its
standalone_hyenadna.py): an MLP with sine activations over (t, cos, -sin of 2 bands) of max_seq_len positions,
times exp(-|delta_c| t) with delta_c spread linearly over ln(1e-2)/1.5 .. ln(1e-2)/0.3, the first T positions of the
max_seq_len table (not the table respaced to T). Where our filter departs from HyenaDNA's defaults (one inner
Linear + sine where HyenaDNA has two, a sine module per activation where HyenaDNA reuses one, so one shared frequency
vector, frequencies starting at 1 where its hg38 configs start them at 10, D starting at 1) the reference follows our
structure: those are choices of ours, which this test does not decide.
"""

from __future__ import annotations

import math

import pytest
import torch
from stripedhyena.model import StripedHyena
from stripedhyena.utils import dotdict

from megagenome.config import ModelConfig, d_ff
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model import family_of
from megagenome.model.hyena import operators
from megagenome.model.hyena.operators import HyenaOperator
from megagenome.model.layers import DenseLayers

EPS = 1e-12  # both norms' eps (module docstring)
# Logits agree to this fraction of their largest magnitude. Both sides are float32 throughout (their filter and FFT
# are float32 whatever the dtype), in different orders: their complex log/exp of float32 poles and full complex FFT,
# our exp/cos/sin of the log-rates and angles and real FFT. Each filter is within ~2e-6 of a float64 evaluation of
# the same parameters, and the logits differ by 0.6e-6 to 5.7e-6 of their largest (measured over 4 seeds and
# T = 32, 100, 128); 3e-5 is 5x the worst, and the smallest deliberate mismatch below is ~2500x it.
RELATIVE_TOL = 3e-5
T = 100  # under max_seq_len (128), not a power of two


def unit_gain_(model: torch.nn.Module) -> None:
    """Redraw the projections at N(0, 1/fan_in), the embedding at N(0, 1), norm scales and D in [0.5, 1.5]."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("proj.weight", "w_gate.weight", "w_up.weight", "w_down.weight")):
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
            elif name in ("embed.weight", "lm_head.weight"):
                p.normal_(0, 1)
            elif name.endswith(("norm.weight", ".D")):
                p.uniform_(0.5, 1.5)


def oracle_of(ours) -> StripedHyena:
    """stripedhyena's StripedHyena holding our model's weights (the mapping of the module docstring)."""
    cfg, d = ours.cfg, ours.cfg.d_model
    config = dotdict(
        hidden_size=d,
        num_layers=cfg.n_layer,
        hyena_layer_idxs=list(range(cfg.n_layer)),
        attn_layer_idxs=[],
        num_attention_heads=cfg.n_head,  # their column split's heads
        num_filters=d,
        hyena_filter_groups=1,
        state_size=cfg.state_size,
        short_filter_length=cfg.short_filter_len,
        short_filter_bias=True,  # their parallel_fir adds the bias whatever this says: a zero one
        column_split_hyena=True,
        inner_mlp_size=d_ff(cfg),
        mlp_activation="silu",
        eps=EPS,
        tie_embeddings=cfg.tie_embeddings,
        vocab_size=ours.padded_vocab_size,
        use_flashfft=False,
        params_dtype=torch.float32,
        hyena_block_dtype=torch.float32,
        mlp_dtype=torch.float32,  # their default is bf16
        model_parallel_size=1,
    )
    theirs = StripedHyena(config).eval()
    with torch.no_grad():
        theirs.embedding_layer.weight.copy_(ours.embed.weight)
        if not cfg.tie_embeddings:
            theirs.unembed.weight.copy_(ours.lm_head.weight)
        theirs.norm.scale.copy_(ours.norm.weight)
        for a, b in zip(ours.blocks, theirs.blocks, strict=True):
            m, f = a.mixer, b.filter
            b.pre_norm.scale.copy_(a.mixer_norm.weight)
            b.projections.weight.copy_(m.in_proj.weight)
            b.projections.bias.zero_()
            f.short_filter_weight.copy_(m.short_filter.flip(-1)[:, None])  # (3d, 1, k): conv1d's taps reversed
            f.short_filter_bias.zero_()
            magnitude = torch.exp(-m.filter.log_rate.exp())  # |pole| = exp(Re lambda)
            poles = torch.stack([magnitude * m.filter.theta.cos(), magnitude * m.filter.theta.sin()], -1)
            f.poles.copy_(poles[:, :, None])  # (d, S, 1, 2)
            f.residues.copy_(m.filter.residues[:, :, None])  # (d, S, 1, 2)
            f.D.copy_(m.D)
            b.out_filter_dense.weight.copy_(m.out_proj.weight)
            b.out_filter_dense.bias.zero_()
            b.post_norm.scale.copy_(a.mlp_norm.weight)
            b.mlp.l1.weight.copy_(a.mlp.w_gate.weight)  # l3(silu(l1 z) * l2 z)
            b.mlp.l2.weight.copy_(a.mlp.w_up.weight)
            b.mlp.l3.weight.copy_(a.mlp.w_down.weight)
    return theirs


def li_model(tie: bool = True):
    cfg = ModelConfig(
        family="striped_hyena", layer_pattern="LI", d_model=32, n_layer=2, n_head=4, max_seq_len=128,
        norm_eps=EPS, tie_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    ours = family_of(cfg).build(cfg, VOCAB_SIZE).eval()
    unit_gain_(ours)
    return ours


@pytest.fixture(scope="module")
def pair():
    """(our LI model, the oracle holding its weights, tokens, our logits)."""
    ours = li_model()
    x = torch.randint(0, VOCAB_SIZE, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return ours, oracle_of(ours), x, ours.logits(x)


def their_logits(theirs: StripedHyena, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return theirs(x)[0][..., :VOCAB_SIZE]  # their vocabulary is our padded one; ours is sliced to VOCAB_SIZE


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_li_model_matches_stripedhyena(tie, pair):
    ours = pair[0] if tie else li_model(tie=False)
    x = pair[2]
    with torch.no_grad():
        want = ours.logits(x)
    got = their_logits(pair[1] if tie else oracle_of(ours), x)
    scale = want.abs().max().item()
    assert scale > 5  # unit gain: logits of order sqrt(d)
    err = (got - want).abs().max().item()
    assert err <= RELATIVE_TOL * scale, f"max |theirs - ours| = {err:.3g} over logits up to {scale:.3g}"


def _unflipped(ours, theirs):
    for a, b in zip(ours.blocks, theirs.blocks):
        b.filter.short_filter_weight.copy_(a.mixer.short_filter[:, None])


def _conjugate_poles(ours, theirs):
    for b in theirs.blocks:
        b.filter.poles[..., 1].neg_()


def _angles_off(ours, theirs):
    turn = complex(math.cos(1e-3), math.sin(1e-3))
    for b in theirs.blocks:
        b.filter.poles.copy_(torch.view_as_real(torch.view_as_complex(b.filter.poles) * turn))


def _zero_D(ours, theirs):
    for b in theirs.blocks:
        b.filter.D.zero_()


def _gate_up_swapped(ours, theirs):
    for a, b in zip(ours.blocks, theirs.blocks):
        b.mlp.l1.weight.copy_(a.mlp.w_up.weight)
        b.mlp.l2.weight.copy_(a.mlp.w_gate.weight)


def _block_layout(ours, theirs):
    for b in theirs.blocks:  # (x2 | x1 | v) in blocks of d instead of per head
        b.filter.column_split_hyena = False


MISMATCHES = {
    "block layout instead of per-head": _block_layout,
    "short filter not reversed": _unflipped,
    "conjugate poles": _conjugate_poles,
    "angles off by 1e-3 rad": _angles_off,
    "D left at their zero init": _zero_D,
    "gate and up swapped": _gate_up_swapped,
}


@pytest.mark.parametrize("mismatch", MISMATCHES, ids=list(MISMATCHES))
def test_the_oracle_sees_a_wrong_mapping(mismatch, pair):
    """The comparison above is not vacuous: each way of getting the mapping wrong moves the logits by at least
    100x the tolerance (the smallest, a 1e-3 rad error in every pole's angle, by ~2500x)."""
    ours, _, x, want = pair
    theirs = oracle_of(ours)
    with torch.no_grad():
        MISMATCHES[mismatch](ours, theirs)
    err = (their_logits(theirs, x) - want).abs().max().item()
    assert err > 100 * RELATIVE_TOL * want.abs().max().item(), err


def test_the_oracle_sees_a_wrong_operator(pair, monkeypatch):
    """And it catches a bug in our operator: a circular convolution (FFT without the padding to 2T) for the causal
    one, and a filter one tap late (h[s] applied at lag s + 1)."""
    ours, theirs, x, want = pair
    scale = want.abs().max().item()
    good = operators.fft_conv

    def circular(u, h):
        return torch.fft.irfft(torch.fft.rfft(u.float()) * torch.fft.rfft(h.float(), n=u.size(-1)), n=u.size(-1))

    def late(u, h):
        return good(u, torch.nn.functional.pad(h, (1, 0))[..., : h.size(-1)])

    for wrong in (circular, late):
        monkeypatch.setattr(operators, "fft_conv", wrong)
        with torch.no_grad():
            err = (ours.logits(x) - their_logits(theirs, x)).abs().max().item()
        assert err > 100 * RELATIVE_TOL * scale, (wrong.__name__, err)


# ----- SE, MR and H against a reference from the papers ---------------------------------------------------------


def causal_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """y[b, c, t] = sum_{s <= t} h[c, s] u[b, c, t - s], a loop over the taps (float64)."""
    y = torch.zeros_like(u)
    for s in range(min(h.size(-1), u.size(-1))):
        y[..., s:] += h[:, s, None] * u[..., : u.size(-1) - s]
    return y


def hyena_decay(d: int, positions: torch.Tensor) -> torch.Tensor:
    """HyenaDNA's ExponentialModulation (fast_decay_pct 0.3, slow_decay_pct 1.5, target 1e-2, shift 0):
    exp(-|delta_c| t), delta_c linear in c from ln(1e-2)/1.5 to ln(1e-2)/0.3; (d, len(positions))."""
    lo, hi = math.log(1e-2) / 1.5, math.log(1e-2) / 0.3
    deltas = torch.tensor([lo + (hi - lo) * c / (d - 1) for c in range(d)], dtype=torch.float64)
    return torch.exp(-deltas.abs()[:, None] * positions[None, :])


def reference_filter(op: HyenaOperator, cfg: ModelConfig, T: int) -> torch.Tensor:
    """Each channel's filter (d, taps) in float64, from the parameters and the papers' definitions."""
    f = op.filter
    if op.kind == "SE":
        return f.h.double()
    if op.kind == "MR":  # explicit taps times the decay over the taps' own span, t = s / (L - 1)
        L = f.h.size(-1)
        return f.h.double() * hyena_decay(cfg.d_model, torch.arange(L, dtype=torch.float64) / (L - 1))
    if op.kind == "LI":  # Re(sum_s R_s exp(lambda_s t)), in complex128
        lam = torch.complex(-f.log_rate.double().exp(), f.theta.double())
        R = torch.view_as_complex(f.residues.double().contiguous())
        t = torch.arange(T, dtype=torch.float64)
        return (R[..., None] * torch.exp(lam[..., None] * t)).real.sum(1)
    # H: HyenaDNA's PositionalEmbedding(emb_dim 5, seq_len = max_seq_len) -> MLP with sines -> modulation
    n, N = torch.arange(T, dtype=torch.float64), cfg.max_seq_len
    t = n / (N - 1)  # linspace(0, 1, N)[:T]
    w = 2 * math.pi * n / N
    bands = (1e-4, 1.0)  # linspace(1e-4, bands - 1, bands) with 2 bands
    z = torch.stack([t, *(torch.cos(b * w) for b in bands), *(-torch.sin(b * w) for b in bands)], -1)  # (T, 5)
    lin1, sin1, lin2, sin2 = f.mlp
    a = torch.sin(sin1.freq.double() * (torch.einsum("tk,wk->tw", z, lin1.weight.double()) + lin1.bias.double()))
    a = torch.sin(sin2.freq.double() * (torch.einsum("tk,wk->tw", a, lin2.weight.double()) + lin2.bias.double()))
    h = torch.einsum("tw,cw->ct", a, f.out.weight.double())  # (d, T), no bias
    return h * hyena_decay(cfg.d_model, t)


def reference_operator(op: HyenaOperator, x: torch.Tensor, h: torch.Tensor, layout: str = "head") -> torch.Tensor:
    """(h * (x1 v) + D x1 v) x2 then out_proj, over the featurized projections; float64. layout "head": rows of
    each head (x2, x1, v) in turn (stripedhyena's column split); "block": all x2 rows, then x1, then v (a
    deliberately wrong reading, to show the layout matters)."""
    d, hs = x.size(-1), op.head_size
    z = torch.einsum("btk,ck->bct", x.double(), op.in_proj.weight.double())  # (B, 3d, T)
    z = causal_conv(z, op.short_filter.double())  # the featurizer: tap s at lag s
    if layout == "head":
        rows = [[3 * hs * j + part * hs + i for j in range(d // hs) for i in range(hs)] for part in range(3)]
    else:
        rows = [list(range(part * d, (part + 1) * d)) for part in range(3)]
    x2, x1, v = (z[:, r] for r in rows)
    u = x1 * v
    y = (causal_conv(u, h) + op.D.double()[:, None] * u) * x2  # (B, d, T)
    return torch.einsum("bct,oc->bto", y, op.out_proj.weight.double())


@pytest.mark.parametrize("kind", ["H", "SE", "MR", "LI"])
def test_operator_matches_the_reference(kind):
    cfg = ModelConfig(
        family="hyena" if kind == "H" else "striped_hyena", layer_pattern=kind, d_model=32, n_head=4,
        max_seq_len=64, mr_filter_len=32,
    )  # fmt: skip
    torch.manual_seed(2)
    op = HyenaOperator(cfg, kind, DenseLayers())
    with torch.no_grad():
        op.D.uniform_(0.5, 1.5)
        if kind == "H":  # learned frequencies away from their start at 1
            for sine in (op.filter.mlp[1], op.filter.mlp[3]):
                sine.freq.uniform_(0.5, 2.0)
    x = torch.randn(2, 48, cfg.d_model, generator=torch.Generator().manual_seed(3))  # T = 48 < max_seq_len
    h = reference_filter(op, cfg, 48)
    with torch.no_grad():
        got = op(x).double()
        torch.testing.assert_close(op.filter(48).double()[:, :48], h[:, :48], atol=1e-5, rtol=1e-5)
    want = reference_operator(op, x, h)
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * scale, f"{kind}: max |ours - reference| = {err:.3g} over outputs up to {scale:.3g}"
    # The reference is not vacuous: the block layout, and (for H and MR) the filter without its decay, differ.
    wrong = [reference_operator(op, x, h, layout="block")]
    if kind in ("H", "MR"):
        positions = torch.arange(h.size(-1), dtype=torch.float64)
        span = positions / (cfg.max_seq_len - 1) if kind == "H" else positions / (h.size(-1) - 1)
        wrong.append(reference_operator(op, x, h / hyena_decay(cfg.d_model, span)))
    for w in wrong:
        assert (w - want).abs().max().item() > 100 * 1e-5 * scale
