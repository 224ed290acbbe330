"""Published token tables (--model.vocabulary, megagenome/model/vocabulary.py) in every family.

A model holding a published table must be, on megagenome's tokens, the model whose own rows are the table's rows of
them: the equivalence checked here copies a table model's weights into a megagenome-vocabulary twin, with its
embedding and head rows picked by the table's ids, and the two must give the same logits. The loss is the authors':
the cross entropy over every row of the table, with the labels mapped (computed here by hand from table_logits), and
log_probs() is the authors' softmax over the whole table, restricted to megagenome's tokens. GPN has no such twin:
its one-hot embedding writes a token's row into that channel of the residual stream, so another row is another
model (its table is checked against the gpn package's own model in tests/test_import.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from megagenome.config import ModelConfig, RootConfig
from megagenome.data import tokenizer
from megagenome.model import family_of, validate
from megagenome.model.caduceus import rc
from megagenome.model.vocabulary import MEGAGENOME_TOKENS, VOCABULARIES

SMALL = dict(d_model=32, n_layer=2, n_head=4, max_seq_len=64)
FAMILIES = {
    "transformer": ModelConfig(family="transformer", **SMALL),
    "striped_hyena": ModelConfig(family="striped_hyena", layer_pattern="SE MR LI A", n_layer=4, mr_filter_len=16,
                                 **{k: v for k, v in SMALL.items() if k != "n_layer"}),
    "hyena": ModelConfig(family="hyena", filter_width=16, **SMALL),
    "caduceus_ps": ModelConfig(family="caduceus", objective="mlm", rc_equivariance="ps", **SMALL),
    "caduceus_ph": ModelConfig(family="caduceus", objective="mlm", rc_equivariance="post_hoc", **SMALL),
    "gpn": ModelConfig(family="gpn", objective="mlm", **SMALL),
}  # fmt: skip
HEAD_ROWS = {"gpn": "lm_head.decoder.weight"}  # the vocabulary matrix of a family whose head is not lm_head.weight


def test_ids_are_in_the_tokenizers_order():
    assert MEGAGENOME_TOKENS == tokenizer.VOCAB
    for v in VOCABULARIES.values():
        assert v.own or (len(v.ids) == tokenizer.VOCAB_SIZE and max(v.ids) < v.rows), v.name
    # The bases have rows of their own in every table: A C G T N distinct.
    for v in VOCABULARIES.values():
        bases = v.ids[tokenizer.A_ID :] if not v.own else ()
        assert len(set(bases)) == len(bases), v.name


def build(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = family_of(cfg).build(cfg, tokenizer.VOCAB_SIZE).eval()
    with torch.no_grad():  # unit-scale weights, so every row matters
        for p in model.parameters():
            p.normal_(0, 1 / max(1, p.shape[-1]) ** 0.5) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return model


def twin_of(model, cfg: ModelConfig):
    """The megagenome-vocabulary model equal to `model` on megagenome's tokens: its embedding and head rows are the
    table's rows of each token."""
    twin = family_of(cfg).build(replace(cfg, vocabulary="megagenome"), tokenizer.VOCAB_SIZE).eval()
    rows = model.token_rows
    state = {}
    twin_state = twin.state_dict()
    for name, weight in model.state_dict().items():
        if name in ("embed.weight", "lm_head.weight", HEAD_ROWS.get(cfg.family)):
            picked = twin_state[name].clone()
            picked[: len(rows)] = weight[rows]
            state[name] = picked
        else:
            state[name] = weight
    twin.load_state_dict(state)
    return twin


@pytest.mark.parametrize("vocabulary", ["bytes", "characters", "gpn"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_published_table_is_its_rows_of_megagenomes_tokens(name, vocabulary):
    cfg = replace(FAMILIES[name], vocabulary=vocabulary)
    if any("--model.vocabulary" in p for p in validate(RootConfig(model=cfg))):
        pytest.skip(f"{vocabulary} with {name}: refused by the config checks (test_refusals)")
    model = build(cfg)
    table = VOCABULARIES[vocabulary]
    assert model.table_rows == table.rows and model.padded_vocab_size >= table.rows
    x = torch.randint(0, tokenizer.VOCAB_SIZE, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model.table_logits(x)  # (B, T, rows)
        got = model.logits(x)
        assert full.shape[-1] == table.rows and got.shape[-1] == tokenizer.VOCAB_SIZE
        torch.testing.assert_close(got, full[..., list(table.ids)], rtol=0, atol=0)
        if cfg.family != "gpn":  # GPN's one-hot embedding puts a token's row into the residual stream's channels
            torch.testing.assert_close(got, twin_of(model, cfg).logits(x), rtol=1e-5, atol=1e-5)
        # log_probs: the whole table's softmax, megagenome's rows of it (not a softmax over eight rows).
        logp = model.log_probs(x)
        torch.testing.assert_close(logp, F.log_softmax(full.float(), -1)[..., list(table.ids)])
        first = [list(table.ids).index(r) for r in sorted(set(table.ids))]  # each row once
        mass = logp[..., first].exp().sum(-1)
        if len(first) < table.rows:  # rows no megagenome token reads keep their share
            assert (mass < 1 - 1e-3).all()
        else:
            torch.testing.assert_close(mass, torch.ones_like(mass))
        # The loss: cross entropy over every row, the labels mapped (-100 ignored).
        labels = torch.randint(
            tokenizer.A_ID, tokenizer.VOCAB_SIZE, x.shape, generator=torch.Generator().manual_seed(4)
        )
        labels[0, :3] = -100
        weight = (labels >= 0).float()
        targets = torch.tensor(table.ids)[labels.clamp(min=0)]
        ce = F.cross_entropy(full.float().flatten(0, 1), targets.flatten(), reduction="none") * weight.flatten()
        loss, nll_sum, weight_sum = model(x, labels, weight)
        torch.testing.assert_close(nll_sum, ce.sum())
        assert weight_sum.item() == weight.sum().item()


@pytest.mark.parametrize("mode", ["caduceus_ps", "caduceus_ph"])
def test_caduceus_stays_equivariant_over_a_published_table(mode):
    cfg = replace(FAMILIES[mode], vocabulary="characters")
    model = build(cfg)
    x = torch.randint(tokenizer.A_ID, tokenizer.T_ID + 1, (2, 20), generator=torch.Generator().manual_seed(5))
    complement = rc.complement_index(tokenizer.VOCAB_SIZE)
    with torch.no_grad():
        forward = model.logits(x)
        reverse = model.logits(rc.reverse_complement_ids(x, complement))
    torch.testing.assert_close(reverse, rc.reverse_complement_logits(forward, complement), rtol=1e-5, atol=1e-5)


def test_refusals():
    mlm_bytes = RootConfig(model=replace(FAMILIES["gpn"], vocabulary="bytes"))
    assert any("--model.vocabulary bytes" in p for p in validate(mlm_bytes))
    # An imported form's options where the family's blocks do not implement them (ModelFamily.options).
    gpn_divide = RootConfig(model=replace(FAMILIES["gpn"], norm_form="divide", biases=["qkv"]))
    assert sum("only for --model.family" in p for p in validate(gpn_divide)) == 2
    no_decay = RootConfig(model=replace(FAMILIES["transformer"], mr_decay=False))
    assert any("--model.mr_decay=False: only for --model.family striped_hyena" in p for p in validate(no_decay))
    with pytest.raises(ValueError, match="--model.vocabulary='klingon'"):
        family_of(FAMILIES["transformer"]).build(replace(FAMILIES["transformer"], vocabulary="klingon"), 8)
