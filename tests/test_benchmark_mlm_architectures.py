"""benchmarks/mlm_architectures.py's pure parts, without a launch: the arms' configs at equal parameters, the budget
and equal-wall arithmetic, which strand modes are scored, the smoke VCF subset, and the report (rendered from a
record as --render_only does, failed and pending arms included). The experiment itself is its results file's
command (hours on 2 CPU cores).
"""

from __future__ import annotations

import json
import sys

import yaml
from support.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import mlm_architectures as mlm  # noqa: E402


def test_every_arm_is_a_masked_model_at_the_transformers_parameter_count():
    from megagenome.config import ModelConfig
    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model import family_of

    counts = {}
    for name, (config, extra) in mlm.ARMS.items():
        shape = yaml.safe_load((REPO / config).read_text())["model"]
        shape.update(dict(zip([k.removeprefix("--model.") for k in extra[::2]], extra[1::2])))
        cfg = ModelConfig(**shape)
        assert cfg.objective == "mlm", name
        counts[name] = family_of(cfg).parameter_counts(cfg, VOCAB_SIZE)[0]
    reference = counts[mlm.REFERENCE]
    assert reference == 854_144  # configs/tiny_transformer.yaml's
    assert all(abs(n / reference - 1) < 0.02 for n in counts.values()), counts
    assert mlm.arm_flags("caduceus_ph")[-2:] == ["--model.rc_equivariance", "post_hoc"]
    assert "--model.objective" in mlm.arm_flags("gpn") and "mlm" in mlm.arm_flags("gpn")


def test_budgets_keep_the_default_recipes_proportions():
    assert mlm.budget_flags(600, 3) == [
        "--train.max_steps",
        "600",
        "--train.warmup_steps",
        "50",
        "--train.eval_interval",
        "200",
    ]
    assert mlm.budget_flags(12)[1::2] == ["12", "1", "12"]  # one evaluation, at the end
    assert mlm.wall_steps(600, 30_000.0, 15_000.0) == 1200 and mlm.wall_steps(600, 100.0, 15_000.0) == 4
    assert mlm.wall_steps(600, 1.0, 15_000.0) == 3
    assert mlm.smoke_flags(None) == [] and mlm.smoke_flags(6)[6:] == [
        "--train.log_interval",
        "2",
        "--data.eval_windows",
        "16",
    ]
    assert mlm.rc_modes("gpn") == [False, True] and mlm.rc_modes("caduceus_ps") == [False]


def test_cheap_arms_run_whole_first_then_caduceus_on_e_coli_then_on_brca1():
    arms, budgets = list(mlm.ARMS), ["tokens", "wall"]
    assert mlm.order(arms, budgets, vep=True) == [
        ("learning", "mlm_transformer"),
        ("vep", "mlm_transformer"),
        ("learning", "gpn"),
        ("vep", "gpn"),
        ("learning", "caduceus_ph"),
        ("learning", "caduceus_ps"),
        ("vep", "caduceus_ph"),
        ("vep", "caduceus_ps"),
    ]
    # the reference's E. coli run is there for the @wall arms' throughput, its BRCA1 run only when asked for
    assert mlm.order(["caduceus_ps"], budgets, vep=True) == [("learning", "mlm_transformer")] + [
        ("learning", "caduceus_ps"),
        ("vep", "caduceus_ps"),
    ]
    assert mlm.order(["gpn"], ["tokens"], vep=False) == [("learning", "gpn")]


def test_the_smoke_subset_keeps_the_header_and_spreads_over_the_file(tmp_path):
    vcf = tmp_path / "in.vcf"
    vcf.write_text("##fileformat=VCFv4.2\n#CHROM\tPOS\n" + "".join(f"chr17\t{i}\n" for i in range(100)))
    out = mlm.subset_vcf(vcf, tmp_path / "out.vcf", 10).read_text().splitlines()
    assert out[:2] == ["##fileformat=VCFv4.2", "#CHROM\tPOS"] and len(out) == 12
    assert out[2] == "chr17\t0" and out[-1] == "chr17\t90"


def _arm(**over):
    arm = {"parameters": 854144, "steps": 600, "tokens": 4915200, "heldout_bits_per_base": 1.91,
           "best_markov_bits_per_base": 1.93, "best_markov_order": 7, "wall_s": 349.0, "tokens_per_s_median": 15000.0,
           "curve": [(200, 1.95), (600, 1.91)], "masked_positions": 36000, "ran": False}  # fmt: skip
    return arm | over


