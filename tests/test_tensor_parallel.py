"""Tensor parallelism (parallel/tensor_parallel.py) equals the dense model, on real DeepSpeed over gloo.

Tier 1 (no processes): the flags are validated before launch; shards merge back into the dense weights.

Tiers 2-3, in three process groups (one launch per world size, each running many scenarios through
support/worker.py: `megagenome.run.pretrain.run`, the CLI's code path, and the checks of support/tp_checks.py):

- layers: column/row-parallel linears, the vocabulary-parallel embedding and cross entropy (padding column,
  ignored labels, loss weights) equal torch's dense layers: outputs and gradients within 1e-6 (fp32);
- the whole model built by the tensor-parallel layer factory (clm and mlm, tied and untied head, with and without
  checkpointing) starts from exactly the slices of the dense model's weights (same seed); loss and every gradient
  shard equal the dense model's within 1e-6; inside a DeepSpeed engine too (ZeRO-0 p.grad, ZeRO-1
  safe_get_full_grad), and the gradient norm that clipping uses counts every gradient once;
- dropout streams: the attention-dropout stream differs across tensor ranks, the residual one does not;
- DeepSpeed activation checkpointing partitioned over the tensor group: gradients bit-identical to no
  checkpointing (dropout on), and the block stack keeps half the bytes per rank of the unpartitioned run;
- training: tp=2 through `megagenome pretrain` equals the dense single-process run for 6 AdamW steps with
  clipping active (per-step losses, grad norms, held-out loss, and the weights reassembled from the
  mp_rank_00/mp_rank_01 checkpoint files); tp=2 x dp=2 with ZeRO-1 (4 ranks) equals tp=2 x dp=1 with twice the
  micro batch, its optimizer states partitioned over the 2 data-parallel ranks only; partitioned activation
  checkpointing and stop-and-resume equal the uninterrupted run exactly (dropout on).

Tolerances are absolute unless named, and measured (fp32, repeated runs give identical numbers): layer outputs
differ from dense by <= 2.4e-7 and their gradients by <= 2.4e-7 (summation order of the split matmuls and
all-reduces), model gradients by <= 9e-8 (|grad| up to 0.35), gradient norms by <= 1e-7 relative; after 6 AdamW
steps the losses by 2.4e-7 (one float32 ulp at ~2 nats) and the weights by 1.6e-8 (tp=2 vs dense) and 1.1e-8
(tp2 x dp2 vs tp2 x dp1). Partitioned checkpointing and resuming are bit-identical and compared exactly. A wrong
split (each rank given the other's qkv heads) moves the loss by 1.2e-2, and a gradient norm that counts the
replicated norm weights on both tensor ranks is off by 7.5e-5 relative.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.helpers import REPO, copy_genome, tiny_config
from support.runs import STEPS, STOP, Runs, assert_equivalent, ds, run_worker

from megagenome.config import DataConfig, LogConfig, ModelConfig, ParallelConfig, RootConfig, TrainConfig
from megagenome.model.transformer import TRANSFORMER
from megagenome.parallel import tensor_parallel as tp

LAYER_ATOL = 1e-6  # layer outputs and gradients against torch's dense layers (fp32)
GRAD_ATOL = 1e-6  # every gradient of the model against the dense model's (fp32, |grad| up to ~0.35)
LOSS_ATOL = 1e-6  # per-step training loss and final held-out loss after STEPS AdamW steps
NORM_RTOL = 1e-5  # gradient norm per step, relative (measured <= 1e-7)
WEIGHT_ATOL = 1e-6  # every element of every weight after STEPS steps
DROPOUT = 0.1


# ----- tier 1 ------------------------------------------------------------------------------------------------------


def test_prepare_rejects_an_indivisible_split_before_launch(tmp_path):
    from megagenome.config import ConfigError
    from megagenome.run.assembly import validate

    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path)
    cfg = RootConfig(
        model=ModelConfig(d_model=48, n_head=6, d_ff=100),
        data=DataConfig(fasta=fasta, seq_len=64, val_ranges=["NC_001422.1:4301-5386"]),
        train=TrainConfig(ds_config=str(REPO / "ds_configs" / "zero0.json")),
        parallel=ParallelConfig(tensor=16),
        log=LogConfig(run_dir=str(tmp_path / "run")),
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg, [], world_size=16)
    text = str(err.value)
    assert "--model.n_head=6 is not divisible by --parallel.tensor=16" in text
    assert "d_ff=100" in text and "padded vocabulary (8 rows)" in text


def test_partition_dims_and_merge_invert_the_split():
    """The transformer family's split dimensions (model/transformer/family.py) and merge_shards undo the split."""
    dim = TRANSFORMER.partition_dim
    dense = {
        "embed.weight": torch.randn(8, 6),
        "lm_head.weight": torch.randn(8, 6),
        "blocks.0.attn.qkv.weight": torch.randn(12, 6),
        "blocks.0.attn.proj.weight": torch.randn(6, 4),
        "blocks.0.mlp.w_down.weight": torch.randn(6, 10),
        "blocks.0.attn_norm.weight": torch.randn(6),
    }
    shards = [{k: v if dim(k) is None else v.chunk(2, dim(k))[r] for k, v in dense.items()} for r in range(2)]
    assert dim("blocks.0.attn_norm.weight") is None
    assert dim("blocks.3.mlp.w_up.weight") == 0 and dim("blocks.3.attn.proj.weight") == 1
    merged = tp.merge_shards(shards, dim)
    assert all(torch.equal(merged[k], dense[k]) for k in dense)


