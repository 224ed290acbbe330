"""Tier 4 (GPU only): DeepSpeed's real fp16 engine with dynamic and static loss scaling.

fp16 cannot run on DeepSpeed's CPU accelerator, so these run only where CUDA is available (the device
check script runs them on a lent GPU). The loop's own overflow logic is covered on CPU in tests/test_loop.py.
"""

import json

import pytest
import torch
from support.helpers import REPO, cli, copy_genome, tiny_config, write_yaml

from megagenome.observe.metrics import read_metrics

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def fp16_run(tmp_path, fp16: dict, **overrides):
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path)
    fragment = tmp_path / "fp16.json"
    fragment.write_text(json.dumps({"fp16": fp16}))
    cfg = tiny_config(tmp_path, fasta, tmp_path / "run", **overrides)
    cfg["train"]["ds_config"] = [str(REPO / "ds_configs" / "zero1.json"), str(fragment)]
    cfg["train"]["max_steps"], cfg["train"]["warmup_steps"] = 12, 10
    proc = cli("pretrain", "--config", write_yaml(tmp_path / "c.yaml", cfg), timeout=300)
    return proc, tmp_path / "run"


def train_rows(run_dir):
    return [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if "split" not in r]


def test_dynamic_scale_skips_overflowing_steps_without_advancing_the_schedule(tmp_path):
    # 2^40 overflows fp16 gradients at once: the first steps are skipped while the scale comes down.
    proc, run_dir = fp16_run(
        tmp_path, {"enabled": True, "loss_scale": 0, "initial_scale_power": 40, "hysteresis": 1, "min_loss_scale": 1}
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = train_rows(run_dir)
    assert rows[-1]["skipped_steps"] > 0
    scales = [r["loss_scale"] for r in rows]
    assert scales[0] > scales[-1] and all(s is not None for s in scales)
    for prev, row in zip(rows, rows[1:]):
        if row["skipped_steps"] > prev["skipped_steps"]:
            assert row["lr"] == prev["lr"], "the LR schedule advanced on a skipped step"
        else:
            assert row["lr"] != prev["lr"]  # warmup: every applied step moves the LR


def test_static_scale_trains(tmp_path):
    proc, run_dir = fp16_run(tmp_path, {"enabled": True, "loss_scale": 1024})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = train_rows(run_dir)
    assert all(r["loss_scale"] == 1024 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_overflow_at_minimum_scale_stops_with_a_checkpoint(tmp_path):
    # A huge learning rate blows the weights up after the first update; every later step overflows and
    # the scale is already at its floor, so the run must stop cleanly with the last good checkpoint.
    proc, run_dir = fp16_run(
        tmp_path,
        {"enabled": True, "loss_scale": 0, "initial_scale_power": 0, "hysteresis": 1, "min_loss_scale": 1},
        train__lr=1e8,
        train__min_lr=0.0,
    )
    assert proc.returncode == 3, proc.stderr[-4000:]
    assert "loss scale already at fp16.min_loss_scale" in proc.stderr
    assert any((p / "COMPLETE").exists() for p in (run_dir / "checkpoints").iterdir())


# The Hyena families (model/hyena/; tests/test_hyena_engine.py runs every other engine seam on CPU): hyena's H layers
# and striped_hyena with every operator and attention.
HYENA = {
    "hyena": {"model__family": "hyena", "model__filter_width": 16},
    "striped_hyena": {"model__family": "striped_hyena", "model__n_layer": 4, "model__mr_filter_len": 16},
}
HYENA_STEPS = 6
FP16_LOSS_ATOL = 5e-3  # against fp32: the bf16 tolerance of tests/test_ds_equivalence.py (fp16 keeps 3 more bits)


def hyena_run(tmp_path, family: str, fragments: list[str]) -> list[float]:
    """Per-step training losses of a 6-step run of `family` on ZeRO-1 plus `fragments` (ds_configs/ names)."""
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path)
    cfg = tiny_config(tmp_path, fasta, tmp_path / "run", **HYENA[family])
    if family == "striped_hyena":
        cfg["model"]["layer_pattern"] = "SE MR LI A"
    cfg["model"]["dropout"] = 0.0
    cfg["train"]["ds_config"] = [str(REPO / "ds_configs" / f"{n}.json") for n in ["zero1", *fragments]]
    cfg["train"].update(max_steps=HYENA_STEPS, tf32=False)
    proc = cli("pretrain", "--config", write_yaml(tmp_path / "c.yaml", cfg), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return train_rows(tmp_path / "run")


@pytest.mark.parametrize("family", list(HYENA))
def test_hyena_families_train_under_fp16_loss_scaling_and_track_fp32(tmp_path, family):
    """Static loss scale 1024 (ds_configs/fp16_static.json): no step skipped, the loss falls, and every step's loss
    is within FP16_LOSS_ATOL of the fp32 run's (the filters and FFT convolutions run in float32 under fp16)."""
    fp16 = hyena_run(tmp_path / "fp16", family, ["fp16_static"])
    fp32 = hyena_run(tmp_path / "fp32", family, [])
    assert all(r["loss_scale"] == 1024 for r in fp16) and fp16[-1]["skipped_steps"] == 0, fp16
    losses = [r["loss"] for r in fp16]
    assert losses[-1] < losses[0], losses
    diff = max(abs(a - r["loss"]) for a, r in zip(losses, fp32))
    print(f"{family} fp16 vs fp32: loss {diff:.3g}")
    assert diff <= FP16_LOSS_ATOL, (losses, [r["loss"] for r in fp32])
