"""benchmarks/gpu_check.py on CPU: its package probe, arithmetic, peaks and verdicts, its step plan and error handling,
and a `--smoke` run end to end (tiny shapes, SDPA, no GPU tests; the Hugging Face peer cells run where transformers
is installed and are skipped with the reason where it is not). Checks outputs, never speed: no GPU runs here.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
from support.helpers import PYTHON, REPO, env

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_check_cells as cells  # noqa: E402

from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model.hyena import STRIPED_HYENA
from megagenome.model.transformer.flops import flops_per_token
from megagenome.observe.metrics import gpu_peak  # noqa: E402

STRIPED_SMOKE_PARAMETERS = 228_736  # the striped smoke shape: d 64, SE, MR, LI and attention layers
H200 = 150_000_000_000  # bytes torch reports for an H200 (~139.7 GiB)
H100 = 85_000_000_000  # an H100 80GB


def test_micro_estimate_table():
    # 1B: 1,027,704,832 parameters (configs/dna_1b.yaml, d_ff 5632), 20 x 2048; 125M: 84,960,000, 12 x 768.
    one_b, small = (1_027_704_832, 20, 2048), (84_960_000, 12, 768)
    assert [cells.estimate_micro(*one_b, s, H200) for s in (2048, 8192, 32768)] == [16, 4, 1]
    assert [cells.estimate_micro(*small, s, H200) for s in (2048, 8192, 32768)] == [32, 8, 2]  # 65,536-token cap
    assert [cells.estimate_micro(*one_b, s, H100) for s in (2048, 8192)] == [4, 1]
    assert cells.estimate_micro(*one_b, 8192, 10 * 2**30) == 1  # never below 1: the cell then runs out of memory


@pytest.mark.parametrize(
    "name, table, tflops",
    [
        ("NVIDIA H200", "H200 SXM", 989.0),
        ("NVIDIA H200 NVL", "H200 NVL", 835.0),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.0),
        ("NVIDIA H100 NVL", "H100 NVL", 835.0),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.0),
        ("NVIDIA GH200 480GB", "GH200", 989.0),
    ],
)
def test_peaks_of_the_names_torch_reports(name, table, tflops):
    """torch.cuda.get_device_properties(0).name as it reads on each Hopper part: the NVL and PCIe variants have lower
    clocks and must not get the SXM peak (that would understate their MFU by up to a quarter)."""
    assert gpu_peak(name) == (table, tflops)
    assert table in gpu_check.HOPPER


def test_probe_names_every_missing_package_with_its_pip_name(monkeypatch, capsys):
    """A missing needed package is found before anything else runs, named with what to pip install, and stops the
    check with exit status 3; a missing optional one is reported with what it skips."""
    monkeypatch.setattr(gpu_check, "PROBE_REQUIRED", [*gpu_check.PROBE_REQUIRED, ("no_such_mod_x", "no-such-pkg-x")])
    monkeypatch.setattr(gpu_check, "PROBE_OPTIONAL", [("no_such_mod_y", "no-such-pkg-y", "the y cells")])
    missing, optional = gpu_check.probe_imports()
    assert [m["pip"] for m in missing] == ["no-such-pkg-x"] and "ModuleNotFoundError" in missing[0]["error"]
    assert [(m["pip"], m["skips"]) for m in optional] == [("no-such-pkg-y", "the y cells")]
    assert gpu_check.main(["--smoke", "--out", "/nonexistent/never-written"]) == gpu_check.MISSING_EXIT
    out = capsys.readouterr()
    assert "missing package: pip install no-such-pkg-x" in out.out and "the y cells skipped" in out.out


def test_probe_covers_what_deepspeed_requires():
    """Every install requirement of the installed DeepSpeed (py-cpuinfo, ninja, hjson, msgpack, ...) is probed."""
    from importlib import metadata

    names = [re.split(r"[;<>=! ]", r)[0] for r in metadata.requires("deepspeed") if "extra ==" not in r]
    required = {name.lower() for name in names}
    probed = {pip.lower() for _, pip in gpu_check.PROBE_REQUIRED}
    assert required <= probed, required - probed
    assert {"jsonargparse", "pyfaidx", "pyyaml", "numpy", "torch", "mambapy"} <= probed


def test_only_files_with_gpu_tests_are_collected():
    files = gpu_check.gpu_test_files()
    assert "tests/test_fp16_gpu.py" in files and "tests/test_model_layers.py" in files
    assert "tests/test_tune.py" not in files and "tests/test_gpu_check.py" not in files
    assert "tests/test_fused_paths.py" in files  # the fused paths against eager, on the GPU
    assert "tests/test_caduceus_scan.py" in files  # the fused CUDA scan against the float64 loop


def test_gpu_test_step_counts_outcomes(tmp_path, monkeypatch):
    # Without CUDA every GPU-marked test skips: the step runs them and reads the counts and reasons from pytest -v.
    monkeypatch.chdir(REPO)
    t = gpu_check.run_gpu_tests(gpu_check.Clock(300), tmp_path)
    assert t["status"] == "ran" and t["exit_status"] == 0, t
    assert (t["passed"], t["failed"], t["error"]) == (0, 0, 0) and t["skipped"] >= 5
    assert any("needs a CUDA device" in reason for reason in t["skip_reasons"])


def _cell(model, seq, mfu, status="ok", variant="eager"):
    return {"impl": "megagenome", "variant": variant, "model": model, "seq": seq, "status": status, "mfu": mfu}


def test_goal_verdicts():
    h200 = {"name": "NVIDIA H200", "peak_name": "H200 SXM"}
    g8, g32 = gpu_check.goals([_cell("1B", 8192, 0.46), _cell("1B", 32768, 0.34)], h200, smoke=False)
    assert (g8["met"], g8["target_mfu"], g32["met"], g32["target_mfu"]) == (True, 0.45, False, 0.35)
    nvl = {"name": "NVIDIA H200 NVL", "peak_name": "H200 NVL"}
    assert gpu_check.goals([_cell("1B", 8192, 0.44)], nvl, smoke=False)[0]["met"] is False
    compiled_only = [_cell("1B", 8192, 0.5, variant="compile")]  # the goal is judged on the eager cell
    assert gpu_check.goals(compiled_only, h200, smoke=False)[0]["met"] is None
    a100 = {"name": "NVIDIA A100-SXM4-80GB", "peak_name": "A100 SXM"}
    assert gpu_check.goals([_cell("1B", 8192, 0.6)], a100, smoke=False)[0]["met"] is None
    skipped = [{**_cell("1B", 8192, None, "skipped"), "reason": "time budget"}]
    g = gpu_check.goals(skipped, h200, smoke=False)[0]
    assert g["met"] is None and "time budget" in g["note"]


def test_mfu_in_both_conventions():
    c = {"status": "ok", "parameters": 1_027_704_832, "n_layer": 20, "d_model": 2048, "seq": 8192, "tokens_per_s": 5e4}
    out = cells.with_mfu(c, 989.0)
    causal, full = flops_per_token(1_027_704_832, 20, 2048, 8192), flops_per_token(1_027_704_832, 20, 2048, 8192, False)
    assert causal == 6 * 1_027_704_832 + 6 * 20 * 2048 * 8192 and full == causal + 6 * 20 * 2048 * 8192
    assert out["mfu"] == pytest.approx(causal * 5e4 / 1e12 / 989.0)
    assert out["mfu_full_attn"] == pytest.approx(full * 5e4 / 1e12 / 989.0)
    assert out["mfu_full_attn"] / out["mfu"] == pytest.approx(10.193e9 / 8.179e9, rel=1e-3)  # 25% more at 8k


def test_cells_log_and_sync_only_every_few_steps(tmp_path):
    """A cell's child writes a metrics row, so waits for the device, every plan["log_interval"] steps and at no other
    step (run/trials.py's trial config logs every step); --warmup and --steps are rounded up to whole rows."""
    plan = cells.step_plan(5, 10, 5)
    assert plan == {"log_interval": 5, "warmup": 5, "steps": 10, "warmup_rows": 1, "timed_rows": 2, "note": ""}
    rounded = cells.step_plan(3, 12, 5)
    assert (rounded["warmup"], rounded["steps"], rounded["timed_rows"]) == (5, 15, 3)
    assert "--warmup 3 rounded up to 5, --steps 12 rounded up to 15" in rounded["note"]
    assert cells.step_plan(1, 1, 1)["note"] == "" and cells.step_plan(0, 1, 5)["warmup_rows"] == 0
    cfg = cells.cell_config("1B", 128, "eager", True, "unused.fa")
    trial = cells.cell_trial_config(cfg, 4, plan, tmp_path / "run")
    t = trial.train
    assert (t.max_steps, t.micro_batch_size, t.log_interval, t.sync_interval) == (15, 4, 5, 5)
    assert (t.eval_interval, trial.checkpoint.interval, trial.log.run_dir) == (0, 0, str(tmp_path / "run"))
    assert [d for d in range(1, 16) if d % t.log_interval == 0] == [5, 10, 15]  # rows: 1 warm-up, 2 timed


def test_tokens_per_s_comes_from_the_timed_rows():
    plan = cells.step_plan(5, 10, 5)
    rows = [{"step": 5, "window_tokens": 5000, "tokens_per_s": 10.0}]  # warm-up: 500 s
    rows += [
        {"step": 10, "window_tokens": 5000, "tokens_per_s": 1000.0},
        {"step": 15, "window_tokens": 5000, "tokens_per_s": 500.0},
    ]
    timed = cells.timed_rows(rows, plan)
    assert [r["step"] for r in timed] == [10, 15] and cells.timed_rows(rows[:2], plan) == rows[1:2]
    out = cells.throughput(timed)
    assert out["tokens_per_s"] == pytest.approx(10000 / 15.0) and out["timed_s"] == 15.0
    assert out["row_tokens_per_s"] == [1000.0, 500.0]


def test_a_cell_that_raises_is_recorded_and_results_are_written_after_each_cell(tmp_path, monkeypatch):
    """The real megagenome_cell needs a GPU-sized run (a child training process); here it is replaced by a stand-in
    that fails once and otherwise returns a measured cell, and checks what is on disk each time it is called."""
    seen = []

    def fake_cell(cfg, micro, plan, work, timeout):
        seen.append(json.loads((tmp_path / "gpu_check.json").read_text()))  # written before every cell
        if len(seen) == 1:
            raise RuntimeError("boom in the first cell")
        return {"micro": micro, "status": "ok", "parameters": 1000, "tokens_per_s": 50.0, "peak_tflops": 1.0}

    def fake_peer(spec, work, timeout):
        return {"status": "ok", "micro": spec["micro"], "parameters": 1000, "tokens_per_s": 40.0}

    monkeypatch.setattr(cells, "megagenome_cell", fake_cell)
    monkeypatch.setattr(cells, "hf_cell", fake_peer)
    monkeypatch.chdir(tmp_path)  # main() moves to the repository root
    assert gpu_check.main(["--smoke", "--out", str(tmp_path)]) == 0
    assert [len(r["cells"]) for r in seen] == [0, 1, 2, 4, 5]  # the flash cell is skipped on CPU without a call
    assert not any(r["complete"] for r in seen) and seen[1]["cells"][0]["status"] == "error"
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    first, *rest = r["cells"]
    assert r["complete"] and first["status"] == "error" and "RuntimeError: boom in the first cell" in first["reason"]
    assert "in fake_cell" in first["reason"] and (first["model"], first["seq"], first["variant"]) == (
        "1B",
        128,
        "eager",
    )
    assert [c["status"] for c in rest if c["impl"] == "megagenome"] == ["ok", "ok", "skipped", "ok", "ok"]
    peer = "skipped" if importlib.util.find_spec("transformers") is None else "ok"
    assert [c["status"] for c in rest if c["impl"] == "hf"] == [peer, peer]
    assert "| error: RuntimeError: boom in the first cell |" in (tmp_path / "gpu_check.md").read_text()
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path):
    proc = subprocess.run(
        [PYTHON, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)],
        cwd=tmp_path,
        env={**env(), "OUT": "/nonexistent"},  # --out wins over $OUT
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r["smoke"] and r["tests"]["status"] == "skipped" and r["device"]["type"] == "cpu"
    assert r["attention"] == "auto's choice here: sdpa" and r["complete"]
    assert r["steps"] == {"log_interval": 2, "warmup": 2, "steps": 2, "warmup_rows": 1, "timed_rows": 1} | {
        "note": "",
        "grad_accum": 1,
    }
    ours = [c for c in r["cells"] if c["impl"] == "megagenome"]
    peers = [c for c in r["cells"] if c["impl"] == "hf"]
    shapes = [(c["model"], c["seq"], c["variant"]) for c in ours]
    assert shapes == [("1B", 128, "eager"), ("1B", 256, "eager"), ("1B", 128, "compile"), ("1B", 128, "flash")] + [
        ("125M", 64, "eager"),
        ("S1B", 128, "eager"),
    ]
    flash = ours.pop(3)
    assert flash["status"] == "skipped" and flash["reason"] == "flash-attn is not importable here"
    # the smoke shapes: d 64 x 2 layers, d 32 x 2 layers, a striped d 64 x 4 layers (SE, MR, LI, attention)
    params = {"1B": 107_328, "125M": 33_184, "S1B": STRIPED_SMOKE_PARAMETERS}
    for c in ours:
        assert c["status"] == "ok" and c["ended"] == "done", c  # ended once its rows were written
        assert (c["log_interval"], c["warmup"], c["steps"], c["attention_auto_choice"]) == (2, 2, 2, "sdpa")
        assert len(c["row_tokens_per_s"]) == 1 and c["timed_s"] > 0  # one timed row of 2 steps
        assert c["parameters"] == params[c["model"]] and c["micro"] == 2 and c["tokens_per_s"] > 0
        for i, (suffix, causal) in enumerate((("", True), ("_full_attn", False))):
            flops = flops_per_token(c["parameters"], c["n_layer"], c["d_model"], c["seq"], causal=causal)
            if c["model"] == "S1B":  # the family's own count (model/hyena/costs.py), carried by the cell
                cfg = cells.cell_config("S1B", c["seq"], "eager", True, "unused.fa").model
                n, block = STRIPED_HYENA.parameter_counts(cfg, VOCAB_SIZE)
                assert c["flops_per_token"] == list(STRIPED_HYENA.run_flops(cfg, n, block, c["seq"], True, False)[:2])
                flops = c["flops_per_token"][i]
            assert c[f"tflops_per_gpu{suffix}"] == pytest.approx(flops * c["tokens_per_s"] / 1e12, rel=1e-6)
            assert c[f"mfu{suffix}"] == pytest.approx(c[f"tflops_per_gpu{suffix}"] / c["peak_tflops"], rel=1e-6)
        assert c["peak_source"] == "measured-cpu-matmul" and c["peak_mem_bytes"] > 0
    assert len(peers) == 2
    if importlib.util.find_spec("transformers") is None:
        assert all(c["status"] == "skipped" and "transformers is not installed" in c["reason"] for c in peers)
    else:
        for c in peers:
            assert c["status"] == "ok", c
            assert c["parameters"] == params[c["model"]] and c["attn_implementation"] == "sdpa"
    assert [g["met"] for g in r["goals"]] == [None, None] and all("smoke" in g["note"] for g in r["goals"])
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("# GPU check (") and "| implementation | model | params |" in md and "PARTIAL" not in md
    assert "| attention (auto's choice) |" in md and "may fall back" in md and "every 2; tokens/s over" in md
    assert "Goal (>= 45.0% MFU causal, megagenome 1B seq 8192): not decided" in md
    assert "Goal (>= 35.0% MFU causal, megagenome 1B seq 32768): not decided" in md
