"""Knowledge distillation (--train.distill_from; model/distill.py, assembly._teacher) on real DeepSpeed runs: a
16-wide student of the 32-wide "dense" run of support/trained.py, trained in the shared 2-rank launch.

- The loss is (1 - alpha) CE + alpha T^2 KL(teacher || student), checked against torch's kl_div;
- with the teacher, ZeRO 1, 2 and 3 train exactly as ZeRO 0 (losses and weights within the equivalence tolerances);
- alpha 0 equals training without a teacher, step for step; alpha 0.5 does not (the teacher is really used);
- the teacher is frozen and outside the student: its checkpoint holds the student's tensors only, and the teacher run's
  weights are unchanged;
- a model-parallel student, a teacher of another objective or a shorter context are refused, naming the flag.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.runs import assert_equivalent

from megagenome.after_training.inference import read_weights
from megagenome.config import ConfigError, RootConfig
from megagenome.config import validate as validate_config
from megagenome.config.sections import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from megagenome.model.distill import Teacher, distill_sums
from megagenome.run.assembly import Ranks, _teacher

pytestmark = pytest.mark.slow


def test_blended_loss_matches_torch_kl_div():
    torch.manual_seed(0)
    student, teacher_logits = torch.randn(10, 8), torch.randn(10, 8)
    labels = torch.randint(0, 8, (10,))
    weight = torch.tensor([1.0] * 7 + [0.0] * 3)
    ce = F.cross_entropy(student, labels, reduction="none")
    holder = Teacher(torch.nn.Linear(1, 1), alpha=0.3, temperature=2.0)
    got = distill_sums(student, teacher_logits, ce, weight, holder)
    kl = F.kl_div(
        F.log_softmax(student / 2, -1), F.log_softmax(teacher_logits / 2, -1), log_target=True, reduction="none"
    )
    expected = ((0.7 * ce + 0.3 * 4 * kl.sum(-1)) * weight).sum()
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    assert not any(p.requires_grad for p in holder.model.parameters())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_distillation_under_zero_stage_equals_zero0(trained, stage):
    assert_equivalent(trained.runs, f"distill_zero{stage}", trained.runs, "distill_zero0")


def test_alpha0_is_plain_training_and_the_teacher_changes_the_student(trained):
    runs = trained.runs
    assert runs.losses("distill_alpha0") == runs.losses("student_plain")
    assert_equivalent(runs, "distill_alpha0", runs, "student_plain", loss_atol=0.0, weight_atol=0.0)
    plain, taught = runs.losses("student_plain"), runs.losses("distill_zero0")
    assert max(abs(a - b) for a, b in zip(plain, taught)) > 1e-3


def test_the_teacher_is_frozen_and_not_saved(trained):
    before = {k: v.clone() for k, v in read_weights(str(trained.run_dir("dense")))[1].items()}
    student_cfg, student, _, _ = read_weights(str(trained.run_dir("distill_zero3")))  # consolidation checks the keys
    assert student_cfg.d_model == 16 and student["embed.weight"].shape[1] == 16
    after = read_weights(str(trained.run_dir("dense")))[1]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_refused_students_and_teachers(trained):
    cfg = RootConfig(train=TrainConfig(distill_from="somewhere"), parallel=ParallelConfig(tensor=2))
    problems = validate_config(cfg)
    assert any("--train.distill_from needs a student without model parallelism" in p for p in problems)
    ranks = Ranks(0, 1, None, torch.device("cpu"))
    teacher = str(trained.run_dir("dense"))
    for model, data, message in [
        (ModelConfig(objective="mlm"), DataConfig(seq_len=64), "objective is clm"),
        (ModelConfig(), DataConfig(seq_len=512), "context 128 is below --data.seq_len=512"),
    ]:
        cfg = RootConfig(model=model, data=data, train=TrainConfig(distill_from=teacher))
        with pytest.raises(ConfigError, match=message):
            _teacher(cfg, ranks, {})
    with pytest.raises(ConfigError, match="--train.distill_from=/nonexistent"):
        _teacher(RootConfig(train=TrainConfig(distill_from="/nonexistent")), ranks, {})
