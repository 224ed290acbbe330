"""Tier-1 tests of DNATransformer: shapes, masking, loss arithmetic, parameters and trainability (CPU)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megagenome.config import ModelConfig, d_ff
from megagenome.model.transformer import DNATransformer


def tiny(**overrides) -> ModelConfig:
    fields = {"d_model": 32, "n_layer": 2, "n_head": 4, "max_seq_len": 64}
    fields.update(overrides)
    return ModelConfig(**fields)


def batch(B=2, T=16, vocab=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = torch.randint(0, vocab, (B, T), generator=g)
    loss_weight = torch.rand(B, T, generator=g)
    return input_ids, labels, loss_weight


def test_shapes_and_finite_loss():
    torch.manual_seed(0)
    model = DNATransformer(tiny(), vocab_size=5)
    input_ids, labels, weight = batch(vocab=5)
    loss, nll_sum, weight_sum = model(input_ids, labels, weight)
    assert loss.shape == nll_sum.shape == weight_sum.shape == ()
    assert torch.isfinite(loss) and loss.dtype == torch.float32
    assert model.logits(input_ids).shape == (2, 16, 5)
    assert (model.vocab_size, model.padded_vocab_size) == (5, 8)
    assert model.embed.weight.shape == (8, 32)


def test_loss_matches_manual_weighted_cross_entropy():
    torch.manual_seed(0)
    model = DNATransformer(tiny(), vocab_size=8)
    input_ids, labels, weight = batch()
    loss, nll_sum, weight_sum = model(input_ids, labels, weight)
    ce = F.cross_entropy(model.logits(input_ids).reshape(-1, 8), labels.reshape(-1), reduction="none")
    expected_nll = (ce * weight.reshape(-1)).sum()
    torch.testing.assert_close(nll_sum, expected_nll)
    torch.testing.assert_close(weight_sum, weight.sum())
    torch.testing.assert_close(loss, expected_nll / weight.sum().clamp(min=1))


def test_loss_denominator_clamped_to_one():
    torch.manual_seed(0)
    model = DNATransformer(tiny(), vocab_size=8)
    input_ids, labels, _ = batch()
    weight = torch.zeros(2, 16)
    weight[0, 3] = 0.25
    loss, nll_sum, weight_sum = model(input_ids, labels, weight)
    assert weight_sum.item() == pytest.approx(0.25)
    torch.testing.assert_close(loss, nll_sum)
    loss, nll_sum, weight_sum = model(input_ids, labels, torch.zeros(2, 16))
    assert loss.item() == nll_sum.item() == weight_sum.item() == 0.0


def test_weight_zero_positions_do_not_contribute():
    torch.manual_seed(0)
    model = DNATransformer(tiny(), vocab_size=8)
    input_ids, labels, weight = batch()
    weight[0, 5] = 0.0
    base = model(input_ids, labels, weight)
    for new_label in ((labels[0, 5] + 1) % 8, -100):  # another base, or the ignore index
        changed = labels.clone()
        changed[0, 5] = new_label
        for a, b in zip(base, model(input_ids, changed, weight), strict=True):
            torch.testing.assert_close(a, b)
    # Gradients reach no logit of the weight-0 position.
    logits = model.logits(input_ids).detach().requires_grad_(True)
    ce = F.cross_entropy(logits.reshape(-1, 8), labels.reshape(-1), reduction="none")
    (ce * weight.reshape(-1)).sum().backward()
    assert torch.all(logits.grad[0, 5] == 0) and torch.any(logits.grad[0, 4] != 0)


def test_padded_vocab_columns_do_not_matter():
    torch.manual_seed(0)
    model = DNATransformer(tiny(tie_embeddings=False), vocab_size=5)
    input_ids, labels, weight = batch(vocab=5)
    before = model(input_ids, labels, weight)
    with torch.no_grad():
        model.lm_head.weight[5:] = 100.0  # huge logits in the padded columns 5..7
    for a, b in zip(before, model(input_ids, labels, weight), strict=True):
        torch.testing.assert_close(a, b)


def test_clm_is_causal_and_mlm_is_bidirectional():
    torch.manual_seed(0)
    t = 9
    input_ids, _, _ = batch(T=16)
    changed = input_ids.clone()
    changed[:, t] = (changed[:, t] + 1) % 8
    for objective in ("clm", "mlm"):
        model = DNATransformer(tiny(objective=objective), vocab_size=8).eval()
        with torch.no_grad():
            a, b = model.logits(input_ids), model.logits(changed)
        assert not torch.allclose(a[:, t:], b[:, t:])
        if objective == "clm":
            torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
        else:
            assert (a[:, :t] - b[:, :t]).abs().amax(dim=-1).min() > 1e-4  # every earlier position sees it


def test_sequence_longer_than_max_seq_len_raises():
    model = DNATransformer(tiny(max_seq_len=16), vocab_size=8)
    model.logits(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long), torch.zeros(1, 17, dtype=torch.long), torch.ones(1, 17))


def test_bad_head_size_raises():
    with pytest.raises(ValueError, match="n_head"):
        DNATransformer(tiny(d_model=30), vocab_size=8)


def test_tied_embeddings_share_storage_and_count_once():
    cfg = tiny()
    assert d_ff(cfg) == 128  # 8/3 * 32 = 85, rounded up to a multiple of 64
    d, hidden, vocab, layers = 32, 128, 8, 2
    per_block = 3 * d * d + d * d + 3 * d * hidden + 2 * d  # qkv, proj, SwiGLU, two RMSNorm scales
    hand = layers * per_block + vocab * d + d  # blocks, embedding (= head), final norm
    tied = DNATransformer(cfg, vocab_size=vocab)
    assert tied.lm_head.weight.data_ptr() == tied.embed.weight.data_ptr()
    assert tied.num_parameters() == hand == 33184
    assert tied.num_parameters(exclude_embeddings=True) == hand - vocab * d
    untied = DNATransformer(tiny(tie_embeddings=False), vocab_size=vocab)
    assert untied.lm_head.weight.data_ptr() != untied.embed.weight.data_ptr()
    assert untied.num_parameters() == hand + vocab * d
    assert untied.num_parameters(exclude_embeddings=True) == hand - vocab * d


def test_init_std():
    torch.manual_seed(0)
    cfg = tiny(d_model=256, n_layer=8, n_head=4)
    model = DNATransformer(cfg, vocab_size=8)
    block = model.blocks[0]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.w_down.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(2*8)
    assert block.attn.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.all(block.attn_norm.weight == 1) and torch.all(model.norm.weight == 1)


def test_no_batchnorm_anywhere():
    model = DNATransformer(tiny(), vocab_size=8)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("tie", [True, False])
def test_param_groups_cover_every_parameter_once(tie):
    model = DNATransformer(tiny(tie_embeddings=tie), vocab_size=8)
    decay, no_decay = model.param_groups(weight_decay=0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert any(p is model.embed.weight for p in decay["params"])
    torch.optim.AdamW(model.param_groups(0.1), lr=1e-3)  # accepted as-is


def test_bfloat16_forward_gives_float32_loss():
    torch.manual_seed(0)
    model = DNATransformer(tiny(), vocab_size=8)
    input_ids, labels, weight = batch()
    reference = model(input_ids, labels, weight)[0]
    loss = model.to(torch.bfloat16)(input_ids, labels, weight)[0]
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(reference.item(), rel=2e-2)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    model = DNATransformer(tiny(dropout=0.5), vocab_size=8)
    input_ids, labels, weight = batch()
    model.eval()
    torch.testing.assert_close(model(input_ids, labels, weight)[0], model(input_ids, labels, weight)[0])
    model.train()
    assert model(input_ids, labels, weight)[0] != model(input_ids, labels, weight)[0]


@pytest.mark.parametrize("objective", ["clm", "mlm"])
def test_overfits_one_fixed_batch(objective):
    torch.manual_seed(0)
    model = DNATransformer(tiny(objective=objective), vocab_size=8)
    input_ids, labels, _ = batch(B=4, T=32, seed=1)
    weight = torch.ones(4, 32)
    optimizer = torch.optim.AdamW(model.param_groups(0.0), lr=1e-2)
    first = None
    for _ in range(50):
        loss, _, _ = model(input_ids, labels, weight)
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first, (first, loss.item())


def test_state_dict_round_trip_without_rotary_tables():
    torch.manual_seed(0)
    model = DNATransformer(tiny(), vocab_size=8)
    state = model.state_dict()
    assert not any("rotary" in key for key in state)  # a pure function of the config, not checkpointed
    torch.manual_seed(1)
    fresh = DNATransformer(tiny(), vocab_size=8)
    fresh.load_state_dict(state)
    assert fresh.lm_head.weight is fresh.embed.weight
    input_ids, labels, weight = batch()
    torch.testing.assert_close(fresh(input_ids, labels, weight), model(input_ids, labels, weight))
