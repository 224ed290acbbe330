"""The metrics of a labelled task (`megagenome finetune`): classification, regression and per-base classification.

Every value is a plain Python float or int, or None where the metric is undefined on the data (AUROC when a class
has no example, a correlation of a constant), never a numpy scalar or NaN: the dicts go straight into
metrics.jsonl and the run's records, and json.dumps writes NaN as a token that is not JSON.

Conventions: MCC is scikit-learn's matthews_corrcoef, which is 0.0 (not None) where its denominator is 0, such as
one predicted class; AUROC is binary on the positive class's probability for 2 classes and the macro average of
one-vs-rest AUROCs (each class's probability against the rest) for more. Per-base labels equal to IGNORE (-100, as
in data/labelled.py) are positions without a label (padding) and are left out. HIGHER_IS_BETTER says which way each
metric improves, for picking the best checkpoint.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.stats
import sklearn.metrics

HIGHER_IS_BETTER: dict[str, bool] = {
    "accuracy": True,
    "mcc": True,
    "auroc": True,
    "spearman": True,
    "pearson": True,
    "mse": False,
    "loss": False,
}
IGNORE = -100  # per-base label of positions without a label; data/labelled.py's IGNORE (observe/ imports no data/)
TASKS = ("classification", "regression", "per_base")
_ROW_SUM_TOLERANCE = 1e-3  # probabilities from float16/bfloat16 softmax sum to 1 only this closely


def _number(value: float) -> float | None:
    """A plain float, None for NaN or infinity."""
    value = float(value)
    return value if math.isfinite(value) else None


def _check_classification(labels: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(labels as int64 (N,), probs as float64 (N, C)), or ValueError for shapes, classes or rows that are wrong."""
    labels, probs = np.asarray(labels), np.asarray(probs, dtype=np.float64)
    if labels.ndim != 1 or probs.ndim != 2 or probs.shape[0] != labels.shape[0]:
        raise ValueError(f"classification metrics: labels (N,) and probs (N, C), got {labels.shape} and {probs.shape}")
    if probs.shape[1] < 2:
        raise ValueError(f"classification metrics: probs need at least 2 classes, got shape {probs.shape}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"classification metrics: labels must be class indices (integers), got {labels.dtype}")
    labels = labels.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= probs.shape[1]):
        raise ValueError(f"classification metrics: labels {labels.min()}..{labels.max()} outside [0, {probs.shape[1]})")
    if not np.isfinite(probs).all():
        raise ValueError("classification metrics: probs hold NaN or infinity")
    sums = probs.sum(axis=1)  # (N,)
    if probs.size and (probs.min() < 0 or np.abs(sums - 1).max() > _ROW_SUM_TOLERANCE):
        worst = int(np.argmax(np.abs(sums - 1)))
        raise ValueError(f"classification metrics: probs rows must be probabilities; row {worst} sums to {sums[worst]}")
    return labels, probs


def _auroc(labels: np.ndarray, probs: np.ndarray) -> float | None:
    """Binary AUROC on probs[:, 1] for 2 classes, macro one-vs-rest for more; None when a class has no example."""
    classes = probs.shape[1]
    if np.unique(labels).size < classes:
        return None
    if classes == 2:
        return _number(sklearn.metrics.roc_auc_score(labels, probs[:, 1]))
    # Macro one-vs-rest, class by class: what roc_auc_score(multi_class="ovr") computes, without its demand that rows
    # sum to 1 within 1e-5 (a bfloat16 softmax's do not), and without renormalising them, which would break ties.
    per_class = [sklearn.metrics.roc_auc_score(labels == k, probs[:, k]) for k in range(classes)]
    return _number(np.mean(per_class))


def classification_metrics(labels: np.ndarray, probs: np.ndarray) -> dict:
    """accuracy, mcc, auroc and n of labels (N,) int against class probabilities probs (N, C), rows summing to 1;
    with no examples every metric is None."""
    labels, probs = _check_classification(labels, probs)
    n = int(labels.size)
    if n == 0:
        return {"accuracy": None, "mcc": None, "auroc": None, "n": 0}
    predicted = probs.argmax(axis=1)  # (N,)
    return {
        "accuracy": _number(np.mean(predicted == labels)),
        "mcc": _number(sklearn.metrics.matthews_corrcoef(labels, predicted)),
        "auroc": _auroc(labels, probs),
        "n": n,
    }


def regression_metrics(values: np.ndarray, predictions: np.ndarray) -> dict:
    """spearman, pearson, mse and n of predictions (N,) against values (N,); a correlation is None with fewer than
    two examples or a constant input, mse None with none."""
    values = np.asarray(values, dtype=np.float64).ravel()
    predictions = np.asarray(predictions, dtype=np.float64).ravel()
    if values.shape != predictions.shape:
        raise ValueError(f"regression metrics: {values.size} values but {predictions.size} predictions")
    if not (np.isfinite(values).all() and np.isfinite(predictions).all()):
        raise ValueError("regression metrics: values or predictions hold NaN or infinity")
    n = int(values.size)
    defined = n >= 2 and np.ptp(values) > 0 and np.ptp(predictions) > 0
    return {
        "spearman": _number(scipy.stats.spearmanr(values, predictions).statistic) if defined else None,
        "pearson": _number(scipy.stats.pearsonr(values, predictions).statistic) if defined else None,
        "mse": _number(np.mean((values - predictions) ** 2)) if n else None,
        "n": n,
    }


def per_base_metrics(labels: np.ndarray, probs: np.ndarray) -> dict:
    """classification_metrics over every labelled base: labels (N, T) with IGNORE where a base has no label,
    probs (N, T, C)."""
    labels, probs = np.asarray(labels), np.asarray(probs)
    if labels.ndim != 2 or probs.ndim != 3 or probs.shape[:2] != labels.shape:
        raise ValueError(f"per-base metrics: labels (N, T) and probs (N, T, C), got {labels.shape} and {probs.shape}")
    keep = labels != IGNORE  # (N, T)
    return classification_metrics(labels[keep], probs[keep])


def task_metrics(task: str, labels, outputs) -> dict:
    """The metrics of `task`: classification (labels (N,), probs (N, C)), regression (values (N,), predictions
    (N,)) or per_base (labels (N, T), probs (N, T, C))."""
    if task == "classification":
        return classification_metrics(labels, outputs)
    if task == "regression":
        return regression_metrics(labels, outputs)
    if task == "per_base":
        return per_base_metrics(labels, outputs)
    raise ValueError(f"unknown task {task!r} (tasks: {', '.join(TASKS)})")
