"""The gpn family (megagenome/model/gpn/) against GPN's own code, and its behaviour as a LanguageModel.

The oracle is the gpn package (pip gpn==0.9.0a1, a test-only dependency: it imports transformers, which megagenome
itself never does): gpn.model.GPNForMaskedLM of a GPNConfig with encoder "convnet", embedding "one_hot", our padded
vocabulary (8) as vocab_size, bias False and no dropout. Our state dict is mapped into theirs key by key, and the two
must give the same logits on the same token ids. The mapping is the specification of what our parameters mean in
their terms (their ConvLayer's conv and ffn are nn.Sequential: LayerNorm, transpose, Conv1d, transpose, GELU,
Linear, Dropout; LayerNorm, Linear, GELU, Linear, Dropout):

    blocks.{i}.conv_norm.weight    ->  model.encoder.layer.{i}.conv.0.weight
    blocks.{i}.conv.weight         ->  model.encoder.layer.{i}.conv.2.weight    (d, d, k): Conv1d's, unflipped
    blocks.{i}.conv_out.weight     ->  model.encoder.layer.{i}.conv.5.weight
    blocks.{i}.ffn_norm.weight     ->  model.encoder.layer.{i}.ffn.0.weight
    blocks.{i}.ffn_up.weight       ->  model.encoder.layer.{i}.ffn.1.weight
    blocks.{i}.ffn_down.weight     ->  model.encoder.layer.{i}.ffn.3.weight
    norm.weight                    ->  model.ln_f.weight
    lm_head.dense.weight           ->  cls.transform.0.weight
    lm_head.norm.weight            ->  cls.transform.2.weight
    lm_head.decoder.weight         ->  cls.decoder.weight

Their LayerNorms are nn.LayerNorm's default eps 1e-5 (GPNConfig's layer_norm_eps is RoFormer's and unused by the
convnet), our --model.norm_eps default. The one-hot embedding needs no mapping: theirs is F.one_hot(ids,
hidden_size), ours the identity's rows, the same vectors. Their dilation schedule is their get_dilation_schedule
of the same five settings (rest_kernel_size is our kernel_size).

The weights are redrawn at unit gain (linears and convolutions N(0, 1/fan_in), norm scales N(1, 0.2^2)): at GPN's
initialisation (linears N(0, 0.02)) the branches are a small term of the residual stream; here every path moves the
logits by O(1), and each deliberate mismatch (a wrong dilation schedule, kernels flipped in time, a norm scale
mapped to the wrong block) moves them by far more than the tolerance.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.utils.checkpoint
from gpn.model import GPNConfig, GPNForMaskedLM
from gpn.modules import get_dilation_schedule

from megagenome.config import ModelConfig
from megagenome.data.tokenizer import A_ID, C_ID, VOCAB_SIZE
from megagenome.model import family_of
from megagenome.model.distill import Teacher
from megagenome.model.gpn import GPN
from megagenome.model.gpn.costs import dilations, kernels, receptive_field
from megagenome.model.gpn.family import DNA_VOCAB_ROWS
from megagenome.model.gpn.model import GPNLM
from megagenome.model.stack import padded_vocab_size

# Logits agree to this fraction of their largest magnitude. Both sides run the same float32 ops in the same order
# (layer norm, Conv1d over the transposed view, erf GELU, the linears), and on this CPU they are bit-identical (0.0
# over the three configs below); 1e-5 leaves room for other kernels (a GPU's convolution algorithms). The controls
# move the logits by 0.24 to 1.3 of their largest, over 1e4 x the tolerance.
RELATIVE_TOL = 1e-5
MISMATCH_MIN = 1e-2


def config(**kw) -> ModelConfig:
    base = dict(family="gpn", objective="mlm", d_model=16, n_layer=4, max_seq_len=128)
    return ModelConfig(**{**base, **kw})


def build(cfg: ModelConfig, seed: int = 0) -> GPNLM:
    torch.manual_seed(seed)
    return GPN.build(cfg, VOCAB_SIZE)


def ids_of(B: int, T: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (B, T), generator=torch.Generator().manual_seed(seed))  # (B, T)


def redraw_unit(model: torch.nn.Module) -> None:
    """Unit-gain weights (module docstring): every path matters."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)  # fan_in: in x taps


