"""Evaluation of a task model on a split (layer L4): every rank its share, outputs gathered, metrics on every rank.

Each rank runs the same number of forward passes (data/task_batches.py eval_batches: under ZeRO-3 a forward is a
collective), the outputs of its real examples are gathered on every rank in example order, and the metrics
(observe/task_metrics.py) and the loss are computed from them alike on every rank, so early stopping needs no
broadcast. The loss is the training objective's: cross entropy in nats (per example, or per labelled base), or the
mean squared error of the standardised target.
"""

from __future__ import annotations

import numpy as np
import torch

from megagenome.data.task_batches import IGNORE, eval_batches
from megagenome.engine import engine as ds
from megagenome.observe.record import atomic_write
from megagenome.observe.task_metrics import task_metrics


class Evaluator:
    """metrics(split) -> (metrics, outputs in example order) of the engine's current weights."""

    def __init__(self, engine, data, micro: int, rank: int, world: int, to_device):
        self.engine, self.data, self.micro = engine, data, micro
        self.rank, self.world, self.to_device = rank, world, to_device
        module = engine.module
        self.scale = (module.head.target_mean, module.head.target_std)

    def outputs(self, split: str) -> list[np.ndarray]:
        """The model's outputs (probabilities (C,) or (T, C), or a value) of every example of `split`, in order."""
        examples = self.data.splits[split]
        mine = []
        self.engine.eval()
        with torch.no_grad():
            for index, batch in eval_batches(examples, self.data.task, self.micro, self.rank, self.world):
                _, out = self.engine(**self.to_device(batch))
                out = out.float().cpu().numpy()
                lengths = batch["lengths"].numpy()
                for row, i in enumerate(index):
                    mine.append((i, out[row, : lengths[row]] if self.data.task == "per_base" else out[row]))
        ordered = sorted((pair for part in ds.all_gather_object(mine) for pair in part), key=lambda pair: pair[0])
        return [o for _, o in ordered]

    def evaluate(self) -> dict:
        """The validation metrics (with "loss"): the fine-tuning loop's evaluation (train/task_loop.py)."""
        return self.metrics("validation")[0]

    def metrics(self, split: str) -> tuple[dict, list[np.ndarray]]:
        outputs = self.outputs(split)
        return score(self.data.task, self.data.splits[split], outputs, self.scale[1]), outputs


def score(task: str, examples: list, outputs: list[np.ndarray], target_std: float = 1.0) -> dict:
    """The loss and metrics (observe/task_metrics.py) of `outputs` (probabilities (C,) or (T, C), or a value per
    example) against the examples' labels: what the model is judged by, and the k-mer baseline alike
    (run/task_baseline.py). The regression loss is the squared error of the target standardised by target_std."""
    if task == "per_base":
        labels, probs = _padded(examples, outputs)
        valid = labels != IGNORE
        picked = probs[valid, labels[valid]]
        loss = float(-np.log(np.clip(picked, 1e-12, None)).mean())
        metrics = task_metrics(task, labels, probs)
    elif task == "regression":
        values = np.array([float(e.label) for e in examples])
        predictions = np.array(outputs, dtype=np.float64)
        loss = float((((predictions - values) / target_std) ** 2).mean())
        metrics = task_metrics(task, values, predictions)
    else:
        labels = np.array([int(e.label) for e in examples])
        probs = np.stack(outputs)
        loss = float(-np.log(np.clip(probs[np.arange(len(labels)), labels], 1e-12, None)).mean())
        metrics = task_metrics(task, labels, probs)
    return {"loss": loss, **metrics}


def _padded(examples, outputs) -> tuple[np.ndarray, np.ndarray]:
    """(labels (N, T) with IGNORE past each sequence, probabilities (N, T, C)) of per-base outputs."""
    longest = max(len(o) for o in outputs)
    classes = outputs[0].shape[-1]
    labels = np.full((len(outputs), longest), IGNORE, dtype=np.int64)
    probs = np.zeros((len(outputs), longest, classes), dtype=np.float32)
    for i, (e, o) in enumerate(zip(examples, outputs)):
        labels[i, : len(o)] = np.asarray(e.label)[: len(o)]
        probs[i, : len(o)] = o
    return labels, probs


def write_predictions(path: str, data, split: str, outputs: list[np.ndarray], baseline: list | None = None) -> None:
    """A TSV of `split`'s predictions: name, label, then the prediction (regression), the predicted class and each
    class's probability (classification), or the bases, labels and predicted classes as strings (per_base); with
    `baseline` (the k-mer baseline's outputs, run/task_baseline.py) its prediction or predicted class after them."""
    examples = data.splits[split]
    classes = list(data.classes)
    theirs = baseline if baseline is not None else [None] * len(examples)
    extra = ["baseline_prediction" if data.task == "regression" else "baseline_predicted"] if baseline else []
    if data.task == "regression":
        header = ["name", "label", "prediction", *extra]
        rows = [[e.name, e.label, f"{float(o):.6g}", *_shown(b, data.task, classes)] for e, o, b in
                zip(examples, outputs, theirs)]  # fmt: skip
    elif data.task == "per_base":
        header = ["name", "labels", "predicted", *extra]
        rows = [[e.name, _classes_string(e.label), _classes_string(o.argmax(-1)), *_shown(b, data.task, classes)]
                for e, o, b in zip(examples, outputs, theirs)]  # fmt: skip
    else:
        header = ["name", "label", "predicted", *[f"p_{c}" for c in classes], *extra]
        rows = [
            [e.name, classes[int(e.label)], classes[int(o.argmax())], *[f"{p:.6g}" for p in o],
             *_shown(b, data.task, classes)]
            for e, o, b in zip(examples, outputs, theirs)
        ]  # fmt: skip
    lines = ["\t".join(header)] + ["\t".join(str(v) for v in row) for row in rows]
    atomic_write(path, "\n".join(lines) + "\n")


def _shown(output, task: str, classes: list[str]) -> list[str]:
    """The baseline's column of one example: nothing without a baseline, else its value or predicted class(es)."""
    if output is None:
        return []
    if task == "regression":
        return [f"{float(output):.6g}"]
    if task == "per_base":
        return [_classes_string(np.asarray(output).argmax(-1))]
    return [classes[int(np.asarray(output).argmax())]]


def _classes_string(labels) -> str:
    """Per-base class indices as one string of digits (IGNORE as '.'); classes past 9 as letters."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    return "".join("." if v == IGNORE else digits[int(v)] for v in np.asarray(labels))
