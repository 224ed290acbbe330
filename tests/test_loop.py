"""Tier 1: the training loop's own logic, driven by a stand-in engine.

A mock here on purpose: DeepSpeed's fp16 path cannot run on the CPU accelerator ("Type fp16 is not
supported on your device"), so the overflow handling megagenome adds around engine.step() is tested
against an object with the engine's interface (support/stand_in.py). The real fp16 engine is exercised by the
GPU-marked tests in tests/test_fp16_gpu.py.
"""

import pytest
import torch
from support.stand_in import StandInEngine, plan, trainer

from megagenome.observe.metrics import MetricsWriter, read_metrics
from megagenome.run.summary import print_summary
from megagenome.train.stopping import TrainingStopped


class FakeFp16Engine(StandInEngine):
    """Engine interface of a DeepSpeed fp16 engine whose loss scaler overflows on chosen steps."""

    def __init__(self, overflow_steps=(), collapse_at=None):
        super().__init__()
        self.overflow_steps, self.collapse_at = set(overflow_steps), collapse_at
        self.optimizer = type("Opt", (), {"cur_scale": 1024.0})()
        self.skipped_steps, self.applied = 0, 0

    def step(self):
        self.calls += 1
        if self.calls == self.collapse_at:
            raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
        if self.calls in self.overflow_steps:  # DeepSpeed skips the update and halves the scale
            self.skipped_steps += 1
            self.optimizer.cur_scale /= 2
        else:
            self.applied += 1

    def fp16_enabled(self):
        return True


def run_fit(engine, tmp_path, saved):
    writer = MetricsWriter(str(tmp_path / "metrics.jsonl"), enabled=True)
    evaluated = {"loss": 1.0, "bits_per_base": 1.0, "bases": 1}
    return trainer(engine, plan(), evaluate=lambda: evaluated, save=saved.append, writer=writer).fit()


def test_skipped_steps_and_loss_scale_are_logged(tmp_path):
    engine = FakeFp16Engine(overflow_steps={2, 3})
    run_fit(engine, tmp_path, saved := [])
    rows = [r for r in read_metrics(str(tmp_path / "metrics.jsonl")) if "split" not in r]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 2, 2, 2]
    assert [r["loss_scale"] for r in rows] == [1024.0, 512.0, 256.0, 256.0, 256.0]
    assert engine.applied == 3 and saved == [5]


def test_overflow_at_minimum_scale_stops_with_a_checkpoint(tmp_path):
    engine = FakeFp16Engine(collapse_at=4)
    with pytest.raises(TrainingStopped, match="overflowed at step 4 .* Checkpoint of step 3 saved"):
        run_fit(engine, tmp_path, saved := [])
    assert saved == [3]  # the weights of the last applied step, saved before stopping
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_other_engine_errors_are_not_swallowed(tmp_path):
    engine = FakeFp16Engine()
    engine.step = lambda: (_ for _ in ()).throw(RuntimeError("NCCL timeout"))
    with pytest.raises(RuntimeError, match="NCCL timeout"):
        run_fit(engine, tmp_path, [])


def test_summary_of_a_run_stopped_before_any_evaluation(capsys):
    print_summary(
        {
            "run_dir": "r",
            "parameters": 10,
            "steps": 3,
            "train_loss": 1.2,
            "heldout_bits_per_base": None,
            "markov_bits_per_base": {"0": 2.0},
            "best_markov_order": 0,
            "beats_best_markov": False,
            "tokens_per_s_median": None,
            "wall_s": 1.0,
        }
    )
    assert "held-out bits/base not evaluated" in capsys.readouterr().out


