"""Learning-rate schedules (--train.schedule cosine|wsd|linear|constant, engine/schedules.py).

Tier 1 (pure functions): the multiplier's shapes (warmup end, stable plateau, decay end at min_lr, monotone, the
1-sqrt formula), cosine equal to DeepSpeed's own WarmupCosineLR at every step, the scheduler object (per-group peak
LRs, state), the "scheduler" entry and the config problems.

Tier 2 (one 2-rank launch, ZeRO-1 fp32, every scenario in one process group): extending a wsd run from a checkpoint
of its stable phase with a larger --train.max_steps equals a run that had the larger budget from the start (losses
and weights); so does extending it from a step of its decay whose last update was still at the peak (the first
update after the resume runs at the new schedule's LR, not at the one ZeRO restores with the optimizer state:
schedules.reapply), and the lr column of cosine, linear (with --train.lr_scaling sqrt) and constant runs is the pure
function's, exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.helpers import copy_genome
from support.runs import LOSS_ATOL, WEIGHT_ATOL, ds, max_abs_diff, run_worker, scenario

from megagenome.config import RootConfig, TrainConfig, validate
from megagenome.engine.ds_config import scaled_lr
from megagenome.engine.ds_final import build_ds_config
from megagenome.engine.schedules import Schedule, StepScheduler, client_scheduler, scheduler_entry
from megagenome.observe.metrics import read_metrics
from megagenome.parallel.layout import BatchSizes


def wsd(max_steps=100, warmup=10, fraction=0.2, shape="sqrt", min_lr=1e-4, lr=1e-3) -> Schedule:
    train = TrainConfig(
        schedule="wsd", max_steps=max_steps, warmup_steps=warmup, decay_fraction=fraction, decay_shape=shape
    )
    train.lr, train.min_lr = lr, min_lr
    return Schedule.of(train)


def test_wsd_warmup_plateau_and_decay_to_min_lr():
    s = wsd()  # warmup 10, stable to step 80, decay over the last 20 steps to min_lr / lr = 0.1
    m = [s.multiplier(n) for n in range(101)]
    assert m[0] == 0.0 and m[5] == 0.5 and m[10] == 1.0  # linear warmup from 0, peak at its end
    assert s.decay_start == 80 and all(x == 1.0 for x in m[10:81])
    assert m[100] == pytest.approx(0.1, abs=1e-12)
    assert all(a <= b for a, b in zip(m[:10], m[1:11])) and all(a >= b for a, b in zip(m[10:], m[11:]))
    assert m[81] < 1.0 and m[99] > 0.1


@pytest.mark.parametrize(
    "shape, f",
    [
        ("sqrt", lambda p: 1 - math.sqrt(p)),
        ("linear", lambda p: 1 - p),
        ("cosine", lambda p: math.cos(math.pi * p / 2) ** 2),
    ],
)
def test_wsd_decay_shapes(shape, f):
    """1-sqrt (Hägele et al. 2024): min + (1 - min)(1 - sqrt(p)); cosine written as cos^2(pi p / 2) here."""
    s = wsd(shape=shape)
    for n, p in [(85, 0.25), (90, 0.5), (95, 0.75), (100, 1.0)]:
        assert s.multiplier(n) == pytest.approx(0.1 + 0.9 * f(p), abs=1e-12), (shape, n)


def test_linear_and_constant():
    train = TrainConfig(schedule="linear", max_steps=50, warmup_steps=10)
    train.lr, train.min_lr = 1e-3, 2e-4
    lin = Schedule.of(train)
    assert lin.multiplier(5) == 0.5 and lin.multiplier(10) == pytest.approx(1.0, abs=1e-12)
    assert lin.multiplier(30) == pytest.approx(0.6) and lin.multiplier(50) == pytest.approx(0.2, abs=1e-12)
    m = [lin.multiplier(n) for n in range(10, 51)]
    assert all(a > b for a, b in zip(m, m[1:]))
    train.schedule = "constant"
    const = Schedule.of(train)
    assert const.multiplier(3) == 0.3 and {const.multiplier(n) for n in range(10, 60)} == {1.0}
    train.warmup_steps = 0  # no warmup: the peak from the first update
    assert Schedule.of(train).multiplier(0) == 1.0 and wsd(warmup=0).multiplier(0) == 1.0


def test_wsd_stable_phase_does_not_depend_on_max_steps():
    """What makes a wsd run extendable: a longer budget never starts its decay earlier, and up to a shorter run's
    decay start the multipliers are the same."""
    for fraction in (0.1, 0.2, 0.25, 1 / 3, 0.5, 0.9, 1.0):
        starts = [wsd(max_steps=t, warmup=0, fraction=fraction).decay_start for t in range(1, 400)]
        assert all(a <= b for a, b in zip(starts, starts[1:])), fraction
    short, long = wsd(max_steps=100), wsd(max_steps=1000)
    assert [short.multiplier(n) for n in range(81)] == [long.multiplier(n) for n in range(81)]
    assert long.multiplier(100) == 1.0 != short.multiplier(100)


@pytest.mark.parametrize("warmup, max_steps, ratio", [(0, 20, 0.1), (1, 20, 0.1), (2, 9, 0.0), (7, 37, 0.25)])
def test_cosine_equals_deepspeed_warmup_cosine(warmup, max_steps, ratio):
    """DeepSpeed builds cosine from scheduler_entry; multiplier reproduces its LR at every step, to the bit, for
    every parameter group's own peak LR (and past the end, where it stays at min_lr)."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    train = TrainConfig(max_steps=max_steps, warmup_steps=warmup)
    train.lr, train.min_lr = 3e-3, 3e-3 * ratio
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD([{"params": params[:1], "lr": train.lr}, {"params": params[1:], "lr": 0.02}])
    entry = scheduler_entry(train, train.lr, train.min_lr)
    ds_sched = WarmupCosineLR(opt, **entry["params"])
    s = Schedule.of(train, train.lr, train.min_lr)
    for n in range(max_steps + 3):
        assert [g["lr"] for g in opt.param_groups] == [train.lr * s.multiplier(n), 0.02 * s.multiplier(n)], n
        ds_sched.step()
    assert s.multiplier(max_steps) == pytest.approx(ratio)


