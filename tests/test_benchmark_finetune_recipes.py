"""benchmarks/finetune_recipes.py's pure parts, without a fine-tuning run: the report rendered from a record as
--render_only does (a measured arm beside its k-mer baseline, a failed arm, undefined metrics), its refusals, and the
tasks' leakage rule as written. The experiment itself is its results file's command (an hour on 2 CPU cores)."""

from __future__ import annotations

import json
import sys

from support.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import finetune_recipes as recipes  # noqa: E402


def _arm(mcc: float | None, baseline_mcc: float, **over) -> dict:
    test = {"accuracy": 0.96, "mcc": mcc, "auroc": 0.98, "loss": 0.1, "n": 200}
    return {"flags": "(none)", "best_step": 800, "last_step": 1000, "stopped_early": False, "test": test,
            "validation": test, "baseline": {"choice": "k=3, C=0.1", "test": {"mcc": baseline_mcc}}, "wall_s": 819.4,
            **over}  # fmt: skip


def test_the_report_puts_each_arm_beside_its_baseline(tmp_path):
    meta = {
        "date": "2026-12-06",
        "command": "python benchmarks/finetune_recipes.py",
        "hardware": "cpu",
        "software": "sw",
    }
    chosen = {"layer": 3, "pooling": "last", "metric": "mcc", "by_choice": {"final norm, mean": 0.5}, "why": "probes"}
    old = {"measured_as": "`default` (`(none)`)", "measured": {"commit": "4eb3b3f"}}
    record = {"meta": meta, "model": "/r/runs/tiny", "results": {"two_species": {
        "default": _arm(0.931, 0.950, head_input=chosen), "lr_1e-3": _arm(0.97, 0.950, flags="--train.lr 1e-3"),
        "scratch": _arm(None, 0.950), "probe": {"failed": "exit 1: ['boom']"},
        "lr_1e-4": _arm(0.9, 0.950, flags="--train.lr 1e-4", **old)}}}  # fmt: skip
    out = tmp_path / "finetune_recipes"
    (tmp_path / "finetune_recipes.json").write_text(json.dumps(record))
    assert recipes.main(["--render_only", "--out", str(out)]) == 0
    md = (tmp_path / "finetune_recipes.md").read_text()
    assert md == recipes.markdown(record)
    row = "| default | `(none)` | block 3, last (probes) | 800 of 1000 | 0.960 | 0.931 | 0.950 (k=3, C=0.1) | -0.019 |"
    assert row + " 0.980 | 819 |" in md
    assert "| lr_1e-3 | `--train.lr 1e-3` | as given | 800 of 1000 | 0.960 | 0.970 | 0.950 (k=3, C=0.1) | +0.020" in md
    assert "| scratch | `(none)` | as given | 800 of 1000 | 0.960 | - | 0.950 (k=3, C=0.1) | - |" in md  # undefined MCC
    assert "| probe | `--model.freeze_backbone true --train.lr 1e-2` | - | exit 1: ['boom'] |" in md
    assert "evaluates one strand, as before): `lr_1e-4` as `default` (`(none)`) at 4eb3b3f." in md
    assert "## two_species: ecoli, saureus; 512-base windows, 400 training and 100 test per class" in md


