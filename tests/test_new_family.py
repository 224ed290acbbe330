"""Tier 2: a sixth model family is its folder plus one registry line (docs/architecture.md, "Adding a family").

The family is tests/support/conv_family/ (a tiny causal convolutional LM, outside the package); the registry line is
the fixture's `FAMILIES[CONV.name] = CONV`. With nothing else edited, pretrain.run in this process (a world of one,
the real DeepSpeed engine) trains it, checkpoints, resumes to the same losses as an uninterrupted run, evaluates the
run directory to its logged held-out loss and exports it (safetensors, loaded back to the same logits). In-process
because the registry line is this process's; a subprocess would need the family installed as a package.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from support.conv_family import CONV
from support.helpers import copy_genome, tiny_config, world_of_one

from megagenome.after_training import export
from megagenome.after_training.evaluate import evaluate
from megagenome.after_training.inference import load_model
from megagenome.config import ModelConfig, RootConfig
from megagenome.config.load import config_from_dict, load_config
from megagenome.data.dataset import build_genome_data
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model import FAMILIES, validate
from megagenome.observe.metrics import read_metrics
from megagenome.run import pretrain

STEPS = 6


@pytest.fixture(scope="module")
def conv_runs(tmp_path_factory):
    """The family registered (the one line), then two runs of it: 6 steps straight, and 3 steps then resumed to 6."""
    FAMILIES[CONV.name] = CONV  # the registry line
    root = tmp_path_factory.mktemp("conv_family")
    fasta = copy_genome("phiX174_NC_001422.1.fna", root / "genome")
    try:
        with world_of_one():
            for name, stops in (("straight", [STEPS]), ("resumed", [3, STEPS])):
                for stop in stops:
                    cfg = tiny_config(root, fasta, root / name, train__max_steps=STEPS, train__stop_at=stop)
                    cfg["model"].update(family="conv", dropout=0.0)
                    pretrain.run(config_from_dict(cfg), [], keep_process_group=True)
        yield root, fasta
    finally:
        del FAMILIES[CONV.name]


def _train_losses(run_dir: pathlib.Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(str(run_dir / "metrics.jsonl")) if "split" not in r}


def test_the_new_family_trains_checkpoints_and_resumes_exactly(conv_runs):
    root, _ = conv_runs
    straight, resumed = _train_losses(root / "straight"), _train_losses(root / "resumed")
    assert sorted(straight) == list(range(1, STEPS + 1)) and straight == resumed  # bit for bit after the resume
    assert straight[STEPS] < straight[1]  # it learns
    summary = json.loads((root / "straight" / "summary.json").read_text())
    assert summary["model"] == CONV.describe(load_config(str(root / "straight" / "config.yaml")).model)
    tags = sorted(p.name for p in (root / "resumed" / "checkpoints").iterdir())
    assert tags == ["step_00000003", "step_00000006"]


def test_the_new_family_evaluates_to_its_logged_held_out_loss(conv_runs):
    root, fasta = conv_runs
    run_dir = root / "straight"
    logged = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r.get("split") == "val"][-1]
    cfg = load_config(str(run_dir / "config.yaml"))
    data = build_genome_data(cfg.data, cfg.model.objective)
    regions = [f"{r.contig}:{r.start + 1}-{r.end}" for r in data.eval_regions]
    data.close()
    result = evaluate(load_model(str(run_dir)), fasta, regions, cfg.data.seq_len + 1, 4, rc=False, progress=False)
    assert result["overall"]["bases"] == logged["bases"]
    assert result["overall"]["bits_per_base"] == pytest.approx(logged["bits_per_base"], rel=2e-6)


def test_the_new_family_exports_and_loads_back(conv_runs, tmp_path):
    root, _ = conv_runs
    out = tmp_path / "export"
    manifest = export.export(str(root / "straight"), str(out), dtype="bf16")
    assert (out / "model.safetensors").exists() and manifest["parameters"] == CONV.parameter_counts(
        load_config(str(root / "straight" / "config.yaml")).model, VOCAB_SIZE)[0]  # fmt: skip
    tokens = torch.randint(3, 7, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained, exported = load_model(str(root / "straight")).model, load_model(str(out)).model
        # bf16 weights, fp32 compute: the logits of the trained weights rounded to bf16
        rounded = trained.to(torch.bfloat16).to(torch.float32)
        assert torch.equal(rounded.logits(tokens), exported.to(torch.float32).logits(tokens))


def test_the_new_family_has_its_own_checks_and_refuses_options_it_does_not_read(conv_runs):
    mlm = validate(RootConfig(model=ModelConfig(family="conv", objective="mlm")))
    assert any("--model.objective=mlm with --model.family=conv" in p for p in mlm)
    gqa = validate(RootConfig(model=ModelConfig(family="conv", n_kv_head=1)))
    assert any("--model.n_kv_head=1: only for --model.family transformer (not conv)" in p for p in gqa)
