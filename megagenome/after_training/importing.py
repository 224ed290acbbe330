"""`megagenome import` (layer L4): a published checkpoint -> a megagenome export directory, which every command reads.

    megagenome import SOURCE --format {gpn,...} --output DIR [--source_config FILE] [--dtype fp32|bf16]

SOURCE is what the model's authors publish: a Hugging Face directory (config.json beside model.safetensors, sharded
*.safetensors with their index, or pytorch_model.bin) or one weights file (.safetensors, .pt, .bin) with its config
given by --source_config (JSON or YAML). The format (model/published.py, PUBLISHED by name) maps the config into its
family's ModelConfig and the weights into the family's names; what does not map is refused before anything is
written, naming the key (and the file). DIR is then written as `megagenome export` writes one (export.py, the same
staging under a temporary name, the same manifest and Hugging Face files), its manifest's source naming what it was
imported from. eval, score-variants, embed, finetune, export and `pretrain --model.init_from DIR` read it as any
export; DIR/model.yaml holds the model section a run continuing from it needs (`--config run.yaml --config
DIR/model.yaml --model.init_from DIR`).

The way back is `megagenome export DIR --format NAME --output OUT` (export.py): the authors' layout, which their
code loads.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import sys

import torch

from megagenome.after_training.export import check_output, staged_export
from megagenome.config.checks import model_problems
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model import PUBLISHED, family_of, family_problems
from megagenome.model.published import ImportRefused
from megagenome.weights.load import DTYPES

PROG = "megagenome import"
MODEL_YAML = "model.yaml"


class ImportFailure(ValueError):
    """A checkpoint that cannot be imported as asked (the message names the file or key)."""


def main(ns) -> int:
    """`megagenome import` on its parsed namespace: 0, or 2 with the reason on stderr."""
    try:
        manifest = import_checkpoint(ns.source, ns.format, ns.output, ns.source_config, ns.dtype)
    except (ValueError, OSError) as e:  # ImportFailure, ImportRefused, ExportError, a corrupt file ...
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    family, parameters = manifest["model"]["family"], manifest["parameters"]
    print(f"megagenome: imported {ns.source} ({ns.format}) to {ns.output}: a {family} model, {parameters:,} parameters")
    model_yaml = os.path.join(ns.output, MODEL_YAML)
    print(f"  continue training with: --config RUN.yaml --config {model_yaml} --model.init_from {ns.output}")
    return 0


def import_checkpoint(source: str, fmt: str, output: str, config_path: str | None = None, dtype: str = "fp32") -> dict:
    """Write the export directory `output` of the published checkpoint `source` in format `fmt`; its manifest."""
    if fmt not in PUBLISHED:
        raise ImportFailure(f"--format {fmt}: not one of {', '.join(PUBLISHED)}")
    if dtype not in DTYPES:
        raise ImportFailure(f"--dtype {dtype}: not one of fp32, bf16")
    check_output(output)
    published = PUBLISHED[fmt]
    config, config_file = read_config(source, config_path)
    vocab, tokenizer_file = read_tokenizer(source) if published.tokenizer else (None, None)
    try:
        model_cfg = published.model_config(config, vocab)
    except ImportRefused as e:
        where = tokenizer_file if e.key == "tokenizer" and tokenizer_file else config_file
        raise ImportFailure(f"{where}: {e} (--format {fmt})") from e
    problems = model_problems(model_cfg) + family_problems(model_cfg)
    if problems:
        raise ImportFailure(
            f"{config_file}: maps to a model megagenome refuses (--format {fmt}): {'; '.join(problems)}"
        )
    weights, weights_file = read_weights(source)
    try:
        state = published.to_ours(weights, model_cfg)
    except ImportRefused as e:
        raise ImportFailure(f"{weights_file}: {e} (--format {fmt})") from e
    check_shapes(state, model_cfg, weights_file)
    provenance = {"imported_from": os.path.abspath(source), "format": fmt, "config": os.path.abspath(config_file)}
    with staged_export(output, model_cfg, state, dtype, provenance) as staged:
        write_model_yaml(os.path.join(staged.path, MODEL_YAML), model_cfg)
    return staged.manifest


def read_config(source: str, config_path: str | None) -> tuple[dict, str]:
    """(the published config as a dict, its file): --source_config, else SOURCE/config.json."""
    if not os.path.exists(source):
        raise ImportFailure(f"{source}: no such file or directory (the checkpoint to import)")
    path = config_path or (os.path.join(source, "config.json") if os.path.isdir(source) else None)
    if path is None:
        raise ImportFailure(f"{source} is a weights file: give its config with --source_config (JSON or YAML)")
    if not os.path.isfile(path):
        raise ImportFailure(f"{path}: no such file (the checkpoint's config; give it with --source_config)")
    import yaml

    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    is_yaml = path.endswith((".yml", ".yaml"))
    try:
        config = yaml.safe_load(text) if is_yaml else json.loads(text)
    except (ValueError, yaml.YAMLError) as e:  # json.JSONDecodeError is a ValueError
        raise ImportFailure(f"{path}: not valid {'YAML' if is_yaml else 'JSON'}: {' '.join(str(e).split())}") from e
    if not isinstance(config, dict):
        raise ImportFailure(f"{path}: expected a mapping of config keys, got {type(config).__name__}")
    return config, path


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")


def read_tokenizer(source: str) -> tuple[dict[str, int] | None, str | None]:
    """({token: row}, its file) of the checkpoint directory's tokenizer: tokenizer.json (the `tokenizers` library's:
    its model's vocabulary and added tokens), vocab.json ({token: id}) or vocab.txt (a token per line); (None, None)
    when it has none (the format refuses that, naming what it needs)."""
    folder = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as fh:
                if name == "vocab.txt":
                    return {line.rstrip("\n"): i for i, line in enumerate(fh)}, path
                data = json.load(fh)
        except (ValueError, UnicodeDecodeError) as e:
            raise ImportFailure(f"{path}: not a readable tokenizer: {' '.join(str(e).split())[:200]}") from e
        if name == "vocab.json":
            return {str(k): int(v) for k, v in data.items()}, path
        vocab = (data.get("model") or {}).get("vocab") or {}
        if isinstance(vocab, list):  # Unigram: [token, score] by row
            vocab = {entry[0]: i for i, entry in enumerate(vocab)}
        vocab = {str(k): int(v) for k, v in vocab.items()}
        vocab |= {t["content"]: int(t["id"]) for t in data.get("added_tokens") or []}
        return vocab, path
    return None, None


def weight_files(source: str) -> list[str]:
    """The weights files of SOURCE: the file itself, or a directory's safetensors (all shards) or pytorch_model.bin."""
    if os.path.isfile(source):
        return [source]
    if not os.path.isdir(source):
        raise ImportFailure(f"{source}: no such file or directory")
    patterns = (
        "model.safetensors",
        "model-*-of-*.safetensors",
        "*.safetensors",
        "pytorch_model*.bin",
        "*.pt",
        "*.ckpt",
    )
    for pattern in patterns:
        found = sorted(glob.glob(os.path.join(source, pattern)))
        if found:
            return found
    raise ImportFailure(f"{source}: no weights (model.safetensors, *.safetensors, pytorch_model.bin, *.pt or *.ckpt)")


