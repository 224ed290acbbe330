"""Tiers 2-3: real DeepSpeed on the CPU accelerator (gloo), started by the real `deepspeed` launcher.

Success is judged by what the run wrote (metrics, summary, COMPLETE markers), not only by the exit code:
on CPU about 1 run in 15 has one rank abort at interpreter teardown after finishing its work (see
docs/platform.md); the run itself tears its process group down explicitly to make that rare.
"""

import json
import os

import pytest
from support.helpers import cli, copy_genome, launch, tiny_config, write_yaml

from megagenome.observe.dashboards import read_tensorboard, scalars
from megagenome.observe.metrics import read_metrics

pytestmark = pytest.mark.slow


def finished(run_dir, proc) -> list[dict]:
    """Rows of a run that must have finished; shows the run's output when it did not."""
    summary = os.path.join(run_dir, "summary.json")
    assert os.path.exists(summary), (
        f"run did not finish (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def train_losses(rows):
    return {r["step"]: r["loss"] for r in rows if "split" not in r}


@pytest.fixture(scope="module")
def phix(tmp_path_factory):
    return copy_genome("phiX174_NC_001422.1.fna", tmp_path_factory.mktemp("genome"))


@pytest.fixture(scope="module")
def uninterrupted(phix, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    run_dir = tmp / "run"
    proc = launch(2, "pretrain", "--config", write_yaml(tmp / "c.yaml", tiny_config(tmp, phix, run_dir)))
    return run_dir, proc, finished(str(run_dir), proc)


def test_two_rank_run_through_the_deepspeed_launcher(uninterrupted):
    run_dir, proc, rows = uninterrupted
    assert sorted(os.listdir(run_dir)) == sorted(
        [
            ".megagenome.lock",  # the run lock (run/lock.py), released at the end, kept as the last holder's record
            "checkpoints",
            "config.yaml",
            "ds_config.json",
            "env.json",
            "logs",  # DeepSpeed's and torch's lines of each rank (console.py)
            "memory.json",
            "metrics.jsonl",
            "split.json",
            "summary.json",
            "tensorboard",
        ]
    )
    memory = json.loads((run_dir / "memory.json").read_text())
    assert memory["world_size"] == 2 and memory["step"] == 2 and len(memory["ranks"]) == 2
    assert all(r["total"] > 0 and r["optimizer_states"] > 0 for r in memory["ranks"])
    env = json.loads((run_dir / "env.json").read_text())
    assert env["world_size"] == 2 and env["deepspeed"] == "0.19.8"
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 4  # micro 2 x accumulation 1 x 2 ranks
    train = [r for r in rows if "split" not in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]  # written once, by rank 0 only
    for key in ["tokens", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mem_peak_bytes"]:
        assert train[-1][key] is not None, key
    assert train[-1]["tokens"] == 6 * 4 * 64
    evals = [r for r in rows if r.get("split") == "val"]
    assert [r["step"] for r in evals] == [3, 6] and all(r["bits_per_base"] > 0 for r in evals)
    ckpts = sorted(os.listdir(run_dir / "checkpoints"))
    assert ckpts == ["step_00000003", "step_00000006"]
    assert all((run_dir / "checkpoints" / c / "COMPLETE").exists() for c in ckpts)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["markov_bits_per_base"]) == {str(k) for k in range(9)}
    assert "held-out bits/base" in proc.stdout and "Markov baselines   order-0..8" in proc.stdout
    split = json.loads((run_dir / "split.json").read_text())
    assert split  # the split is recorded
    assert tensorboard_matches_metrics(run_dir, rows)
    shown = cli("report", str(run_dir))  # `megagenome report`: its plots and report.md, default RUN/report
    assert shown.returncode == 0 and "report.md and 6 plot(s)" in shown.stdout, shown.stderr[-3000:]
    pngs = ["bits_per_base", "loss", "lr", "memory", "mfu", "tokens_per_s"]
    assert sorted(os.listdir(run_dir / "report")) == sorted([f"{n}.png" for n in pngs] + ["report.md"])
    report = (run_dir / "report" / "report.md").read_text()
    assert "| steps | 6 of 6 |" in report and "order-8 Markov" in report and "Not drawn" not in report


def tensorboard_matches_metrics(run_dir, rows) -> bool:
    """The TensorBoard event files show every number of every metrics row (training and eval) at its step, once."""
    expected = {}
    for row in rows:
        step, values = scalars(row)
        for tag, value in values.items():
            expected.setdefault(tag, {})[step] = value
    shown = read_tensorboard(str(run_dir / "tensorboard"))
    assert set(shown) == set(expected) and {"train/loss", "val/bits_per_base"} <= set(shown)
    for tag in expected:
        assert shown[tag] == pytest.approx(expected[tag], rel=1e-6), tag  # float32 in the event files
    return True


def test_resume_equals_uninterrupted(uninterrupted, phix, tmp_path):
    """Stop after step 3 (a checkpoint), resume in a new invocation: steps 4-6 match to 1e-6 (fp32)."""
    _, _, full_rows = uninterrupted
    run_dir = tmp_path / "run"
    cfg = write_yaml(tmp_path / "c.yaml", tiny_config(tmp_path, phix, run_dir))
    first = launch(2, "pretrain", "--config", cfg, "--train.stop_at", "3")
    assert (run_dir / "checkpoints" / "step_00000003" / "COMPLETE").exists(), first.stderr[-4000:]
    second = launch(2, "pretrain", "--config", cfg)
    assert "resumed from" in second.stdout
    resumed_rows = finished(str(run_dir), second)
    resumed = train_losses(resumed_rows)
    assert tensorboard_matches_metrics(run_dir, resumed_rows)  # two invocations, two event files, each step once
    reference = train_losses(full_rows)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6, rel=0), step


def test_local_sh_without_the_venv_says_what_to_do(tmp_path):
    """A new shell without the virtual environment: one line naming the activate script, not a ModuleNotFoundError
    from deep inside the launch. The system's python stands in as a script that has no torch, as a distribution's
    python3 has none (a stand-in: the CI machine's own python may differ)."""
    import subprocess

    from support.helpers import REPO

    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    (bare / "python").chmod(0o755)
    env = {"PATH": f"{bare}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(REPO / "launch" / "local.sh"), "--config", "configs/tiny.yaml"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "activate the checkout's virtual environment first" in proc.stderr and ".venv/bin/activate" in proc.stderr
