"""`megagenome eval` (megagenome/after_training/evaluate.py) on finished real DeepSpeed runs (support/trained.py).

- Consolidation: for a run of every checkpoint layout (ZeRO-0, ZeRO-3, tensor parallel 2, pipeline 2), eval on the
  run's own held-out windows reproduces the held-out loss the run logged at its last step (weights/consolidate.py reads
  the weights the engine evaluated with);
- 2 ranks under the launcher give exactly one process's result (causal, both strands, masked);
- windows cover every base once (a causal record's first base never), N bases are not targets, soft-masked and
  unmasked bases are reported apart, a BGZF FASTA with regions works;
- bad input exits 2 with the flag or file named: a window wider than the context, a region outside the FASTA, a run
  without checkpoints, a checkpoint of another model config.
"""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from support.helpers import copy_genome

from megagenome.after_training import evaluate as eval_command
from megagenome.after_training.evaluate import Sequence, Window, evaluate, per_base, summarise, windows
from megagenome.after_training.inference import load_model
from megagenome.config.load import load_config
from megagenome.data.dataset import build_genome_data
from megagenome.data.tokenizer import N_ID
from megagenome.observe.metrics import read_metrics

pytestmark = pytest.mark.slow


def run_eval(run, fasta, **flags) -> int:
    """`megagenome eval` on a namespace as the CLI parses it (tests/test_cli.py parses the real flags)."""
    ns = {"step": None, "regions": [], "window": None, "batch_size": 8, "reverse_complement": False, "dtype": "fp32"}
    ns |= {"output": None, "overwrite": False, "progress": False, **flags}
    return eval_command.main(SimpleNamespace(run=str(run), fasta=fasta, **ns))


def _eval_regions(run_dir) -> list[str]:
    cfg = load_config(str(run_dir / "config.yaml"))
    data = build_genome_data(cfg.data, cfg.model.objective)
    return [f"{r.contig}:{r.start + 1}-{r.end}" for r in data.eval_regions], cfg.data.seq_len + 1


@pytest.mark.parametrize("layout", ["dense", "zero3", "tp2", "pp2"])
def test_eval_reproduces_the_runs_held_out_loss(trained, layout):
    run_dir = trained.run_dir(layout)
    logged = [r for r in read_metrics(str(run_dir / "metrics.jsonl")) if r.get("split") == "val"][-1]
    regions, window = _eval_regions(run_dir)
    result = evaluate(load_model(str(run_dir)), trained.fasta, regions, window, 4, rc=False, progress=False)
    overall = result["overall"]
    assert overall["bases"] == logged["bases"]
    assert overall["nll_nats"] / overall["bases"] == pytest.approx(logged["loss"], rel=2e-6, abs=2e-6)
    assert overall["bits_per_base"] == pytest.approx(logged["bits_per_base"], rel=2e-6)


def test_two_ranks_equal_one_process(trained):
    from support.eval_checks import CASES

    out = trained.check_dir("eval_2ranks")
    for name, run, kw in CASES:
        one = evaluate(load_model(str(trained.run_dir(run))), trained.fasta, [], progress=False, **kw)
        two = json.loads((out / f"{name}.json").read_text())
        assert two["run"]["ranks"] == 2 and one["run"]["ranks"] == 1
        for key in ("overall", "softmasked", "unmasked", "per_sequence_mean_nll", "records"):
            assert two[key] == json.loads(json.dumps(one[key])), (name, key)