def read_weights(source: str) -> tuple[dict[str, torch.Tensor], str]:
    """(every tensor of the checkpoint by its name, the file or directory they were read from)."""
    files = weight_files(source)
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            if path.endswith(".safetensors"):
                from safetensors.torch import load_file

                part = load_file(path)
            else:  # weights only, and the BytesIO of Transformer Engine's fp8 state in Evo 2's checkpoints
                with torch.serialization.safe_globals([io.BytesIO]):
                    part = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file: safetensors' and pickle's many errors
            raise ImportFailure(f"{path}: cannot read its weights: {' '.join(str(e).split())[:300]}") from e
        if isinstance(part, dict) and isinstance(part.get("state_dict"), dict):
            part = part["state_dict"]
        if isinstance(part, dict):  # Transformer Engine's fp8 state beside a weight: no weight of its own
            part = {k: v for k, v in part.items() if not k.endswith("_extra_state")}
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise ImportFailure(f"{path}: not a state dict (a mapping of tensor names to tensors)")
        weights |= part
    return weights, (files[0] if len(files) == 1 else source)


def check_shapes(state: dict[str, torch.Tensor], cfg, where: str) -> None:
    """Refuse a mapped state dict whose names or shapes are not the family's for cfg (naming the first tensor)."""
    expected = family_of(cfg).expected_shapes(cfg, VOCAB_SIZE)
    for name, shape in expected.items():
        if name not in state:
            raise ImportFailure(f"{where}: the mapped weights lack {name}")
        if tuple(state[name].shape) != shape:
            raise ImportFailure(
                f"{where}: {name} is {list(state[name].shape)}, the config's model needs {list(shape)} (the config "
                "and the weights disagree)"
            )


def write_model_yaml(path: str, cfg) -> None:
    """The model section of a run config that continues from the import (loadable with --config)."""
    import yaml

    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("init_from", "compile")}
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("# The model section of a run continuing from this import: --config RUN.yaml --config model.yaml\n")
        yaml.safe_dump({"model": fields}, fh, sort_keys=False)
