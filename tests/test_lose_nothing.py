"""Lose nothing, whatever happens (the run lock, divergence, resume checks, verified checkpoints, resizing), on real
DeepSpeed runs: each test reproduces a failure a user met and shows it handled, nothing lost, the last good
checkpoint intact, and the resumed losses equal to an uninterrupted run where the run continues.

One 2-rank worker (support/worker.py, through the real `deepspeed` launcher) runs every 2-rank scenario in one
process group; two 1-rank workers (plain processes) run the other halves of the resize scenarios: a run grown from
1 rank to 2 and one shrunk from 2 to 1, each against an uninterrupted run. Signals, restarts and full disks have their
own tests (test_supervise.py, test_stopping.py, test_checkpoint_integrity.py); the lock, the data fingerprints and
the leftovers have unit tests with real processes (test_run_lock.py, test_data_fingerprint.py, test_prepare.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from support.helpers import PYTHON, REPO, copy_genome, env, tiny_config
from support.runs import ds, run_worker

from megagenome.observe.metrics import read_metrics

pytestmark = pytest.mark.slow  # every test reads the runs of the `lose` fixture's three workers

STEPS = 6
RESIZE_ATOL = 2e-6  # another data-parallel size sums the same gradients in another order: float32 rounding only


def _cfg(root, fasta, name, ds_config=None, **train):
    cfg = tiny_config(root, fasta, root / name)
    cfg["model"]["dropout"] = 0.0
    cfg["train"]["ds_config"] = ds_config or ds("zero0")
    cfg["train"].update(train)
    cfg["checkpoint"] = {"interval": 3, "resume": "auto", "keep_last": 10}
    return cfg


def _scenario(cfg, name=None):
    return {"name": name or os.path.basename(cfg["log"]["run_dir"]), "config": cfg}


def _resize(root, fasta, name, **train):
    """ZeRO-1 fp32, global batch 4: micro 2 x accumulation 2 on 1 rank, micro 2 x 1 on 2 ranks."""
    return _cfg(root, fasta, name, ds("zero1"), micro_batch_size=2, **train)


def _diverging(root, fasta, name, ds_config, **train):
    """lr 1e6: the issue's reproduction (gradient norm infinite within a few steps)."""
    cfg = _cfg(root, fasta, name, ds_config, lr=1e6, min_lr=1e5, warmup_steps=0, max_steps=10, **train)
    cfg["checkpoint"]["interval"] = 1
    return cfg


def _spiky(root, fasta, name, **train):
    """An aggressive loss-spike detector (any loss 0.3 sd above the mean of the previous 2), rolling back: it fires
    on this tiny run's ordinary noise, which makes rollbacks happen at steps a test can reproduce."""
    cfg = _cfg(root, fasta, name, max_steps=12, eval_interval=6, spike_sigmas=0.3, spike_window=2, **train)
    cfg["train"].update(on_spike="rollback", nonfinite_limit=100)
    cfg["checkpoint"]["interval"] = 2
    return cfg


