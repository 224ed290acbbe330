"""The metrics of a labelled task (observe/task_metrics.py) against values worked out here from their definitions on
tiny arrays: MCC from the confusion matrix, AUROC by counting pairs, Spearman from ranks; None where a metric is
undefined, IGNORE positions left out, and every value a plain JSON-serialisable Python number."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from megagenome.data import labelled
from megagenome.observe import task_metrics as tm


def mcc_by_hand(labels, predicted, classes: int) -> float:
    """Gorodkin's multiclass MCC from the confusion matrix (the binary formula when classes == 2)."""
    confusion = np.zeros((classes, classes))
    for t, p in zip(labels, predicted):
        confusion[t, p] += 1
    s, c = confusion.sum(), np.trace(confusion)
    truth, guessed = confusion.sum(axis=1), confusion.sum(axis=0)
    return (c * s - truth @ guessed) / math.sqrt((s**2 - guessed @ guessed) * (s**2 - truth @ truth))


def auroc_by_hand(positive, scores) -> float:
    """The probability that a positive outscores a negative, ties counted half, over every pair."""
    pos = [s for s, p in zip(scores, positive) if p]
    neg = [s for s, p in zip(scores, positive) if not p]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def ranks(values) -> list[float]:
    """1-based ranks, ties given the mean of the ranks they span."""
    order = sorted(values)
    return [sum(i + 1 for i, v in enumerate(order) if v == x) / order.count(x) for x in values]


def pearson_by_hand(x, y) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))


def assert_plain(metrics: dict) -> None:
    """Only Python ints, floats and None (np.float64 is a float subclass: the type is checked exactly)."""
    json.dumps(metrics, allow_nan=False)
    for key, value in metrics.items():
        assert type(value) in (int, float, type(None)), (key, type(value))
        assert value is None or math.isfinite(value)


BINARY_LABELS = np.array([0, 0, 1, 1, 1, 0, 1, 0])
BINARY_P1 = np.array([0.1, 0.6, 0.8, 0.4, 0.9, 0.6, 0.6, 0.2])  # ties at 0.6 across the classes


def test_binary_classification():
    probs = np.stack([1 - BINARY_P1, BINARY_P1], axis=1)
    m = tm.classification_metrics(BINARY_LABELS, probs)
    predicted = (BINARY_P1 > 0.5).astype(int)  # [0, 1, 1, 0, 1, 1, 1, 0]: TP 3, TN 2, FP 2, FN 1
    assert m["accuracy"] == pytest.approx(5 / 8)
    assert m["mcc"] == pytest.approx((3 * 2 - 2 * 1) / math.sqrt(5 * 4 * 4 * 3))
    assert m["mcc"] == pytest.approx(mcc_by_hand(BINARY_LABELS, predicted, 2))
    assert m["auroc"] == pytest.approx(auroc_by_hand(BINARY_LABELS == 1, BINARY_P1))
    assert m["auroc"] == pytest.approx(13 / 16)
    assert m["n"] == 8
    assert_plain(m)


def test_multiclass_classification():
    labels = np.array([0, 1, 2, 2, 1, 0, 2, 1])
    probs = np.array(
        [
            [0.7, 0.2, 0.1],
            [0.3, 0.4, 0.3],
            [0.2, 0.2, 0.6],
            [0.5, 0.1, 0.4],
            [0.1, 0.8, 0.1],
            [0.3, 0.3, 0.4],
            [0.1, 0.1, 0.8],
            [0.6, 0.3, 0.1],
        ]
    )
    m = tm.classification_metrics(labels, probs)
    predicted = probs.argmax(axis=1)
    assert m["accuracy"] == pytest.approx(np.mean(predicted == labels)) and m["accuracy"] == pytest.approx(5 / 8)
    assert m["mcc"] == pytest.approx(mcc_by_hand(labels, predicted, 3))
    one_vs_rest = [auroc_by_hand(labels == k, probs[:, k]) for k in range(3)]
    assert m["auroc"] == pytest.approx(sum(one_vs_rest) / 3)
    assert_plain(m)


