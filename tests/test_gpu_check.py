"""benchmarks/gpu_check.py on CPU: its arithmetic and verdicts, and a `--smoke` run end to end (tiny shapes, SDPA,
no GPU tests; the Hugging Face peer cells run where transformers is installed and are skipped with the reason where
it is not). Checks outputs, never speed: no GPU runs here.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from support.helpers import PYTHON, REPO, env

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402

from megagenome.metrics import flops_per_token  # noqa: E402

H200 = 150_000_000_000  # bytes torch reports for an H200 (~139.7 GiB)
H100 = 85_000_000_000  # an H100 80GB


def test_micro_estimate_table():
    # 1B: 1,011,976,192 parameters (configs/dna_1b.yaml), 20 x 2048; 125M: 84,960,000, 12 x 768.
    one_b, small = (1_011_976_192, 20, 2048), (84_960_000, 12, 768)
    assert [gpu_check.estimate_micro(*one_b, s, H200) for s in (2048, 8192)] == [16, 4]
    assert [gpu_check.estimate_micro(*small, s, H200) for s in (2048, 8192)] == [32, 8]  # the 65,536-token cap
    assert [gpu_check.estimate_micro(*one_b, s, H100) for s in (2048, 8192)] == [4, 1]
    assert gpu_check.estimate_micro(*one_b, 8192, 10 * 2**30) == 1  # never below 1: the cell then runs out of memory


def test_only_files_with_gpu_tests_are_collected():
    files = gpu_check.gpu_test_files()
    assert "tests/test_fp16_gpu.py" in files and "tests/test_model_layers.py" in files
    assert "tests/test_tune.py" not in files


def test_gpu_test_step_counts_outcomes(tmp_path, monkeypatch):
    # Without CUDA every GPU-marked test skips: the step runs them and reads the counts and reasons from pytest -v.
    monkeypatch.chdir(REPO)
    t = gpu_check.run_gpu_tests(gpu_check.Clock(300), tmp_path)
    assert t["status"] == "ran" and t["exit_status"] == 0, t
    assert (t["passed"], t["failed"], t["error"]) == (0, 0, 0) and t["skipped"] >= 5
    assert any("needs a CUDA device" in reason for reason in t["skip_reasons"])


def _cell(impl, model, seq, mfu, status="ok"):
    return {
        "impl": impl,
        "model": model,
        "seq": seq,
        "status": status,
        "micro": 4,
        "mfu": mfu,
        "tokens_per_s": 1000.0,
        "tflops_per_gpu": 1.0,
        "parameters": 10,
        "attention": "sdpa",
    }


def test_goal_verdicts():
    h200 = {"name": "NVIDIA H200", "peak_name": "H200 SXM"}
    assert gpu_check.goal([_cell("megagenome", "1B", 8192, 0.46)], h200, smoke=False)["met"] is True
    assert gpu_check.goal([_cell("megagenome", "1B", 8192, 0.44)], h200, smoke=False)["met"] is False
    a100 = {"name": "NVIDIA A100-SXM4-80GB", "peak_name": "A100 SXM"}
    assert gpu_check.goal([_cell("megagenome", "1B", 8192, 0.6)], a100, smoke=False)["met"] is None
    skipped = [{**_cell("megagenome", "1B", 8192, None, "skipped"), "reason": "time budget"}]
    g = gpu_check.goal(skipped, h200, smoke=False)
    assert g["met"] is None and "time budget" in g["note"]


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
    assert r["attention"] == {
        "megagenome": "sdpa",
        "hf": "sdpa",
        "note": "flash-attn not importable here: PyTorch SDPA for both",
    }
    ours = [c for c in r["cells"] if c["impl"] == "megagenome"]
    peers = [c for c in r["cells"] if c["impl"] == "hf"]
    assert [(c["model"], c["seq"]) for c in ours] == [("1B", 128), ("1B", 64), ("125M", 128), ("125M", 64)]
    params = {"1B": 107_328, "125M": 33_184}  # the smoke shapes: d 64 x 2 layers, d 32 x 2 layers
    for c in ours:
        assert c["status"] == "ok", c
        assert c["parameters"] == params[c["model"]] and c["micro"] == 2 and c["tokens_per_s"] > 0
        expected = flops_per_token(c["parameters"], c["n_layer"], c["d_model"], c["seq"]) * c["tokens_per_s"] / 1e12
        assert c["tflops_per_gpu"] == pytest.approx(expected, rel=1e-6)
        assert c["mfu"] == pytest.approx(c["tflops_per_gpu"] / c["peak_tflops"], rel=1e-6)
        assert c["peak_source"] == "measured-cpu-matmul" and c["peak_mem_bytes"] > 0
    assert len(peers) == 4
    if importlib.util.find_spec("transformers") is None:
        assert all(c["status"] == "skipped" and "transformers is not installed" in c["reason"] for c in peers)
    else:
        for c in peers:
            assert c["status"] == "ok", c
            assert c["parameters"] == params[c["model"]] and c["attn_implementation"] == "sdpa"
    assert r["goal"]["met"] is None and "smoke" in r["goal"]["note"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("# GPU check (") and "| implementation | model | params |" in md
    assert "Goal (>= 45.0% MFU, megagenome 1B seq 8192): not decided" in md