@pytest.fixture(scope="module")
def lose(tmp_path_factory):
    """Every scenario's run directory under one root, after the three workers ran (1 rank, 2 ranks, 1 rank)."""
    root = tmp_path_factory.mktemp("lose_nothing")
    fasta = copy_genome("phiX174_NC_001422.1.fna", root / "genomes")
    grow = _resize(root, fasta, "grow", grad_accum_steps=2)
    shrink = _resize(root, fasta, "shrink", grad_accum_steps=1)
    one = [
        _scenario({**grow, "train": {**grow["train"], "stop_at": 3}}),
        _scenario(_resize(root, fasta, "grow_ref", grad_accum_steps=2)),
    ]
    for worker in ("w1a", "w2", "w1b"):
        (root / worker).mkdir()
    runs1 = run_worker(root / "w1a", one, 1)
    holder = subprocess.Popen(  # another run holding the run directory's lock, in a process of its own
        [
            PYTHON,
            "-c",
            "import sys,time; from megagenome.run.lock import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(900)",
            str(root / "locked"),
        ],
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    spiky = _spiky(root, fasta, "spiky")
    split = _spiky(root, fasta, "spiky_split")
    corrupt = _cfg(root, fasta, "corrupt")
    two = [
        _scenario(grow),  # resumes the 1-rank run at 2 ranks
        _scenario({**shrink, "train": {**shrink["train"], "stop_at": 3}}),
        _scenario(_resize(root, fasta, "shrink_ref", grad_accum_steps=1)),
        _scenario(_diverging(root, fasta, "diverge_stop", ds("zero0"), on_nonfinite="stop")),
        _scenario(_diverging(root, fasta, "diverge_skip", ds("zero1", "bf16"), on_nonfinite="skip", nonfinite_limit=2)),
        _scenario(spiky),
        _scenario({**split, "train": {**split["train"], "stop_at": 8}}),
        _scenario(split),
        _scenario(corrupt),
        {"name": "corrupt_it", "check": "support.lose_checks:corrupt_newest", "run_dir": str(root / "corrupt")},
        _scenario(corrupt),  # resumes: the newest checkpoint is bad, the previous one is taken
        _scenario(_cfg(root, fasta, "locked")),
    ]
    try:
        runs2 = run_worker(root / "w2", two, 2, timeout_s=600)
    finally:
        holder.kill()
        holder.wait()
    runs1b = run_worker(root / "w1b", [_scenario(shrink)], 1)
    return {"root": root, "fasta": fasta, "w1": runs1, "w2": runs2, "w1b": runs1b}


def _rows(run_dir, split=None):
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    return [r for r in rows if r.get("split") == split] if split else [r for r in rows if "split" not in r]


def _log(lose, worker: str) -> str:
    path = lose["root"] / worker / "worker.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _not_json(constant: str):
    pytest.fail(f"{constant} in metrics.jsonl: not JSON")


def test_metrics_stay_json_and_stop_on_nonfinite(lose):
    """Issue item 3, stop: lr 1e6 in fp32 made the gradient norm infinite and the run trained on to exit 0, saving
    the diverged weights, with Infinity in metrics.jsonl. Now the first bad step stops the run (Diverged, exit code
    4): no checkpoint of it or after it exists, and every line of metrics.jsonl is strict JSON with the non-finite
    values as null and named."""
    run_dir = lose["root"] / "diverge_stop"
    errors = (run_dir / "error_rank0.txt").read_text()
    assert "Diverged" in errors and "--train.on_nonfinite stop" in errors, errors
    events = _rows(run_dir, "event")
    assert len(events) == 1 and events[0]["event"] == "stop" and events[0]["reason"] == "nonfinite", events
    bad = events[0]["bad_step"]
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=_not_json)
    flagged = [r for r in _rows(run_dir) if r.get("nonfinite")]
    assert all(r[k] is None for r in flagged for k in r["nonfinite"])
    steps = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMPLETE").exists())
    assert steps and max(steps) < bad, (steps, bad)


def test_a_diverged_run_exits_with_4(lose, tmp_path):
    """The same diverging config through `megagenome pretrain` (one process): the command exits with 4, saying why."""
    config = (lose["root"] / "diverge_stop" / "config.yaml").read_text()
    (tmp_path / "run.yaml").write_text(config.replace(str(lose["root"] / "diverge_stop"), str(tmp_path / "run")))
    result = _cli("--config", str(tmp_path / "run.yaml"))
    assert result.returncode == 4, result.stderr[-3000:]
    assert "stopped: step" in result.stderr and "--train.on_nonfinite stop" in result.stderr, result.stderr[-3000:]


