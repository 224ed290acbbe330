"""The layer and pooling a task head reads, chosen on validation when --model.layer / --model.pooling are left unset
(layer L4): linear probes of the backbone, fitted before fine-tuning starts.

For each candidate (layer, pooling) the backbone's features of the training examples (up to MAX_EXAMPLES, a seeded
sample, fewer where one split's features of every candidate would pass FEATURE_BYTES) are standardised and fitted
with scikit-learn's logistic regression (ridge for regression), C = 1, and the probe is scored on as many validation
examples by the run's metric with task_eval.score, as the model and the k-mer baseline are. Fine-tuning trains the
head on the best candidate; a tie keeps the earlier one in the order below, so the final norm and mean pooling (a
run's choice when it sets neither) win ties.

    layers     -1 (the final norm, what the LM head reads), then up to MAX_BLOCKS blocks evenly spaced, the deepest
               first (every block of a model with at most MAX_BLOCKS); --model.layer set: that layer alone
    poolings   mean, last, centre for sequence tasks; --model.pooling set: that one alone. Per-base tasks read every
               position: their probe is fitted on up to MAX_POSITIONS labelled bases of the training examples and
               scored on as many of the validation examples', each base one example

Each rank computes the features of its share of the examples through the engine (under ZeRO-3 a forward is a
collective), the features are gathered, and rank 0 fits the probes and broadcasts its choice, so every rank trains
the same head. A probe measures what a layer holds linearly before training, not what fine-tuning will make of it:
benchmarks/results/finetune_recipes.md measures the chosen head input against the fixed final norm and mean.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import torch

from megagenome.data.task_batches import IGNORE, eval_batches
from megagenome.engine import engine as ds
from megagenome.model.heads import FINAL_NORM, pool
from megagenome.observe.task_metrics import HIGHER_IS_BETTER
from megagenome.run.task_baseline import predicted
from megagenome.run.task_eval import score

MAX_EXAMPLES = 2000  # training (and validation) examples the probes see: a seeded sample beyond this
MAX_POSITIONS = 50_000  # per-base tasks: labelled bases per split
FEATURE_BYTES = 512 << 20  # the features of one split, all pairs: fewer examples (or bases) for a wide model
MAX_BLOCKS = 4  # block outputs tried besides the final norm
POOLINGS = ("mean", "last", "centre")


def candidates(n_layer: int, task: str, layer: int | None, pooling: str | None) -> list[tuple[int, str]]:
    """The (layer, pooling) pairs the probes try, in tie-breaking order (module docstring)."""
    if layer is not None:
        layers = [layer]
    elif n_layer <= MAX_BLOCKS:
        layers = [FINAL_NORM, *range(n_layer, 0, -1)]
    else:
        layers = [FINAL_NORM, *sorted({round(n_layer * (i + 1) / MAX_BLOCKS) for i in range(MAX_BLOCKS)}, reverse=True)]
    poolings = [pooling] if pooling is not None else (["mean"] if task == "per_base" else list(POOLINGS))
    return [(n, how) for n in layers for how in poolings]


def choose(module, data, metric: str, pairs: list[tuple[int, str]], micro: int, rank: int, world: int, to_device):
    """{"layer", "pooling", "metric", "by_choice" ({"layer L, P": validation value})}: the best pair of `pairs` by
    the probes (every rank gets rank 0's choice). A single pair, or no validation examples, is taken as it is."""
    if len(pairs) == 1 or not data.splits["validation"]:
        layer, pooling = pairs[0]
        why = "set" if len(pairs) == 1 else "no validation split: the first candidate"
        return {"layer": layer, "pooling": pooling, "metric": None, "by_choice": {}, "why": why}
    per_row = 4 * module.head.linear.in_features * len(pairs)  # float32 bytes of one example's (or base's) features
    rows = max(1, FEATURE_BYTES // per_row)
    limit = min(rows, MAX_EXAMPLES if data.task != "per_base" else MAX_POSITIONS)
    sets = {split: _sample(data.splits[split], split, limit) for split in ("train", "validation")}
    features = {split: _features(module, data.task, examples, pairs, limit, micro, rank, world, to_device)
                for split, examples in sets.items()}  # fmt: skip
    choice = _fit(data, metric, pairs, features) if rank == 0 else None
    return ds.broadcast_object(choice) if world > 1 else choice


def label(layer: int, pooling: str, task: str) -> str:
    """How a pair reads in the summary and in by_choice."""
    where = "final norm" if layer == FINAL_NORM else f"block {layer}"
    return where if task == "per_base" else f"{where}, {pooling}"


def _sample(examples: list, split: str, limit: int) -> list:
    """At most `limit` of the examples (MAX_EXAMPLES or fewer), a seeded sample in order."""
    limit = min(limit, MAX_EXAMPLES)
    if len(examples) <= limit:
        return list(examples)
    keep = np.sort(np.random.default_rng([0, split == "train"]).choice(len(examples), limit, replace=False))
    return [examples[i] for i in keep]


def _features(module, task: str, examples: list, pairs, limit, micro: int, rank: int, world: int, to_device) -> dict:
    """{"pairs": {pair: (N, d) float32}, "labels": (N,)} of the examples (per-base: of about `limit` of their
    labelled bases), every rank's share gathered in example order."""
    layers = sorted({n for n, _ in pairs})
    per_example = max(1, limit // max(1, len(examples)))
    mine = []
    was_training = module.training
    module.eval()
    with torch.no_grad():
        for index, batch in eval_batches(examples, task, micro, rank, world):
            batch = to_device(batch)
            states = module.backbone.layer_states(batch["input_ids"], layers)
            lengths = batch["lengths"]
            for row, i in enumerate(index):
                if task == "per_base":
                    positions = _positions(batch["labels"][row].cpu().numpy(), per_example, i)
                    got = {pair: states[pair[0]][row, positions].float().cpu().numpy() for pair in pairs}
                    labels = batch["labels"][row, positions].cpu().numpy()
                else:
                    got = {pair: pool(states[pair[0]][row : row + 1].float(), lengths[row : row + 1], pair[1])[0]
                           .cpu().numpy() for pair in pairs}  # fmt: skip
                    labels = np.array([examples[i].label])
                mine.append((i, got, labels))
    module.train(was_training)
    ordered = sorted((item for part in ds.all_gather_object(mine) for item in part), key=lambda item: item[0])
    stacked = {pair: np.concatenate([np.atleast_2d(got[pair]) for _, got, _ in ordered]) for pair in pairs}
    return {"pairs": stacked, "labels": np.concatenate([labels for _, _, labels in ordered])}


def _positions(labels: np.ndarray, count: int, seed: int) -> np.ndarray:
    """Up to `count` labelled positions of one example, a seeded sample, in order."""
    labelled = np.flatnonzero(labels != IGNORE)
    if len(labelled) <= count:
        return labelled
    return np.sort(np.random.default_rng([1, seed]).choice(labelled, count, replace=False))


def _fit(data, metric: str, pairs, features: dict) -> dict:
    """Rank 0: each pair's probe fitted on the training features and scored on validation; the best pair."""
    from sklearn.linear_model import LogisticRegression, Ridge
    from sklearn.preprocessing import StandardScaler

    regression = data.task == "regression"
    train, validation = features["train"], features["validation"]
    y = train["labels"].astype(np.float64 if regression else np.int64)
    examples = [SimpleNamespace(label=v) for v in validation["labels"].tolist()]
    scored_as = "regression" if regression else "classification"  # per-base: each base one example
    std = float(np.std(y)) if regression and np.std(y) > 0 else 1.0
    scored = {}
    for pair in pairs:
        scaler = StandardScaler().fit(train["pairs"][pair])
        with warnings.catch_warnings():  # lbfgs's "failed to converge": the probe is a guide
            warnings.simplefilter("ignore")
            probe = Ridge(alpha=1.0) if regression else LogisticRegression(C=1.0, max_iter=1000)
            probe.fit(scaler.transform(train["pairs"][pair]), y)
        outputs = predicted(probe, scaler.transform(validation["pairs"][pair]), regression, len(data.classes))
        scored[pair] = score(scored_as, examples, outputs, std)
    if all(s[metric] is None for s in scored.values()):
        metric = "loss"  # undefined on this validation split for every pair
    sign = 1 if HIGHER_IS_BETTER[metric] else -1
    best = max(pairs, key=lambda pair: -np.inf if scored[pair][metric] is None else sign * scored[pair][metric])
    by_choice = {label(*pair, data.task): scored[pair][metric] for pair in pairs}
    return {"layer": best[0], "pooling": best[1], "metric": metric, "by_choice": by_choice, "why": "probes"}
