"""benchmarks/brca1_finetune.py's parts that need no training: the task it writes from the real BRCA1 VCF and locus
(ALT windows with the ALT at the centre, the test split one fold of supervised VEP's block folds, no block on both
sides), the one-hot baseline on that split, and the report rendered from a record. The experiment itself is its
results file's command."""

from __future__ import annotations

import csv
import json
import sys

import numpy as np
from support.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import brca1_finetune as bench  # noqa: E402


def test_the_task_holds_out_whole_blocks_of_alt_windows(tmp_path):
    manifest = bench.build_task(str(tmp_path / "task"), 512, 0)
    variants = manifest["variants"]
    assert len(variants) == 3893 and manifest["splitter"] == "StratifiedGroupKFold"
    by_split = {s: list(csv.DictReader(open(tmp_path / "task" / f"{s}.csv"))) for s in ("train", "test")}
    for split, rows in by_split.items():
        mine = [v for v in variants if v["split"] == split]
        assert len(rows) == len(mine) and all(len(r["seq"]) == 512 for r in rows)
        assert all(r["seq"][256] == v["alt"] and r["label"] == v["label"] for r, v in zip(rows, mine))
    test_blocks = {(v["pos"] - 1) // 100 for v in variants if v["split"] == "test"}  # pos is 1-based
    assert not test_blocks & {(v["pos"] - 1) // 100 for v in variants if v["split"] == "train"}
    assert {v["fold"] for v in variants if v["split"] == "test"} == {0}
    assert 0.15 < len(by_split["test"]) / len(variants) < 0.25
    assert bench.build_task(str(tmp_path / "task"), 512, 0) == json.loads(
        (tmp_path / "task" / "manifest.json").read_text()
    )
    onehot = bench.onehot_baseline(manifest, 50)
    assert 0.5 < onehot["auroc"] < 0.75 and onehot["ci95"][0] < onehot["auroc"] < onehot["ci95"][1]
    y = np.array([v["label"] == "LOF" for v in variants if v["split"] == "test"])
    assert len(onehot["p"]) == len(y)
    same = bench.paired_difference(onehot["p"], onehot["p"], y, 50)
    assert same == {"delta": 0.0, "ci95": [0.0, 0.0]}  # a predictor against itself: no difference in any resample
    flipped = bench.paired_difference(1 - onehot["p"], onehot["p"], y, 50)  # AUROC(1 - p) = 1 - AUROC(p)
    assert np.isclose(flipped["delta"], 1 - 2 * onehot["auroc"]) and flipped["ci95"][1] < 0


def test_the_report_puts_each_model_beside_the_bases():
    variants = [{"split": "train", "label": "LOF"}, {"split": "test", "label": "LOF"}, {"split": "test", "label": "x"}]
    manifest = {"window": 512, "test_fold": 0, "splitter": "StratifiedGroupKFold", "variants": variants}
    meta = {"date": "2026-12-07", "command": "python benchmarks/brca1_finetune.py", "hardware": "cpu", "software": "s"}
    run = {"run_dir": "/r/hyena", "family": "hyena", "lr": 5e-4, "best_step": 300, "last_step": 800,
           "test": {"auroc": 0.7, "mcc": 0.2}, "ci95": [0.66, 0.74], "baseline": {"test": {"auroc": 0.55}},
           "head_input": {"layer": 2, "pooling": "centre"},
           "against_bases": {"delta": 0.08, "ci95": [0.01, 0.15]}}  # fmt: skip
    task = bench.task_summary(manifest)
    assert task["snvs"] == {"train": 1, "test": 2} and task["test_lof"] == 1 and "variants" not in task
    worse = dict(run, family="transformer", against_bases={"delta": -0.08, "ci95": [-0.15, -0.01]})
    runs = [run, worse, dict(run, family="gpn", against_bases={"delta": 0.0, "ci95": [-0.05, 0.05]})]
    runs.append({"run_dir": "/r/x", "missing": "m"})
    record = {"meta": meta, "task": task, "onehot": {"auroc": 0.62, "ci95": [0.58, 0.67]}, "runs": runs}
    md = bench.markdown(record)
    assert "- task: 1 training and 2 test SNVs (1 LOF), ALT windows of 512 bases; test = fold 0 of 5" in md
    row = (
        "| hyena | 0.0005 | block 2, centre | 300 of 800 | 0.700 [0.660, 0.740] | 0.200 | 0.550 | 0.620 [0.580, 0.670]"
    )
    assert row + " | +0.080 [+0.010, +0.150] | yes |" in md
    assert "| -0.080 [-0.150, -0.010] | no, below |" in md and "| +0.000 [-0.050, +0.050] | not distinguishable |" in md
    assert "| /r/x | m |" in md
    assert np.isclose(record["onehot"]["auroc"], 0.62)


def test_render_only_without_results_is_refused(tmp_path, capsys):
    assert bench.main(["--render_only", "--out", str(tmp_path / "none")]) == 2
    assert "no " in capsys.readouterr().err and not list(tmp_path.iterdir())