def test_nonfinite_steps_skipped_never_update_the_weights(lose):
    """Issue item 3, skip (bf16, ZeRO-1): every bad step is discarded by DeepSpeed, so the checkpoints saved after
    bad steps hold exactly the weights of the last good step; past --train.nonfinite_limit (2) the run stops."""
    run_dir = lose["root"] / "diverge_skip"
    events = _rows(run_dir, "event")
    assert [e["event"] for e in events] == ["skip", "skip", "skip"], events
    first_bad = events[0]["bad_step"]
    assert first_bad > 1, "the first step should be finite (its update makes the model diverge)"
    assert "more than --train.nonfinite_limit=2" in (run_dir / "error_rank0.txt").read_text()

    def weights(step):
        tag = run_dir / "checkpoints" / f"step_{step:08d}" / "mp_rank_00_model_states.pt"
        return torch.load(tag, map_location="cpu", weights_only=False)["module"]

    good = weights(first_bad - 1)
    for e in events[:-1]:  # the last bad step stopped the run before its checkpoint
        after = weights(e["bad_step"])
        assert all(torch.equal(good[k], after[k]) for k in good), f"step {e['bad_step']} changed the weights"
        assert all(torch.isfinite(v.float()).all() for v in after.values())


def test_rollback_skips_batches_and_resumes_exactly(lose):
    """Issue item 3, rollback: a spike reloads the last complete checkpoint and skips the batches since it; the
    event rows say where, the summary counts them, and a run stopped after a rollback and resumed continues to the
    very same losses as the uninterrupted one (the data offset and the spike window are in the checkpoint)."""
    full, split = lose["root"] / "spiky", lose["root"] / "spiky_split"
    events = _rows(full, "event")
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert rollbacks, f"no rollback happened: {events}\n{_log(lose, 'w2')[-4000:]}"
    for e in rollbacks:
        assert e["step"] % 2 == 0 and e["skipped_batches"] == e["bad_step"] - e["step"] > 0, e
        assert e["reason"] == "spike" and e["update_discarded"], e
    assert _summary(full)["bad_steps"]["rollback"] == len(rollbacks)
    assert [r["step"] for r in _rows(full)] == list(range(1, 13))  # rows of rolled-back steps were replaced
    assert [r["loss"] for r in _rows(split)] == [r["loss"] for r in _rows(full)]
    assert [r["loss"] for r in _rows(split, "val")] == [r["loss"] for r in _rows(full, "val")]


def test_corrupt_newest_checkpoint_falls_back(lose):
    """Issue item 7: a truncated mp_rank_00_model_states.pt in the newest checkpoint stopped the resume with
    DeepSpeed's 'checkpoint file is corrupted', naming no file. Now the file is named, every rank falls back to the
    previous complete checkpoint with a warning, and the resumed steps equal the uninterrupted run's."""
    run_dir = lose["root"] / "corrupt"
    log = _log(lose, "w2")
    assert "mp_rank_00_model_states.pt" in log and "falling back" in log, log[-4000:]
    before = [r for r in read_metrics(str(run_dir / "metrics.uninterrupted.jsonl")) if "split" not in r]
    after = _rows(run_dir)
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in after] == [r["loss"] for r in before]


def test_locked_run_dir_refused_before_writing(lose):
    """Issue item 1: a second run into a run directory in use was not refused (both wrote it). Now it is refused
    naming the holder's PID, and nothing of it is written there."""
    run_dir = lose["root"] / "locked"
    errors = (run_dir / "error_rank0.txt").read_text()
    assert "in use" in errors or "locked" in errors.lower(), errors
    written = sorted(p.name for p in run_dir.iterdir() if not p.name.startswith("error_rank"))
    assert written == [".megagenome.lock"], written