def test_the_report_renders_from_the_record_failed_and_pending_arms_included(tmp_path):
    vep_row = {"objective": "mlm", "parameters": 854144, "window": 512, "rc": False, "auroc": 0.51,
               "ci95": [0.49, 0.53], "n_positive": 823, "n_negative": 3070, "variants_per_s": 40.0, "steps": 600,
               "tokens": 4915200}  # fmt: skip
    record = {
        "date": "2026-12-04", "hardware": "cpu", "software": "sw", "command": "python benchmarks/mlm_architectures.py",
        "work": "/tmp/mlm_arch", "arms": list(mlm.ARMS), "bootstrap": 1000, "seed": 0,
        "learning": {"mlm_transformer": _arm(), "gpn": _arm(ran=True, load_before=1.0, load_after=2.0),
                     "gpn@wall": _arm(steps=1200), "caduceus_ph": {"failed": "CalledProcessError: exit 1"}},
        "vep": {"mlm_transformer": {"rows": [vep_row, vep_row | {"rc": True}], "heldout_bits_per_base": 1.6},
                "caduceus_ph": {"rows": [vep_row], "heldout_bits_per_base": 1.7}},
        "causal": [{**vep_row, "objective": "clm", "auroc": 0.458, "ci95": [0.437, 0.481], "run_dir": "runs/brca1",
                    "date": "2026-12-01"}],
        "composition": {"auroc": 0.46, "ci95": [0.44, 0.478]},
        "masked_baseline": {"0": 1.95, "1": 1.93, "2": 1.92, "3": 1.9150, "4": 1.96},
    }  # fmt: skip
    out = tmp_path / "mlm_architectures"
    (tmp_path / "mlm_architectures.json").write_text(json.dumps(record))
    assert mlm.main(["--render_only", "--out", str(out)]) == 0
    md = (tmp_path / "mlm_architectures.md").read_text()
    assert md == mlm.markdown(record) and md.startswith("# Masked DNA LMs")
    assert "- command: `python benchmarks/mlm_architectures.py`" in md and "- date: 2026-12-04" in md
    assert (
        "| gpn | 854,144 | 600 | 4,915,200 | 1.9100 | 1.9150 (k=3) | +0.0050 | 1.9300 (order 7) | 349 | 15,000 | "
        "1.0 -> 2.0 | 36,000 |" in md
    )  # the masked baseline it is compared with; the causal Markov chain for scale
    assert "k = 0..4: 1.9500 1.9300 1.9200 1.9150 1.9600." in md
    assert "| caduceus_ph | failed: CalledProcessError: exit 1 |" in md
    assert "Not run yet (this file is rewritten after every arm): caduceus_ps." in md
    assert "0.458 [0.437, 0.481]" in md and "0.510 [0.490, 0.530]" in md and "0.460 [0.440, 0.478]" in md
    assert "no (post hoc: its inference averages both strands)" in md
    assert "What is not compared fairly here" in md and mlm.LOAD_NOTE in md


def test_arms_measured_earlier_are_kept_and_a_spent_budget_starts_nothing(tmp_path):
    """Designed to finish in pieces: an arm recorded by an earlier invocation (same settings) is carried, not run
    again; failed and stopped ones are run again; with the budget spent, the next arm is recorded as stopped without
    a launch and nothing after it starts."""
    import argparse
    import time

    settings = {"steps": None, "variants": None, "bootstrap": 1000, "seed": 0}
    learning = {"mlm_transformer": _arm(), "gpn": {"failed": "x"}, "caduceus_ph": {"stopped": "y"}}
    previous = {**settings, "learning": learning, "vep": {}}
    record = mlm.carried(previous | {"arms": list(mlm.ARMS)}, {**settings, "learning": {}, "vep": {}, "arms": ["gpn"]})
    assert list(record["learning"]) == ["mlm_transformer"] and record["arms"] == list(mlm.ARMS)
    rows = {"causal": [{"auroc": 0.458}], "composition": {"auroc": 0.46}}  # kept by a --no-vep invocation
    assert mlm.carried(previous | rows, {**settings, "learning": {}, "vep": {}, "arms": []}).items() >= rows.items()
    assert mlm.carried(previous, {**settings, "steps": 20, "learning": {}, "vep": {}})["learning"] == {}

    args = argparse.Namespace(work=str(tmp_path), vep=False, variants=None, steps=None, arms=list(mlm.ARMS),
                              budgets=["tokens", "wall"])  # fmt: skip
    writes = []
    mlm.run_all(args, record, lambda r: writes.append(json.dumps(r)), deadline=time.monotonic())
    assert record["learning"]["mlm_transformer"] == _arm()  # kept, not launched
    assert list(record["learning"]) == ["mlm_transformer", "gpn"] and "stopped" in record["learning"]["gpn"]
    assert len(writes) == 1 and not (tmp_path / "gpn").exists()
    md = mlm.markdown({**record, "date": "d", "hardware": "h", "software": "s", "command": "c", "work": "w",
                       "arms": list(mlm.ARMS)})  # fmt: skip
    assert "| gpn | stopped: not started: this invocation's budget is spent |" in md
