"""Pipeline parallelism (engine/pipeline.py): DNATransformer as a DeepSpeed PipelineModule.

Tier 1: DeepSpeed's pipe x data topology against ParallelState's rank layout, and the refusal of ZeRO-2 with
pipeline stages before anything starts (assembly.validate, and the real CLI with --dry_run); the layout's other
pipeline rules are tests/test_layout.py's.

Tier 2, in one process (a gloo world of one): a 1-stage PipelineModule built by pipeline.build from a dense
model computes the dense model's loss and gradients bit for bit (tied and untied head, selective recompute), its
loss_fn returns the exact sums in evaluation, and --parallel.pipeline_checkpoint_interval recomputes (fewer saved
activations, the same gradients).

Tier 3 (slow): one launch of support/worker.py on 2 ranks runs every scenario below in one process group:
pp=2 (2 stages, 1 data-parallel rank, micro 4 x accumulation 2) against pp=1 (2 data-parallel ranks, micro 4 x
accumulation 1): the same 8 windows per step, in the same micro batches. Judged on per-step losses, gradient
norms and the final held-out loss (metrics.jsonl), and on the final weights, reassembled from the pipeline
checkpoint's per-layer files by pipeline.dense_state_dict, against the dense checkpoint. fp32, ZeRO-0, with
and without an activation checkpoint interval, tied and untied embeddings; ZeRO-1 fp32 and bf16; stop at step 3
and resume (with dropout on, so each rank's RNG state must be restored too).

Tier 3 on 4 ranks (one more launch): tensor 2 x pipeline 2 (micro 4 x accumulation 2, one data-parallel rank)
against the dense 2-rank run above, tied and untied, with ZeRO-1 and an activation checkpoint interval; its
checkpoint has one layer file per layer and tensor rank and about a quarter of the parameter bytes per rank;
stop-and-resume is bit-identical; pipeline 2 x data 2 (micro 2 x accumulation 2) against the dense run.
Measured: tp2 x pp2 losses <= 2.4e-7, gradient norms <= 1.3e-7 relative, weights <= 1.2e-7 (untied); pp2 x dp2
1.2e-7 / 1.2e-7 / 1.1e-8: the same tolerances as pp=2 apply.

Tolerances (fp32, 6 AdamW steps at lr 3e-3 with clipping active, d_model 32, 2 layers; measured, repeatable): pp=2
differs from pp=1 by <= 1.8e-7 in the losses (an ulp or so at ~1.9 nats: the stages accumulate micro batches
where the dense run averages two ranks), <= 1.3e-7 (relative) in the gradient norms and <= 1.2e-7 in the
weights; the assertions allow 1e-6 (a 0.1% change of lr moves losses by ~1e-4, and leaving DeepSpeed's fp32
ZeRO-0 clipping to count only the first stage's gradients moves them by 1.6e-4). Recomputing activations with
the same partition and resuming from a checkpoint change nothing: compared exactly. bf16 against fp32: 5e-3
(as in tests/test_ds_equivalence.py; measured 6e-4).
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from support import helpers
from support.helpers import REPO, cli, copy_genome, final_ds_config, tiny_config, write_yaml
from support.runs import BF16_LOSS_ATOL, STEPS, STOP, Runs, assert_equivalent, ds, max_abs_diff, run_worker
from support.saved import param_storages, saved_bytes

from megagenome.config import ConfigError, ModelConfig, ParallelConfig
from megagenome.config.load import config_from_dict
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.engine import pipeline
from megagenome.model.transformer import DNATransformer
from megagenome.model.transformer.blocks import Block
from megagenome.run.assembly import validate

DROPOUT = 0.1  # only in the resume pair; every equivalence across layouts runs without dropout


# ----- tier 1: checks before launch ------------------------------------------------------------------------


@pytest.mark.parametrize("world_size, stages", [(2, 2), (4, 2), (8, 2), (8, 4), (12, 3)])
def test_deepspeed_pipe_topology_is_parallel_state_layout(world_size, stages):
    """pipeline.build hands DeepSpeed a pipe x data topology; its groups must be ParallelState's (tp = sp = 1),
    or the data sampler (ParallelState's data-parallel rank) and DeepSpeed's gradient reduction would disagree."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from megagenome.parallel.state import group_ranks

    topology = PipeDataParallelTopology(num_pp=stages, num_dp=world_size // stages)
    ours = group_ranks(world_size, tp=1, pp=stages)
    assert sorted(map(sorted, topology.get_axis_comm_lists("data"))) == ours["dp"]
    assert sorted(map(sorted, topology.get_axis_comm_lists("pipe"))) == ours["pp"]


@pytest.fixture(scope="module")
def phix(tmp_path_factory):
    return copy_genome("phiX174_NC_001422.1.fna", tmp_path_factory.mktemp("genome"))


def zero2_pipeline_config(tmp_path, phix) -> dict:
    cfg = tiny_config(tmp_path, phix, tmp_path / "run")
    cfg["train"]["ds_config"] = str(REPO / "ds_configs" / "zero2.json")
    cfg["parallel"] = {"pipeline": 2}
    return cfg


def test_zero2_with_pipeline_is_refused_before_launch(tmp_path, phix):
    with pytest.raises(ConfigError) as e:
        validate(config_from_dict(zero2_pipeline_config(tmp_path, phix)), [], world_size=2)
    assert e.value.problems == [
        f"{REPO / 'ds_configs' / 'zero2.json'}: zero_optimization.stage=2 cannot run with --parallel.pipeline=2: "
        "DeepSpeed's pipeline engine rejects ZeRO stages 2 and 3 (it reduces gradients itself, after the last "
        "micro batch); use ZeRO stage 0 or 1 (e.g. ds_configs/zero1.json)"
    ]


def test_zero2_with_pipeline_is_refused_by_the_cli(tmp_path, phix):
    """Through `megagenome pretrain --dry_run` (2 CPU ranks): exit code 2, the message, nothing started."""
    config = write_yaml(tmp_path / "c.yaml", zero2_pipeline_config(tmp_path, phix))
    proc = cli("pretrain", "--config", config, "--dry_run")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "cannot run with --parallel.pipeline=2" in proc.stderr and "use ZeRO stage 0 or 1" in proc.stderr
    assert not (tmp_path / "run").exists()


# ----- tier 2: one process, one stage ----------------------------------------------------------------------

B, T = 2, 32


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one rank (PipelineModule creates groups), undone afterwards."""
    from megagenome.parallel.layout import ParallelLayout
    from megagenome.parallel.state import ParallelState

    with helpers.world_of_one():
        yield ParallelState.build(0, ParallelLayout(1))


def dense_and_stage(state, tie=True, interval=0, dropout=0.0, policy="none", checkpoint_fn=None):
    cfg = ModelConfig(
        d_model=32, n_layer=3, n_head=2, max_seq_len=T, tie_embeddings=tie, dropout=dropout, checkpointing=policy
    )
    torch.manual_seed(0)
    dense = DNATransformer(cfg, VOCAB_SIZE)
    torch.manual_seed(123)  # the stage's own initialisation must not matter: its weights are copied
    stage = pipeline.build(dense, ParallelConfig(pipeline_checkpoint_interval=interval), state, checkpoint_fn)
    stage.set_checkpoint_interval(interval)  # the pipeline engine does this at initialize
    return dense.train(), stage.train()


def batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB_SIZE, (B, T + 1), generator=g)
    weight = torch.rand(B, T, generator=g)
    weight[0, :5] = 0.0  # some positions carry no loss
    return ids[:, :-1], ids[:, 1:], weight  # (B, T) each


def stage_loss(stage, ids, labels, weight):
    return stage.loss_fn(stage(ids), (labels, weight))


@pytest.mark.parametrize("tie, policy", [(True, "none"), (False, "none"), (True, "selective")])
def test_one_stage_equals_the_dense_model(world_of_one, tie, policy):
    """Forward, loss and every gradient bit for bit; with --model.checkpointing selective the stage's blocks
    recompute their attention core like the dense model's."""
    dense, stage = dense_and_stage(world_of_one, tie, policy=policy)
    blocks = [m for m in stage.modules() if isinstance(m, Block)]
    assert len(blocks) == 3 and all((b.attn.recompute_core is not None) == (policy == "selective") for b in blocks)
    ids, labels, weight = batch()
    reference = dense(ids, labels, weight)
    loss = stage_loss(stage, ids, labels, weight)
    assert torch.equal(loss, reference[0])
    reference[0].backward()
    loss.backward()
    got = {n: p.grad for n, p in stage.named_parameters()}
    if tie:
        assert torch.equal(got.pop("tied_modules.embed.weight"), dense.embed.weight.grad)
    else:
        assert torch.equal(got.pop("0.weight"), dense.embed.weight.grad)
        assert torch.equal(got.pop(f"{dense.cfg.n_layer + 2}.weight"), dense.lm_head.weight.grad)
    dense_grads = {n: p.grad for n, p in dense.named_parameters()}
    for name, grad in got.items():
        index, rest = name.split(".", 1)
        dense_name = "norm." + rest if int(index) == dense.cfg.n_layer + 1 else f"blocks.{int(index) - 1}.{rest}"
        assert torch.equal(grad, dense_grads[dense_name]), name
    with torch.no_grad():  # evaluation: the exact sums, not the mean
        sums = stage_loss(stage, ids, labels, weight)
    assert torch.equal(sums, torch.stack([reference[1], reference[2]]).detach())


def deepspeed_checkpoint_fn():
    """DeepSpeed's checkpoint function configured from ds_configs/activation_checkpointing.json, as the assembly
    gets it (pipeline.build then uses DeepSpeed's non-reentrant variant)."""
    from megagenome.engine import engine

    block = json.loads((REPO / "ds_configs" / "activation_checkpointing.json").read_text())
    return engine.activation_checkpoint_function(final_ds_config(block))


@pytest.mark.parametrize("kind", ["torch", "deepspeed"])
@pytest.mark.parametrize("interval", [1, 2])
def test_checkpoint_interval_recomputes_exactly(world_of_one, interval, kind):
    """Dropout on: the recomputation must replay the masks. The stage's 6 layers (embedding, 3 blocks, norm,
    head) run in segments of `interval` layers, each keeping only its input (the head alone has no parameters
    and is not recomputed)."""
    ids, labels, weight = batch()
    checkpoint_fn = deepspeed_checkpoint_fn() if kind == "deepspeed" else None
    runs = {}
    for k in (0, interval):
        _, stage = dense_and_stage(world_of_one, interval=k, dropout=0.1, checkpoint_fn=checkpoint_fn)
        torch.manual_seed(1)
        saved = saved_bytes(functools.partial(stage_loss, stage, ids, labels, weight), param_storages(stage))
        torch.manual_seed(1)
        stage_loss(stage, ids, labels, weight).backward()
        runs[k] = saved, {n: p.grad for n, p in stage.named_parameters()}
    (plain_bytes, plain), (ckpt_bytes, ckpt) = runs[0], runs[interval]
    assert all(torch.equal(plain[n], ckpt[n]) for n in plain)
    print(f"interval {interval} ({kind}): saved activations {plain_bytes} -> {ckpt_bytes} bytes")
    assert ckpt_bytes < plain_bytes / 2, (plain_bytes, ckpt_bytes)


# ----- tier 3: two stages on two ranks, through the launcher -------------------------------------------------


def scenario(
    root,
    fasta: str,
    name: str,
    ds_config="zero0",
    pipeline_stages: int = 2,
    dropout: float = 0.0,
    tensor: int = 1,
    micro: int = 4,
    **kw,
):
    """Global batch 8: micro 4 x accumulation 2 on one pipeline of 2 stages, or micro 4 x 2 data-parallel ranks
    (on 2 ranks); on 4 ranks tensor 2 x pipeline 2 (micro 4 x accumulation 2) or pipeline 2 x data 2 (micro 2 x
    accumulation 2)."""
    cfg = tiny_config(root, fasta, root / name)
    cfg["model"]["dropout"] = dropout
    cfg["train"].update(
        {
            "ds_config": ds(*ds_config.split("+")),
            "micro_batch_size": micro,
            "grad_accum_steps": 2 if pipeline_stages > 1 else 1,
            "max_steps": STEPS,
            "eval_interval": STOP,
        }
    )
    cfg["checkpoint"] = {"interval": 0, "resume": "auto", "keep_last": 2}
    cfg["parallel"] = {"pipeline": pipeline_stages, "tensor": tensor}
    for dotted, value in kw.items():
        section, key = dotted.split("__")
        cfg[section][key] = value
    return {"name": name, "config": cfg}


def two_rank_scenarios(root, fasta: str) -> list[dict]:
    untied = {"model__tie_embeddings": False}
    resume = [scenario(root, fasta, "pp2_resume", dropout=DROPOUT, train__stop_at=STOP)]
    runs = [
        scenario(root, fasta, "dense", pipeline_stages=1),
        scenario(root, fasta, "pp2"),
        scenario(root, fasta, "pp2_ckpt1", parallel__pipeline_checkpoint_interval=1),
        scenario(root, fasta, "pp2_ckpt2", parallel__pipeline_checkpoint_interval=2),
        scenario(root, fasta, "pp2_uniform", parallel__pipeline_partition="uniform"),
        scenario(root, fasta, "dense_untied", pipeline_stages=1, **untied),
        scenario(root, fasta, "pp2_untied", parallel__pipeline_partition="type:Block", **untied),
        scenario(root, fasta, "pp2_zero1", "zero1"),
        scenario(root, fasta, "pp2_zero1_bf16", "zero1+bf16"),
        scenario(root, fasta, "pp2_dropout", dropout=DROPOUT),
    ]
    return resume + runs + [scenario(root, fasta, "pp2_resume", dropout=DROPOUT)]


def four_rank_scenarios(root, fasta: str) -> list[dict]:
    untied = {"model__tie_embeddings": False}
    tp2 = {"tensor": 2}
    resume = [scenario(root, fasta, "tp2_pp2_resume", dropout=DROPOUT, train__stop_at=STOP, **tp2)]
    runs = [
        scenario(root, fasta, "tp2_pp2", **tp2),
        scenario(root, fasta, "tp2_pp2_untied", parallel__pipeline_partition="type:Block", **tp2, **untied),
        scenario(root, fasta, "tp2_pp2_ckpt1_zero1", "zero1", parallel__pipeline_checkpoint_interval=1, **tp2),
        scenario(root, fasta, "pp2_dp2", micro=2),
        scenario(root, fasta, "tp2_pp2_dropout", dropout=DROPOUT, **tp2),
    ]
    return resume + runs + [scenario(root, fasta, "tp2_pp2_resume", dropout=DROPOUT, **tp2)]


@pytest.fixture(scope="module")
def two_ranks(phix, tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("pipeline")
    return run_worker(root, two_rank_scenarios(root, phix), 2)


@pytest.fixture(scope="module")
def four_ranks(phix, tmp_path_factory) -> Runs:
    root = tmp_path_factory.mktemp("pipeline4")
    return run_worker(root, four_rank_scenarios(root, phix), 4)


def compare(runs: Runs, a: str, b: str, runs_b: Runs | None = None, **tolerances) -> None:
    """Run a of `runs` against run b of runs_b (default: the same worker), gradient norms included."""
    assert_equivalent(runs, a, runs if runs_b is None else runs_b, b, grad_norms=True, **tolerances)


@pytest.mark.slow
def test_the_pipeline_really_has_two_stages(two_ranks):
    ds_config = json.loads((two_ranks.root / "pp2" / "ds_config.json").read_text())
    assert (ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]) == (4, 2)
    assert ds_config["train_batch_size"] == 8  # one data-parallel rank

    def layer_files(name: str) -> list[str]:
        tag = two_ranks.root / name / "checkpoints" / f"step_{STEPS:08d}"
        return sorted(f for f in os.listdir(tag) if f.startswith("layer_"))

    # Layers 0-3 (embedding, 2 blocks, final norm); the tied head is the embedding, written once by stage 0.
    assert layer_files("pp2") == [f"layer_{i:02d}-model_states.pt" for i in range(4)]
    assert layer_files("pp2_untied") == [f"layer_{i:02d}-model_states.pt" for i in range(5)]
    optimizer_files = (two_ranks.root / "pp2" / "checkpoints" / f"step_{STEPS:08d}").glob("mp_rank_*")
    assert sorted(f.name for f in optimizer_files) == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2", "pp2_ckpt1", "pp2_ckpt2", "pp2_uniform"])
def test_two_stages_equal_one(two_ranks, name):
    compare(two_ranks, name, "dense")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2_ckpt1", "pp2_ckpt2"])
def test_checkpoint_interval_changes_nothing(two_ranks, name):
    """With the same stage partition recomputation is exact. (Another partition moves ulps: the two halves of the
    tied embedding's gradient are then added at another point of the accumulation.)"""
    assert two_ranks.losses(name) == two_ranks.losses("pp2")
    assert max_abs_diff(two_ranks.weights(name), two_ranks.weights("pp2")) == 0.0


@pytest.mark.slow
def test_two_stages_equal_one_with_untied_embeddings(two_ranks):
    compare(two_ranks, "pp2_untied", "dense_untied")


@pytest.mark.slow
def test_zero1_with_two_stages_equals_zero0_with_one(two_ranks):
    compare(two_ranks, "pp2_zero1", "dense")


@pytest.mark.slow
def test_bf16_with_two_stages_trains_and_tracks_fp32(two_ranks):
    ds_config = json.loads((two_ranks.root / "pp2_zero1_bf16" / "ds_config.json").read_text())
    assert ds_config["bf16"]["enabled"] and ds_config["zero_optimization"]["stage"] == 1
    losses = two_ranks.losses("pp2_zero1_bf16")
    assert losses[STEPS - 1] < losses[0] - 0.1, losses
    fp32 = two_ranks.losses("pp2_zero1")
    diff = max(abs(x - y) for x, y in zip(losses, fp32))
    print(f"pp2_zero1_bf16 vs pp2_zero1 (fp32): loss {diff:.3g}")
    assert diff <= BF16_LOSS_ATOL, (losses, fp32)


@pytest.mark.slow
def test_resume_with_two_stages_equals_uninterrupted(two_ranks):
    """Steps 4-6 from the step-3 pipeline checkpoint (per-layer files, per-stage optimizer state, per-rank RNG)
    match the uninterrupted run bit for bit; the metrics hold every step once."""
    ckpts = sorted(p.name for p in (two_ranks.root / "pp2_resume" / "checkpoints").glob("step_*"))
    assert ckpts == [f"step_{STOP:08d}", f"step_{STEPS:08d}"], ckpts
    assert two_ranks.losses("pp2_resume") == two_ranks.losses("pp2_dropout")
    assert two_ranks.grad_norms("pp2_resume") == two_ranks.grad_norms("pp2_dropout")
    assert max_abs_diff(two_ranks.weights("pp2_resume"), two_ranks.weights("pp2_dropout")) == 0.0
    assert two_ranks.losses("pp2_dropout") != two_ranks.losses("pp2")  # dropout really was on


# ----- tier 3: four ranks: tensor x pipeline, pipeline x data ------------------------------------------------


@pytest.mark.slow
def test_tensor_times_pipeline_has_sharded_stages(four_ranks):
    """tp2 x pp2: each of the 2 stages is split over 2 tensor ranks: one layer file per layer and tensor rank,
    one optimizer file per stage and tensor rank, and about a quarter of the parameter bytes per rank (the tied
    embedding's shard sits on the first and the last stage)."""
    tag = four_ranks.root / "tp2_pp2" / "checkpoints" / f"step_{STEPS:08d}"
    four_ranks.rows("tp2_pp2")
    layers = sorted(f.name for f in tag.glob("layer_*"))
    assert layers == [f"layer_{i:02d}-model_{r:02d}-model_states.pt" for i in range(4) for r in range(2)]
    assert sorted(f.name for f in tag.glob("mp_rank_*")) == [f"mp_rank_{r:02d}_model_states.pt" for r in range(4)]
    ds_config = json.loads((four_ranks.root / "tp2_pp2" / "ds_config.json").read_text())
    assert ds_config["train_batch_size"] == 8 and ds_config["gradient_accumulation_steps"] == 2
    memory = json.loads((four_ranks.root / "tp2_pp2" / "memory.json").read_text())
    dense = 4 * sum(v.numel() for k, v in four_ranks.weights("tp2_pp2").items() if k != "lm_head.weight")  # fp32
    per_rank = [r["params"] for r in memory["ranks"]]
    print(f"tp2 x pp2 parameter bytes per rank {per_rank} of {dense}")
    assert all(p < 0.4 * dense for p in per_rank), (per_rank, dense)


@pytest.mark.slow
@pytest.mark.parametrize("name, reference", [("tp2_pp2", "dense"), ("tp2_pp2_untied", "dense_untied")])
def test_tensor_times_pipeline_equals_dense(four_ranks, two_ranks, name, reference):
    compare(four_ranks, name, reference, runs_b=two_ranks)


@pytest.mark.slow
def test_tensor_times_pipeline_with_zero1_and_recompute_equals_dense(four_ranks, two_ranks):
    compare(four_ranks, "tp2_pp2_ckpt1_zero1", "dense", runs_b=two_ranks)


@pytest.mark.slow
def test_pipeline_times_data_parallel_equals_dense(four_ranks, two_ranks):
    """pp2 x dp2: DeepSpeed reduces each stage's gradients over its 2 data-parallel ranks."""
    compare(four_ranks, "pp2_dp2", "dense", runs_b=two_ranks)


@pytest.mark.slow
def test_resume_with_tensor_times_pipeline_equals_uninterrupted(four_ranks):
    assert four_ranks.losses("tp2_pp2_resume") == four_ranks.losses("tp2_pp2_dropout")
    assert four_ranks.grad_norms("tp2_pp2_resume") == four_ranks.grad_norms("tp2_pp2_dropout")
    assert max_abs_diff(four_ranks.weights("tp2_pp2_resume"), four_ranks.weights("tp2_pp2_dropout")) == 0.0
    assert four_ranks.losses("tp2_pp2_dropout") != four_ranks.losses("tp2_pp2")
