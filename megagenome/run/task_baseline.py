"""The k-mer baseline of a fine-tuning task (layer L4): what counting bases alone reaches on the same splits.

A fine-tuned model's test MCC means little without it: on species and promoter tasks, k-mer composition often
separates the classes by itself. The baseline is fitted on the training split, chosen on the validation split by
the run's own metric (--train.metric), and scored on the validation and test splits with the same metrics and loss
as the model (run/task_eval.py score), so its figures sit beside the model's in summary.json, the console summary,
the predictions files and `megagenome report`.

    classification  k-mer composition: each sequence's frequencies of its k-mers (those of A/C/G/T only, each row
                    summing to 1), standardised on the training split, into scikit-learn's multinomial logistic
                    regression; k = 1..6 and the inverse regularisation C in C_GRID chosen on validation
    regression      the same features into ridge regression (alpha = 1 / C over the same grid)
    per_base        a position-wise k-mer context model: the class of a base from the k = 2h + 1 bases centred on
                    it, h = 0..3: the counts of (context, class) over the training bases, smoothed by 1/2 per class
                    (Krichevsky-Trofimov); a context holding N, or running past the sequence, falls back to the
                    class frequencies

The composition models are fitted on at most MAX_TRAIN training examples (a seeded sample beyond that; the
validation and test splits are always scored whole), 18 fits of up to 4^6 features: seconds on thousands of
examples, about a minute at the cap. If none of the choices has a defined validation metric (an AUROC with a class
missing), the validation loss chooses, and "metric" says so.
"""

from __future__ import annotations

import warnings

import numpy as np

from megagenome.data.tokenizer import A_ID, C_ID, G_ID, T_ID, VOCAB_SIZE, encode
from megagenome.observe.task_metrics import HIGHER_IS_BETTER
from megagenome.run.task_data import TaskData, target_scale
from megagenome.run.task_eval import score

KS = range(1, 7)  # composition k-mers; 4^6 = 4096 features
HALF_WIDTHS = range(4)  # per-base contexts of 1, 3, 5 and 7 bases
C_GRID = (0.01, 0.1, 1.0)
MAX_TRAIN = 10_000  # composition fits: a seeded sample of the training examples beyond this
_BASE4 = np.full(VOCAB_SIZE, -1, dtype=np.int64)
_BASE4[[A_ID, C_ID, G_ID, T_ID]] = [0, 1, 2, 3]
SPLITS = ("validation", "test")


def _bases(sequence: str) -> np.ndarray:
    """0..3 for A/C/G/T, -1 for anything else (N)."""
    return _BASE4[encode(sequence)[0]]


def composition(sequences: list[str], k: int) -> np.ndarray:
    """(N, 4^k) frequencies of each sequence's k-mers of A/C/G/T only (a row of zeros when it has none)."""
    out = np.zeros((len(sequences), 4**k), dtype=np.float64)
    for row, sequence in enumerate(sequences):
        x = _bases(sequence)
        if x.size < k:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(x, k)  # (L - k + 1, k)
        valid = (windows >= 0).all(axis=1)
        codes = windows[valid] @ (4 ** np.arange(k - 1, -1, -1))
        counts = np.bincount(codes, minlength=4**k)
        out[row] = counts / max(1, counts.sum())
    return out


def fit(data: TaskData, metric: str) -> dict:
    """The baseline of `data`: {"name", "choice" (what validation chose), "by_choice" ({choice: validation metric}),
    "metric", "validation" and "test" (metrics, as the model's), "outputs" ({split: outputs per example})}."""
    if data.task == "per_base":
        candidates = {f"k={2 * h + 1}": _per_base(data, h) for h in HALF_WIDTHS}
        name = "position-wise k-mer context model (counts)"
    else:
        candidates = _composition_fits(data)
        name = "k-mer composition, " + ("ridge regression" if data.task == "regression" else "logistic regression")
    std = target_scale(data)[1] if data.task == "regression" else 1.0
    std = std if std > 0 else 1.0  # as the model's head takes it (model/heads.py set_target_scale)
    scored = {
        choice: {split: score(data.task, data.splits[split], outputs[split], std) for split in SPLITS if
                 data.splits[split]}
        for choice, outputs in candidates.items()
    }  # fmt: skip
    if all(s["validation"][metric] is None for s in scored.values()):
        metric = "loss"  # the run's metric is undefined on this validation split for every choice
    sign = 1 if HIGHER_IS_BETTER[metric] else -1
    by_choice = {choice: s["validation"][metric] for choice, s in scored.items()}
    best = max(by_choice, key=lambda c: -np.inf if by_choice[c] is None else sign * by_choice[c])
    return {
        "name": name,
        "choice": best,
        "metric": metric,
        "by_choice": by_choice,
        **scored[best],
        "outputs": candidates[best],
    }