def theirs_of(cfg: ModelConfig) -> GPNForMaskedLM:
    their = GPNConfig(
        vocab_size=padded_vocab_size(VOCAB_SIZE), embedding="one_hot", encoder="convnet",
        num_hidden_layers=cfg.n_layer, hidden_size=cfg.d_model, intermediate_size=4 * cfg.d_model,
        hidden_dropout_prob=0.0, bias=False, first_kernel_size=cfg.first_kernel_size,
        rest_kernel_size=cfg.kernel_size, dilation_base=cfg.dilation_base, dilation_cycle=cfg.dilation_cycle,
        dilation_double_every=cfg.dilation_double_every, dilation_max=cfg.dilation_max,
    )  # fmt: skip
    return GPNForMaskedLM(their).eval()


def their_key(ours: str) -> str:
    """The module docstring's mapping."""
    parts = ours.split(".")
    if parts[0] == "blocks":
        index = {"conv_norm": "conv.0", "conv": "conv.2", "conv_out": "conv.5", "ffn_norm": "ffn.0",
                 "ffn_up": "ffn.1", "ffn_down": "ffn.3"}[parts[2]]  # fmt: skip
        return f"model.encoder.layer.{parts[1]}.{index}.weight"
    return OUTSIDE_KEYS[ours]


OUTSIDE_KEYS = {
    "norm.weight": "model.ln_f.weight",
    "lm_head.dense.weight": "cls.transform.0.weight",
    "lm_head.norm.weight": "cls.transform.2.weight",
    "lm_head.decoder.weight": "cls.decoder.weight",
}


def relative_error(ours: GPNLM, theirs: GPNForMaskedLM, ids: torch.Tensor, weights: GPNLM | None = None) -> float:
    """Largest logit difference over the largest logit, theirs holding the weights of `weights` (default: ours)."""
    state = {their_key(k): v for k, v in (weights or ours).state_dict().items()}
    assert set(state) == set(theirs.state_dict()), "the mapping covers every tensor, both ways"
    theirs.load_state_dict(state)
    with torch.no_grad():
        want = theirs(input_ids=ids).logits[..., :VOCAB_SIZE]  # (B, T, vocab)
        got = ours.eval().logits(ids)  # (B, T, vocab)
    return ((got - want).abs().max() / want.abs().max()).item()


ORACLE_CONFIGS = {
    "gpn-defaults": {},
    "even-kernels": dict(first_kernel_size=4, kernel_size=6, dilation_base=3, dilation_cycle=3),
    "capped": dict(dilation_double_every=2, dilation_max=4, n_layer=7, dilation_cycle=6),
}


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("settings", ORACLE_CONFIGS.values(), ids=ORACLE_CONFIGS.keys())
def test_logits_are_gpns(settings):
    """The same logits as GPNForMaskedLM on the same ids: GPN's schedule (kernel 9 then 5, dilations 1, 2, 4, 8),
    even kernels ("same" padding one more on the right) at odd dilations, and a capped, slower schedule."""
    cfg = config(**settings)
    ours = build(cfg)
    redraw_unit(ours)
    error = relative_error(ours, theirs_of(cfg), ids_of(2, 100))
    print(f"{settings}: relative error {error:.2e}")
    assert error < RELATIVE_TOL


