"""Tier 1: the k-mer baseline of fine-tuning tasks (run/task_baseline.py): composition features against hand counts;
on tasks whose answer is in the k-mers it finds it and validation picks the k that holds it; its metrics are the
model's (run/task_eval.py score) on the same splits; the per-base context model reads the centred bases."""

import numpy as np
import pytest

from megagenome.data.labelled import Example
from megagenome.observe.task_metrics import task_metrics
from megagenome.run import task_baseline
from megagenome.run.task_data import TaskData


def test_composition_counts_the_kmers_of_bases_only():
    f = task_baseline.composition(["ACGTA", "ANNA", "AC"], 2)
    # ACGTA: AC CG GT TA, a quarter each; ANNA: no 2-mer of bases (a row of zeros); AC: AC alone.
    ac, cg, gt, ta = 0 * 4 + 1, 1 * 4 + 2, 2 * 4 + 3, 3 * 4 + 0
    expected = np.zeros((3, 16))
    expected[0, [ac, cg, gt, ta]] = 0.25
    expected[2, ac] = 1.0
    assert np.array_equal(f, expected)
    assert task_baseline.composition(["A"], 3).sum() == 0  # shorter than k


def _random(rng, n: int, gc: float) -> str:
    p = [(1 - gc) / 2, gc / 2, gc / 2, (1 - gc) / 2]
    return "".join(rng.choice(list("ACGT"), size=n, p=p))


def _dinucleotide_task(seed: int = 0) -> TaskData:
    """Class 1 windows are made of CG/GC pairs and AT/TA pairs, class 0 of CC/GG/AA/TT pairs: both 50% GC, so
    base counts say little (class 1 has exactly as many C as G, class 0 about as many) and 2-mers everything."""
    rng = np.random.default_rng(seed)
    pairs = {0: ["CC", "GG", "AA", "TT"], 1: ["CG", "GC", "AT", "TA"]}

    def example(i: int, label: int) -> Example:
        return Example("".join(rng.choice(pairs[label], size=100)), label, f"w{i}")

    splits = {s: [example(i, i % 2) for i in range(n)] for s, n in (("train", 80), ("validation", 40), ("test", 40))}
    return TaskData("classification", ("plain", "alternating"), splits, "synthetic")


def test_validation_picks_the_k_that_holds_the_answer():
    data = _dinucleotide_task()
    fit = task_baseline.fit(data, "mcc")
    assert not fit["choice"].startswith("k=1,") and fit["by_choice"][fit["choice"]] == 1.0, fit["by_choice"]
    assert max(v for c, v in fit["by_choice"].items() if c.startswith("k=1,")) < 0.8  # base counts: far from it
    assert fit["test"]["mcc"] == 1.0 and fit["test"]["n"] == 40
    # The same metrics and loss as the model's, from the outputs the predictions file shows.
    labels = np.array([e.label for e in data.splits["test"]])
    probs = np.stack(fit["outputs"]["test"])
    assert probs.shape == (40, 2) and np.allclose(probs.sum(axis=1), 1)
    assert {k: fit["test"][k] for k in ("accuracy", "mcc", "auroc", "n")} == task_metrics(
        "classification", labels, probs
    )
    assert fit["test"]["loss"] == pytest.approx(-np.log(probs[np.arange(40), labels]).mean())
    assert fit["name"] == "k-mer composition, logistic regression" and "outputs" in fit


def test_regression_on_gc_content():
    rng = np.random.default_rng(1)

    def example(i):
        gc = rng.uniform(0.2, 0.8)
        return Example(_random(rng, 300, gc), gc, f"r{i}")

    splits = {s: [example(i) for i in range(n)] for s, n in (("train", 120), ("validation", 40), ("test", 40))}
    fit = task_baseline.fit(TaskData("regression", (), splits, "synthetic"), "spearman")
    assert fit["name"] == "k-mer composition, ridge regression"
    assert fit["test"]["spearman"] > 0.9, fit["test"]


def test_per_base_context_reads_the_centred_bases():
    """A base is labelled 1 when its right neighbour is G: invisible to the base alone (k=1), read by k=3."""
    rng = np.random.default_rng(2)

    def example(i):
        s = _random(rng, 200, 0.5)
        label = np.array([1 if j + 1 < len(s) and s[j + 1] == "G" else 0 for j in range(len(s))], dtype=np.int64)
        return Example(s, label, f"p{i}")

    splits = {s: [example(i) for i in range(n)] for s, n in (("train", 30), ("validation", 10), ("test", 10))}
    fit = task_baseline.fit(TaskData("per_base", ("other", "before G"), splits, "synthetic"), "mcc")
    assert fit["by_choice"]["k=1"] < 0.1 and fit["by_choice"]["k=3"] > 0.99, fit["by_choice"]
    assert fit["choice"] in ("k=3", "k=5", "k=7") and fit["test"]["mcc"] > 0.99
    assert fit["outputs"]["test"][0].shape == (200, 2)


def test_compared_says_which_side_is_better():
    assert task_baseline.compared(0.62, 0.57, "mcc") == "0.0500 above it (better)"
    assert task_baseline.compared(0.50, 0.57, "mcc") == "0.0700 below it (not better)"
    assert task_baseline.compared(0.40, 0.50, "loss") == "0.1000 below it (better)"
    assert task_baseline.compared(None, 0.5, "auroc").startswith("not comparable")