def test_refusals(tmp_path, capsys):
    assert recipes.main(["--render_only", "--out", str(tmp_path / "none")]) == 2
    assert "no " in capsys.readouterr().err
    assert recipes.main(["--model", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "train the default job first" in capsys.readouterr().err


def test_every_arm_parses_as_finetune_flags_and_the_default_adds_none():
    from megagenome.config.load import argument_problems, finetune_config, finetune_parser, value_problems

    base = ["--model.pretrained", "runs/tiny", "--data.benchmark", "task"]
    for arm, flags in recipes.ARMS.items():
        parser = finetune_parser()
        assert not argument_problems(parser, base + flags) and not value_problems(parser, base + flags), arm
        cfg = finetune_config(parser.parse_args(base + flags))
        assert cfg.model.pretrained == "runs/tiny", arm
    assert recipes.ARMS["default"] == [] and recipes.ARMS["scratch"] == ["--model.init", "random"]
    assert set(recipes.TASKS) == {"two_species", "species", "two_species_held_out"}
    assert recipes.TASKS["two_species_held_out"][-1] * 4_639_675 < 4_639_675 - 4_400_000  # inside the held-out range


def test_the_margins_interval_and_recall_come_from_the_predictions(tmp_path):
    """from_predictions: each class's windows right (model, baseline, windows), and a paired bootstrap interval of
    the MCC margin that holds the observed margin; a model that is right wherever the baseline is, and more, has an
    interval above 0. Without the file: None, not an error."""
    from sklearn.metrics import matthews_corrcoef

    rows = ["name\tlabel\tpredicted\tp_a\tp_b\tbaseline_predicted"]
    labels = ["a"] * 50 + ["b"] * 50
    model = labels[:45] + ["b"] * 5 + labels[50:]  # 5 errors, all on class a
    base = labels[:35] + ["b"] * 15 + labels[50:98] + ["a"] * 2  # 17 errors
    rows += [f"w{i}\t{y}\t{m}\t0.5\t0.5\t{b}" for i, (y, m, b) in enumerate(zip(labels, model, base))]
    (tmp_path / "predictions_test.tsv").write_text("\n".join(rows) + "\n")
    got = recipes.from_predictions(str(tmp_path), resamples=500)
    assert got["recall"] == {"a": [45, 35, 50], "b": [50, 48, 50]}
    low, high = got["margin_ci95"]
    observed = matthews_corrcoef(labels, model) - matthews_corrcoef(labels, base)
    assert 0 < low < observed < high
    assert recipes.from_predictions(str(tmp_path / "gone")) == {"margin_ci95": None, "recall": None}


def test_test_windows_inside_the_models_held_out_range_are_counted(tmp_path):
    """pretraining_overlap: the test windows of the model's own genome (matched by sha256, wherever the task was
    built) wholly inside its --data.val_ranges; None for a model pretrained on none of the task's genomes."""
    genome = tmp_path / "g.fa"
    genome.write_text(">c1\n" + "ACGT" * 100 + "\n")
    other = tmp_path / "h.fa"
    other.write_text(">c2\nAAAA\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.yaml").write_text(f"data:\n  fasta: {genome}\n  val_ranges: ['c1:301-400']\n")
    windows = [{"species": "g", "split": "test", "contig": "c1", "start": s, "end": s + 49} for s in (301, 341, 281)]
    windows.append({"species": "g", "split": "train", "contig": "c1", "start": 1, "end": 50})
    manifest = {"genomes": {"g": {"path": "/elsewhere/g.fa", "sha256": recipes.sha256_file(str(genome))},
                            "h": {"path": str(other), "sha256": recipes.sha256_file(str(other))}},
                "windows": windows}  # fmt: skip
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert recipes.pretraining_overlap(str(model), str(tmp_path)) == {"species": "g", "test_windows": 3,
                                                                        "in_held_out": 2}  # fmt: skip
    (model / "config.yaml").write_text(f"data:\n  fasta: {other.with_name('x.fa')}\n")
    assert recipes.pretraining_overlap(str(model), str(tmp_path)) is None


def test_arms_of_another_model_at_the_same_path_are_not_kept(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"steps": 600, "heldout_bits_per_base": 1.8752}))
    identity = recipes.model_identity(str(run))
    assert identity == {"steps": 600, "heldout_bits_per_base": 1.8752}
    previous = {"model": str(run), "model_identity": identity, "results": {"species": {"default": _arm(0.4, 0.5)}}}
    assert recipes.kept(previous, str(run), identity) == previous["results"]
    retrained = {"steps": 600, "heldout_bits_per_base": 1.8763}
    assert recipes.kept(previous, str(run), retrained) == {}
    assert recipes.kept({**previous, "model_identity": None}, str(run), identity) == {}  # recorded before identities
    assert recipes.kept(previous, str(tmp_path / "other"), identity) == {}
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"weights")
    digest = "9a129038d9a00aed0cf6a7ea059ca50a813449061ab87848cf1a13eafdf33b2c"  # sha256 of b"weights"
    assert recipes.model_identity(str(export)) == {"export": digest}
