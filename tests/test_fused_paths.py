"""The fused paths of the model equal the eager formulas they replace (issue 14, part B).

- torch's rms_norm equals the float32 RMSNorm formula the model had (kept below as the reference);
- the rotary embedding applied once to the packed qkv (model/transformer/blocks.py _RotaryQK) equals rotating q and
  k one by one as before, forward and gradients, at a sequence-parallel offset and with tables cast from float32;
- a whole model with both equals the model with the old formulas (losses and every parameter gradient);
- the attention seam resolves --model.attention=auto as documented and refuses what cannot run, naming the flag;
- --model.compile (regional torch.compile, inductor on CPU) equals eager: loss and gradients of a 2-layer model
  under no, full and selective checkpointing, and two DeepSpeed ZeRO-2 steps in a world of one;
- the config refuses --model.compile where it cannot work.

On CPU nothing here is mocked except the GPU probes of the backend-resolution test (there is no GPU to ask: the
compute capability and the flash-attn imports are set by hand, and the test says which). The GPU tests at the end
compare every GPU backend with SDPA's math backend on CUDA and are skipped without one.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import pytest
import torch
from support.helpers import final_ds_config, world_of_one

import megagenome.model.attention as attn_mod
from megagenome.config import ModelConfig, TrainConfig, config_hash, validate
from megagenome.config.load import config_from_dict
from megagenome.model import attention_summary
from megagenome.model.attention import attention, attention_backend, fa3_available, flash_available
from megagenome.model.layers import RMSNorm
from megagenome.model.transformer import TRANSFORMER, DNATransformer
from megagenome.model.transformer.blocks import SelfAttention
from megagenome.parallel.layout import LayoutError, ParallelLayout

VOCAB = 9

# ----- the eager formulas the fused paths replace, kept as references ----------------------------------------------


def reference_rmsnorm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm.forward before torch's rms_norm: float32 statistics and scaling, cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + norm.eps)
    return (xf * norm.weight.float()).to(x.dtype)


def reference_rotary(rotary, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """RotaryEmbedding.forward before the packed path: tables sliced and cast per call, x (B, H, T, head_dim)."""
    T = x.size(-2)
    cos = rotary.cos[offset : offset + T].to(x.dtype)
    sin = rotary.sin[offset : offset + T].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_attention_forward(self: SelfAttention, x: torch.Tensor) -> torch.Tensor:
    """SelfAttention.forward before the packed path: per-head unbind, q and k rotated one by one."""
    B, T, _ = x.shape
    qkv = self.qkv(x).view(B, T, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # (3, B, n_head, T, head_dim)
    q, k, v = qkv.unbind(0)
    offset = self.sequence_rank * T
    q, k = reference_rotary(self.rotary, q, offset), reference_rotary(self.rotary, k, offset)
    y = self._core(q, k, v).transpose(1, 2).reshape(B, T, -1)
    return self.proj(y)


def loss_and_grads(model: DNATransformer, seed: int = 3) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 32), generator=g)
    labels = torch.randint(0, VOCAB, (2, 32), generator=g)
    weight = torch.rand(2, 32, generator=g)
    model.zero_grad(set_to_none=True)
    loss, _, _ = model(ids, labels, weight)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a: tuple, b: tuple, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=rtol, atol=atol)
    assert sorted(a[1]) == sorted(b[1])
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=rtol, atol=atol, msg=name)


# ----- RMSNorm and rotary -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_equals_the_float32_formula(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(64).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64))
    x = torch.randn(3, 7, 64, dtype=dtype, requires_grad=True)
    got, want = norm(x), reference_rmsnorm(norm, x)
    assert got.dtype == dtype
    assert torch.equal(got, want)  # on CPU torch's rms_norm runs the same float32 ops
    grad = torch.randn_like(got)
    g_got = torch.autograd.grad(got, (x, norm.weight), grad)
    g_want = torch.autograd.grad(want, (x, norm.weight), grad)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rmsnorm_float32_scale_with_bfloat16_activations():
    """A float32 weight and bf16 input (no common dtype for the fused kernel) still normalises in float32."""
    norm = RMSNorm(16)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    assert torch.equal(norm(x), reference_rmsnorm(norm, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rotary_equals_rotating_q_and_k_one_by_one(dtype):
    """Forward bit-identical and input/weight gradients within fp32 tolerance, at a sequence-parallel offset."""
    torch.manual_seed(0)
    attn = SelfAttention(ModelConfig(d_model=64, n_head=4, max_seq_len=64)).to(dtype)
    attn.sequence_rank = 1  # chunk 1 of a split sequence: positions 16..31
    x = torch.randn(2, 16, 64, dtype=dtype, requires_grad=True)
    got, want = attn(x), reference_attention_forward(attn, x)
    assert torch.equal(got, want)
    grad = torch.randn_like(got)
    inputs = (x, *attn.parameters())
    for a, b in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rotary_tables_are_cast_once_and_follow_the_buffers():
    """fp32 tables with bf16 activations: one cached cast, reused; re-cast buffers invalidate it."""
    attn = SelfAttention(ModelConfig(d_model=32, n_head=4, max_seq_len=32))
    rotary = attn.rotary
    cos1, _ = rotary.tables(torch.bfloat16, 0, 8)
    cos2, _ = rotary.tables(torch.bfloat16, 4, 8)
    assert cos1.dtype == torch.bfloat16 and cos1.untyped_storage().data_ptr() == cos2.untyped_storage().data_ptr()
    x = torch.randn(1, 8, 32, dtype=torch.bfloat16)
    qkv = attn.qkv.to(torch.bfloat16)(x).view(1, 8, 4, 3, 8)
    q, k, _ = rotary.rotate_qkv(qkv, 0)
    torch.testing.assert_close(q, reference_rotary(rotary, qkv[..., 0, :].transpose(1, 2), 0).transpose(1, 2))
    rotary.double()  # buffers re-cast: the cached bf16 copy must not be reused for a stale buffer
    cos3, _ = rotary.tables(torch.bfloat16, 0, 8)
    assert cos3.untyped_storage().data_ptr() != cos1.untyped_storage().data_ptr()
    assert torch.equal(cos3, rotary.cos[:8].to(torch.bfloat16))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_model_equals_the_model_with_the_old_formulas(monkeypatch, dropout):
    cfg = ModelConfig(d_model=64, n_layer=2, n_head=4, max_seq_len=32, dropout=dropout)
    torch.manual_seed(0)
    model = DNATransformer(cfg, VOCAB)
    torch.manual_seed(5)
    fused = loss_and_grads(model)
    monkeypatch.setattr(RMSNorm, "forward", reference_rmsnorm)
    monkeypatch.setattr(SelfAttention, "forward", reference_attention_forward)
    torch.manual_seed(5)  # the same dropout masks
    assert_same(fused, loss_and_grads(model))


@pytest.mark.parametrize("case", ["fp32", "bf16", "bf16-activations-fp32-tables"])
def test_saved_activations_match_the_planner_with_long_rotary_tables(case):
    """The packed path saves, per block, the whole rotary tables in the activation dtype (the buffers or their cached
    cast), the core's output once (proj reads it without a copy) and the norms' float32 statistics:
    model/transformer/costs.py's formula, here with max_seq_len 4x the window."""
    from support.saved import param_storages, saved_bytes

    from megagenome.model.transformer.costs import TransformerShape, activation_bytes

    dtype, e = (torch.float32, 4) if case == "fp32" else (torch.bfloat16, 2)
    cfg = ModelConfig(d_model=64, n_layer=2, n_head=4, max_seq_len=256)
    torch.manual_seed(0)
    model = DNATransformer(cfg, VOCAB).to(dtype).train()
    if case.endswith("fp32-tables"):
        for block in model.blocks:
            block.attn.rotary.float()
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (2, 64), generator=g) for _ in range(2))
    got = saved_bytes(lambda: model(ids, labels, torch.ones(2, 64)), param_storages(model))
    shape = TransformerShape(
        d_model=64,
        n_layer=2,
        n_head=4,
        d_ff=model.blocks[0].mlp.w_up.out_features,
        vocab_size=VOCAB,
        padded_vocab=model.padded_vocab_size,
        max_seq_len=256,
    )
    assert got == activation_bytes(shape, 64, 2, "none", e, kernel="flash", math_bytes=4, mask_bytes=e)["saved"]


