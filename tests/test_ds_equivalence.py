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
- bf16 (zero1.json + bf16.json) trains: the loss falls, grad norms are finite, and it tracks fp32;
- a finished run assembled again from its directory (assembly.from_run_dir: config.yaml, newest checkpoint) on the
  same ranks scores its held-out windows exactly as the run logged them.

A `deepspeed` launch costs ~10 s on CPU, so every scenario of one world size runs in one process group:
support/worker.py calls `pretrain.run` once per scenario, and is started once for 2 ranks (the real launcher)
and once for 1 rank (no launcher). support/runs.py reads the runs back and holds the measured tolerances.
"""

from __future__ import annotations

import json
import math

import pytest
from support.helpers import copy_genome
from support.runs import (
    BF16_LOSS_ATOL,
    STEPS,
    STOP,
    Runs,
    assert_equivalent,
    ds,
    max_abs_diff,
    run_worker,
    scenario,
)

pytestmark = pytest.mark.slow

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
    # assembly.from_run_dir on a finished 2-rank ZeRO-1 run (what evaluation and export build on).
    check = "support.assembly_checks:from_run_dir_evaluates"
    reassembled = {"name": "reassembled", "check": check, "run_dir": str(root / "reassembled")}
    reassembled["args"] = {"trained": str(root / "zero1")}
    return first + split_a + full + accum + bf16 + split_b + again + [reassembled]


def one_rank_scenarios(root, fasta: str) -> list[dict]:
    out = []
    for c in ACCUM_STAGES:
        out.append(scenario(root, fasta, f"{c}_micro4", ds(c), 4, dropout=0.0))
        out.append(scenario(root, fasta, f"{c}_micro2_accum2", ds(c), 2, 2, dropout=0.0))
    out.append(scenario(root, fasta, "zero0_micro8", ds("zero0"), 8, dropout=0.0))  # global batch 8, like 2 ranks
    return out


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


def test_a_run_assembled_from_its_directory_scores_as_it_logged(two_ranks):
    """assembly.from_run_dir (what evaluation and export build on) rebuilds the model and engine of a finished ZeRO-1
    run from config.yaml and its newest complete checkpoint: its held-out loss is bit-identical to the run's own
    last eval row, on every rank."""
    results = two_ranks.checks("reassembled")
    for r in results:
        assert r["step"] == STEPS and r["logged"] is not None, r
        assert r["evaluated"] == {k: r["logged"][k] for k in ("loss", "bits_per_base", "bases")}, r
