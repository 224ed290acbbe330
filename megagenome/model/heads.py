"""Task heads on a pretrained backbone (layer L1): what `megagenome finetune` trains.

TaskModel wraps any family's model (the LanguageModel protocol of family.py) and reads one of its layers:
-1 (FINAL_NORM) through hidden(), which honours the activation-checkpoint function DeepSpeed's JSON configures, any
other through layer_states(). The head is a linear layer:

    classification   pooled (B, d) -> (B, classes) logits, cross entropy
    regression       pooled (B, d) -> (B,) value, mean squared error on the standardised target (the training set's
                     mean and standard deviation, held by the head, so predictions come out in label units)
    per_base         (B, T, d) -> (B, T, classes) logits, cross entropy over the positions whose label is not IGNORE

Pooling of a sequence (B, T, d) -> (B, d) over its real bases (`lengths`; padding sits at the end): mean, the last
base (for a causal backbone the one position that has seen the whole sequence) or the middle base. Padding is at the
end, so a causal backbone's states of the real bases do not depend on it; a bidirectional (mlm) backbone sees the
padding tokens, as in the pretraining windows' N runs.

forward(input_ids, lengths, labels) returns (loss, outputs): outputs are class probabilities (B, C) or (B, T, C), or
values (B,), in float32, which evaluation gathers for the metrics.

With rc_average, a forward outside training (evaluation, the test, an export's predictions) runs the head on both
strands, each row's real bases reverse-complemented in place (padding stays at the end), and averages the outputs:
probabilities, a per-base strand's mapped back onto the forward strand's positions, or values. The loss is the
average's. For a label that holds on either strand it is the model's best single guess, and a model trained with
reverse complements (--data.rc_prob) has learnt both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megagenome.model.complement import reverse_complement_rows, within_lengths
from megagenome.model.stack import BlockStack

IGNORE = -100  # a per-base label that carries no loss (padding); data/labelled.py uses the same value
FINAL_NORM = -1


class TaskHead(nn.Module):
    """Dropout and one linear layer, plus the regression target's scale (mean 0, std 1 when not regression): plain
    floats, not buffers, so that a bf16 engine does not round them; task.json and an export's manifest record them."""

    def __init__(self, d_model: int, outputs: int, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.linear = nn.Linear(d_model, outputs)
        nn.init.normal_(self.linear.weight, std=d_model**-0.5)
        nn.init.zeros_(self.linear.bias)
        self.target_mean, self.target_std = 0.0, 1.0

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(self.dropout(features))


class TaskModel(nn.Module):
    """A backbone and a task head (module docstring)."""

    def __init__(
        self,
        backbone: nn.Module,
        task: str,
        outputs: int,
        layer: int,
        pooling: str,
        dropout: float,
        rc_average: bool = False,
    ):
        super().__init__()
        self.backbone = backbone
        self.task, self.layer, self.pooling, self.rc_average = task, layer, pooling, rc_average
        self.head = TaskHead(backbone.cfg.d_model, 1 if task == "regression" else outputs, dropout)

    def set_target_scale(self, mean: float, std: float) -> None:
        """The regression target's training-set mean and standard deviation (std 0 is taken as 1)."""
        self.head.target_mean, self.head.target_std = float(mean), float(std) if std > 0 else 1.0

    def states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, d) the backbone's states at the chosen layer."""
        if self.layer == FINAL_NORM:
            return self.backbone.hidden(input_ids)
        return self.backbone.layer_states(input_ids, [self.layer])[self.layer]

    def features(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(B, d) pooled features of a sequence task, (B, T, d) of a per-base task, in float32."""
        x = self.states(input_ids).float()  # (B, T, d)
        if self.task == "per_base":
            return x
        return pool(x, lengths, self.pooling)

    def predict(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The head's raw output: logits (B, C) / (B, T, C), or the standardised value (B,)."""
        features = self.features(input_ids, lengths)
        out = self.head(features.to(self.head.linear.weight.dtype)).float()
        return out.squeeze(-1) if self.task == "regression" else out

    def forward(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss over the batch's labelled items, outputs: probabilities or values in label units)."""
        if self.rc_average and not self.training:
            return self._both_strands(input_ids, lengths, labels)
        out = self.predict(input_ids, lengths)
        if self.task == "regression":
            mean, std = self.head.target_mean, self.head.target_std
            loss = F.mse_loss(out, (labels.float() - mean) / std)
            return loss, out * std + mean
        if self.task == "per_base":
            loss = F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)  # (B*T, C)
        else:
            loss = F.cross_entropy(out, labels)
        return loss, out.softmax(-1)

    def _both_strands(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's (loss, outputs) of the average of both strands' outputs (module docstring)."""
        forward = self.predict(input_ids, lengths)
        other = self.predict(reverse_complement_rows(input_ids, lengths), lengths)
        if self.task == "regression":
            mean, std = self.head.target_mean, self.head.target_std
            out = (forward + other) / 2
            return F.mse_loss(out, (labels.float() - mean) / std), out * std + mean
        if self.task == "per_base":  # the other strand's position L-1-t is the forward strand's t
            index = within_lengths(lengths, other.shape[1]).to(other.device)
            other = other.gather(1, index[..., None].expand_as(other))
        probs = (forward.softmax(-1) + other.softmax(-1)) / 2
        logp = probs.clamp_min(1e-12).log()
        if self.task == "per_base":
            return F.nll_loss(logp.flatten(0, 1), labels.flatten(), ignore_index=IGNORE), probs
        return F.nll_loss(logp, labels), probs


def pool(x: torch.Tensor, lengths: torch.Tensor, how: str) -> torch.Tensor:
    """(B, d) of x (B, T, d) over each row's first lengths[b] positions: their mean, the last one or the middle one."""
    B, T, _ = x.shape
    rows = torch.arange(B, device=x.device)
    lengths = lengths.to(x.device).clamp(1, T)
    if how == "last":
        return x[rows, lengths - 1]
    if how == "centre":
        return x[rows, (lengths - 1) // 2]
    valid = (torch.arange(T, device=x.device)[None, :] < lengths[:, None]).to(x.dtype)  # (B, T)
    return (x * valid[..., None]).sum(1) / lengths[:, None].to(x.dtype)


def param_groups(
    model: nn.Module, weight_decay: float, lr: float | None = None, head_scale: float = 1.0, layer_decay: float = 1.0
) -> list[dict]:
    """The trainable parameters grouped by weight decay (matrices decayed; vectors: biases, norms, gains, not) and by
    learning rate, each a multiple of the peak `lr` the optimizer uses (lr_scales): groups at 1 take the optimizer's,
    the others carry their own "lr". Groups at 1 come first, decayed before plain, as without scales. Parameters with
    requires_grad False (a frozen backbone, LoRA's base weights) are left out."""
    scales = lr_scales(model, head_scale, layer_decay)
    if lr is None and any(v != 1.0 for v in scales.values()):
        raise ValueError("param_groups: a learning-rate scale needs the peak lr")
    grouped: dict[tuple[float, bool], list] = {}
    for p in model.parameters():
        if p.requires_grad:
            grouped.setdefault((scales.get(id(p), 1.0), p.ndim >= 2), []).append(p)
    groups = []
    for scale, decayed in sorted(grouped, key=lambda k: (k[0] != 1.0, -k[0], not k[1])):
        group = {"params": grouped[scale, decayed], "weight_decay": weight_decay if decayed else 0.0}
        groups.append(group if scale == 1.0 else {**group, "lr": lr * scale})
    return groups


def lr_scales(model: nn.Module, head_scale: float = 1.0, layer_decay: float = 1.0) -> dict[int, float]:
    """Each parameter's (by id) multiple of the peak learning rate, where it is not 1: the head's head_scale; with
    layer-wise decay, block i of the backbone's n (0 next to the embedding) layer_decay ** (n - i) and the embedding
    layer_decay ** (n + 1), so that the layers nearest the input, which hold the most general features, move least;
    the final norm and the head are not decayed."""
    out = {}
    if layer_decay != 1.0:
        stack = next(m for m in model.modules() if isinstance(m, BlockStack))  # under LoRA's wrapper too
        depths = stack.parameter_depths()
        top = max(depths.values())  # the last block's: n
        out.update({pid: layer_decay ** (top + 1 - depth) for pid, depth in depths.items()})
    if head_scale != 1.0:
        for p in model.head.parameters():
            out[id(p)] = head_scale
    return out