def test_deliberate_mismatches_are_caught():
    """Each control moves the logits by far more than the tolerance: their model built with a wrong dilation
    schedule, our kernels flipped in time (a convolution instead of torch's correlation), a norm scale swapped."""
    cfg = config()
    ours, ids = build(cfg), ids_of(2, 100)
    redraw_unit(ours)
    errors = {"wrong dilation schedule": relative_error(ours, theirs_of(config(dilation_base=3)), ids)}
    flipped = build(cfg)
    flipped.load_state_dict(ours.state_dict())
    with torch.no_grad():
        for block in flipped.blocks:
            block.conv.weight.copy_(block.conv.weight.flip(-1))
    errors["kernels flipped"] = relative_error(ours, theirs_of(cfg), ids, weights=flipped)
    swapped = build(cfg)
    swapped.load_state_dict(ours.state_dict())
    with torch.no_grad():
        a, b = swapped.blocks[1].ffn_norm.weight, swapped.blocks[2].ffn_norm.weight
        a_copy = a.clone()
        a.copy_(b)
        b.copy_(a_copy)
    errors["norm scales swapped"] = relative_error(ours, theirs_of(cfg), ids, weights=swapped)
    print({k: f"{v:.2e}" for k, v in errors.items()})
    assert all(v > MISMATCH_MIN for v in errors.values()), errors


def test_gpn_defaults_schedule_and_receptive_field():
    """GPN's 25 blocks: dilations 1, 2, 4, ..., 128 three times and 1, as their get_dilation_schedule; kernels 9
    then 5; a receptive field of 1 + 8 + 4 x (254 + 255 + 255 + 1) = 3,069 bases."""
    cfg = config(n_layer=25, d_model=512)
    theirs = get_dilation_schedule(GPNConfig(num_hidden_layers=25))
    assert dilations(cfg) == theirs == ([1, 2, 4, 8, 16, 32, 64, 128] * 4)[:25]
    assert kernels(cfg) == [9] + [5] * 24
    assert receptive_field(kernels(cfg), dilations(cfg)) == 3069
    assert "receptive field 3,069 bases" in GPN.describe(cfg)
    assert d_ff_of(cfg) == 2048 and DNA_VOCAB_ROWS == padded_vocab_size(VOCAB_SIZE)


def d_ff_of(cfg: ModelConfig) -> int:
    return family_of(cfg).costs(cfg, VOCAB_SIZE).d_ff


def test_receptive_field_is_what_the_model_sees():
    """Changing one base moves the logits exactly within the receptive field's half-width on each side."""
    cfg = config(n_layer=3)  # kernels 9, 5, 5 at dilations 1, 2, 4: 1 + 8 + 8 + 16 = 33 bases, 16 each side
    model = build(cfg).eval()
    redraw_unit(model)
    ids = ids_of(1, 100)
    other = ids.clone()
    other[0, 50] = A_ID if ids[0, 50] != A_ID else C_ID  # another base
    with torch.no_grad():
        moved = (model.logits(ids) - model.logits(other)).abs().amax(-1)[0] > 0  # (T,)
    half = (receptive_field(kernels(cfg), dilations(cfg)) - 1) // 2
    assert moved.nonzero().flatten().tolist() == list(range(50 - half, 50 + half + 1))


# ----- behaviour as a LanguageModel ---------------------------------------------------------------------------------


def batch(B: int = 2, T: int = 64):
    ids = ids_of(B, T)
    labels = torch.where(ids_of(B, T, seed=8) % 3 == 0, ids, torch.full_like(ids, -100))  # (B, T)
    return ids, labels, (labels != -100).float()


def test_loss_sums_and_backward():
    model = build(config()).train()
    ids, labels, weight = batch()
    loss, nll_sum, weight_sum = model(ids, labels, weight)
    ce = torch.nn.functional.cross_entropy(model.logits(ids).flatten(0, 1), labels.flatten(), reduction="sum")
    assert weight_sum == weight.sum() and torch.allclose(nll_sum, ce) and torch.allclose(loss, ce / weight.sum())
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def gradients(policy: str) -> dict[str, torch.Tensor]:
    model = build(config(checkpointing=policy, checkpoint_every=3, dropout=0.0)).train()
    model.set_checkpoint_function(functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False))
    model(*batch())[0].backward()
    return {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["full", "every_k", "selective"])
def test_checkpointing_gives_the_same_gradients(policy):
    reference, got = gradients("none"), gradients(policy)
    assert all(torch.allclose(got[k], reference[k], rtol=1e-5, atol=1e-7) for k in reference)


