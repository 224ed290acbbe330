"""benchmarks/loader.py runs end to end on a 40 kbp genome in about a second and its figures are consistent.

Checks outputs, never speed: every loader returns (B, T) batches whose labels are the inputs shifted by one; (B) and
the bit-identical experiments give (A)'s batches; tokens/s is batches x B x T / wall time; ratios and the target
verdict follow from the rates; the report renders and the results are JSON-able.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
from support.helpers import DATA, REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import loader as bench  # noqa: E402

GENOME = DATA / "hg19_chr17_1-40000_softmasked.fa"  # one record, soft-masked repeats (loss weights, E2's soft bits)
T, B = 64, 4


@pytest.fixture(scope="module")
def result():
    return bench.run_benchmark(GENOME, [], [T], B, rounds=2, seconds=0.01, prepare_runs=2, profile_batches=3)


def test_prepare_figures(result):
    p = result["prepare"]
    assert p["records"] == 1 and p["bases"] == 40_000 and len(p["wall_s"]) == 2
    assert p["bases_per_s"] == pytest.approx(p["bases"] / p["median_wall_s"])


def test_batches_agree(result):
    c = result["checks"]
    assert c["fasta_equals_prepared"] and c["E1_equals_prepared"] and c["E2_equals_prepared"]
    assert 0.49 < c["E3_rc_fraction_of_100k"] < 0.51


def test_rates_and_ratios(result):
    loaders = result["loaders"][T]
    assert len(loaders) == 9
    for v in loaders.values():
        assert len(v["rounds"]) == 2 and v["setup_s"] >= 0
        for r in v["rounds"]:
            assert r["batches"] >= 1 and r["tokens_per_s"] == pytest.approx(r["batches"] * B * T / r["wall_s"])
        assert v["min_tokens_per_s"] <= v["tokens_per_s"] <= v["max_tokens_per_s"]
    s = result["summary"][T]
    a = loaders["A prepared (train_batch)"]["tokens_per_s"]
    assert s["A_multiple_of_450k"] == pytest.approx(a / 0.45e6)
    assert s["target_met"] == (a >= 100 * 0.45e6)
    assert s["ratios"]["plain"]["A_over_C"] == pytest.approx(a / loaders["C reference, plain"]["tokens_per_s"])
    assert math.isclose(bench.consumption(2048)["tokens_per_s"], 455_760, rel_tol=1e-3)


def test_profile_and_report(result):
    p = result["profiles"][T]
    assert p["stages"]["train_batch_us"] > 0 and all(us > 0 for us in p["stages"]["us_per_batch"].values())
    assert p["cprofile"]["top"] and p["cprofile"]["batches"] == 3
    full = {
        **result,
        "date": "2000-01-01",
        "hardware": "h",
        "software": "s",
        "command": "c",
        "load_average_at_start": [],
    }
    text = bench.markdown(full)
    assert "## prepare" in text and "A prepared (train_batch)" in text and "## Where (A)'s time goes" in text
    json.dumps(full)


def test_every_loader_gives_training_batches(tmp_path):
    bgz, plain = bench.copy_inputs(tmp_path, GENOME)
    _, prepared_dir = bench.bench_prepare(bench.write_manifest(tmp_path, bgz, []), tmp_path, 1)
    made = bench.make_loaders(prepared_dir, bgz, plain, T, B, [])
    try:
        for name, load in made["loaders"].items():
            out = load()
            if name.startswith("ceiling"):
                assert len(out) == B and all(t.shape == (T + 1,) and t.max() <= 7 for t, _ in out)
                continue
            assert {k: (tuple(v.shape), v.dtype) for k, v in out.items()} == {
                "input_ids": ((B, T), torch.int64),
                "labels": ((B, T), torch.int64),
                "loss_weight": ((B, T), torch.float32),
            }, name
            ids, labels = out["input_ids"].numpy(), out["labels"].numpy()
            known = labels[:, :-1] != bench.IGNORE_INDEX
            assert np.array_equal(labels[:, :-1][known], ids[:, 1:][known]), name  # next-base targets
            assert set(np.unique(ids).tolist()) <= {3, 4, 5, 6, 7}, name  # A C G T N
    finally:
        for load in made["loaders"].values():
            load.close()


def test_contended_slots_are_measured_again(tmp_path):
    """A share of the core no attempt can reach (> 1) makes every slot and prepare run take 1 + retries attempts."""
    out = bench.bench_loaders({T: {"noop": lambda: None}}, B, rounds=2, seconds=0.001, min_cpu_share=1.01, retries=1)
    assert out[T]["noop"]["repeated_slots"] == 2 and all(r["attempts"] == 2 for r in out[T]["noop"]["rounds"])
    bgz, _ = bench.copy_inputs(tmp_path / "in", GENOME)
    record, kept = bench.bench_prepare(bench.write_manifest(tmp_path / "in", bgz, []), tmp_path, 2, 1.01, 1)
    assert record["repeated_runs"] == 2 and len(record["wall_s"]) == 2
    assert sorted(p.name for p in tmp_path.glob("prepared*")) == ["prepared0"] and kept == str(tmp_path / "prepared0")