@pytest.mark.parametrize("name,ref", [("grow", "grow_ref"), ("shrink", "shrink_ref")])
def test_resize_converts_and_keeps_global_batch(lose, name, ref):
    """A run resumed at another data-parallel size (1 -> 2 ranks, 2 -> 1) used to stop with the command to convert
    its checkpoint. Now it is converted to the universal format automatically and the run continues with the same
    global batch (accumulation adjusted) to the losses of an uninterrupted run, up to float32 rounding."""
    run_dir, ref_dir = lose["root"] / name, lose["root"] / ref
    assert (run_dir / "checkpoints_universal" / "step_00000003" / "COMPLETE").exists(), _log(lose, "w2")[-4000:]
    got, want = _rows(run_dir), _rows(ref_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, want, strict=True):
        assert math.isclose(g["loss"], w["loss"], abs_tol=RESIZE_ATOL), (g["step"], g["loss"], w["loss"])
    final = [r["loss"] for r in _rows(run_dir, "val")][-1]
    assert math.isclose(final, [r["loss"] for r in _rows(ref_dir, "val")][-1], abs_tol=RESIZE_ATOL)


def test_resize_is_recognised_with_a_relative_run_dir(lose, monkeypatch):
    """The shipped configs name their run directory relative to the working directory: a resize of such a run's own
    checkpoint is converted too (validated for 1 rank: the 2-rank ZeRO-1 run keeps its global batch 4 with
    accumulation 2), not refused as another run's."""
    from dataclasses import replace

    from megagenome.config.load import load_config
    from megagenome.run import assembly

    monkeypatch.chdir(lose["root"])
    cfg = load_config(str(lose["root"] / "shrink_ref" / "config.yaml"))
    validated = assembly.validate(replace(cfg, log=replace(cfg.log, run_dir="shrink_ref")), [], 1)
    validated.data.close()
    assert validated.resume.convert and validated.cfg.train.grad_accum_steps == 2, validated.resume.problems


def _cli(*args):
    cmd = [PYTHON, "-m", "megagenome", "pretrain", *args]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)


def test_changed_config_refused_before_anything_is_written(lose):
    """Issue item 4: resuming with another --model.d_model or --data.seq_len was refused only after the ranks had
    loaded the checkpoint, after config.yaml, ds_config.json and split.json were overwritten, in a wall of DeepSpeed
    size mismatches. Now the differing keys are listed with both values before anything starts (exit 2), and the
    run directory is byte for byte as it was."""
    run_dir = lose["root"] / "shrink_ref"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    cfg = str(run_dir / "config.yaml")
    result = _cli("--config", cfg, "--model.d_model", "64", "--data.seq_len", "32")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--model.d_model: checkpoint 32, this run 64" in result.stderr, result.stderr[-3000:]
    assert "--data.seq_len: checkpoint 64, this run 32" in result.stderr
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before


def test_changed_data_refused_unless_allowed(lose, tmp_path):
    """Issue item 5: a different genome at the same path resumed silently. Now its SHA-256 is compared with the
    checkpoint's: refused naming both digests (exit 2), accepted with --checkpoint.allow_data_change true, and the
    change recorded in summary.json (two more steps trained on the changed genome: a rerun of the finished run with
    nothing to train would only print its recorded summary)."""
    src = lose["root"] / "shrink_ref"
    run_dir = tmp_path / "run"
    import shutil

    shutil.copytree(src, run_dir)
    config = (run_dir / "config.yaml").read_text().replace(str(src), str(run_dir))
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path / "genome")
    config = config.replace(lose["fasta"], fasta)
    (run_dir / "config.yaml").write_text(config)
    text = open(fasta).read().split("\n")
    text[1] = text[1][:10] + ("A" if text[1][10] != "A" else "C") + text[1][11:]  # one base of the genome changed
    open(fasta, "w").write("\n".join(text))
    cfg = str(run_dir / "config.yaml")
    refused = _cli("--config", cfg, "--data.fasta", fasta)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "the training data differs" in refused.stderr and "sha256" in refused.stderr.lower(), refused.stderr[-3000:]
    allowed = _cli(
        "--config", cfg, "--data.fasta", fasta, "--checkpoint.allow_data_change", "true", "--train.max_steps", "8"
    )
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert _summary(run_dir)["data_changes"], _summary(run_dir)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
