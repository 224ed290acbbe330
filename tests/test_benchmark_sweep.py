"""benchmarks/sweep.py: a two-cell sweep on 2 CPU ranks runs and writes its results; out-of-memory becomes a row.

Checks outputs, never speed: the CSV, Markdown and JSON (and the PNG where matplotlib is installed) exist with one
row per cell, every cell ok with positive tokens/s, per-rank peak memory and model states; re-reported with a tiny
--cpu_memory_budget_gb the same cells are simulated-oom rows (labelled so, throughput dropped). The launch takes
~30 s on 2 cores; the pure parts (grid, sizes, out-of-memory classification) are checked without one, as are those
of benchmarks/peers.py (its batch bookkeeping, ratios and verdicts, and the HF model's shape where transformers is
installed) and of benchmarks/fused_paths.py (its per-round ratios).
"""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch
from support.helpers import DATA, REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import fused_paths  # noqa: E402
import harness  # noqa: E402
import peers  # noqa: E402
import peers_worker  # noqa: E402
import sweep  # noqa: E402

ARGS = ["--sizes", "tiny", "--seq_lens", "256", "--zero", "1", "--checkpointing", "none", "--micro", "1,2"]
ARGS += ["--steps", "3", "--warmup", "1", "--nproc", "2", "--fasta", str(DATA / "phiX174_NC_001422.1.fna")]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    argv = [*ARGS, "--results_dir", str(root / "results"), "--work_dir", str(root / "work")]
    return root, argv, sweep.main(argv)


@pytest.mark.slow
def test_two_cells_ok(swept):
    root, _, paths = swept
    try:
        import matplotlib  # noqa: F401  (the bench extra)

        has_matplotlib = True
    except ImportError:
        has_matplotlib = False
    assert {"csv", "md", "json"} <= set(paths)
    assert ("png" in paths) == has_matplotlib
    for p in paths.values():
        assert p.exists() and p.stat().st_size > 0
    with open(paths["csv"]) as fh:
        rows = list(csv.DictReader(fh))
    assert [r["micro"] for r in rows] == ["1", "2"]
    for r in rows:
        assert r["status"] == "ok", r["error"]
        assert float(r["tokens_per_s"]) > 0 and float(r["step_s"]) > 0 and float(r["tflops_per_device"]) > 0
        assert r["world"] == "2" and r["dp"] == "2" and r["zero"] == "1" and r["precision"] == "bf16"
        peaks = [float(v) for v in r["peak_gib_per_rank"].split("/")]
        states = [float(v) for v in r["model_state_gib_per_rank"].split("/")]
        assert len(peaks) == len(states) == 2 and all(p > s > 0 for p, s in zip(peaks, states))
        assert r["memory_kind"] == "peak RSS" and int(r["parameters"]) == sweep.parameters("tiny")
    result = json.loads(paths["json"].read_text())
    assert len(result["rows"]) == 2 and result["meta"]["command"].startswith("python benchmarks/sweep.py --sizes tiny")
    md = paths["md"].read_text()
    assert "- command: `python benchmarks/sweep.py" in md and "- hardware:" in md and "- software:" in md
    assert md.count("| tiny_s256_z1_none_m") == 2
    if not has_matplotlib:
        assert "plot: not written (matplotlib is not installed" in md
    # global tokens/s = tokens per step / step time (2 ranks x micro x 256 tokens)
    for r in rows:
        assert float(r["tokens_per_s"]) * float(r["step_s"]) == pytest.approx(2 * int(r["micro"]) * 256, rel=1e-3)


@pytest.mark.slow
def test_simulated_oom_is_a_row(swept):
    root, argv, _ = swept
    argv = [*argv[: argv.index("--results_dir")], "--results_dir", str(root / "budget"), "--work_dir"]
    argv += [str(root / "work"), "--cpu_memory_budget_gb", "0.01"]
    args = sweep.parse_args(argv)
    work, cells = sweep.plan(args)
    paths = sweep.report(args, argv, work, cells, [], 0.0)
    with open(paths["csv"]) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2
    for r in rows:
        assert r["status"] == "oom" and r["oom_kind"] == "simulated" and r["tokens_per_s"] == ""
        assert r["error"].startswith("simulated: peak RSS") and r["peak_gib_per_rank"]
    measured = [r["tokens_per_s_measured_simulated_oom"] for r in json.loads(paths["json"].read_text())["rows"]]
    assert all(v > 0 for v in measured)
    assert "oom (simulated)" in paths["md"].read_text()


