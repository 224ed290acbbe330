"""The labelled data of a fine-tuning run (layer L4): read, split, cropped and checked against the model before any
process group starts (data/labelled.py reads the formats).

    read_task_data(cfg, context)   the train / validation / test examples of --data.*, the class names, and every
                                   problem at once (ConfigError): unreadable files, sequences longer than the
                                   model's context (unless --data.max_len crops them), an empty split
    target_scale(data)             the regression target's training-set mean and standard deviation
    fingerprint(data)              sizes and a digest of the examples, recorded in task.json and every checkpoint, so
                                   a resume on other data is refused
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np

from megagenome.config import ConfigError
from megagenome.config.finetune import FinetuneConfig
from megagenome.data import labelled

SPLITS = ("train", "validation", "test")


@dataclass
class TaskData:
    """The examples of each split (SPLITS; test may be empty) and the class names (() for regression)."""

    task: str
    classes: tuple[str, ...]
    splits: dict[str, list]
    source: str


def read_task_data(cfg: FinetuneConfig, context: int) -> TaskData:
    """The labelled examples of cfg.data (module docstring); ConfigError listing every problem."""
    d = cfg.data
    try:
        data = _read(cfg)
    except (OSError, ValueError) as e:
        raise ConfigError([f"--data: {e}"]) from e
    if "validation" not in data.splits or not data.splits["validation"]:
        n = len(data.splits.get("train", []))
        if n < 2 and d.validation_fraction > 0:
            raise ConfigError([
                f"--data: the training set has {n} example(s) ({data.source}); holding out a validation split "
                "(--data.validation_fraction) needs at least 2, and fine-tuning needs far more: give more "
                "training examples, or a validation set of its own (--data.validation_bed)"
            ])  # fmt: skip
        train, validation = labelled.split_validation(data.splits["train"], d.validation_fraction, d.seed, d.task)
        data.splits["train"], data.splits["validation"] = train, validation
    data.splits.setdefault("test", [])
    if d.max_len is not None:
        data.splits = {k: [crop(e, d.max_len) for e in v] for k, v in data.splits.items()}
    problems = [f"--data: the {split} set is empty ({data.source})" for split in SPLITS[:2] if not data.splits[split]]
    for split in SPLITS:
        longest = max(data.splits[split], key=lambda e: len(e.sequence), default=None)
        if longest is not None and len(longest.sequence) > context:
            problems.append(
                f"--data: {split} sequence {longest.name} has {len(longest.sequence)} bases, more than the model's "
                f"context {context} (--model.max_seq_len of --model.pretrained); crop with --data.max_len"
            )
    if d.task != "regression" and len(data.classes) < 2:
        problems.append(f"--data: {data.source} has {len(data.classes)} class(es); a classifier needs at least 2")
    if problems:
        raise ConfigError(problems)
    return data


def _read(cfg: FinetuneConfig) -> TaskData:
    d = cfg.data
    if d.benchmark:
        read = labelled.read_genomic_benchmarks(d.benchmark)
        return TaskData(d.task, tuple(read.classes), dict(read.splits), d.benchmark)
    files = {"train": d.train_bed, "validation": d.validation_bed, "test": d.test_bed}
    splits, classes = {}, None
    for split, bed in files.items():
        if not bed:
            continue
        if d.task == "per_base":
            examples, names = labelled.read_per_base_task(d.fasta, bed, d.annotation_bed)
        else:
            examples, names = labelled.read_bed_task(d.fasta, bed, d.label_column, d.task)
        if classes is None:
            classes = tuple(names)  # the training set's (read first)
        splits[split] = _reindex(examples, tuple(names), classes, bed, d.task)
    return TaskData(d.task, classes or (), splits, d.train_bed)


def _reindex(examples: list, names: tuple[str, ...], classes: tuple[str, ...], bed: str, task: str) -> list:
    """A split's examples with their class indices (of the split's own sorted names) mapped to the training set's
    classes; a class the training set lacks is refused."""
    if task == "regression" or names == classes:
        return examples
    missing = sorted(set(names) - set(classes))
    if missing:
        raise ValueError(f"{bed}: classes {missing} do not occur in the training set ({', '.join(classes)})")
    index = np.array([classes.index(n) for n in names], dtype=np.int64)
    if task == "per_base":
        return [
            dataclasses.replace(e, label=np.where(e.label >= 0, index[np.maximum(e.label, 0)], e.label))
            for e in examples
        ]
    return [dataclasses.replace(e, label=int(index[e.label])) for e in examples]


def crop(example, max_len: int):
    """`example` cut to its central max_len bases (per-base labels with it); shorter ones unchanged."""
    n = len(example.sequence)
    if n <= max_len:
        return example
    start = (n - max_len) // 2
    label = example.label
    if isinstance(label, np.ndarray):
        label = label[start : start + max_len]
    return dataclasses.replace(example, sequence=example.sequence[start : start + max_len], label=label)


def target_scale(data: TaskData) -> tuple[float, float]:
    """(mean, standard deviation) of the training labels of a regression task; (0, 1) otherwise."""
    if data.task != "regression":
        return 0.0, 1.0
    values = np.array([float(e.label) for e in data.splits["train"]], dtype=np.float64)
    return float(values.mean()), float(values.std())


def fingerprint(data: TaskData) -> dict:
    """The examples' identity: sizes per split, the classes and a sha256 over every sequence and label."""
    digest = hashlib.sha256()
    for split in SPLITS:
        for e in data.splits[split]:
            label = e.label.tobytes() if isinstance(e.label, np.ndarray) else repr(e.label).encode()
            digest.update(f"{split}\0{e.name}\0{e.sequence}\0".encode() + label)
    sizes = {split: len(data.splits[split]) for split in SPLITS}
    return {"task": data.task, "classes": list(data.classes), "sizes": sizes, "sha256": digest.hexdigest()}