# ----- tiers 2-3: the workers ------------------------------------------------------------------------------------


def scenario(root, fasta: str, name: str, ds_config, micro: int, tensor: int = 1, dropout: float = 0.0, **extra):
    cfg = tiny_config(root, fasta, root / name)  # d_model 32, 2 layers, 2 heads (1 per tensor rank), d_ff 128
    cfg["model"]["dropout"] = dropout
    cfg["model"]["checkpointing"] = extra.pop("checkpointing", "none")
    cfg["train"].update({"ds_config": ds_config, "micro_batch_size": micro, "max_steps": STEPS, "eval_interval": STOP})
    cfg["train"].update(extra)
    cfg["parallel"] = {"tensor": tensor}
    cfg["checkpoint"] = {"interval": 0, "resume": "auto", "keep_last": 2}
    return {"name": name, "config": cfg}


def one_rank_scenarios(root, fasta: str) -> list[dict]:
    return [scenario(root, fasta, "dense_micro4", ds("zero0"), 4)]


def two_rank_scenarios(root, fasta: str) -> list[dict]:
    drop = {"tensor": 2, "dropout": DROPOUT}
    return [
        {"name": "checks", "check": "support.tp_checks:tensor_parallel_equivalence", "run_dir": str(root / "checks")},
        scenario(root, fasta, "tp2_micro4", ds("zero0"), 4, tensor=2),
        scenario(root, fasta, "tp2_micro8_zero1", ds("zero1"), 8, tensor=2),
        scenario(root, fasta, "tp2_dropout", ds("zero0"), 4, **drop),
        scenario(root, fasta, "tp2_resume", ds("zero0"), 4, stop_at=STOP, **drop),
        scenario(
            root, fasta, "tp2_partitioned", ds("zero0", "activation_partitioned"), 4, checkpointing="full", **drop
        ),
        scenario(root, fasta, "tp2_resume", ds("zero0"), 4, **drop),  # the second invocation: resumes at STOP
    ]


def four_rank_scenarios(root, fasta: str) -> list[dict]:
    return [scenario(root, fasta, "tp2_dp2_micro4_zero1", ds("zero1"), 4, tensor=2)]


@pytest.fixture(scope="module")
def phix(tmp_path_factory):
    return copy_genome("phiX174_NC_001422.1.fna", tmp_path_factory.mktemp("genome"))