def test_windows_score_every_base_once():
    tokens = np.array([3, 4, 5, 6, 7, 3, 4, 5, 6, 3, 3], dtype=np.uint8)
    seqs = [Sequence("a", tokens, np.zeros(len(tokens), bool)), Sequence("b", tokens[:3], np.zeros(3, bool))]
    for causal, rc in [(True, False), (True, True), (False, False), (False, True)]:
        wins = windows(seqs, 4, causal, rc)
        # log-probability = -(1 + strand): the per-base mean tells how many strands predicted each base
        logps = {i: np.full(len(w.tokens), -(1.0 + w.strand), dtype=np.float32) for i, w in enumerate(wins)}
        lls = per_base(seqs, wins, logps, causal)
        for seq, ll in zip(seqs, lls):
            expected = np.full(len(seq.tokens), -1.5 if rc else -1.0)
            if causal:
                expected[0] = np.nan if not rc else -2.0  # the forward strand never predicts the first base
                if rc:
                    expected[-1] = -1.0  # nor the reverse strand the last
            np.testing.assert_array_equal(ll, expected, err_msg=f"causal={causal} rc={rc}")
    assert windows([Sequence("x", tokens[:1], np.zeros(1, bool))], 4, True, False) == []


def test_summary_leaves_out_n_and_splits_soft_masked():
    tokens = np.array([3, 4, N_ID, 6, 3], dtype=np.uint8)
    soft = np.array([False, True, True, False, True])
    ll = np.array([np.nan, -1.0, -5.0, -2.0, -4.0])
    s = summarise([Sequence("r", tokens, soft)], [ll])
    assert s["overall"]["bases"] == 3 and s["records"][0]["n_bases"] == 1
    assert s["overall"]["nll_nats"] == pytest.approx(7.0)
    assert s["softmasked"]["bits_per_base"] == pytest.approx(5.0 / 2 / math.log(2))
    assert s["unmasked"]["bits_per_base"] == pytest.approx(2.0 / math.log(2))
    assert s["per_sequence_mean_nll"] == pytest.approx(7.0 / 3)
    assert isinstance(Window(0, 0, 0, tokens), Window)


def test_bgzf_regions_soft_masked_json(trained, tmp_path, capsys):
    yeast = copy_genome("scerevisiae_S288C_ASM205763v1.fa.bgz", tmp_path)
    soft = copy_genome("hg19_chr17_1-40000_softmasked.fa", tmp_path)
    out = tmp_path / "eval.json"
    run = str(trained.run_dir("dense"))
    assert run_eval(run, yeast, regions=["chrI:1-700", "chrV:101-400"], output=str(out)) == 0
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["records"]] == ["chrI:1-700", "chrV:101-400"]
    assert [r["bases"] for r in result["records"]] == [699, 299]
    assert "per-sequence mean NLL" in capsys.readouterr().out
    assert run_eval(run, soft, regions=["chr17:1-3000"], output=str(out)) == 2  # an earlier result is kept ...
    assert "--output" in capsys.readouterr().err and json.loads(out.read_text()) == result
    assert run_eval(run, soft, regions=["chr17:1-3000"], output=str(out), overwrite=True) == 0  # ... unless asked
    result = json.loads(out.read_text())
    masked, unmasked = result["softmasked"], result["unmasked"]
    assert masked["bases"] > 0 and unmasked["bases"] > 0
    assert masked["bases"] + unmasked["bases"] == result["overall"]["bases"]


def test_bad_input_exits_2_naming_the_cause(trained, tmp_path, capsys):
    run = trained.run_dir("dense")
    fasta = trained.fasta
    assert run_eval(run, fasta, window=129) == 2
    assert "--window=129" in capsys.readouterr().err
    assert run_eval(run, fasta, regions=["chrX:1-10"]) == 2
    assert "--regions chrX:1-10" in capsys.readouterr().err
    empty = tmp_path / "empty"
    shutil.copytree(run, empty, ignore=shutil.ignore_patterns("checkpoints"))
    assert run_eval(empty, fasta) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    other = tmp_path / "other"
    shutil.copytree(run, other)
    cfg = yaml.safe_load((other / "config.yaml").read_text())
    cfg["model"]["d_model"] = 64
    (other / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert run_eval(other, fasta) == 2
    err = capsys.readouterr().err
    assert "not the model of its config" in err and "embed.weight" in err
