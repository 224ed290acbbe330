"""The layouts of the field's published checkpoints (layer L1): how a published model maps into a megagenome family,
both ways.

A format (PublishedFormat, one per published layout, in the folder of the family it maps into, e.g.
model/gpn/published.py) answers from what its authors publish, their config as a dict and their state dict:

    model_config(config, tokenizer)  the family's ModelConfig, or ImportRefused naming the key and the reason (a
                                variant megagenome does not implement): checked before anything is written;
                                tokenizer: the checkpoint's {token: row} (read only where `tokenizer` is set: a
                                table the format does not fix, Llama's)
    to_ours(weights, cfg)       megagenome's dense state dict (the family's names; every tensor of theirs used,
                                every one of ours filled, or ImportRefused)
    to_theirs(state, cfg)       the way back: (their config dict, their state dict), what their code loads

The formats know no files: after_training/importing.py reads a checkpoint directory or file and writes an export
directory, after_training/export.py writes the way back (`megagenome export --format`). model/__init__.py holds the
registry (PUBLISHED, by --format name).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from megagenome.config import ModelConfig


class ImportRefused(ValueError):
    """A published checkpoint that does not map: `key` is its config key or weight name, `reason` why."""

    def __init__(self, key: str, reason: str):
        self.key, self.reason = key, reason
        super().__init__(f"{key}: {reason}")


class PublishedFormat(ABC):
    """One published layout (the module docstring)."""

    name: str  # --format
    family: str  # the --model.family it maps into
    title: str  # what it is, for --help and the docs
    oracle: str  # the authors' code that reads and writes it (the tests' oracle)
    tokenizer = False  # whether model_config needs the checkpoint's tokenizer (its table is not the format's own)
    weights_file = "model.safetensors"  # what `export --format` writes: safetensors, or torch.save for a .pt
    config_file = "config.json"  # ... and the config beside it: JSON, or YAML for a .yml

    @abstractmethod
    def model_config(self, config: dict, tokenizer: dict[str, int] | None = None) -> ModelConfig: ...

    @abstractmethod
    def to_ours(self, weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def to_theirs(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict, dict[str, torch.Tensor]]: ...


class Weights:
    """A checkpoint's tensors being mapped: take(name) hands one over (in float32) and marks it used, skip(name)
    marks one used without a place in the model (a buffer ours recomputes), leftover() refuses what was never used
    (a part of their model megagenome would silently drop)."""

    def __init__(self, weights: dict[str, torch.Tensor], ignore: tuple[str, ...] = ()):
        self.weights = {k: v for k, v in weights.items() if not k.endswith(ignore)} if ignore else dict(weights)
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    def take(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise ImportRefused(name, "missing from the checkpoint's weights")
        self.used.add(name)
        return self.weights[name].float()

    def skip(self, *names: str) -> None:
        self.used.update(n for n in names if n in self.weights)

    def leftover(self) -> None:
        left = sorted(set(self.weights) - self.used)
        if left:
            raise ImportRefused(left[0], f"a weight megagenome's model has no place for ({len(left)} such)")


def expect(config: dict, key: str, allowed, reason: str, default=None) -> None:
    """Refuse config[key] (default when absent) unless it is `allowed` (a value, or a tuple of values)."""
    value = config.get(key, default)
    options = allowed if isinstance(allowed, tuple) else (allowed,)
    if value not in options:
        raise ImportRefused(key, f"{value!r} is not supported ({reason})")


def require(config: dict, *keys: str) -> None:
    """Refuse a config without every one of `keys`."""
    for key in keys:
        if key not in config:
            raise ImportRefused(key, "missing from the checkpoint's config")


def take_all(weights: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """{our name: weights[their name]} (float32) for names = {our name: their name}; refuses a missing tensor or one
    left over (Weights)."""
    w = Weights(weights)
    out = {ours: w.take(theirs) for ours, theirs in names.items()}
    w.leftover()
    return out


def layers_by_index(config: dict, kinds: dict[str, str]) -> list[str]:
    """The operator of each of config["num_layers"] layers from index lists, kinds = {config key: operator} (e.g.
    Evo 2's hcs_layer_idxs -> SE); every layer in exactly one list, or ImportRefused naming the key."""
    n = int(config["num_layers"])
    out: list[str | None] = [None] * n
    for key, kind in kinds.items():
        for i in config.get(key) or []:
            if not 0 <= int(i) < n:
                raise ImportRefused(key, f"layer {i} is outside 0..{n - 1} (num_layers {n})")
            if out[int(i)] is not None:
                raise ImportRefused(key, f"layer {i} is also a {out[int(i)]} layer")
            out[int(i)] = kind
    missing = [i for i, k in enumerate(out) if k is None]
    if missing:
        raise ImportRefused("num_layers", f"layers {missing[:5]} are in none of {', '.join(kinds)}")
    return out  # type: ignore[return-value]