def test_accounting_columns(tmp_path):
    """Two ranks, rank 0 here; the other rank's contribution to the one reduce_sum per row is simulated: loss 1.0
    (its own), 5 real tokens in 1 batch, and a larger peak memory in its slot."""
    engine = StandInEngine()
    p = plan(max_steps=3)
    p.world_size, p.global_batch = 2, 2
    p.flops_per_token, p.hw_flops_per_token, p.peak_tflops, p.peak_source = 6.0, 8.0, 1e-9, "override"
    other_mem = float(2**50)
    calls = []

    def reduce_sum(values):
        calls.append(len(values))
        other = [values[0], 5.0, 1.0, 0.0, other_mem]
        return [a + b for a, b in zip(values, other)]

    def train_batch(step, micro):
        return {"loss_weight": torch.tensor([[1.0, 0.0, 0.5, 1.0]])}  # 3 positions carry loss, one padding/N

    writer = MetricsWriter(str(tmp_path / "metrics.jsonl"), enabled=True)
    evaluated = {"loss": 1.0, "bits_per_base": 1.0, "bases": 1}
    trainer(engine, p, train_batch, evaluate=lambda: evaluated, writer=writer, reduce_sum=reduce_sum).fit()
    rows = [r for r in read_metrics(str(tmp_path / "metrics.jsonl")) if "split" not in r]
    assert calls == [3 + 2] * 3  # loss, real tokens, batches, one memory slot per rank: one collective per row
    for r in rows:
        assert r["window_tokens"] == 2 * 4 and r["window_real_tokens"] == 3 + 5
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2)
        assert r["tflops_per_gpu"] == pytest.approx(6.0 * r["tokens_per_s"] / 2 / 1e12)
        assert r["hw_tflops_per_gpu"] == pytest.approx(8.0 * r["tokens_per_s"] / 2 / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 1e-9)
        assert r["hfu"] / r["mfu"] == pytest.approx(8.0 / 6.0)
        assert r["peak_tflops"] == 1e-9 and r["peak_source"] == "override"
        assert r["mem_peak_bytes_max"] == other_mem > r["mem_peak_bytes"] > 0
        assert r["loss"] == pytest.approx(float((engine.module.weight.detach() ** 2).sum()))  # mean of 2 equal


def test_ranks_that_do_not_count_tokens_and_batches_without_weights(tmp_path):
    p = plan(max_steps=2)
    p.counts_tokens = False  # e.g. a tensor-parallel rank > 0: its batches repeat rank 0's tokens
    batch = {"loss_weight": torch.ones(1, 4)}
    writer = MetricsWriter(str(tmp_path / "a.jsonl"), enabled=True)
    evaluated = {"loss": 1.0, "bits_per_base": 1.0, "bases": 1}
    engine = StandInEngine()
    trainer(engine, p, lambda s, m: batch, evaluate=lambda: evaluated, writer=writer).fit()
    rows = [r for r in read_metrics(str(tmp_path / "a.jsonl")) if "split" not in r]
    assert [r["window_real_tokens"] for r in rows] == [None, None]
    run_fit(StandInEngine(), tmp_path, [])  # batches without loss_weight: nothing to count
    rows = [r for r in read_metrics(str(tmp_path / "metrics.jsonl")) if "split" not in r]
    assert {r["window_real_tokens"] for r in rows} == {None}
    assert {r["hfu"] for r in rows} == {None} and rows[0]["hw_tflops_per_gpu"] == rows[0]["tflops_per_gpu"]


def test_summary_shows_mfu_hfu_and_the_peak_source(capsys):
    print_summary(
        {
            "run_dir": "r",
            "parameters": 10,
            "steps": 3,
            "train_loss": 1.2,
            "heldout_bits_per_base": 1.9,
            "markov_bits_per_base": {"0": 2.0},
            "best_markov_order": 0,
            "beats_best_markov": True,
            "tokens_per_s_median": 1000.0,
            "tflops_per_gpu_median": 0.05,
            "mfu_median": 0.25,
            "hfu_median": 0.3,
            "peak_tflops": 0.2,
            "peak_source": "measured-cpu-matmul",
            "real_token_fraction": 0.99,
            "mem_peak_bytes_max": 2**31,
            "wall_s": 1.0,
        }
    )
    out = capsys.readouterr().out
    assert "MFU                25.00%  (HFU 30.00%" in out and "measured-cpu-matmul" in out
    assert "99.00% of positions carry loss" in out and "2.00 GiB" in out


class NanEngine(StandInEngine):
    """The stand-in engine whose loss is NaN on chosen calls (forward passes, one per step here)."""

    def __init__(self, nan_calls):
        super().__init__()
        self.nan_calls, self.forwards = set(nan_calls), 0

    def __call__(self, **batch):
        self.forwards += 1
        loss, _, weight = super().__call__(**batch)
        if self.forwards in self.nan_calls:
            loss = loss * float("nan")
        return loss, loss.detach(), weight


