"""Knowledge distillation's loss (layer L1): the student's usual cross entropy blended with the KL divergence from a
frozen teacher's predictions at a temperature (Hinton et al. 2015).

    loss = (1 - alpha) x CE(student, labels) + alpha x T^2 x KL(softmax(teacher / T) || softmax(student / T))

per target position, weighted by the batch's loss weights exactly as the usual loss is (N targets, unselected mlm
positions and padding weigh 0). The T^2 factor keeps the soft term's gradient scale independent of T. The teacher
is held outside the student's module tree (Teacher), so it is not trained, not partitioned by ZeRO-3 and not saved
in the student's checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Teacher:
    """A frozen teacher model with the blend's weight alpha and temperature."""

    def __init__(self, model: nn.Module, alpha: float, temperature: float):
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model, self.alpha, self.temperature = model, alpha, temperature

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.logits(input_ids).float()  # (B, T, vocab)


def soft_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(N,) KL(teacher || student) of each position's distributions at the temperature, in nats, float32."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (N, vocab)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)  # (N, vocab)
    return (t.exp() * (t - s)).sum(-1)  # (N,)


def distill_sums(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, ce: torch.Tensor, weight: torch.Tensor, teacher: Teacher
) -> torch.Tensor:
    """The blended loss numerator: sum over positions of weight x ((1 - alpha) CE + alpha T^2 KL); inputs flattened
    to (N, vocab) logits and (N,) ce and weight."""
    kl = soft_kl(student_logits, teacher_logits, teacher.temperature)  # (N,)
    blended = (1 - teacher.alpha) * ce + teacher.alpha * teacher.temperature**2 * kl
    return (blended * weight).sum()
