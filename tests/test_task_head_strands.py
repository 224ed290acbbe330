"""Tier 1: a task head that averages both strands (TaskModel rc_average, model/complement.py).

- reverse_complement_rows reverses and complements each row's real bases in place, padding left at the end
  (against the tokenizer's own reverse_complement of the strings);
- in evaluation the outputs are the mean of the two strands' probabilities (per-base ones mapped back position by
  position) or values, the loss that of the mean; in training nothing changes;
- so a sequence and its reverse complement get the same class probabilities, exactly up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megagenome.config import ModelConfig
from megagenome.data.tokenizer import PAD_ID, VOCAB_SIZE, encode, reverse_complement
from megagenome.model import family_of
from megagenome.model.complement import reverse_complement_rows
from megagenome.model.heads import TaskModel

SEQS = ["ACGTTGCAAC", "GGGATC", "TTTACGNAGC"]


def _batch(seqs: list[str], rc: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T) padded at the end, lengths) of the sequences, or of their reverse complements (the tokenizer's)."""
    rows = [encode(s)[0] for s in seqs]
    rows = [reverse_complement(r) for r in rows] if rc else rows
    ids = torch.full((len(rows), max(map(len, rows))), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r.astype("int64"))
    return ids, torch.tensor([len(r) for r in rows])


def _model(task: str, rc: bool) -> TaskModel:
    cfg = ModelConfig(family="transformer", d_model=32, n_layer=2, n_head=2, max_seq_len=64, objective="clm")
    torch.manual_seed(0)
    backbone = family_of(cfg).build(cfg, VOCAB_SIZE)
    torch.manual_seed(1)
    model = TaskModel(backbone, task, 3, -1, "mean", 0.0, rc_average=rc)
    return model.eval()


def test_reverse_complement_rows_keeps_the_padding_at_the_end():
    ids, lengths = _batch(SEQS)
    expected, _ = _batch(SEQS, rc=True)
    assert torch.equal(reverse_complement_rows(ids, lengths), expected)
    assert torch.equal(reverse_complement_rows(expected, lengths), ids)


def test_evaluation_averages_the_two_strands():
    ids, lengths = _batch(SEQS)
    other, _ = _batch(SEQS, rc=True)
    labels = torch.tensor([0, 2, 1])
    model = _model("classification", rc=True)
    with torch.no_grad():
        loss, probs = model(ids, lengths, labels)
        mean = (model.predict(ids, lengths).softmax(-1) + model.predict(other, lengths).softmax(-1)) / 2
        assert torch.allclose(probs, mean, atol=1e-6)
        assert torch.allclose(loss, F.nll_loss(mean.log(), labels), atol=1e-6)
        _, flipped = model(other, lengths, labels)
        assert torch.allclose(flipped, probs, atol=1e-6)  # either strand: the same answer
        model.train()
        loss_train, probs_train = model(ids, lengths, labels)  # training: one strand, as before
        assert torch.allclose(probs_train, model.predict(ids, lengths).softmax(-1))
        plain = _model("classification", rc=False)
        assert torch.allclose(plain(ids, lengths, labels)[1], model.eval().predict(ids, lengths).softmax(-1))


def test_per_base_and_regression_outputs_average_position_by_position():
    ids, lengths = _batch(SEQS)
    other, _ = _batch(SEQS, rc=True)
    labels = torch.randint(0, 3, ids.shape)
    labels[ids == PAD_ID] = -100
    model = _model("per_base", rc=True)
    with torch.no_grad():
        _, probs = model(ids, lengths, labels)
        a, b = model.predict(ids, lengths).softmax(-1), model.predict(other, lengths).softmax(-1)
        for row, n in enumerate(lengths.tolist()):
            for t in range(n):  # the other strand's position n-1-t reads the forward strand's t
                assert torch.allclose(probs[row, t], (a[row, t] + b[row, n - 1 - t]) / 2, atol=1e-6)
        reg = _model("regression", rc=True)
        reg.set_target_scale(5.0, 2.0)
        _, values = reg(ids, lengths, torch.zeros(3))
        expected = (reg.predict(ids, lengths) + reg.predict(other, lengths)) / 2 * 2.0 + 5.0
        assert torch.allclose(values, expected, atol=1e-5)