def test_step_scheduler_scales_each_group_and_resumes_from_its_count():
    train = TrainConfig(schedule="wsd", max_steps=10, warmup_steps=4, decay_fraction=0.5)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    groups = [{"params": params[:1], "lr": 1e-3}, {"params": params[1:2], "lr": 0.02}]
    groups.append({"params": params[2:], "lr": torch.tensor(5e-3)})  # a tensor LR is updated in place
    opt = torch.optim.AdamW(groups)
    sched = client_scheduler(train)(opt)
    s = sched.schedule
    assert [float(g["lr"]) for g in opt.param_groups] == [0.0, 0.0, 0.0]
    for _ in range(6):
        sched.step()
    lrs = [float(g["lr"]) for g in opt.param_groups]
    assert lrs == pytest.approx([1e-3 * s.multiplier(6), 0.02 * s.multiplier(6), 5e-3 * s.multiplier(6)])
    assert 0 < s.multiplier(6) < 1 and sched.get_last_lr()[:2] == lrs[:2]
    state = sched.state_dict()
    assert state["last_batch_iteration"] == 5
    # A fresh scheduler (a resumed run: the optimizer state loaded first, LRs mid-schedule) continues at once
    opt2 = torch.optim.AdamW([{"params": params[:1], "lr": 1e-3}, {"params": params[1:2], "lr": 0.02}])
    again = StepScheduler(opt2, s)
    again.load_state_dict({"last_batch_iteration": 5})  # WarmupCosineLR's state: a cosine checkpoint loads too
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx(lrs[:2])
    again.step()
    sched.step()
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([float(g["lr"]) for g in opt.param_groups][:2])


def test_ds_config_entry_only_for_cosine():
    batch = BatchSizes(micro=4, grad_accum=1, global_batch=8)
    train = TrainConfig(max_steps=50, warmup_steps=5)
    merged = build_ds_config({}, batch, train, universal=False, on_gpu=False)
    assert merged["scheduler"] == {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": 50,
            "warmup_num_steps": 5,
            "warmup_type": "linear",
            "warmup_min_ratio": 0.0,
            "cos_min_ratio": train.min_lr / train.lr,
        },
    }
    assert client_scheduler(train) is None
    for kind in ("wsd", "linear", "constant"):
        train.schedule = kind
        assert "scheduler" not in build_ds_config({}, batch, train, universal=False, on_gpu=False)
        assert callable(client_scheduler(train))