# ----- the attention seam -------------------------------------------------------------------------------------------


def test_auto_is_sdpa_on_cpu_and_named_backends_are_returned_as_given():
    for dtype in (torch.float32, torch.bfloat16):
        assert attention_backend("auto", "cpu", dtype) == "sdpa"
    for kernel in ("sdpa", "math", "cudnn", "flash", "fa3"):
        assert attention_backend(kernel, "cpu", torch.float32) == kernel
    with pytest.raises(ValueError, match=r"model\.attention"):
        attention_backend("xformers", "cpu", torch.float32)
    assert attention_summary("auto", "cpu", torch.bfloat16) == "attention: sdpa (auto)"
    assert attention_summary("math", "cpu", torch.float32) == "attention: math"


def test_auto_resolution_on_gpus(monkeypatch):
    """Mocked (no GPU here): the compute capability, cuDNN's presence and the flash-attn imports are set by hand."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)

    def resolve(sm, flash, fa3, dtype=torch.bfloat16, dropout=0.0):
        for key in [k for k in attn_mod._PROBES if isinstance(k, tuple) and k[0] == "auto"]:
            monkeypatch.delitem(attn_mod._PROBES, key)  # what auto resolved to is memoised: resolve afresh
        monkeypatch.setitem(attn_mod._PROBES, ("sm", 0), sm)
        monkeypatch.setitem(attn_mod._PROBES, "flash", (lambda: None) if flash else None)
        monkeypatch.setitem(attn_mod._PROBES, "fa3", (lambda: None) if fa3 else None)
        return attention_backend("auto", torch.device("cuda", 0), dtype, dropout)

    assert resolve((9, 0), flash=True, fa3=True) == "fa3"
    assert resolve((9, 0), flash=True, fa3=True, dtype=torch.float16) == "fa3"
    assert resolve((9, 0), flash=False, fa3=False) == "cudnn"
    assert resolve((8, 0), flash=True, fa3=True) == "cudnn"  # FA3 is Hopper-only
    assert resolve((9, 0), flash=True, fa3=True, dropout=0.1) == "flash"  # neither FA3 nor cuDNN with dropout
    assert resolve((9, 0), flash=False, fa3=True, dropout=0.1) == "sdpa"
    assert resolve((7, 5), flash=True, fa3=False) == "flash"
    assert resolve((7, 5), flash=False, fa3=False) == "sdpa"
    assert resolve((9, 0), flash=True, fa3=True, dtype=torch.float32) == "sdpa"
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    assert resolve((9, 0), flash=False, fa3=False) == "sdpa"


def test_compiling_resolves_auto_on_every_gpu_beforehand(monkeypatch):
    """Mocked (no GPU here): DNATransformer.compile_blocks resolves auto for every visible GPU, dtype and dropout and
    probes the imports eagerly, on every rank, so a compiled (fullgraph) block only looks the answer up: dynamo
    cannot trace an import or a device query."""
    monkeypatch.setattr(attn_mod, "_PROBES", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    cfg = ModelConfig(d_model=16, n_layer=1, n_head=2, max_seq_len=16)
    DNATransformer(cfg, 8).compile_blocks()
    resolved = {k: v for k, v in attn_mod._PROBES.items() if isinstance(k, tuple) and k[0] == "auto"}
    assert {"flash", "fa3"} <= set(attn_mod._PROBES)
    assert len(resolved) == 2 * 2 * 2  # 2 GPUs x bf16/fp16 x with and without dropout
    expected = "cudnn" if attn_mod._PROBES["fa3"] is None else "fa3"  # FA3 is not installed here
    assert resolved[("auto", "cuda:1", torch.bfloat16, False)] == expected
    assert resolved[("auto", "cuda:0", torch.float16, True)] == ("flash" if attn_mod._PROBES["flash"] else "sdpa")


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "fa3"])
def test_gpu_backends_refuse_cpu_tensors_naming_the_flag(kernel):
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=rf"--model\.attention={kernel}"):
        attention(q, q, q, causal=True, kernel=kernel)


def test_fa3_missing_is_named(monkeypatch):
    monkeypatch.setitem(attn_mod._PROBES, "fa3", None)
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="flash_attn_interface"):
        attention(q, q, q, causal=True, kernel="fa3")


@pytest.mark.parametrize("causal", [True, False])
def test_math_backend_equals_sdpa_on_strided_views(causal):
    """The model hands the kernels strided views of its packed qkv; math and torch's choice agree on them."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 24, 4, 3, 16)  # (B, T, n_head, 3, head_dim)
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))  # (B, n_head, T, head_dim) views
    math = attention(q, k, v, causal=causal, kernel="math")
    sdpa = attention(q, k, v, causal=causal, kernel="sdpa")
    dense = attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal, kernel="math")
    torch.testing.assert_close(math, sdpa, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(math, dense, rtol=1e-6, atol=1e-6)


# ----- configuration ------------------------------------------------------------------------------------------------


def test_config_accepts_every_backend_and_compile_changes_no_checkpoint_key():
    for kernel in ("auto", "sdpa", "math", "cudnn", "flash", "fa3"):
        assert config_from_dict({"model": {"attention": kernel}}).model.attention == kernel
    base = config_from_dict({"model": {}})
    compiled = config_from_dict({"model": {"compile": True, "attention": "cudnn"}})
    assert compiled.model.compile and not base.model.compile
    assert config_hash(base) == config_hash(compiled)  # a resume may switch either


def test_fa3_with_dropout_is_refused_before_launch():
    problems = validate(config_from_dict({"model": {"attention": "fa3", "dropout": 0.1}}))
    assert any("--model.attention=fa3 with --model.dropout=0.1" in p for p in problems)
    assert not [p for p in validate(config_from_dict({"model": {"attention": "fa3"}})) if "fa3" in p]


@pytest.mark.parametrize("degree", ["pipeline", "tensor", "sequence"])
def test_compile_is_refused_with_model_parallelism(degree):
    cfg = config_from_dict({"model": {"compile": True, "n_layer": 4}, "parallel": {degree: 2}})
    problems = [p for p in validate(cfg) if "--model.compile" in p]
    assert len(problems) == 1 and f"--parallel.{degree}=2" in problems[0]
    assert not [p for p in validate(config_from_dict({"parallel": {degree: 2}})) if "compile" in p]


def test_compile_is_refused_with_zero3():
    cfg = config_from_dict({"model": {"compile": True}})
    rules = TRANSFORMER.parallel_rules(cfg.model, 16)
    with pytest.raises(LayoutError, match=r"--model\.compile.*stage=3.*torch\.compiler\.disable"):
        ParallelLayout.build(1, cfg.parallel, cfg.model, 64, rules, {"stage": 3}, "zero3.json")
    for stage in (0, 1, 2):
        ParallelLayout.build(1, cfg.parallel, cfg.model, 64, rules, {"stage": stage}, "zero.json")


# ----- regional torch.compile (inductor on CPU) ---------------------------------------------------------------------


def _ds_losses(model: DNATransformer, steps: int = 2) -> list[float]:
    """Per-step losses of `model` under a real DeepSpeed ZeRO-2 engine (a world of one; no warmup, so weights move)."""
    from megagenome.engine import engine

    ds = final_ds_config({"zero_optimization": {"stage": 2}}, TrainConfig(warmup_steps=0, lr=1e-2))
    eng = engine.initialize(model, model.param_groups(0.1), ds)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids, labels = (torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(2))
        loss, _, _ = eng(ids, labels, torch.ones(2, 32))
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def compiled_runs():
    """Every compiled case, run once: the blocks compile on the first forward and later models reuse the graph.

    {policy: (eager, compiled)} loss-and-gradients of a 2-layer model, "zero2": (eager, compiled) per-step losses
    under DeepSpeed, and "seconds": the wall time of the whole fixture (printed by the test)."""
    start = time.perf_counter()
    runs = {}
    for policy in ("none", "full", "selective"):
        cfg = ModelConfig(d_model=64, n_layer=2, n_head=4, max_seq_len=32, checkpointing=policy)
        torch.manual_seed(0)
        eager = DNATransformer(cfg, VOCAB)
        compiled = copy.deepcopy(eager)
        compiled.compile_blocks()
        runs[policy] = (loss_and_grads(eager), loss_and_grads(compiled))
    cfg = ModelConfig(d_model=64, n_layer=2, n_head=4, max_seq_len=32)
    with world_of_one():
        built = []
        for flag in (False, True):
            torch.manual_seed(0)
            built.append(DNATransformer(dataclasses.replace(cfg, compile=flag), VOCAB))
        assert all(not b._compiled_call_impl for b in built[0].blocks)
        assert all(b._compiled_call_impl for b in built[1].blocks)  # --model.compile compiled at construction
        runs["zero2"] = tuple(_ds_losses(m) for m in built)
    runs["seconds"] = time.perf_counter() - start
    return runs


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
def test_compiled_blocks_equal_eager(compiled_runs, policy):
    eager, compiled = compiled_runs[policy]
    print(f"compile fixture: {compiled_runs['seconds']:.1f} s")
    assert_same(eager, compiled, rtol=1e-5, atol=1e-6)


def test_compiled_model_keeps_parameter_names_and_trains_under_deepspeed(compiled_runs):
    eager, compiled = compiled_runs["zero2"]
    assert eager[0] != eager[1]  # the weights moved between the steps
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-6)
    cfg = ModelConfig(d_model=32, n_layer=2, n_head=4)
    compiled = DNATransformer(dataclasses.replace(cfg, compile=True), VOCAB)
    assert list(compiled.state_dict()) == list(DNATransformer(cfg, VOCAB).state_dict())