def _composition_fits(data: TaskData) -> dict[str, dict[str, list]]:
    """{"k=K, C=c": {split: outputs}} of every (k, C) pair: logistic or ridge regression on composition."""
    from sklearn.linear_model import LogisticRegression, Ridge
    from sklearn.preprocessing import StandardScaler

    regression = data.task == "regression"
    train = data.splits["train"]
    if len(train) > MAX_TRAIN:
        keep = np.sort(np.random.default_rng(0).choice(len(train), MAX_TRAIN, replace=False))
        train = [train[i] for i in keep]
    y = np.array([float(e.label) if regression else int(e.label) for e in train])
    out = {}
    for k in KS:
        features = {s: composition([e.sequence for e in (train if s == "train" else data.splits[s])], k)
                    for s in ("train", *SPLITS)}  # fmt: skip
        scaler = StandardScaler().fit(features["train"])
        scaled = {s: scaler.transform(f) if len(f) else f for s, f in features.items()}
        for c in C_GRID:
            with warnings.catch_warnings():  # lbfgs's "failed to converge" at the weakest regularisation
                warnings.simplefilter("ignore")
                model = (Ridge(alpha=1.0 / c) if regression else LogisticRegression(C=c, max_iter=2000)).fit(
                    scaled["train"], y
                )
            out[f"k={k}, C={c:g}"] = {s: predicted(model, scaled[s], regression, len(data.classes)) for s in SPLITS}
    return out


def predicted(model, features: np.ndarray, regression: bool, classes: int) -> list:
    """Per-example outputs as the model gives them: a value, or the probability of every class (a class absent from
    the training split gets 0)."""
    if not len(features):
        return []
    if regression:
        return [float(v) for v in model.predict(features)]
    probs = np.zeros((len(features), classes))
    probs[:, model.classes_] = model.predict_proba(features)
    return list(probs)


def _per_base(data: TaskData, h: int) -> dict[str, list]:
    """{split: (T, C) probabilities per example} of the context model of half-width h (module docstring)."""
    classes, k = len(data.classes), 2 * h + 1
    counts = np.zeros((4**k, classes))
    prior = np.zeros(classes)
    for e in data.splits["train"]:
        codes, labels = _contexts(e.sequence, h), np.asarray(e.label)
        labelled = (labels >= 0) & (labels < classes)
        prior += np.bincount(labels[labelled], minlength=classes)
        keep = labelled & (codes >= 0)
        np.add.at(counts, (codes[keep], labels[keep]), 1)
    table = (counts + 0.5) / (counts + 0.5).sum(axis=1, keepdims=True)  # (contexts, C)
    fallback = (prior + 0.5) / (prior + 0.5).sum()
    out = {}
    for split in SPLITS:
        out[split] = []
        for e in data.splits[split]:
            codes = _contexts(e.sequence, h)
            out[split].append(np.where((codes >= 0)[:, None], table[np.maximum(codes, 0)], fallback))
    return out


def _contexts(sequence: str, h: int) -> np.ndarray:
    """The code of the 2h + 1 bases centred on each position, -1 where one is not A/C/G/T or lies outside."""
    x = _bases(sequence)
    padded = np.concatenate([np.full(h, -1), x, np.full(h, -1)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * h + 1)  # (L, 2h + 1)
    codes = np.where(windows >= 0, windows, 0) @ (4 ** np.arange(2 * h, -1, -1))
    return np.where((windows >= 0).all(axis=1), codes, -1)


def compared(model_value: float | None, baseline_value: float | None, metric: str) -> str:
    """ "0.0500 above it" style: how far the model is from the baseline on `metric`, and which side is better."""
    if model_value is None or baseline_value is None:
        return "not comparable (undefined on this split)"
    gap = model_value - baseline_value
    better = gap > 0 if HIGHER_IS_BETTER[metric] else gap < 0
    side = "above" if gap > 0 else "below" if gap < 0 else "level with"
    return f"{abs(gap):.4f} {side} it ({'better' if better else 'not better'})" if gap else "level with it"
