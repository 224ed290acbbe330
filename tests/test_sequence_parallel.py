"""Sequence parallelism (DeepSpeed-Ulysses, --parallel.sequence): tiers 1 and 3.

Tier 1 (no processes): the validation messages, the batch split, the rotary position offset and the model
hook (the layout's sequence-parallel rules are tests/test_layout.py's). Tier 3 (slow, one 2-rank `deepspeed`
launch through support/worker.py, CPU ranks on gloo):

- DistributedAttention around the SDPA core equals SDPA over the whole sequence, causal and bidirectional,
  outputs and q/k/v gradients; a whole DNATransformer split over 2 ranks equals the unsplit model: chunk
  logits, the chunk losses' sum and the sp-summed weight gradients, clm and mlm, with non-uniform loss weights
  and every activation-checkpointing policy (support/sp_checks.py). Deliberately broken splits (chunk-local
  attention, rotary positions not offset) are shown to differ, so the comparison can fail.
- `megagenome pretrain` with --parallel.sequence 2 (2 ranks: sp 2 x dp 1, micro 2 x accumulation 2) equals
  --parallel.sequence 1 (sp 1 x dp 2, micro 2): per-step training losses, the final held-out loss (bits/base
  over the full held-out windows) and the final weights, fp32, at ZeRO 0, 2 and 3, clm and mlm. Both runs
  train on the same samples and the same objective (the mean of 2 micro-batch means), so any difference is
  floating-point order.

Tolerances are measured (6 AdamW steps at lr 3e-3, as in support/runs.py); see the constants.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.helpers import REPO, copy_genome, tiny_config
from support.runs import STEPS, max_abs_diff, run_worker, scenario

from megagenome.config import ConfigError, ModelConfig
from megagenome.config.load import config_from_dict
from megagenome.engine import engine
from megagenome.model.transformer import DNATransformer
from megagenome.model.transformer.blocks import RotaryEmbedding
from megagenome.parallel.sequence import shard_batch
from megagenome.run.assembly import validate

# sp_checks: largest difference measured / allowed. float64 models still compute the loss in float32
# (forward's log-softmax), hence the 1e-8 relative on their gradients.
CORE_ATOL = {"float64": 1e-12, "float32": 1e-6}  # measured 0 (bit-identical) for both
LOGITS_ATOL = {"float64": 1e-10, "float32": 1e-6}  # measured 0
LOSS_ATOL = {"float64": 1e-6, "float32": 1e-5}  # nats; measured 0 (sums of float32 chunk sums)
GRAD_RTOL = {"float64": 1e-8, "float32": 2e-6}  # of the largest gradient; measured 1.5e-9 and 3e-7
CONTROL_MIN = 1e-4  # broken splits differ by 4e-4 (rotary) to 7e-2 (local attention)
# pretrain sp 2 vs sp 1, fp32: per-step and final held-out loss, every element of every weight.
PRETRAIN_LOSS_ATOL = 1e-6
PRETRAIN_WEIGHT_ATOL = 1e-6
BF16_LOSS_ATOL = 5e-3
BF16_NORM_RTOL = 0.05


# ----- tier 1 -----------------------------------------------------------------------------------------------


def test_validation_rejects_an_indivisible_sequence_before_any_process_group(tmp_path):
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path)
    cfg = tiny_config(tmp_path, fasta, tmp_path / "run")
    cfg["data"]["seq_len"] = 63
    cfg["model"].update({"d_model": 48, "n_head": 3})
    cfg["parallel"] = {"sequence": 2}
    with pytest.raises(ConfigError) as e:
        validate(config_from_dict(cfg), [], world_size=2)
    text = str(e.value)
    assert "--data.seq_len=63 is not divisible by --parallel.sequence=2" in text
    assert "--model.n_head=3 is not divisible by --parallel.sequence=2" in text


def test_shard_batch_splits_positions_and_keeps_the_whole_weight():
    B, T = 3, 8
    batch = {
        "input_ids": torch.arange(B * T).view(B, T),
        "labels": torch.arange(B * T).view(B, T) + 100,
        "loss_weight": torch.rand(B, T),
    }
    parts = [shard_batch(batch, r, 2) for r in range(2)]
    for key in ("input_ids", "labels", "loss_weight"):
        assert torch.equal(torch.cat([p[key] for p in parts], dim=1), batch[key])
        assert all(p[key].is_contiguous() and p[key].shape == (B, T // 2) for p in parts)
    for p in parts:
        assert torch.allclose(p["weight_total"], batch["loss_weight"].sum())
    assert shard_batch(batch, 0, 1) is batch
    with pytest.raises(ValueError, match="--parallel.sequence=3"):
        shard_batch(batch, 0, 3)


def test_rotary_offset_continues_the_positions():
    rope = RotaryEmbedding(8, 32)
    x = torch.randn(2, 3, 16, 8)
    full = rope(x)
    assert torch.equal(rope(x[:, :, 8:], offset=8), full[:, :, 8:])
    with pytest.raises(ValueError, match="rotary tables"):
        rope(x, offset=24)


def test_model_hook_validates_and_leaves_the_state_dict_alone():
    cfg = ModelConfig(d_model=32, n_layer=2, n_head=4, max_seq_len=32)
    model = DNATransformer(cfg, 8)
    keys = set(model.state_dict())

    def calls(core, q, k, v):
        calls.n += 1
        return core(q, k, v)

    calls.n = 0
    model.set_sequence_parallel(calls, 1, 2)
    assert set(model.state_dict()) == keys
    assert all(b.attn.sequence_rank == 1 and b.attn.sequence_parallel is calls for b in model.blocks)
    ids = torch.zeros(1, 16, dtype=torch.long)
    model.logits(ids)  # 16 local positions at offset 16 fit max_seq_len 32
    assert calls.n == cfg.n_layer
    with pytest.raises(ValueError, match="max_seq_len"):
        model.logits(torch.zeros(1, 17, dtype=torch.long))  # 34 global positions
    with pytest.raises(ValueError, match="--parallel.sequence=3"):
        model.set_sequence_parallel(calls, 0, 3)
    model.set_sequence_parallel(None)
    assert all(b.attn.sequence_rank == 0 and b.attn.sequence_parallel is None for b in model.blocks)


def test_model_loss_is_the_chunk_share_of_the_whole():
    """With weight_total, a chunk's loss is nll_chunk / W_total, so the chunks' losses add up to the loss."""
    torch.manual_seed(0)
    model = DNATransformer(ModelConfig(d_model=32, n_layer=1, n_head=2, max_seq_len=32), 8)
    ids = torch.randint(0, 6, (2, 16))
    w = torch.rand(2, 16)
    loss, nll, weight = model(ids, ids, w)
    share, nll_c, weight_c = model(ids, ids, w, weight_total=w.sum())
    assert torch.allclose(share, nll / weight) and torch.equal(nll_c, nll)


def test_zero3_gradient_factor():
    """The factor the loss is scaled by where ZeRO-3's reduce-scatter divides by sp too many (engine.py); the
    reduce_scatter=false combination it cannot fix is refused by the layout (tests/test_layout.py)."""
    assert engine.sequence_parallel_grad_factor({"zero_optimization": {"stage": 3}}, 2) == 2
    assert engine.sequence_parallel_grad_factor({"zero_optimization": {"stage": 3}}, 1) == 1
    for stage in (0, 1, 2):
        assert engine.sequence_parallel_grad_factor({"zero_optimization": {"stage": stage}}, 4) == 1
    assert engine.sequence_parallel_grad_factor({}, 2) == 1


# ----- tier 3 -----------------------------------------------------------------------------------------------

PAIRS = {  # name -> (ds config fragments, objective)
    "zero0": (["zero0"], "clm"),
    "zero0_mlm": (["zero0"], "mlm"),
    "zero1": (["zero1"], "clm"),
    "zero2": (["zero2"], "clm"),
    "zero3": (["zero3"], "clm"),
    "zero3_offload": (["zero3_offload"], "clm"),
    "striped_zero1": (["zero1"], "clm"),  # striped_hyena: halos and all-to-alls for the convolutions
}
# The striped pair's model: one layer of each operator, filters short enough for 32-position chunks.
STRIPED = {"family": "striped_hyena", "layer_pattern": "SE MR LI A", "n_layer": 4, "mr_filter_len": 16}
BF16 = "zero1_bf16"  # bf16 tracks fp32 only loosely: compared on loss and gradient norm, not bit-level


def _pretrain_scenarios(root, fasta: str) -> list[dict]:
    out = []
    for name, (fragments, objective) in {**PAIRS, BF16: (["zero1", "bf16"], "clm")}.items():
        ds_config = [str(REPO / "ds_configs" / f"{f}.json") for f in fragments]
        for sp in (1, 2):
            # sp 1: 2 data-parallel ranks x micro 2. sp 2: 1 data-parallel replica x micro 2 x accumulation 2.
            s = scenario(root, fasta, f"{name}_sp{sp}", ds_config, 2, sp, 0.0)
            s["config"]["model"]["objective"] = objective
            if name.startswith("striped"):
                s["config"]["model"].update(STRIPED)
            s["config"]["parallel"] = {"sequence": sp}
            out.append(s)
    return out


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp")
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path_factory.mktemp("genome"))
    check = {
        "name": "attention",
        "check": "support.sp_checks:attention_equivalence",
        "run_dir": str(root / "attention"),
    }
    return run_worker(root, [check, *_pretrain_scenarios(root, fasta)], 2)


def _check_results(runs) -> list[dict]:
    return runs.checks("attention")


@pytest.mark.slow
def test_ulysses_attention_equals_full_attention(sp_runs):
    worst: dict[str, float] = {}
    for results in _check_results(sp_runs):
        for case, diffs in results.items():
            if case == "controls":
                continue
            dtype = case.split("/")[1]
            if case.startswith("core/"):
                limits = {"output": CORE_ATOL[dtype], "grad": CORE_ATOL[dtype]}
            else:
                limits = {
                    "logits": LOGITS_ATOL[dtype],
                    "loss": LOSS_ATOL[dtype],
                    # a float32 sum over the batch in every dtype: 10x the loss's bound, or 2 float32 ulps of it
                    "nll": max(LOSS_ATOL[dtype] * 10, 2.4e-7 * diffs["nll_scale"]),
                    "weight": 1e-4,
                    "grad": GRAD_RTOL[dtype] * diffs["grad_scale"],
                }
            for what, limit in limits.items():
                worst[f"{case}/{what}"] = max(worst.get(f"{case}/{what}", 0.0), diffs[what])
                assert diffs[what] <= limit, (case, what, diffs[what], limit)
    print("largest differences:", {k: f"{v:.2g}" for k, v in worst.items() if v})


@pytest.mark.slow
def test_broken_splits_are_caught(sp_runs):
    """The comparisons above can fail: chunk-local attention and unshifted rotary positions differ on the
    second chunk (clm) and on both chunks (mlm, where each chunk attends to the other)."""
    rank0, rank1 = (r["controls"] for r in _check_results(sp_runs))
    for key, diff in rank1.items():
        assert diff > CONTROL_MIN, (key, diff)
    assert rank0["control/mlm/local_attention"] > CONTROL_MIN and rank0["control/mlm/no_rotary_offset"] > CONTROL_MIN


@pytest.mark.slow
@pytest.mark.parametrize("pair", list(PAIRS))
def test_pretrain_sequence_parallel_equals_unsplit(sp_runs, pair):
    a, b = f"{pair}_sp2", f"{pair}_sp1"
    ds_a = json.loads((sp_runs.root / a / "ds_config.json").read_text())
    assert (ds_a["train_micro_batch_size_per_gpu"], ds_a["gradient_accumulation_steps"]) == (2, 2)
    la, lb = sp_runs.losses(a), sp_runs.losses(b)
    loss_diff = max(abs(x - y) for x, y in zip(la, lb))
    weight_diff = max_abs_diff(sp_runs.weights(a), sp_runs.weights(b))
    evals = [[r for r in sp_runs.rows(n) if r.get("split") == "val"][-1] for n in (a, b)]
    print(f"{a} vs {b}: loss {loss_diff:.3g}, weights {weight_diff:.3g}, bits/base {evals[0]['bits_per_base']}")
    assert evals[0]["bases"] == evals[1]["bases"]  # every held-out base scored once, at both layouts
    assert abs(evals[0]["bits_per_base"] - evals[1]["bits_per_base"]) <= PRETRAIN_LOSS_ATOL * 2
    assert loss_diff <= PRETRAIN_LOSS_ATOL, f"losses differ by {loss_diff:.3g}\n{la}\n{lb}"
    assert weight_diff <= PRETRAIN_WEIGHT_ATOL, f"weights differ by up to {weight_diff:.3g}"
    assert la[-2] < la[0]  # and it trained
    assert len(la) == STEPS + 1


@pytest.mark.slow
def test_pretrain_sequence_parallel_bf16_tracks_unsplit(sp_runs):
    """bf16 (ZeRO-1 + bf16.json, DeepSpeed's BF16_Optimizer): the same losses within bf16 noise, and the same
    gradient norm (an sp-fold gradient scale error would show as a factor of 2 here)."""
    a, b = (sp_runs.rows(f"{BF16}_sp{sp}") for sp in (2, 1))
    train_a, train_b = ([r for r in rows if "split" not in r] for rows in (a, b))
    loss_diff = max(abs(x["loss"] - y["loss"]) for x, y in zip(train_a, train_b))
    norm_ratio = max(abs(x["grad_norm"] / y["grad_norm"] - 1) for x, y in zip(train_a, train_b))
    print(f"{BF16} sp2 vs sp1: loss {loss_diff:.3g}, grad norm ratio - 1 up to {norm_ratio:.3g}")
    assert loss_diff <= BF16_LOSS_ATOL and norm_ratio <= BF16_NORM_RTOL