def test_bf16_forward_and_layer_states():
    model = build(config()).to(torch.bfloat16).eval()
    ids = ids_of(2, 32)
    with torch.no_grad():
        logits = model.logits(ids)  # (B, T, vocab)
        states = model.layer_states(ids, [0, 2, -1])
        hidden = model.hidden(ids)
    assert logits.dtype == torch.bfloat16 and logits.shape == (2, 32, VOCAB_SIZE) and logits.isfinite().all()
    assert torch.equal(states[-1], hidden) and states[0].dtype == torch.bfloat16
    assert torch.equal(states[0].float(), torch.nn.functional.one_hot(ids, 16).float())


def test_the_same_seed_gives_the_same_weights():
    a, b, c = build(config()), build(config()), build(config(), seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.blocks[0].conv.weight, c.blocks[0].conv.weight)


def test_initialisation_is_gpns():
    """Linears N(0, init_std), norm scales 1; the convolutions keep torch's Kaiming-uniform bound 1/sqrt(d k)."""
    model = build(config(d_model=32, init_std=0.05))
    linear = torch.cat([m.weight.flatten() for m in model.modules() if isinstance(m, torch.nn.Linear)])
    assert abs(linear.std().item() - 0.05) < 0.003 and abs(linear.mean().item()) < 0.003
    assert all((m.weight == 1).all() for m in model.modules() if isinstance(m, torch.nn.LayerNorm))
    conv = model.blocks[1].conv.weight  # (32, 32, 5)
    assert conv.abs().max() <= (32 * 5) ** -0.5 and conv.abs().max() > 0.9 * (32 * 5) ** -0.5


def test_parameter_accounting_and_groups():
    model = build(config())
    decoder = model.lm_head.decoder.weight
    assert model.vocab_parameters() == [decoder] and GPN.tied_weights(config()) == {}
    assert model.num_parameters() - model.num_parameters(exclude_embeddings=True) == decoder.numel()
    decay, no_decay = model.param_groups(0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert set(model.state_dict()) == set(GPN.expected_shapes(config(), VOCAB_SIZE))  # no buffer saved


def test_distillation_teacher():
    model, teacher = build(config()).train(), build(config(), seed=1).eval()
    model.set_teacher(Teacher(teacher, alpha=0.5, temperature=2.0))
    loss, nll_sum, weight_sum = model(*batch())
    assert loss.isfinite() and not torch.allclose(loss * weight_sum, nll_sum)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())


def test_refusals():
    """What gpn does not run is refused, with the reason, before anything starts."""
    cfg = config()
    model = build(cfg)
    for call in (model.compile_blocks, lambda: model.set_sequence_parallel(None, 0, 2), model.pipeline_layers):
        with pytest.raises(ValueError, match="gpn"):
            call()
    model.set_sequence_parallel(None, 0, 1)  # whole sequences: fine
    with pytest.raises(ValueError, match="max_seq_len"):
        model.logits(ids_of(1, 129))
    refused = GPN.parallel_rules(cfg, VOCAB_SIZE).refused
    assert set(refused) == {"sequence", "pipeline"} and "halo" in refused["sequence"]
    assert [d.size for d in GPN.parallel_rules(cfg, VOCAB_SIZE).tensor] == [cfg.d_model, 4 * cfg.d_model, 8]
    split = {k for k in model.state_dict() if GPN.partition_dim(k) is not None}
    assert split == {k for k in model.state_dict() if k.endswith(("conv.weight", "_out.weight", "ffn_up.weight",
                     "ffn_down.weight", "decoder.weight"))} and len(split) == 4 * cfg.n_layer + 1  # fmt: skip
    assert GPN.shape_problems(config(d_model=4)) and not GPN.shape_problems(cfg)
    with pytest.raises(ValueError, match="vocabulary rows"):
        build(config(d_model=4))
    assert [GPN.quantizable(n) for n in ("blocks.0.ffn_up", "lm_head.dense", "lm_head.decoder")] == [True, False, False]