# ----- on a GPU -----------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _gpu_backends() -> list[str]:
    out = ["sdpa", "cudnn"]
    out += ["flash"] if flash_available() else []
    out += ["fa3"] if fa3_available() and torch.cuda.get_device_capability()[0] == 9 else []
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.gpu
@needs_cuda
def test_every_gpu_backend_equals_math_on_cuda(causal):
    torch.manual_seed(0)
    qkv = torch.randn(2, 256, 8, 3, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16)

    def run(kernel):
        q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))  # the model's strided views
        out = attention(q, k, v, causal=causal, kernel=kernel)
        (dqkv,) = torch.autograd.grad(out, qkv, grad)
        return out.float(), dqkv.float()

    ref = run("math")
    for kernel in _gpu_backends():
        out, dqkv = run(kernel)
        torch.testing.assert_close(out, ref[0], rtol=2e-2, atol=2e-2, msg=kernel)
        torch.testing.assert_close(dqkv, ref[1], rtol=5e-2, atol=5e-2, msg=kernel)


@pytest.mark.gpu
@needs_cuda
def test_fused_model_equals_old_formulas_on_cuda(monkeypatch):
    """CUDA runs torch's fused rms_norm kernel (CPU runs it op by op): equal to the float32 formula in bf16."""
    cfg = ModelConfig(d_model=256, n_layer=2, n_head=4, max_seq_len=128)
    torch.manual_seed(0)
    model = DNATransformer(cfg, VOCAB).cuda().bfloat16()
    g = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(0, VOCAB, (2, 128), generator=g).cuda() for _ in range(2))

    def run():
        model.zero_grad(set_to_none=True)
        loss, _, _ = model(ids, labels, torch.ones(2, 128, device="cuda"))
        loss.backward()
        return loss.float(), [p.grad.float() for p in model.parameters()]

    fused = run()
    monkeypatch.setattr(RMSNorm, "forward", reference_rmsnorm)
    monkeypatch.setattr(SelfAttention, "forward", reference_attention_forward)
    old = run()
    torch.testing.assert_close(fused[0], old[0], rtol=1e-2, atol=1e-2)
    for a, b in zip(fused[1], old[1], strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cudnn_attention_with_causal_and_dropout_on_cuda(dropout):
    """What torch's cuDNN backend accepts: causal without dropout must run and be counted by FlopCounterMode like the
    math backend; with dropout it may refuse, which is why auto never picks it then (asserted on CPU above)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    counts = {}
    for kernel in ("math", "cudnn"):
        with FlopCounterMode(display=False) as counter:
            try:
                attention(q, k, v, causal=True, dropout_p=dropout, kernel=kernel)
            except RuntimeError as e:
                assert dropout > 0 and kernel == "cudnn", e
                print(f"cuDNN attention refuses dropout {dropout}: {e}")
                return
        counts[kernel] = counter.get_total_flops()
    print(f"dropout {dropout}: FlopCounterMode counts {counts}")
    assert counts["cudnn"] == counts["math"] > 0


def test_inference_builds_an_eager_model_from_a_compiled_run():
    """--model.compile is a training option: the model inference, export and scoring build is eager (each window
    or batch shape would recompile a compiled block)."""
    from megagenome.after_training.inference import build_model

    cfg = ModelConfig(d_model=16, n_layer=1, n_head=2, max_seq_len=16, compile=True)
    trained = DNATransformer(cfg, 8)
    assert trained.blocks[0]._compiled_call_impl is not None
    model = build_model(cfg, trained.state_dict())
    assert model.blocks[0]._compiled_call_impl is None and not model.cfg.compile