@pytest.mark.parametrize("action", ["rollback", "skip"])
def test_bad_steps_are_judged_at_the_next_sync_point_in_step_order(tmp_path, action):
    """Steps 2 and 3 have non-finite losses; with --train.sync_interval 4 they are judged after step 4: a rollback
    reloads the checkpoint before the FIRST bad step (rollback(2)) and continues from it, skip logs each."""
    from megagenome.config import TrainConfig
    from megagenome.train.divergence import Guard

    engine = NanEngine({2, 3})
    guard = Guard(TrainConfig(on_nonfinite=action), lambda v: v, 1.0, fp16=False)
    writer = MetricsWriter(str(tmp_path / "metrics.jsonl"), enabled=True)
    calls, rolled = [], []

    def reduce_sum(values):
        calls.append(len(values))
        return values

    def rollback(bad_step):
        rolled.append((bad_step, engine.forwards))
        return 0

    p = plan(max_steps=8, log_interval=8)
    trainer(engine, p, evaluate=lambda: {"bits_per_base": 1.0}, rollback=rollback, writer=writer, reduce_sum=reduce_sum,
            guard=guard, sync_interval=4).fit()  # fmt: skip
    events = [(r["step"], r["event"]) for r in read_metrics(str(tmp_path / "metrics.jsonl")) if "event" in r]
    if action == "rollback":
        assert rolled == [(2, 4)] and events == [(0, "rollback")]  # noticed after step 4, back to before step 2
        # steps 1-8 again: 2 sync points (votes on 4 steps, the step-time slot), a row
        assert engine.forwards == 4 + 8 and calls == [2 * 4 + 1] * 3 + [3 + 1]
    else:
        assert rolled == [] and events == [(2, "skip"), (3, "skip")] and engine.forwards == 8
    # Good steps join the spike window in order; judging stopped at the rollback (steps 3-4 were undone by it).
    good = 1 + 8 if action == "rollback" else 8 - 2
    assert list(guard.window) == pytest.approx([float((engine.module.weight.detach() ** 2).sum())] * good)


def test_a_rollback_without_checkpoint_skips_and_judges_the_steps_after_it(tmp_path):
    """on_nonfinite rollback before any checkpoint: each bad step is skipped instead, and the steps after the first
    are still judged at the same sync point (one event each, all counted against --train.nonfinite_limit), as at
    --train.sync_interval 1."""
    from megagenome.config import TrainConfig
    from megagenome.train.divergence import Diverged, Guard

    outcomes = {}
    for every in (1, 8):
        engine = NanEngine({2, 3, 4})
        guard = Guard(TrainConfig(on_nonfinite="rollback", nonfinite_limit=2), lambda v: v, 1.0, fp16=False)
        path = tmp_path / f"metrics{every}.jsonl"
        writer = MetricsWriter(str(path), enabled=True)
        with pytest.raises(Diverged, match="3 bad steps"):
            trainer(engine, plan(max_steps=8, log_interval=8), rollback=lambda bad: None, writer=writer, guard=guard,
                    sync_interval=every).fit()  # fmt: skip
        outcomes[every] = [(r["step"], r["event"]) for r in read_metrics(str(path)) if "event" in r]
    assert outcomes[8] == outcomes[1] == [(2, "skip"), (3, "skip"), (4, "skip")]


def test_sync_interval_is_checked_and_defaults_to_ten():
    from megagenome.config import RootConfig, TrainConfig
    from megagenome.config.checks import validate

    assert TrainConfig().sync_interval == 10
    problems = validate(RootConfig(train=TrainConfig(sync_interval=0)))
    assert "--train.sync_interval=0: must be positive" in problems


def test_sync_points_come_sooner_when_steps_are_slow():
    """Cadence: at most --train.sync_interval steps apart, and at most a quarter of --checkpoint.grace_s of agreed
    step time, so a signal is acted on in time to save; log steps are always sync points."""
    from megagenome.train.sync_points import Cadence

    cadence = Cadence(plan(max_steps=100, log_interval=50), limit=10, grace_s=60.0)
    for step_s, every in ((0.01, 10), (5.0, 3), (16.0, 1), (100.0, 1), (1.5, 10)):
        cadence.synced(0, step_s)
        assert cadence.every == every
    points = []
    for step in range(1, 71):
        if cadence.due(step):
            points.append(step)
            cadence.synced(step, 5.0 if 20 <= step < 40 else 0.01)  # slow steps from 20 to 40
    assert points == [10, 20, 23, 26, 29, 32, 35, 38, 41, 50, 60, 70]  # 50: a log step
