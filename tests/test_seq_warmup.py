"""Sequence-length warmup (data/curriculum.py): stage arithmetic, the sample stream, validation, the planner, and one
2-rank DeepSpeed launch.

Tier 1 (pure): the stage in force and the cumulative tokens per step against a step-by-step count; the sample stream
of a run resumed at every step boundary (through the Prefetcher, as pretrain reads it) equals the uninterrupted
one, each stage's batches hold the stage's window length and micro batch, the windows of a stage's steps are
consecutive indices of that length's sampler, and after the warmup the batches are a plain run's; group-aware
blending keeps each rank's windows on its own groups at every length; every bad flag is reported at once; the
planner sizes activations for the largest stage and prints the curriculum.

Tier 2 (one `deepspeed` launch, 2 CPU ranks, phiX174, seq_len 128 after stages [32, 64] of 2 steps each):
(a) a run stopped after step 3 (inside the 64 stage) and resumed equals the uninterrupted run exactly, losses and
weights; (b) the metrics rows carry the length in force and the true token counts, and the FLOPs per token
follow the length; (c) windows mode (here with the mlm objective) trains, with fewer tokens in the early steps.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from support.helpers import REPO, copy_genome
from support.runs import STEPS, STOP, Runs, assert_equivalent, ds, run_worker, scenario

from megagenome.config import ModelConfig, Region, RootConfig, validate
from megagenome.data.blend import GroupSampler, Unit
from megagenome.data.curriculum import Curriculum
from megagenome.data.dataset import build_genome_data
from megagenome.data.sampler import batch_indices
from megagenome.model.transformer.costs import activation_bytes
from megagenome.model.transformer.flops import attention_core_forward_flops_per_token
from megagenome.planner.choose import Candidate, Setup, stage_activations
from megagenome.planner.states import Precision
from megagenome.planner.timing import Cluster
from megagenome.run import plan
from megagenome.train.prefetch import Prefetcher

SEQ, LENGTHS, STAGE_STEPS = 128, (32, 64), (2, 2)
MICRO, DP, ACCUM = 2, 2, 2
GLOBAL = MICRO * DP * ACCUM


@pytest.fixture(scope="module")
def phix(tmp_path_factory):
    return copy_genome("phiX174_NC_001422.1.fna", tmp_path_factory.mktemp("genome"))


# ----- stages and offsets ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["tokens", "windows"])
def test_stage_in_force_and_tokens_before_every_step(mode):
    c = Curriculum(SEQ, (16, 32, 64), (3, 1, 2), mode)
    expected_lengths = [16] * 3 + [32] + [64] * 2 + [SEQ] * 4
    assert [c.stage_at(s).length for s in range(10)] == expected_lengths
    k = [SEQ // L if mode == "tokens" else 1 for L in expected_lengths]
    per_step = [GLOBAL * ki * L for ki, L in zip(k, expected_lengths)]
    assert [c.tokens_before(s, GLOBAL) for s in range(11)] == [sum(per_step[:s]) for s in range(11)]
    if mode == "tokens":  # constant tokens per step: the micro batch grows as the length shrinks
        assert set(per_step) == {GLOBAL * SEQ}
    # The FLOPs of a window of steps: the tokens of each step times a count at its length.
    per_token = lambda L: (1.0, float(L))  # noqa: E731
    for first, stop in [(0, 10), (2, 5), (5, 9), (6, 6)]:
        got = c.weighted_tokens(first, stop, GLOBAL, per_token)
        want = [sum(per_step[first:stop]), sum(t * L for t, L in zip(per_step[first:stop], expected_lengths[first:]))]
        assert got == (want if stop > first else []), (first, stop)


def test_curriculum_refuses_what_validation_reports():
    for bad in [dict(lengths=(64, 32), steps=(1,)), dict(lengths=(48,), steps=(1,)), dict(lengths=(32,), steps=(0,))]:
        with pytest.raises(ValueError):
            Curriculum(SEQ, **bad)
    assert Curriculum(SEQ, (48,), (1,), "windows").stage_at(0).k == 1  # windows mode: any shorter length


# ----- the sample stream ---------------------------------------------------------------------------------------


def _stream(data, c: Curriculum, start: int, stop: int, rank: int) -> list[tuple[int, int, dict]]:
    """(step, micro step, batch) of `rank` for steps [start, stop), read as pretrain reads them: from a Prefetcher
    that builds ahead and stops at `stop` (an invocation with --train.stop_at)."""

    def build(step: int, micro_step: int) -> dict:
        length, indices = c.indices(step, step * GLOBAL, micro_step, rank, DP, MICRO)
        return {"indices": indices, **data.train_batch(indices, length)}

    batches = Prefetcher(build, ACCUM, stop)
    try:
        return [(s, m, batches(s, m)) for s in range(start, stop) for m in range(ACCUM)]
    finally:
        batches.close()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


@pytest.mark.parametrize("mode,objective", [("tokens", "clm"), ("windows", "mlm")])
def test_resumed_at_every_step_boundary_reads_the_uninterrupted_stream(phix, mode, objective):
    cfg = RootConfig().data
    cfg.fasta, cfg.val_ranges, cfg.seq_len, cfg.eval_windows = phix, ["NC_001422.1:4301-5386"], SEQ, 4
    cfg.seq_warmup_lengths, cfg.seq_warmup_steps, cfg.seq_warmup_mode = list(LENGTHS), list(STAGE_STEPS), mode
    c, total = Curriculum.from_config(cfg), sum(STAGE_STEPS) + 2
    with build_genome_data(cfg, objective) as data:
        for rank in range(DP):
            whole = _stream(data, c, 0, total, rank)
            for cut in range(1, total):  # stopped after step `cut`, resumed there
                parts = _stream(data, c, 0, cut, rank) + _stream(data, c, cut, total, rank)
                assert [(s, m) for s, m, _ in parts] == [(s, m) for s, m, _ in whole]
                assert all(_same(x, y) for (_, _, x), (_, _, y) in zip(parts, whole)), (rank, cut)
            for step, _, batch in whole:
                stage = c.stage_at(step)
                assert batch["input_ids"].shape == (MICRO * stage.k, stage.length), (step, stage)
                assert batch["labels"].shape == batch["loss_weight"].shape == batch["input_ids"].shape
        # The windows of a stage's steps over all ranks and micro steps: consecutive indices of its own sampler.
        for stage in c.stages[:-1]:
            steps = range(stage.first, stage.stop)
            parts = [
                c.indices(s, s * GLOBAL, m, r, DP, MICRO)[1] for s in steps for r in range(DP) for m in range(ACCUM)
            ]
            got = sorted(np.concatenate(parts).tolist())
            first = stage.first * GLOBAL * stage.k
            assert got == list(range(first, first + len(steps) * GLOBAL * stage.k))
            width = stage.length + (objective == "clm")
            assert all(w.end - w.start == width for w in data.sampler(stage.length).windows(np.array(got)))
        # From the end of the warmup on, the batches are those of the same run without a curriculum.
        plain = dataclasses.replace(cfg, seq_warmup_lengths=[], seq_warmup_steps=[])
        with build_genome_data(plain, objective) as without:
            for step in range(c.warmup_steps, total):
                indices = batch_indices(step * GLOBAL, 1, 1, DP, MICRO)
                length, mine = c.indices(step, step * GLOBAL, 1, 1, DP, MICRO)
                assert length == SEQ and np.array_equal(mine, indices)
                assert _same(data.train_batch(mine, length), without.train_batch(indices))


def test_group_aware_ranks_keep_their_groups_at_every_length():
    """A warmup stage's GroupSampler is built with micro batch x k (dataset.build_prepared_data), so the k windows of
    each slot fall on the rank that batch_indices gives the slot to, and a rank samples only its own groups."""
    units = [Unit(f"u{i}", f"g{i}", 1.0, [Region(f"c{i}", 0, 10_000)]) for i in range(4)]
    c = Curriculum(SEQ, LENGTHS, STAGE_STEPS, "tokens")
    for stage in c.stages:
        sampler = GroupSampler(units, stage.length + 1, 7, DP, MICRO * stage.k)
        for step in range(stage.first, stage.first + 2):
            for rank in range(DP):
                owned = {f"c{group[1:]}" for group in sampler.groups_by_rank[rank]}
                for m in range(ACCUM):
                    _, indices = c.indices(step, step * GLOBAL, m, rank, DP, MICRO)
                    assert set(sampler.rank_local(indices)[0].tolist()) == {rank}
                    assert {w.contig for w in sampler.windows(indices)} <= owned


# ----- validation ------------------------------------------------------------------------------------------------


def _config(**data) -> RootConfig:
    cfg = RootConfig()
    cfg.data.fasta, cfg.data.val_ranges, cfg.data.seq_len = "genome.fa", ["chr1:1-1000"], 512
    cfg.train.max_steps = 100
    for key, value in data.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_a_valid_curriculum_has_no_problems():
    assert validate(_config(data__seq_warmup_lengths=[128, 256], data__seq_warmup_steps=[10, 20])) == []
    windows = _config(
        data__seq_warmup_lengths=[100, 300], data__seq_warmup_steps=[1, 1], data__seq_warmup_mode="windows"
    )
    assert validate(windows) == []
    assert validate(_config(model__objective="mlm", data__seq_warmup_lengths=[128], data__seq_warmup_steps=[5])) == []


@pytest.mark.parametrize(
    "flags,expected",
    [
        ({"data__seq_warmup_lengths": [128, 256], "data__seq_warmup_steps": [10]}, ["has 1 entries"]),
        ({"data__seq_warmup_lengths": [256, 128], "data__seq_warmup_steps": [1, 1]}, ["strictly increasing"]),
        ({"data__seq_warmup_lengths": [128, 512], "data__seq_warmup_steps": [1, 1]}, ["[512] not within [1"]),
        ({"data__seq_warmup_lengths": [96], "data__seq_warmup_steps": [1]}, ["[96] do not divide --data.seq_len=512"]),
        ({"data__seq_warmup_lengths": [128], "data__seq_warmup_steps": [0]}, ["positive number of steps"]),
        ({"data__seq_warmup_mode": "windows"}, ["windows has no effect without --data.seq_warmup_lengths"]),
        ({"data__seq_warmup_lengths": [128], "data__seq_warmup_steps": [100]}, ["must end before --train.max_steps"]),
        ({"data__seq_warmup_lengths": [128], "data__seq_warmup_steps": [1], "parallel__pipeline": 2}, ["pipeline"]),
        (
            {"data__seq_warmup_lengths": [2, 128], "data__seq_warmup_steps": [1, 1], "parallel__sequence": 4},
            ["[2] not"],
        ),
        (
            {"data__seq_warmup_lengths": [128, 256], "data__seq_warmup_steps": [1, 1], "model__max_seq_len": 200},
            ["[256] above the model's maximum --model.max_seq_len=200", "--data.seq_len=512 is above"],
        ),
    ],
)
def test_bad_curricula_are_refused_naming_the_flag(flags, expected):
    problems = [p for p in validate(_config(**flags)) if "seq_warmup" in p or "seq_len" in p]
    assert len(problems) == len(expected), problems
    for text in expected:
        assert any(text in p and "--data.seq" in p for p in problems), (text, problems)


def test_every_curriculum_problem_at_once():
    cfg = _config(data__seq_warmup_lengths=[256, 96], data__seq_warmup_steps=[0], parallel__pipeline=2)
    problems = [p for p in validate(cfg) if "seq_warmup" in p]
    assert len(problems) == 5, problems  # count, order, divisibility, steps, pipeline


# ----- the planner -----------------------------------------------------------------------------------------------


def _plan_config(**data) -> RootConfig:
    cfg = RootConfig(model=ModelConfig(d_model=768, n_layer=12, n_head=12, max_seq_len=4096))
    cfg.data.seq_len = 4096
    cfg.train.ds_config = [str(REPO / "ds_configs" / "zero1.json"), str(REPO / "ds_configs" / "bf16.json")]
    cfg.train.micro_batch_size = 2
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


@pytest.mark.parametrize("mode", ["tokens", "windows"])
def test_plan_prints_the_curriculum_and_sizes_for_its_largest_stage(mode):
    """With flash attention (the planner's assumption) a tokens-mode stage holds the activations of seq_len's, and a
    windows-mode stage fewer: the plan's memory is that of the same run without a warmup, sized at seq_len."""
    warm = _plan_config(seq_warmup_lengths=[1024, 2048], seq_warmup_steps=[100, 100], seq_warmup_mode=mode)
    built, plain = plan.build(warm, Cluster(gpus=8)), plan.build(_plan_config(), Cluster(gpus=8))
    first = "1024 tokens x4 windows per slot;" if mode == "tokens" else "1024 tokens;"
    assert f"steps 1-100: {first} steps 101-200: 2048 tokens" in built["curriculum"] and plain["curriculum"] is None
    assert f"curriculum: sequence-length warmup ({mode} mode)" in plan.render(built)
    assert [r["memory_gib"] for r in built["candidates"]] == [r["memory_gib"] for r in plain["candidates"]]
    assert {r["activations_seq_len"] for r in built["candidates"]} == {4096}
    bad = _plan_config(seq_warmup_lengths=[8192], seq_warmup_steps=[1])
    with pytest.raises(plan.PlanError, match="--data.seq_warmup_lengths"):
        plan.build(bad, Cluster(gpus=8))


@pytest.mark.parametrize("kernel", ["flash", "math"])
def test_activations_are_those_of_the_largest_stage(kernel):
    cfg = _plan_config()
    setup = Setup(
        plan.shape_of(cfg), 4096, 64, Precision("bf16", "fp32"), Cluster(gpus=8), 989.0, kernel=kernel,
        warmup=((1024, 4), (2048, 2)),
    )  # fmt: skip
    for cand in [Candidate(1, False, "none", 2), Candidate(2, False, "selective", 4)]:
        acts, seq = stage_activations(setup, cand, 2, 1)
        sizes = {}
        for length, k in [(4096, 1), (1024, 4), (2048, 2)]:
            a = activation_bytes(setup.shape, length, cand.micro * k, cand.policy, 2, 2, kernel)
            sizes[length] = a["saved"] + a["transient"]
        assert acts["saved"] + acts["transient"] == max(sizes.values()) and seq == 4096
        if kernel == "math":  # the s x s scores: the same tokens at a longer length hold more
            assert sizes[1024] < sizes[2048] < sizes[4096]
    # A stage holding more tokens than seq_len's (not a valid curriculum) shows it takes the largest, not seq's.
    more = dataclasses.replace(setup, warmup=((2048, 4),))
    assert stage_activations(more, Candidate(1, False, "none", 2), 2, 1)[1] == 2048


# ----- one 2-rank DeepSpeed launch -------------------------------------------------------------------------------


def _warmup_scenario(root, fasta, name, mode="tokens", objective="clm", **train) -> dict:
    s = scenario(root, fasta, name, ds("zero1"), MICRO, **train)
    s["config"]["model"]["objective"] = objective
    data = s["config"]["data"]
    data.update(seq_len=SEQ, seq_warmup_lengths=list(LENGTHS), seq_warmup_steps=list(STAGE_STEPS))
    data["seq_warmup_mode"] = mode
    return s


@pytest.fixture(scope="module")
def runs(phix, tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("ws2")
    scenarios = [
        _warmup_scenario(root, phix, "tokens"),
        _warmup_scenario(root, phix, "resumed", stop_at=STOP),  # stops after step 3, inside the 64 stage
        _warmup_scenario(root, phix, "resumed"),  # the same run directory: resumes at step 3
        _warmup_scenario(root, phix, "windows_mlm", mode="windows", objective="mlm"),
    ]
    return run_worker(root, scenarios, 2)


LENGTH_OF_STEP = [32, 32, 64, 64, 128, 128]  # steps 1..STEPS


@pytest.mark.slow
def test_stopped_mid_curriculum_and_resumed_equals_uninterrupted(runs):
    assert STAGE_STEPS[0] < STOP < sum(STAGE_STEPS)  # the stop falls inside the warmup
    assert (runs.root / "resumed" / "checkpoints" / f"step_{STOP:08d}" / "COMPLETE").exists()
    assert_equivalent(runs, "resumed", runs, "tokens", loss_atol=0.0, weight_atol=0.0)


@pytest.mark.slow
def test_rows_follow_the_length_in_force(runs):
    """Tokens mode: every step trains 2 ranks x 2 slots x 128 tokens at any length (all phiX positions carry loss,
    so the real tokens counted on the batches trained equal them); the FLOPs per token differ between lengths by
    exactly the attention term of the length difference."""
    rows = runs.train_rows("tokens")
    assert [r["seq_len"] for r in rows] == LENGTH_OF_STEP
    per_step = DP * MICRO * SEQ
    assert [r["window_tokens"] for r in rows] == [per_step] * STEPS
    assert [r["window_real_tokens"] for r in rows] == [per_step] * STEPS
    assert [r["tokens"] for r in rows] == [per_step * s for s in range(1, STEPS + 1)]
    flops = [r["tflops_per_gpu"] * 1e12 / r["tokens_per_s_per_gpu"] for r in rows]
    d, layers = 32, 2
    for r, f in zip(rows, flops):
        attention = 3 * attention_core_forward_flops_per_token(layers, d, r["seq_len"], causal=True)
        assert f - attention == pytest.approx(flops[-1] - 3 * attention_core_forward_flops_per_token(layers, d, SEQ))
    assert [r["seq_len"] for r in runs.train_rows("resumed")] == LENGTH_OF_STEP
    eval_rows = [r for r in runs.rows("tokens") if r.get("split") == "val"]
    assert eval_rows and all(r["bases"] == 8 * SEQ for r in eval_rows)  # evaluation stays at --data.seq_len


@pytest.mark.slow
def test_windows_mode_trains_fewer_tokens_early(runs):
    rows = runs.train_rows("windows_mlm")
    assert [r["seq_len"] for r in rows] == LENGTH_OF_STEP
    assert [r["window_tokens"] for r in rows] == [DP * MICRO * L for L in LENGTH_OF_STEP]
    assert all(0 < r["window_real_tokens"] < r["window_tokens"] for r in rows)  # mlm: the selected positions
    losses = runs.losses("windows_mlm")
    assert all(np.isfinite(losses)) and losses[-2] < losses[0], losses
