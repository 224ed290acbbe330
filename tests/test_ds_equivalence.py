"""Tiers 2-3: numerical equivalences of DeepSpeed engine configurations, through `megagenome pretrain`.

Claims, each judged on per-step training losses (metrics.jsonl, every step logged), the final held-out
loss and the final weights (the run's last checkpoint, consolidated by DeepSpeed's own zero_to_fp32):

- ZeRO stages 1, 2 and 3 equal ZeRO 0 (fp32, 2 ranks);
- gradient accumulation: micro 2 x accumulation 2 equals micro 4 x accumulation 1, at 1 and 2 ranks,
  ZeRO 0, 2 and 3; and 1 rank equals 2 ranks at the same global batch;
- optimizer offload (zero2_offload.json) and parameter + optimizer offload (zero3_offload.json) equal
  the same stage in memory;
- stopping at step 3 and resuming equals the uninterrupted run, at ZeRO 0-3 and with both offloads;
  dropout is on there, so the per-rank RNG state must be restored too;
- bf16 (zero1.json + bf16.json) trains: the loss falls, grad norms are finite, and it tracks fp32.

A `deepspeed` launch costs ~10 s on CPU, so every scenario of one world size runs in one process group:
tests/ds_scenarios.py calls `pretrain.run` (the CLI's code path, configs parsed by the CLI's parser) once
per scenario, and is started once for 2 ranks (the real launcher) and once for 1 rank (no launcher).
Success is judged by what each run wrote (summary.json, COMPLETE markers), not by the exit code alone:
about 1 in 15 two-rank CPU runs aborts at interpreter teardown after finishing (PLATFORM.md).

Tolerances are absolute and measured (fp32, 6 steps of AdamW at lr 3e-3, d_model 32, 2 layers, repeated
runs give identical numbers). Largest differences seen: losses 2.4e-7 (one float32 ulp at ~2 nats), weights
1.2e-7 (one ulp of a norm weight near 1.0; matrices <= 1.3e-8); resumed runs and the repeated scenario are
bit-identical and are compared exactly. A 0.1% change of lr in one run moves the losses by ~1e-4 and the
weights by ~1.5e-5, so it fails every comparison below.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess

import pytest
import torch
from helpers import BIN, PYTHON, REPO, copy_genome, env, free_port, tiny_config

from megagenome.metrics import read_metrics

pytestmark = pytest.mark.slow

STEPS = 6
STOP = 3  # the split runs stop here and resume to STEPS
LOSS_ATOL = 1e-6  # nats/token, per logged step and for the final held-out loss
WEIGHT_ATOL = 1e-6  # every element of every parameter
BF16_LOSS_ATOL = 5e-3  # bf16 against fp32, per step and final held-out loss
# Dropout in every scenario but the accumulation pairs (whose masks depend on the micro-batch shape), so that
# a resumed run must also restore each rank's RNG state to match.
DROPOUT = 0.1
WORKER_TIMEOUT_S = 300  # a normal worker takes ~1 min; a rank stuck in a collective would wait 30 min (gloo)


def ds(*names: str) -> str | list[str]:
    paths = [str(REPO / "ds_configs" / f"{n}.json") for n in names]
    return paths[0] if len(paths) == 1 else paths


def scenario(root, fasta: str, name: str, ds_config, micro: int, accum: int = 1, dropout: float = DROPOUT, **train):
    cfg = tiny_config(root, fasta, root / name)
    cfg["model"]["dropout"] = dropout
    cfg["train"].update(
        {
            "ds_config": ds_config,
            "micro_batch_size": micro,
            "grad_accum_steps": accum,
            "max_steps": STEPS,
            # Evaluate at the stop too: pretrain's summary printout fails on a run stopped before any evaluation.
            "eval_interval": STOP,
            **train,
        }
    )
    cfg["checkpoint"] = {"interval": 0, "resume": "auto", "keep_last": 2}
    return {"name": name, "config": cfg}


ZERO = ["zero0", "zero1", "zero2", "zero3"]
OFFLOAD = {"zero2_offload": "zero2", "zero3_offload": "zero3"}
ACCUM_STAGES = ["zero0", "zero2", "zero3"]
RESUMED = ZERO + list(OFFLOAD)


def two_rank_scenarios(root, fasta: str) -> list[dict]:
    """Global batch 8 = micro 4 x accumulation 1 x 2 ranks unless named otherwise."""
    first = [scenario(root, fasta, "zero3", ds("zero3"), 4)]
    split_a = [scenario(root, fasta, f"resume_{c}", ds(c), 4, stop_at=STOP) for c in RESUMED]
    full = [scenario(root, fasta, c, ds(c), 4) for c in ZERO[:3] + list(OFFLOAD)]
    accum = []
    for c in ACCUM_STAGES:
        accum.append(scenario(root, fasta, f"{c}_micro4", ds(c), 4, dropout=0.0))
        accum.append(scenario(root, fasta, f"{c}_micro2_accum2", ds(c), 2, 2, dropout=0.0))
    bf16 = [scenario(root, fasta, "zero1_bf16", ds("zero1", "bf16"), 4)]
    # In the same processes, after every other scenario: the second half of each split run, then the first
    # scenario again, which must come out bit-identical if the scenarios do not leak state into each other.
    split_b = [scenario(root, fasta, f"resume_{c}", ds(c), 4) for c in RESUMED]
    again = [scenario(root, fasta, "zero3_again", ds("zero3"), 4)]
    return first + split_a + full + accum + bf16 + split_b + again


def one_rank_scenarios(root, fasta: str) -> list[dict]:
    out = []
    for c in ACCUM_STAGES:
        out.append(scenario(root, fasta, f"{c}_micro4", ds(c), 4, dropout=0.0))
        out.append(scenario(root, fasta, f"{c}_micro2_accum2", ds(c), 2, 2, dropout=0.0))
    out.append(scenario(root, fasta, "zero0_micro8", ds("zero0"), 8, dropout=0.0))  # global batch 8, like 2 ranks
    return out


class Runs:
    """The scenarios of one worker invocation, read back from their run directories."""

    def __init__(self, root, world_size: int, rc: int, log_path):
        self.root, self.world_size, self.rc, self.log_path = root, world_size, rc, log_path

    def _output_tail(self, name: str) -> str:
        errors = ""
        for f in sorted((self.root / name).glob("error_rank*.txt")):
            errors += f"{f.name}:\n{f.read_text()[-3000:]}\n"
        tail = self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""
        return f"{errors}worker ({self.world_size} rank(s), rc {self.rc}) output tail:\n{tail}"

    def rows(self, name: str) -> list[dict]:
        run_dir = self.root / name
        assert (run_dir / "summary.json").exists(), f"scenario {name} did not finish\n{self._output_tail(name)}"
        return read_metrics(str(run_dir / "metrics.jsonl"))

    def losses(self, name: str) -> list[float]:
        """Training loss of steps 1..STEPS (each logged exactly once) and then the final held-out loss."""
        rows = self.rows(name)
        train = [r for r in rows if "split" not in r]
        assert [r["step"] for r in train] == list(range(1, STEPS + 1)), (name, [r["step"] for r in train])
        final_eval = [r for r in rows if r.get("split") == "val" and r["step"] == STEPS]
        assert len(final_eval) == 1, (name, rows)
        return [r["loss"] for r in train] + [final_eval[0]["loss"]]

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        """fp32 weights of the final checkpoint, consolidated the way DeepSpeed documents."""
        self.rows(name)
        ckpt_root = self.root / name / "checkpoints"
        tag = f"step_{STEPS:08d}"
        assert (ckpt_root / tag / "COMPLETE").exists(), f"{name}: no complete final checkpoint"
        ds_config = json.loads((self.root / name / "ds_config.json").read_text())
        if ds_config.get("zero_optimization", {}).get("stage", 0) == 0:
            state = torch.load(ckpt_root / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        else:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state = {"module": get_fp32_state_dict_from_zero_checkpoint(str(ckpt_root), tag)}
        return {k: v.detach().float() for k, v in state["module"].items()}


def run_worker(root, scenarios: list[dict], world_size: int, runs_cls: type = Runs) -> Runs:
    """Run every scenario in one process group of world_size ranks; returns the runs however it ended."""
    spec = root / "spec.json"
    log = root / "worker.log"
    spec.write_text(json.dumps({"scenarios": scenarios, "log": str(root / "scenarios.jsonl")}))
    script = str(REPO / "tests" / "ds_scenarios.py")
    if world_size == 1:
        cmd = [PYTHON, script, "--spec", str(spec)]
    else:
        launcher = [str(BIN / "deepspeed"), "--num_gpus", str(world_size), "--master_port", str(free_port())]
        cmd = [*launcher, script, "--spec", str(spec)]
    with open(log, "w") as out:
        # A session of its own, so a hung worker is stopped with every rank the launcher started.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    return runs_cls(root, world_size, rc, log)


@pytest.fixture(scope="module")
def phix(tmp_path_factory):
    return copy_genome("phiX174_NC_001422.1.fna", tmp_path_factory.mktemp("genome"))


@pytest.fixture(scope="module")
def two_ranks(phix, tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("ws2")
    return run_worker(root, two_rank_scenarios(root, phix), 2)


@pytest.fixture(scope="module")
def one_rank(phix, tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("ws1")
    return run_worker(root, one_rank_scenarios(root, phix), 1)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def assert_equivalent(
    runs_a: Runs, a: str, runs_b: Runs, b: str, loss_atol: float = LOSS_ATOL, weight_atol: float = WEIGHT_ATOL
) -> None:
    """Same per-step losses, final held-out loss and final weights, within loss_atol and weight_atol."""
    la, lb = runs_a.losses(a), runs_b.losses(b)
    loss_diff = max(abs(x - y) for x, y in zip(la, lb))
    weight_diff = max_abs_diff(runs_a.weights(a), runs_b.weights(b))
    where = f"{a} ({runs_a.world_size} rank(s)) vs {b} ({runs_b.world_size})"
    print(f"{where}: loss {loss_diff:.3g}, weights {weight_diff:.3g}")
    assert loss_diff <= loss_atol, f"{where}: losses differ by {loss_diff:.3g}\n{la}\n{lb}"
    assert weight_diff <= weight_atol, f"{where}: weights differ by up to {weight_diff:.3g}"


@pytest.mark.parametrize("stage", ZERO[1:])
def test_zero_stage_equals_zero0(two_ranks, stage):
    ds_config = json.loads((two_ranks.root / stage / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == int(stage[-1])
    shards = list((two_ranks.root / stage / "checkpoints" / f"step_{STEPS:08d}").glob("*optim_states.pt"))
    assert len(shards) == 2, shards  # the optimizer state really was partitioned over both ranks
    assert_equivalent(two_ranks, stage, two_ranks, "zero0")


@pytest.mark.parametrize("offload", list(OFFLOAD))
def test_offload_equals_in_memory(two_ranks, offload):
    ds_config = json.loads((two_ranks.root / offload / "ds_config.json").read_text())
    zero = ds_config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu"  # the run really offloaded
    assert zero.get("offload_param", {}).get("device", "none") == ("cpu" if zero["stage"] == 3 else "none")
    assert_equivalent(two_ranks, offload, two_ranks, OFFLOAD[offload])


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", ACCUM_STAGES)
def test_grad_accumulation_2x2_equals_4x1(request, world_size, stage):
    runs = request.getfixturevalue("one_rank" if world_size == 1 else "two_ranks")
    ds_config = json.loads((runs.root / f"{stage}_micro2_accum2" / "ds_config.json").read_text())
    assert (ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]) == (2, 2)
    assert ds_config["train_batch_size"] == 4 * world_size
    assert_equivalent(runs, f"{stage}_micro2_accum2", runs, f"{stage}_micro4")


def test_one_rank_equals_two_ranks_at_the_same_global_batch(one_rank, two_ranks):
    """Data parallelism changes nothing: 1 rank x micro 8 equals 2 ranks x micro 4 (the same samples)."""
    assert_equivalent(one_rank, "zero0_micro8", two_ranks, "zero0_micro4")


@pytest.mark.parametrize("config", RESUMED)
def test_resume_equals_uninterrupted(two_ranks, config):
    """Steps 4-6 run in a later invocation, from the step-3 checkpoint, match the uninterrupted run bit for bit
    (the same operations in the same order, so exactly; measured 0 at every configuration).

    The resumed run's metrics hold every step exactly once, which a run that ignored the checkpoint and
    started over would not (it appends steps 1-3 again).
    """
    name = f"resume_{config}"
    ckpts = sorted(p.name for p in (two_ranks.root / name / "checkpoints").glob("step_*"))
    assert ckpts == [f"step_{STOP:08d}", f"step_{STEPS:08d}"], ckpts
    assert_equivalent(two_ranks, name, two_ranks, config, loss_atol=0.0, weight_atol=0.0)


def test_scenarios_in_one_process_group_are_independent(two_ranks):
    """The worker's premise: the first scenario, run again after all the others, is bit-identical."""
    assert two_ranks.losses("zero3_again") == two_ranks.losses("zero3")
    assert max_abs_diff(two_ranks.weights("zero3_again"), two_ranks.weights("zero3")) == 0.0


def test_bf16_trains_and_tracks_fp32(two_ranks):
    ds_config = json.loads((two_ranks.root / "zero1_bf16" / "ds_config.json").read_text())
    assert ds_config["bf16"]["enabled"] and ds_config["zero_optimization"]["stage"] == 1
    rows = [r for r in two_ranks.rows("zero1_bf16") if "split" not in r]
    losses = [r["loss"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows), rows
    assert losses[-1] < losses[0] - 0.1, losses  # fp32 falls by ~0.2 nats over these 6 steps
    fp32 = two_ranks.losses("zero1")
    diffs = [abs(x - y) for x, y in zip(two_ranks.losses("zero1_bf16"), fp32)]
    diff = max(diffs)
    print(f"zero1_bf16 vs zero1 (fp32): loss {diff:.3g} (per step {[f'{d:.2g}' for d in diffs]})")
    assert diff <= BF16_LOSS_ATOL, (losses, fp32)