@pytest.fixture(scope="module")
def one_rank(phix, tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("tp_ws1")
    return run_worker(root, one_rank_scenarios(root, phix), 1)


@pytest.fixture(scope="module")
def two_ranks(phix, tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("tp_ws2")
    return run_worker(root, two_rank_scenarios(root, phix), 2)


@pytest.fixture(scope="module")
def four_ranks(phix, tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("tp_ws4")
    return run_worker(root, four_rank_scenarios(root, phix), 4)


# ----- tier 2: layers, model, engine, checkpointing (support/tp_checks.py) -------------------------------------


@pytest.mark.slow
def test_layers_equal_their_dense_counterparts(two_ranks):
    for rank, result in enumerate(two_ranks.checks()):
        for layer, diffs in result["layers"].items():
            print(f"rank {rank} {layer}: " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
            assert all(v <= LAYER_ATOL for v in diffs.values()), (rank, layer, diffs)
        ce = result["layers"]["cross_entropy"]
        assert ce["ignored_loss"] == 0.0 and ce["padding_grad"] == 0.0


@pytest.mark.slow
def test_model_loss_and_gradients_equal_dense(two_ranks):
    for rank, result in enumerate(two_ranks.checks()):
        cases = {k: v for k, v in result.items() if k.startswith("model/")}
        assert len(cases) == 9  # 8 standard, 1 Llama-shaped (grouped-query attention, biases, llama3 rotary)
        for case, d in cases.items():
            assert d["initial_weights"] == 0.0, (rank, case, d)  # the factory's shard is the dense slice, exactly
            assert d["loss"] <= 1e-6 and d["nll"] <= 3e-7 * d["nll_scale"] and d["weight"] == 0.0, (rank, case, d)
            assert d["grad"] <= GRAD_ATOL, (rank, case, d)
            assert d["local_params"] < 0.55 * d["dense_params"], (case, d)  # each rank holds about half
        print(f"rank {rank}: largest gradient difference {max(d['grad'] for d in cases.values()):.3g}")
        # The comparison has teeth: rank r given the other rank's heads is off by orders of magnitude more.
        assert result["control/swapped_heads_loss"] > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1])
def test_engine_gradients_and_clipping_norm_equal_dense(two_ranks, stage):
    for rank, result in enumerate(two_ranks.checks()):
        d = result[f"engine/zero{stage}"]
        print(f"rank {rank} ZeRO-{stage}: {d}")
        assert d["grad"] <= GRAD_ATOL, d
        norm = d["engine_norm"] if stage else d["grad_norm"]  # ZeRO-0 fp32: the loop's own (DeepSpeed keeps none)
        assert norm == pytest.approx(d["dense_norm"], rel=NORM_RTOL), d
        # Controls: counting the replicated norm weights on both ranks, or one rank's shards alone, is caught.
        assert abs(d["control_norm_counting_replicas_twice"] - d["dense_norm"]) > 5 * NORM_RTOL * d["dense_norm"]
        assert abs(d["control_norm_this_rank_only"] - d["dense_norm"]) > 0.05 * d["dense_norm"]


@pytest.mark.slow
def test_dropout_streams(two_ranks):
    for result in two_ranks.checks():
        assert result["rng"] == {
            "outside_equal_across_ranks": True,
            "inside_differs_across_ranks": True,
            "fork_replays": True,
        }


@pytest.mark.slow
def test_partitioned_activation_checkpointing_over_the_tensor_group(two_ranks):
    """Gradients bit-identical to no checkpointing (dropout on) with DeepSpeed's checkpointing, partitioned or
    not; partitioned, each rank keeps half of every block input: (L * B*T*d*4 / 2 bytes, plus 8 bytes of shape
    per block) against L * B*T*d*4 unpartitioned."""
    for rank, result in enumerate(two_ranks.checks()):
        full, part = result["checkpointing/unpartitioned"], result["checkpointing/partitioned"]
        for d in (full, part):
            assert d["grad_bit_identical"], d
        layers, block_input = full["n_layer"], full["block_input_bytes"]
        assert full["saved_bytes"] == full["deepspeed_saved_bytes"] == layers * block_input
        assert part["saved_bytes"] == part["deepspeed_saved_bytes"]
        ratio = part["saved_bytes"] / full["saved_bytes"]
        none = result["checkpointing/none"]["saved_bytes"]
        print(
            f"rank {rank}: block stack keeps {none} B without checkpointing, {full['saved_bytes']} B checkpointed, "
            f"{part['saved_bytes']} B partitioned over 2 tensor ranks (ratio {ratio:.4f})"
        )
        assert layers * block_input // 2 <= part["saved_bytes"] <= layers * (block_input // 2 + 64)
        assert 0.5 <= ratio < 0.51


# ----- tier 3: training through megagenome pretrain -----------------------------------------------------------


@pytest.mark.slow
def test_tp2_trains_like_the_dense_model(one_rank, two_ranks):
    ds_config = json.loads((two_ranks.root / "tp2_micro4" / "ds_config.json").read_text())
    assert ds_config["train_batch_size"] == 4  # data-parallel size 1: both ranks see the same samples
    dense_rows, tp_rows = one_rank.train_rows("dense_micro4"), two_ranks.train_rows("tp2_micro4")
    clip = ds_config["gradient_clipping"]
    assert any(r["grad_norm"] > clip for r in dense_rows), "clipping never acted: the norm comparison is moot"
    norm_diff = max(abs(t["grad_norm"] / d["grad_norm"] - 1) for d, t in zip(dense_rows, tp_rows))
    norms = [round(r["grad_norm"], 4) for r in dense_rows]
    print(f"grad norms per step: dense {norms}, tp2 relative difference {norm_diff:.3g}")
    assert norm_diff <= NORM_RTOL, (dense_rows, tp_rows)
    # Held-out sums are counted once, not once per tensor rank (they hold replicas of them).
    bases = {
        n: [(r["step"], r["bases"]) for r in runs.rows(n) if "split" in r]
        for runs, n in [(one_rank, "dense_micro4"), (two_ranks, "tp2_micro4")]
    }
    assert bases["tp2_micro4"] == bases["dense_micro4"], bases
    tag = two_ranks.root / "tp2_micro4" / "checkpoints" / f"step_{STEPS:08d}"
    assert sorted(p.name for p in tag.glob("mp_rank_*")) == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    assert_equivalent(one_rank, "dense_micro4", two_ranks, "tp2_micro4", LOSS_ATOL, WEIGHT_ATOL)


@pytest.mark.slow
def test_tp2_dp2_zero1_equals_tp2_dp1_with_twice_the_micro_batch(four_ranks, two_ranks):
    name = "tp2_dp2_micro4_zero1"
    ds_config = json.loads((four_ranks.root / name / "ds_config.json").read_text())
    assert ds_config["train_batch_size"] == 8 and ds_config["zero_optimization"]["stage"] == 1  # dp = 2, not 4
    tag = four_ranks.root / name / "checkpoints" / f"step_{STEPS:08d}"
    optim = sorted(p.name for p in tag.glob("*optim_states.pt"))
    assert optim == [f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt" for d in (0, 1) for t in (0, 1)], optim
    # Each rank's AdamW states (2 fp32 tensors) cover half of its tensor shard: ZeRO splits over dp = 2 only.
    module = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    local_params = sum(v.numel() for k, v in module.items() if k != "lm_head.weight")  # tied to embed.weight
    memory = json.loads((four_ranks.root / name / "memory.json").read_text())
    for r in memory["ranks"]:
        assert local_params * 8 / 2 <= r["optimizer_states"] <= local_params * 8 / 2 * 1.01, (r, local_params)
    assert_equivalent(four_ranks, name, two_ranks, "tp2_micro8_zero1", LOSS_ATOL, WEIGHT_ATOL)


@pytest.mark.slow
def test_partitioned_checkpointing_run_equals_the_plain_run(two_ranks):
    """DeepSpeed activation checkpointing partitioned over the tensor group, dropout on: exactly equal."""
    ds_config = json.loads((two_ranks.root / "tp2_partitioned" / "ds_config.json").read_text())
    assert ds_config["activation_checkpointing"]["partition_activations"]
    assert_equivalent(two_ranks, "tp2_partitioned", two_ranks, "tp2_dropout", 0.0, 0.0)


@pytest.mark.slow
def test_resume_with_tp2_equals_uninterrupted(two_ranks):
    """Stopped at step 3 and resumed in a later invocation, dropout on: bit-identical to the uninterrupted run
    (the tensor ranks' dropout streams come back with the saved generator states)."""
    ckpts = sorted(p.name for p in (two_ranks.root / "tp2_resume" / "checkpoints").glob("step_*"))
    assert ckpts == [f"step_{STOP:08d}", f"step_{STEPS:08d}"], ckpts
    assert_equivalent(two_ranks, "tp2_resume", two_ranks, "tp2_dropout", 0.0, 0.0)
    dense = two_ranks.losses("tp2_dropout")
    assert dense != two_ranks.losses("tp2_micro4")  # dropout really was on