def test_schedule_problems_are_named():
    cfg = RootConfig()
    cfg.data.fasta, cfg.data.val_ranges = "genome.fa", ["chr1:1-1000"]
    cfg.train.schedule, cfg.train.max_steps, cfg.train.warmup_steps = "wsd", 100, 90
    assert validate(cfg) == [
        "--train.warmup_steps=90 plus the wsd decay's 20 steps (--train.decay_fraction=0.2 of --train.max_steps="
        "100) exceed max_steps: shorten the warmup or the decay, or, to try the first steps of the run as configured, "
        "keep max_steps and give --train.stop_at 100 (it stops there, same schedule)"
    ]
    cfg.train.warmup_steps = 80
    assert validate(cfg) == []
    cfg.train.decay_fraction = 0.0
    assert validate(cfg) == ["--train.decay_fraction=0: must be within (0, 1] (the decaying share of max_steps)"]
    cfg.train.schedule, cfg.train.decay_shape = "cosine", "linear"
    assert validate(cfg) == [
        "--train.decay_fraction applies to --train.schedule wsd only (this run's is cosine)",
        "--train.decay_shape applies to --train.schedule wsd only (this run's is cosine)",
    ]


# ----- tier 2: real engines, 2 ranks, one launch ----------------------------------------------------------------

WSD = {"schedule": "wsd", "warmup_steps": 2, "decay_fraction": 0.25, "decay_shape": "sqrt", "eval_interval": 4}
SHORT, LONG, SAVED = 8, 12, 4  # run A's budget (decay after step 6), the extended budget (after 9), A's checkpoint
IN_DECAY = 7  # A's checkpoint whose saved LR is decayed (A's update 7 was its last at the peak, as B's was)
LR_RUNS = {
    "cosine": {"schedule": "cosine", "warmup_steps": 3},
    "linear": {"schedule": "linear", "warmup_steps": 2, "lr_scaling": "sqrt", "reference_batch": 2},
    "constant": {"schedule": "constant", "warmup_steps": 3},
}


def _scenario(root, fasta, name, max_steps, **train):
    out = scenario(root, fasta, name, ds("zero1"), 4, max_steps=max_steps, **train)
    out["config"]["checkpoint"].update({"interval": SAVED, "keep_last": 3})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedules")
    fasta = copy_genome("phiX174_NC_001422.1.fna", root)
    saved, decaying = (str(root / "wsd_a" / "checkpoints" / f"step_{s:08d}") for s in (SAVED, IN_DECAY))
    scenarios = [
        _scenario(root, fasta, "wsd_a", SHORT, **WSD),
        _scenario(root, fasta, "wsd_b", LONG, **WSD),
        # A's stable-phase checkpoint, continued in a run directory of its own with the larger budget
        _scenario(root, fasta, "wsd_extended", LONG, **WSD),
        _scenario(root, fasta, "wsd_from_decay", LONG, **WSD),  # A's step 7 with the larger budget
        *[_scenario(root, fasta, name, 6, eval_interval=6, **train) for name, train in LR_RUNS.items()],
    ]
    scenarios[0]["config"]["checkpoint"].update(interval=1, keep_last=5)  # A keeps steps 4-8
    scenarios[2]["config"]["checkpoint"]["resume"] = saved
    scenarios[3]["config"]["checkpoint"]["resume"] = decaying
    return run_worker(root, scenarios, 2)


def _rows(runs, name: str) -> tuple[list[dict], list[dict]]:
    run_dir = runs.root / name
    assert (run_dir / "summary.json").exists(), f"{name} did not finish\n{runs._output_tail(name)}"
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    return [r for r in rows if "split" not in r], [r for r in rows if r.get("split") == "val"]


def _weights(runs, name: str, step: int) -> dict[str, torch.Tensor]:
    """ZeRO-1 fp32: the model-states file holds the updated weights (support/runs.py model_weights)."""
    path = runs.root / name / "checkpoints" / f"step_{step:08d}" / "mp_rank_00_model_states.pt"
    return {k: v.float() for k, v in torch.load(path, map_location="cpu", weights_only=False)["module"].items()}


