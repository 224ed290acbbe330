"""The Hyena families' operators and model in-process (model/hyena/): the causal convolutions, each filter, causality
of every operator kind, float32 FFTs under bf16, the layer pattern, checkpointing policies, and the config's checks.
(Oracle parity: test_hyena_oracle.py; the engine's seams: the equivalence tests; costs: test_hyena_costs.py.)"""

from __future__ import annotations

import pytest
import torch

from megagenome.config import ModelConfig, RootConfig, TrainConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model import family_of, validate
from megagenome.model.hyena import operators
from megagenome.model.hyena.config import layer_kinds
from megagenome.model.hyena.family import DNA_VOCAB_ROWS
from megagenome.model.hyena.operators import ModalFilter, direct_conv, fft_conv
from megagenome.model.layers import DenseLayers
from megagenome.model.stack import padded_vocab_size


def tiny(family: str, **kw) -> ModelConfig:
    base = dict(family=family, d_model=32, n_layer=4, n_head=4, max_seq_len=128, layer_pattern="SE MR LI A")
    return ModelConfig(**{**base, **kw})


def build(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    return family_of(cfg).build(cfg, VOCAB_SIZE)


def causal_reference(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """y[c, t] = sum_{s <= t} h[c, s] u[c, t - s], as a float64 double loop over taps (the definition)."""
    u, h = u.double(), h.double()
    y = torch.zeros_like(u)
    for s in range(h.size(-1)):
        y[..., s:] += h[:, s, None] * u[..., : u.size(-1) - s]
    return y


@pytest.mark.parametrize("taps", [1, 7, 64])
def test_fft_and_direct_convolutions_are_the_causal_convolution(taps):
    g = torch.Generator().manual_seed(1)
    u, h = torch.randn(2, 3, 64, generator=g), torch.randn(3, taps, generator=g)
    want = causal_reference(u, h)
    torch.testing.assert_close(direct_conv(u, h).double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fft_conv(u, h).double(), want, atol=1e-5, rtol=1e-5)


def test_fft_conv_runs_in_float32_under_bf16():
    """bf16 inputs are transformed in float32: the result is float32 and equals the float32 transform of the same
    (rounded) values, where a bf16 FFT (were torch to run one) would round every butterfly."""
    g = torch.Generator().manual_seed(2)
    u, h = torch.randn(1, 4, 256, generator=g).bfloat16(), torch.randn(4, 256, generator=g).bfloat16()
    y = fft_conv(u, h)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, fft_conv(u.float(), h.float()), atol=0, rtol=0)
    torch.testing.assert_close(y.double(), causal_reference(u, h), atol=1e-3, rtol=1e-4)


def test_modal_filter_is_the_sum_of_its_poles():
    """h[c, t] = Re(sum_s R exp(lambda t)), lambda = -exp(log_rate) + i theta, computed with complex numbers."""
    torch.manual_seed(3)
    f = ModalFilter(6, 4, 512, DenseLayers())
    lam = torch.complex(-f.log_rate.double().exp(), f.theta.double())  # (6, 4)
    R = torch.view_as_complex(f.residues.double().contiguous())  # (6, 4)
    t = torch.arange(50, dtype=torch.float64)
    want = (R[..., None] * torch.exp(lam[..., None] * t)).real.sum(1)
    torch.testing.assert_close(f(50).double(), want, atol=1e-6, rtol=1e-5)
    assert (f.log_rate.exp() > 0).all() and (f.log_rate.exp() <= 1).all()  # every pole decays


@pytest.mark.parametrize("family,pattern", [("hyena", "SE"), ("striped_hyena", "SE"), ("striped_hyena", "MR"),
                                            ("striped_hyena", "LI"), ("striped_hyena", "SE MR LI A")])  # fmt: skip
def test_no_output_moves_when_later_inputs_change(family, pattern):
    """Causality of every operator kind: changing the bases after position t changes no logit at or before t. The
    FFT mixes every position numerically, so "no change" is float32 rounding (below 1e-5), against changes of
    order 1 after t."""
    cfg = tiny(family, layer_pattern=pattern, n_layer=2)
    model = build(cfg).eval()
    x = torch.randint(0, 4, (2, 128), generator=torch.Generator().manual_seed(4))
    for t in (0, 37, 127):
        changed = x.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % 4
        with torch.no_grad():
            a, b = model.logits(x), model.logits(changed)
        assert (a[:, : t + 1] - b[:, : t + 1]).abs().max() < 1e-5
        if t < 127:
            assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().max() > 1e-2


def test_layer_pattern_tiles_to_evo2_1b():
    """The default pattern over 25 layers is Evo 2 1B's: attention at 3, 10, 17, 24, SE/MR/LI stripes between."""
    kinds = layer_kinds(ModelConfig(family="striped_hyena", n_layer=25))
    assert [i for i, k in enumerate(kinds) if k == "A"] == [3, 10, 17, 24]
    assert [i for i, k in enumerate(kinds) if k == "LI"] == [2, 6, 9, 13, 16, 20, 23]
    assert layer_kinds(ModelConfig(family="hyena", n_layer=3)) == ["H"] * 3
    model = build(tiny("striped_hyena", layer_pattern="SE,MR LI,A", n_layer=6))
    assert [type(b).__name__ for b in model.blocks] == ["HyenaBlock"] * 3 + ["Block"] + ["HyenaBlock"] * 2


@pytest.mark.parametrize("policy", ["full", "every_k", "selective"])
def test_checkpointing_policies_give_the_same_gradients(policy):
    """Recomputation (of whole blocks, or of each operator's long convolution) changes no gradient."""
    x = torch.randint(0, 4, (2, 64), generator=torch.Generator().manual_seed(5))
    grads = []
    for p in ("none", policy):
        model = build(tiny("striped_hyena", checkpointing=p, checkpoint_every=2))
        loss, _, _ = model(x, x.roll(-1, 1), torch.ones(2, 64))
        loss.backward()
        grads.append({k: v.grad for k, v in model.named_parameters()})
    for k, g in grads[0].items():
        torch.testing.assert_close(grads[1][k], g, atol=1e-6, rtol=1e-5, msg=k)


def test_filters_take_no_weight_decay_and_the_vocabulary_rows_are_eight():
    model = build(tiny("striped_hyena"))
    decay, no_decay = (set(map(id, g["params"])) for g in model.param_groups(0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    filters = {n for n in names.values() if ".filter." in n or n.endswith(("short_filter", ".D"))}
    assert filters and all(id(p) in no_decay for n, p in model.named_parameters() if n in filters)
    assert any(".in_proj." in names[i] for i in decay)
    assert padded_vocab_size(VOCAB_SIZE) == DNA_VOCAB_ROWS  # what run_flops assumes of the head


def test_bf16_model_trains_with_float32_loss():
    model = build(tiny("striped_hyena")).bfloat16()
    x = torch.randint(0, 4, (2, 64), generator=torch.Generator().manual_seed(6))
    loss, nll, _ = model(x, x.roll(-1, 1), torch.ones(2, 64))
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_config_checks_name_the_hyena_flags():
    def problems(**kw):
        return validate(RootConfig(model=ModelConfig(**kw)))

    assert any("--model.layer_pattern='SE XX'" in p and "unknown: XX" in p for p in problems(
        family="striped_hyena", layer_pattern="SE XX"))  # fmt: skip
    assert any(
        "--model.objective=mlm with --model.family=hyena" in p for p in problems(family="hyena", objective="mlm")
    )
    assert any("--model.compile with --model.family=striped_hyena" in p for p in problems(
        family="striped_hyena", compile=True))  # fmt: skip
    assert any("--model.mr_filter_len=0" in p for p in problems(family="striped_hyena", mr_filter_len=0))
    assert not [p for p in problems(family="striped_hyena") if "model." in p]
    muon = validate(RootConfig(model=ModelConfig(family="hyena"), train=TrainConfig(optimizer="muon")))
    assert any("--train.optimizer=muon with --model.family=hyena" in p for p in muon)


def test_sequence_parallel_chunks_must_hold_the_longest_halo():
    """Under sequence parallelism a direct filter's taps before a chunk come from the previous rank only: a chunk
    shorter than a directly convolved MR filter is refused before launch, naming the flags; a long enough one
    passes, and an MR filter by FFT needs no halo."""
    from megagenome.config import ParallelConfig
    from megagenome.parallel.layout import LayoutError, ParallelLayout

    cfg = tiny("striped_hyena", mr_filter_len=32)  # at most DIRECT_MAX_TAPS: direct, with a 31-position halo
    rules = family_of(cfg).parallel_rules(cfg, VOCAB_SIZE)
    with pytest.raises(LayoutError) as err:
        ParallelLayout.build(2, ParallelConfig(sequence=2), cfg, 32, rules)
    want = "--data.seq_len=32 over --parallel.sequence=2 leaves 16 positions per rank, fewer than 31"
    assert want in str(err.value)
    assert ParallelLayout.build(2, ParallelConfig(sequence=2), cfg, 64, rules).sequence == 2
    with pytest.raises(LayoutError) as err:  # a sequence-length warmup's shorter windows too
        ParallelLayout.build(2, ParallelConfig(sequence=2), cfg, 64, rules, warmup_lengths=(32,))
    assert "--data.seq_warmup_lengths=32 over --parallel.sequence=2 leaves 16 positions per rank" in str(err.value)
    long_mr = tiny("striped_hyena", mr_filter_len=128)  # by FFT: all-to-alls, no halo beyond SE's 6 positions
    rules = family_of(long_mr).parallel_rules(long_mr, VOCAB_SIZE)
    assert ParallelLayout.build(2, ParallelConfig(sequence=2), long_mr, 32, rules).sequence == 2


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_fft_and_direct_convolutions_equal_the_reference():
    """torch.fft (cuFFT) and conv1d (cuDNN) on the GPU: the causal convolution of the float64 CPU definition, at an
    8k window (benchmarks/gpu_check.py runs this before its striped cells)."""
    g = torch.Generator().manual_seed(7)
    u, h = torch.randn(2, 16, 8192, generator=g), torch.randn(16, 8192, generator=g) / 100
    want = causal_reference(u, h)
    got = fft_conv(u.cuda(), h.cuda()).cpu().double()
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    short = torch.randn(16, 128, generator=g)
    got = direct_conv(u.cuda(), short.cuda()).cpu().double()
    torch.testing.assert_close(got, causal_reference(u, short), atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_striped_model_on_cuda_in_bf16_tracks_the_cpu_model():
    """The whole striped model (SE, MR, LI, attention) in bf16 on the GPU against float32 on the CPU: logits within
    bf16 rounding, gradients finite."""
    cfg = tiny("striped_hyena", d_model=64, max_seq_len=1024)
    model = build(cfg)
    x = torch.randint(0, 4, (2, 1024), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = model.logits(x)
    gpu = model.cuda().bfloat16()
    got = gpu.logits(x.cuda()).float().cpu()
    assert (got - want).abs().max() < 0.15, (got - want).abs().max()
    loss, _, _ = gpu(x.cuda(), x.roll(-1, 1).cuda(), torch.ones(2, 1024, device="cuda"))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters())


def test_modal_kernel_in_blocks_equals_the_formula_and_its_gradients(monkeypatch):
    """The LI filter computed in blocks of channels (and recomputed in backward) equals the one-shot formula under
    autograd, values and gradients, whatever the block size."""
    from megagenome.model.hyena import operators

    torch.manual_seed(9)
    f = ModalFilter(10, 4, 256, DenseLayers())
    g = torch.randn(10, 100)
    params = (f.log_rate, f.theta, f.residues)
    want = operators.modal_filter(*params, 100)
    want_grads = torch.autograd.grad((want * g).sum(), params)
    monkeypatch.setattr(operators, "MODAL_BLOCK_ELEMENTS", 3 * 4 * 100)  # blocks of 3 channels: 4 blocks
    got = f(100)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for a, b in zip(torch.autograd.grad((got * g).sum(), params), want_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


class SecondHalf(DenseLayers):
    """The layers of tensor-parallel rank 1 of 2 (channels 16-31 of 32), as far as a filter sees them."""

    def column(self, in_features: int, out_features: int) -> torch.nn.Module:
        return torch.nn.Linear(in_features, out_features // 2, bias=False)

    def channels(self, tensor: torch.Tensor, parameter: bool = True) -> torch.Tensor:
        return super().channels(tensor[tensor.size(0) // 2 :].clone(), parameter)


@pytest.mark.parametrize("kind", ["H", "SE", "MR", "LI"])
@pytest.mark.parametrize("layers", [DenseLayers, SecondHalf])
def test_a_filter_computes_one_block_of_its_channels_as_the_whole_filter_does(kind, layers):
    """Under sequence parallelism a long convolution's rank computes only its block of the filter's channels
    (HyenaOperator.forward: `rows`, of this tensor-parallel rank's channels), 1/sp of the whole filter's memory (an LI
    filter of 1,920 channels at 1M bases is 7.7 GB in float32): the block, values and parameter gradients, equals
    the same rows of the whole filter; on a tensor-parallel rank the decays are its own channels' (rows 8-16 of
    channels 16-31 are channels 24-31)."""
    from megagenome.model.hyena.operators import ExplicitFilter, ImplicitFilter

    torch.manual_seed(0)
    cfg = tiny("hyena" if kind == "H" else "striped_hyena", layer_pattern=kind, n_layer=1)
    d = cfg.d_model
    make = {"H": lambda f: ImplicitFilter(cfg, f), "SE": lambda f: ExplicitFilter(d, cfg.se_filter_len, False, f),
            "MR": lambda f: ExplicitFilter(d, cfg.mr_filter_len, True, f),
            "LI": lambda f: ModalFilter(d, cfg.state_size, cfg.max_seq_len, f)}  # fmt: skip
    filt = make[kind](layers())
    rows = slice(8, 16)
    whole = filt(96)
    block = filt(96, rows)
    assert block.shape == (8, whole.size(1))
    torch.testing.assert_close(block, whole[rows], atol=0, rtol=0)
    g = torch.randn_like(block)
    params = [p for p in filt.parameters()]
    want = torch.autograd.grad((whole[rows] * g).sum(), params)
    for a, b in zip(torch.autograd.grad((block * g).sum(), params), want):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("family, pattern", [("hyena", ""), ("striped_hyena", "SE MR LI A")])
def test_inference_in_channel_blocks_equals_the_whole_layer(family, pattern, monkeypatch):
    """Without autograd an FFT layer convolves a block of channels at a time, each block's filter computed alone
    (operators.py INFERENCE_BLOCK_ELEMENTS): blocks of 3 channels here (10 whole blocks and a partial one of 2 over
    32), and the logits are those of the whole-layer path (autograd on) to float32 rounding."""
    T = 40
    monkeypatch.setattr(operators, "INFERENCE_BLOCK_ELEMENTS", 3 * 2 * T)
    cfg = ModelConfig(family=family, layer_pattern=pattern or "LI", d_model=32, n_layer=4, n_head=4, max_seq_len=64,
                      mr_filter_len=48, filter_width=16)  # fmt: skip
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg, VOCAB_SIZE).eval()
    x = torch.randint(0, VOCAB_SIZE, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.enable_grad():
        whole = model.logits(x).detach()
    with torch.no_grad():
        blocks = model.logits(x)
    torch.testing.assert_close(blocks, whole, rtol=0, atol=1e-6 * whole.abs().max().item())