def test_classification_undefined_and_wrong_inputs():
    m = tm.classification_metrics(np.array([1, 1, 1]), np.array([[0.2, 0.8], [0.6, 0.4], [0.1, 0.9]]))
    assert m["auroc"] is None and m["accuracy"] == pytest.approx(2 / 3)
    three = tm.classification_metrics(np.array([0, 1, 0]), np.full((3, 3), 1 / 3))
    assert three["auroc"] is None  # class 2 has no example
    assert tm.classification_metrics(np.zeros(0, dtype=int), np.zeros((0, 2))) == {
        "accuracy": None,
        "mcc": None,
        "auroc": None,
        "n": 0,
    }
    with pytest.raises(ValueError, match="row 1 sums to 1.5"):
        tm.classification_metrics(np.array([0, 1]), np.array([[0.5, 0.5], [0.7, 0.8]]))
    with pytest.raises(ValueError, match=r"labels 0..2 outside \[0, 2\)"):
        tm.classification_metrics(np.array([0, 2]), np.array([[0.5, 0.5], [0.2, 0.8]]))
    with pytest.raises(ValueError, match="unknown task 'ranking'"):
        tm.task_metrics("ranking", [0], [[1.0, 0.0]])


def test_regression():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0]
    predictions = [2.5, 0.5, 2.0, 1.5, 6.0, 8.0]
    m = tm.regression_metrics(np.array(values), np.array(predictions))
    assert m["spearman"] == pytest.approx(pearson_by_hand(ranks(values), ranks(predictions)))
    assert m["pearson"] == pytest.approx(pearson_by_hand(values, predictions))
    assert m["mse"] == pytest.approx(sum((v - p) ** 2 for v, p in zip(values, predictions)) / 6)
    assert m["n"] == 6
    assert_plain(m)
    constant = tm.regression_metrics(np.array([1.0, 2.0, 3.0]), np.array([2.0, 2.0, 2.0]))
    assert constant == {"spearman": None, "pearson": None, "mse": pytest.approx(2 / 3), "n": 3}
    assert_plain(constant)
    assert tm.regression_metrics(np.array([1.0]), np.array([3.0]))["spearman"] is None
    assert tm.regression_metrics(np.zeros(0), np.zeros(0))["mse"] is None
    with pytest.raises(ValueError, match="NaN"):
        tm.regression_metrics(np.array([1.0, math.nan]), np.array([1.0, 2.0]))


def test_per_base_skips_ignore():
    assert tm.IGNORE == labelled.IGNORE == -100
    labels = np.array([[0, 1, tm.IGNORE], [1, tm.IGNORE, tm.IGNORE]])
    p1 = np.array([[0.2, 0.7, 0.9], [0.4, 0.99, 0.01]])  # the IGNORE positions would change every metric
    probs = np.stack([1 - p1, p1], axis=-1)  # (2, 3, 2)
    m = tm.per_base_metrics(labels, probs)
    assert m["n"] == 3 and m["accuracy"] == pytest.approx(2 / 3)
    assert m["auroc"] == pytest.approx(auroc_by_hand([False, True, True], [0.2, 0.7, 0.4]))
    flat = tm.classification_metrics(np.array([0, 1, 1]), np.array([[0.8, 0.2], [0.3, 0.7], [0.6, 0.4]]))
    assert m == pytest.approx(flat)
    assert tm.task_metrics("per_base", labels, probs) == m
    assert_plain(m)
    with pytest.raises(ValueError, match=r"labels \(N, T\) and probs \(N, T, C\)"):
        tm.per_base_metrics(labels, probs[:, :2])


def test_dispatch_and_directions():
    probs = np.stack([1 - BINARY_P1, BINARY_P1], axis=1)
    assert tm.task_metrics("classification", BINARY_LABELS, probs) == tm.classification_metrics(BINARY_LABELS, probs)
    assert tm.task_metrics("regression", [1.0, 2.0, 3.0], [1.0, 3.0, 2.0])["spearman"] == pytest.approx(0.5)
    assert {k for k, up in tm.HIGHER_IS_BETTER.items() if up} == {"accuracy", "mcc", "auroc", "spearman", "pearson"}
    assert {k for k, up in tm.HIGHER_IS_BETTER.items() if not up} == {"mse", "loss"}