def test_grid_and_configs(tmp_path):
    args = sweep.parse_args(["--sizes", "tiny,d64l2h2", "--zero", "0,3", "--checkpointing", "none,full", "--pp", "1,2"])
    cells = sweep.grid(args)
    assert len(cells) == 2 * 2 * 2 * 2 and len({c["cell"] for c in cells}) == len(cells)
    fasta = DATA / "phiX174_NC_001422.1.fna"
    by_name = {c["cell"]: c for c in cells}
    z0 = sweep.cell_config(by_name["tiny_s512_z0_none_m1_tp1_pp1_w2"], tmp_path / "a", tmp_path, fasta, args)
    assert z0["train"]["ds_config"] == [str(REPO / "ds_configs" / "zero0.json"), str(tmp_path / harness.BF16_ONLY)]
    z3 = sweep.cell_config(by_name["d64l2h2_s512_z3_full_m1_tp1_pp2_w2"], tmp_path / "b", tmp_path, fasta, args)
    assert z3["train"]["ds_config"][-1] == str(REPO / "ds_configs" / "bf16.json")
    # pipeline stages recompute through the pipeline engine's interval, not --model.checkpointing
    assert z3["model"]["checkpointing"] == "none" and z3["parallel"]["pipeline_checkpoint_interval"] == 1
    assert z3["train"]["max_steps"] == args.warmup + args.steps and z3["train"]["log_interval"] == 1
    before = sorted(DATA.glob("*.fai"))  # an older checkout may hold one a previous version left
    assert sweep.held_out(fasta, 512) == ["NC_001422.1:4361-5386"]  # 2 x 513 bases at the end of phiX's 5,386
    assert sorted(DATA.glob("*.fai")) == before, "an index was written beside tests/data's genome (use the cache)"
    assert sweep.model_shape("d64l2h2") == (64, 2, 2) and sweep.parameters("tiny") == 854_144
    with pytest.raises(SystemExit):
        sweep.parse_args(["--sizes", "huge"])


def test_oom_kind():
    assert sweep.oom_kind(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "cuda"
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:119] . DefaultCPUAllocator: can't allocate memory: you tried")
    assert sweep.oom_kind(cpu) == "cpu allocator"
    assert sweep.oom_kind(MemoryError()) == "cpu allocator"
    assert sweep.oom_kind(RuntimeError("shape mismatch")) is None and sweep.oom_kind(ValueError("x")) is None


# ----- benchmarks/peers.py: its pure parts (the launch itself is benchmarks/results/peers.md's run) -----------------


def test_peers_interleaved_expected():
    """The shared a / a_fit engine's forwards: a_fit's warm-up batch, then each round's a and a_fit blocks in the
    rotated order [a, a_fit, b], [a_fit, b, a], [b, a, a_fit], ... (b runs on its own engine)."""
    expected = list(range(20))
    out = peers_worker.interleaved_expected(expected, 2, 2, 3, 1)
    assert out == [0] + [2, 3] + [1, 2] + [3, 4] + [4, 5] + [6, 7] + [5, 6]
    assert peers_worker.interleaved_expected(expected, 1, 1, 1, 2) == [0, 1] + [2, 3] + [2, 3]


def test_peers_figures_and_verdicts():
    def rank(a, b):  # seconds per step per round of each framework on one rank
        return {"times": {"a": a, "a_fit": a, "b": b, "c": b}}

    ranks = [rank([1.0, 2.0, 1.0], [1.0, 1.0, 2.0]), rank([0.5, 2.2, 1.0], [1.0, 1.0, 1.0])]
    f = peers.figures(ranks, "times", tokens_per_step=100)
    assert f["seconds_per_step_per_round"]["a"] == [1.0, 2.2, 1.0]  # the slowest rank of every round
    assert f["seconds_per_step_median"]["a"] == 1.0 and f["tokens_per_s_median"]["a"] == 100.0
    assert f["paired_ratios"]["a_over_b"] == pytest.approx([1.0, 2.2, 0.5])
    assert f["targets"]["a_over_b"]["median_paired_ratio"] == pytest.approx(1.0)
    assert harness.verdict(0.95, 1.02, "<=", 1.03) == "met"
    assert harness.verdict(1.04, 1.2, "<=", 1.03) == "not met"
    assert harness.verdict(0.9, 1.1, "<", 1.0).startswith("not resolved")
    assert harness.quartiles([2.0]) == (2.0, 2.0, 2.0)


def test_peers_llama_matches_megagenome_shape():
    pytest.importorskip("transformers")  # the bench extra
    import transformers

    from megagenome.config import ModelConfig, RootConfig
    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model.transformer import DNATransformer

    cfg = RootConfig(model=ModelConfig(d_model=64, n_layer=2, n_head=2, max_seq_len=128))
    ours = DNATransformer(cfg.model, VOCAB_SIZE)
    config = peers_worker.llama_config(cfg, ours.padded_vocab_size, 128)
    theirs = transformers.LlamaForCausalLM(config)
    assert config.intermediate_size == ours.blocks[0].mlp.w_up.out_features
    assert peers_worker.parameter_breakdown(ours) == peers_worker.parameter_breakdown(theirs)
    assert peers_worker.parameter_breakdown(ours)["total"] == ours.num_parameters()


def test_fused_paths_ratios_pair_the_slowest_rank_of_each_round():
    def rank(eager, compiled):
        return {"times": {"eager": eager, "compiled": compiled}, "first_step_s": {"eager": 0.1, "compiled": 9.0},
                "first_loss": {"eager": 2.0, "compiled": 2.0}, "batch": {"global_batch": 4, "seq_len": 8}}  # fmt: skip

    out = fused_paths.summarise([rank([2.0, 3.0, 4.0], [1.0, 2.0, 2.0]), rank([2.5, 2.0, 4.0], [1.0, 1.0, 4.0])])
    assert out["seconds_per_step_per_round"] == {"eager": [2.5, 3.0, 4.0], "compiled": [1.0, 2.0, 4.0]}
    assert out["eager_over_compiled_paired"] == [2.5, 1.5, 1.0]
    assert out["eager_over_compiled_quartiles"] == (1.25, 1.5, 2.0)
    assert out["tokens_per_s_median"]["compiled"] == 32 / 2.0 and out["first_step_s"]["compiled"] == 9.0