@pytest.mark.slow
def test_extended_wsd_run_equals_the_longer_run(runs):
    a, _ = _rows(runs, "wsd_a")
    b, b_eval = _rows(runs, "wsd_b")
    ext, ext_eval = _rows(runs, "wsd_extended")
    assert [r["step"] for r in ext] == list(range(SAVED + 1, LONG + 1))
    assert [r["step"] for r in b] == list(range(1, LONG + 1))
    resumed = [r["loss"] for r in a[:SAVED] + ext]
    loss_diff = max(abs(x - y) for x, y in zip(resumed, [r["loss"] for r in b]))
    eval_diff = abs(ext_eval[-1]["loss"] - b_eval[-1]["loss"])
    weight_diff = max_abs_diff(_weights(runs, "wsd_extended", LONG), _weights(runs, "wsd_b", LONG))
    print(f"extended wsd run vs uninterrupted: loss {loss_diff:.3g}, eval {eval_diff:.3g}, weights {weight_diff:.3g}")
    assert loss_diff <= LOSS_ATOL and eval_diff <= LOSS_ATOL and weight_diff <= WEIGHT_ATOL
    # The lr column: B's and the extension's follow the 12-step schedule; A's own decay (after step 6) differs
    train = TrainConfig(max_steps=LONG, lr=3e-3, min_lr=3e-4, **{k: v for k, v in WSD.items() if k != "eval_interval"})
    long = Schedule.of(train)
    assert [r["lr"] for r in b] == [3e-3 * long.multiplier(r["step"]) for r in b]
    assert [r["lr"] for r in ext] == [r["lr"] for r in b[SAVED:]]
    assert [r["lr"] for r in a[:6]] == [r["lr"] for r in b[:6]] and a[6]["lr"] < b[6]["lr"]
    assert a[-1]["lr"] == pytest.approx(3e-4) and b[-1]["lr"] == pytest.approx(3e-4)
    assert long.decay_start == 9 and b[8]["lr"] == 3e-3 > b[9]["lr"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LR_RUNS))
def test_lr_column_follows_the_schedule(runs, name):
    rows, _ = _rows(runs, name)
    train = TrainConfig(max_steps=6, lr=3e-3, min_lr=3e-4, **LR_RUNS[name])
    lr, min_lr = scaled_lr(train, 8)  # global batch 8 = micro 4 x 2 ranks
    s = Schedule.of(train, lr, min_lr) if name == "cosine" else Schedule.of(train)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["lr"] for r in rows] == [lr * s.multiplier(r["step"]) for r in rows]
    assert len({r["lr"] for r in rows}) > 2  # the column moves: a constant 3e-3 would fail


@pytest.mark.slow
def test_a_resume_runs_its_first_update_at_the_new_schedules_lr(runs):
    """A's step-7 checkpoint holds its decayed LR in the optimizer state, which DeepSpeed restores (ZeRO-1) after the
    scheduler; resumed with max_steps 12, update 8 must run at B's peak LR (schedules.reapply), so the run equals B
    from there on. At A's LR the weights would differ by about lr x 0.64 = 2e-3."""
    a, _ = _rows(runs, "wsd_a")
    b, _ = _rows(runs, "wsd_b")
    ext, _ = _rows(runs, "wsd_from_decay")
    assert [r["step"] for r in ext] == list(range(IN_DECAY + 1, LONG + 1))
    assert a[IN_DECAY - 1]["lr"] < b[IN_DECAY - 1]["lr"]  # the checkpoint's LR is not the new schedule's
    loss_diff = max(abs(x["loss"] - y["loss"]) for x, y in zip(ext, b[IN_DECAY:]))
    weight_diff = max_abs_diff(_weights(runs, "wsd_from_decay", LONG), _weights(runs, "wsd_b", LONG))
    print(f"wsd run extended from its decay vs uninterrupted: loss {loss_diff:.3g}, weights {weight_diff:.3g}")
    assert loss_diff <= LOSS_ATOL and weight_diff <= WEIGHT_ATOL
