"""`megagenome find-micro-batch` (megagenome/run/tune.py): the search, its arithmetic and its trials' classification
(megagenome/run/trials.py); its command-line flags are tested with the CLI's (tests/test_cli.py).

The fast tests drive the search with stand-in trials and a stand-in child process; the slow one searches for real on
CPU, with a memory budget placed halfway between the peaks measured at micro 4 and micro 5. It asserts on any machine:
each real trial is judged by its own peak against the budget and the search follows those outcomes; where the two
peaks are told apart (a quiet machine: a busy one can make a process's peak a fixed start-up spike) it must answer 4.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import yaml
from support.helpers import PYTHON, REPO, copy_genome, env, run_config, tiny_config, write_yaml

from megagenome.run import trials, tune

GiB = 2**30


def root(*argv: str):
    return run_config(argv)[0]


def stand_in(fitting: set[int] | int, outcome: str = trials.OOM):
    """A trial function: micro batches in `fitting` (or <= it) fit, others end with `outcome`; records the order."""
    order: list[int] = []

    def trial(micro: int) -> trials.Trial:
        order.append(micro)
        fits = micro <= fitting if isinstance(fitting, int) else micro in fitting
        return trials.Trial(micro=micro, outcome=trials.FITS if fits else outcome, peak_bytes=micro * 2**20)

    return trial, order


def test_search_doubles_then_bisects_between_last_fit_and_first_failure():
    trial, order = stand_in(5)
    log: list[str] = []
    best, tried = tune.search(trial, max_micro=64, log=log.append)
    assert best == 5
    assert order == [1, 2, 4, 8, 6, 5]
    assert [t.micro for t in tried] == order and len(log) == 6
    assert log[3].startswith("micro 8: does not fit: out of memory")


def test_search_tries_max_micro_when_it_is_no_power_of_two():
    trial, order = stand_in(100)
    assert tune.search(trial, max_micro=12, log=lambda _: None)[0] == 12
    assert order == [1, 2, 4, 8, 12]
    trial, order = stand_in(10)
    assert tune.search(trial, max_micro=12, log=lambda _: None)[0] == 10
    assert order == [1, 2, 4, 8, 12, 10, 11]


def test_search_when_nothing_fits_and_when_a_trial_fails_otherwise():
    trial, order = stand_in(0)
    assert tune.search(trial, max_micro=8, log=lambda _: None)[0] == 0
    assert order == [1]
    trial, order = stand_in(3, outcome="error")
    with pytest.raises(trials.TrialError, match="micro batch 4: error"):
        tune.search(trial, max_micro=8, log=lambda _: None)


def test_accumulation_divisible_and_nearest_valid_alternatives():
    assert tune.accumulation(64, 4, 2) == {
        "global_batch": 64,
        "micro": 4,
        "data_parallel": 2,
        "grad_accum": 8,
        "divisible": True,
    }
    a = tune.accumulation(24, 7, 2)  # 24 = micro x accum x 2 has no solution at micro 7
    assert not a["divisible"] and a["grad_accum"] is None
    assert a["smaller_micro"] == {"micro": 6, "grad_accum": 2}
    assert a["nearest_global_batch"] == {"global_batch": 28, "grad_accum": 2}
    a = tune.accumulation(3, 4, 2)  # the global batch is not even a multiple of the data-parallel size
    assert "smaller_micro" not in a and a["nearest_global_batch"] == {"global_batch": 8, "grad_accum": 1}


@pytest.fixture
def run_yaml(tmp_path):
    """A tiny fp32 run config on phiX174; global batch 2 x 4 x data-parallel size."""
    cfg = tiny_config(tmp_path, copy_genome("phiX174_NC_001422.1.fna", tmp_path), tmp_path / "run")
    cfg["train"]["grad_accum_steps"] = 4
    cfg["log"]["peak_tflops"] = 1.0  # no matmul measurement at the start of every trial
    return write_yaml(tmp_path / "run.yaml", cfg)


def test_trial_config_is_short_and_fresh(run_yaml):
    cfg = trials.trial_config(root("--config", run_yaml, "--train.global_batch_size", "16"), steps=3, grad_accum=2)
    t = cfg.train
    assert (t.max_steps, t.grad_accum_steps, t.global_batch_size, t.log_interval, t.eval_interval) == (3, 2, None, 1, 0)
    assert t.warmup_steps == 0 and t.stop_at is None
    assert cfg.checkpoint.resume == "none" and cfg.checkpoint.interval == 0
    assert cfg.data.eval_windows == 1 and cfg.log.progress is False


@pytest.mark.parametrize(
    "output, returncode, outcome",
    [
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB\n", 1, trials.OOM),
        (
            "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)\n",
            1,
            trials.OOM,
        ),
        ("", -signal.SIGKILL, trials.KILLED),
        ("megagenome pretrain: error: 1 configuration problem(s)\n", 2, "config error"),
        ("Traceback ...\nValueError: something else\n", 1, "error"),
    ],
    ids=["cuda-oom", "cpu-oom", "sigkill", "config", "other"],
)
def test_run_trial_reads_the_outcome_from_the_child(run_yaml, tmp_path, monkeypatch, output, returncode, outcome):
    def child(cmd, log_path, env, timeout):
        with open(log_path, "w") as fh:
            fh.write("megagenome: 1,000 parameters, 1 rank(s) on cpu\n" + output)
        return returncode, False

    monkeypatch.setattr(trials, "run_child", child)
    trial = trials.run_trial(trials.trial_config(root("--config", run_yaml), 2), 4, str(tmp_path))
    assert trial.outcome == outcome and not trial.fits and trial.parameters == 1000
    if outcome == trials.OOM:
        assert trial.detail.startswith(("torch.OutOfMemoryError", "RuntimeError"))
    if outcome == trials.KILLED:
        assert "out-of-memory killer" in trial.detail


def test_run_trial_measures_and_applies_the_budget(run_yaml, tmp_path, monkeypatch):
    def child(cmd, log_path, env, timeout):
        run_dir = yaml.safe_load(open(cmd[-1]))["log"]["run_dir"]
        os.makedirs(run_dir)
        rows = [{"step": s, "tokens_per_s": 100.0 * s, "mem_peak_bytes_max": 2**30 + s} for s in (1, 2, 3)]
        rows.append({"step": 3, "split": "val", "bits_per_base": 2.0})
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        open(log_path, "w").close()
        assert "RANK" not in env and env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
        return 0, False

    monkeypatch.setattr(trials, "run_child", child)
    monkeypatch.setenv("RANK", "3")  # a launcher's variables never reach a trial
    base = trials.trial_config(root("--config", run_yaml), 3)
    fits = trials.run_trial(base, 2, str(tmp_path), budget_bytes=2**30 + 3, warmup=1)
    assert fits.fits and fits.peak_bytes == 2**30 + 3 and fits.tokens_per_s == 250.0  # median of steps 2 and 3
    over = trials.run_trial(base, 2, str(tmp_path), budget_bytes=2**30 + 2)
    assert over.outcome == trials.OVER_BUDGET and "budget" in trials.describe(over)
    assert not os.path.exists(tmp_path / "micro2")  # the trial's run directory is deleted


@pytest.mark.slow
def test_a_budget_between_micro_4_and_5_finds_4_and_the_accumulation(tmp_path, monkeypatch):
    # glibc then returns freed memory and maps big blocks on their own, so a process's peak RSS follows its live
    # tensors (repeat runs agree within ~0.2 MB; without it, ~15 MB apart): docs/platform.md.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = tiny_config(tmp_path, copy_genome("phiX174_NC_001422.1.fna", tmp_path), tmp_path / "run")
    cfg["model"].update(d_model=128, n_layer=3, n_head=4, max_seq_len=512)  # ~20 MB more activations per window
    cfg["data"]["seq_len"] = 512
    cfg["train"]["grad_accum_steps"] = 4  # global batch 2 x 4 x 2 = 16 at --data_parallel 2
    cfg["log"]["peak_tflops"] = 1.0
    config = write_yaml(tmp_path / "run.yaml", cfg)

    base = trials.trial_config(root("--config", config), steps=2)
    p4, p5 = (trials.run_trial(base, m, str(tmp_path / "calibrate"), warmup=1) for m in (4, 5))
    assert p4.fits and p5.fits, (p4, p5)
    separated = p5.peak_bytes - p4.peak_bytes > 4 * 2**20  # a busy machine can make the peak a fixed start-up spike
    budget_gb = (p4.peak_bytes + p5.peak_bytes) / 2 / GiB

    out = tmp_path / "result.json"
    argv = ["--config", config, "--max_micro", "8", "--memory_budget_gb", f"{budget_gb:.6f}", "--data_parallel", "2"]
    e = {**env(), "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(
        [PYTHON, "-m", "megagenome", "find-micro-batch", *argv, "--json_out", str(out)],
        cwd=REPO,
        env=e,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    tried = [(t["micro"], t["outcome"]) for t in result["trials"]]
    logged = [line for line in proc.stderr.splitlines() if line.startswith("megagenome find-micro-batch: micro ")]
    assert [int(line.split()[3].rstrip(":")) for line in logged] == [m for m, _ in tried], proc.stderr
    # Whatever the load: every trial is judged by its own measured peak against the budget, and the search over
    # those outcomes (replayed through tune.search) tried the same micro batches in the same order and answers alike.
    budget = budget_gb * GiB
    for t in result["trials"]:
        assert t["outcome"] == (trials.FITS if t["peak_bytes"] <= budget else trials.OVER_BUDGET), (t, budget)
    outcome = dict(tried)
    replay, order = stand_in({m for m, o in tried if o == trials.FITS}, trials.OVER_BUDGET)
    best, _ = tune.search(replay, max_micro=8, log=lambda _: None)
    assert order == [m for m, _ in tried] and result["largest_micro_batch"] == best
    assert f"Largest micro batch that fits: {best}" in proc.stdout
    if best:
        accum = result["accumulation"]
        assert accum["micro"] == best and (not accum["divisible"] or best * accum["grad_accum"] * 2 == 16)
    if outcome.get(8) == trials.OVER_BUDGET:
        assert "over the memory budget" in logged[[m for m, _ in tried].index(8)]
    if separated:  # the peaks of micro 4 and 5 told apart: the budget between them must find exactly 4
        over = trials.OVER_BUDGET
        assert tried == [(1, "fits"), (2, "fits"), (4, "fits"), (8, over), (6, over), (5, over)], tried
        assert result["largest_micro_batch"] == 4
        assert result["accumulation"]["grad_accum"] == 2 and result["accumulation"]["divisible"]
        assert "--train.micro_batch_size 4 --train.grad_accum_steps 2 (4 x 2 x 2 = 16)" in proc.stdout
        assert "over the memory budget" in logged[-1] and "no out-of-memory error" in logged[-1]
