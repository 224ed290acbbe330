"""What the import tests share (tests/test_import_*.py): continued pretraining from an import, through the real
`megagenome pretrain` (one rank, ZeRO-0, float32, phiX174), and the batch its first step trained on."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import torch

from megagenome.data import tokenizer
from megagenome.data.dataset import build_genome_data
from megagenome.model.vocabulary import VOCABULARIES
from support.helpers import REPO, cli, cli_here, copy_genome, run_config, tiny_config, write_yaml

BYTES = torch.tensor(VOCABULARIES["bytes"].ids)  # each megagenome token's byte (Evo 1 and Evo 2)


def unit_gain_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of unit gain in an authors' model (their own initialisations are near-identities or zeros in
    places, which would hide a mapping error): matrices N(0, 1/fan_in), vectors (norm scales, biases, sine
    frequencies) 1 + N(0, 0.04); buffers untouched."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            else:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))


def import_into(source: str, fmt: str, out: str, *flags: str) -> str:
    """`megagenome import SOURCE --format FMT --output OUT FLAGS` (in this process), which must succeed; OUT."""
    proc = cli_here("import", source, "--format", fmt, "--output", out, *flags)
    assert proc.returncode == 0, proc.stderr
    return out


def published_config_maps_to_shipped(fmt: str, published: pathlib.Path, shipped: str) -> None:
    """The format's mapping of a published config (JSON) is exactly configs/<shipped>'s model section."""
    from dataclasses import asdict

    from megagenome.model import PUBLISHED

    got = PUBLISHED[fmt].model_config(json.loads(published.read_text()))
    want, _ = run_config(["--config", str(REPO / "configs" / shipped)])
    assert asdict(got) == asdict(want.model)


def import_refused(source: str, fmt: str, out: str, *fragments: str) -> None:
    """`megagenome import SOURCE --format FMT --output OUT` must exit 2 with an error naming every fragment and no
    traceback, leaving nothing at OUT (nor a staging directory beside it)."""
    proc = cli_here("import", source, "--format", fmt, "--output", out)
    err = proc.stderr
    assert proc.returncode == 2 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    assert not os.path.exists(out) and not [n for n in os.listdir(os.path.dirname(out)) if ".partial" in n]


def tokens(B: int = 2, T: int = 100, seed: int = 3) -> torch.Tensor:
    """Random megagenome tokens, bases and N."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(tokenizer.A_ID, tokenizer.VOCAB_SIZE, (B, T), generator=g)


def byte_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """An Evo model's (stripedhyena's or vortex's) logits over its 512 bytes, (B, T, 512), of megagenome tokens."""
    with torch.no_grad():
        return model(BYTES[ids])[0]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over the largest magnitude of `want`."""
    return ((got - want).abs().max() / want.abs().max()).item()


def first_step(
    imported: str, tmp_path: pathlib.Path, ds_config: list[str] | None = None, flags: tuple[str, ...] = (), **data
) -> tuple[float, dict[str, torch.Tensor]]:
    """(the first step's logged loss, its batch) of `pretrain --config RUN.yaml --config IMPORTED/model.yaml
    --model.init_from IMPORTED`: the line `megagenome import` prints, RUN.yaml the tiny config without a model
    section (data: overrides of its data section; ds_config: names of ds_configs/ fragments to train with
    instead of zero0.json; flags: more command-line flags, after the import's). The batch is rebuilt from the
    same config: the same seeded windows, reverse complements and masks."""
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path / "genome")
    run = tiny_config(tmp_path, fasta, tmp_path / "run", train__max_steps=2, train__warmup_steps=1,
                      train__eval_interval=0)  # fmt: skip
    del run["model"]  # the import's model.yaml gives it
    if ds_config:  # the DeepSpeed JSON fragments of ds_configs/ (default: zero0.json, fp32)
        run["train"]["ds_config"] = [str(REPO / "ds_configs" / name) for name in ds_config]
    run["data"].update(data)
    argv = ["--config", write_yaml(tmp_path / "run.yaml", run), "--config", os.path.join(imported, "model.yaml"),
            "--model.init_from", imported, *flags]  # fmt: skip
    proc = cli("pretrain", *argv, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    first = next(r for r in rows if r.get("step") == 1 and "loss" in r and "split" not in r)
    cfg, _ = run_config(argv)
    with build_genome_data(cfg.data, cfg.model.objective) as genome:
        return first["loss"], genome.train_batch(np.arange(cfg.train.micro_batch_size))
