"""The Hyena families through every engine seam: hyena (HyenaDNA, 2 H layers) and striped_hyena (StripedHyena 2 with
--model.layer_pattern "SE MR LI A": every operator and attention) equal one rank, as the transformer's tests show it.

Tier 1 (no processes): --parallel.pipeline_partition type:NAME names the family's pipeline classes
(ParallelRules.pipeline_classes, parallel/layout.py); the pipeline's optimizer groups are the model's (the filters
take no weight decay there either); selective recomputation with DeepSpeed's partition_activations is refused (for
the transformer too: both train wrong with it).

Tier 2 (one 2-rank check, support/hyena_checks.py): the tensor-parallel model equals the dense one, every gradient
shard and the replicated ones, the implicit filter's MLP included (it is right only through the all-reduce of the
column-parallel last linear's input gradient; a control without it is caught).

Tier 3, through `megagenome pretrain` (support/worker.py: one 2-rank launch, the universal conversions in this
process, one 1-rank run), fp32 unless named, 6 AdamW steps with clipping active; striped_hyena (every operator kind
but H) runs every seam below, hyena (H) those that gather, split, cast or recompute its parameters (SEAMS: all but
ZeRO 2, offload, accumulation, resume at ZeRO 1, partition by type and the data-parallel universal conversion):

- ZeRO 1, 2, 3 equal ZeRO 0 (dropout on); CPU offload (zero2_offload, zero3_offload) equals the same stage in memory;
  gradient accumulation (micro 2 x 2) equals micro 4 x 1 at ZeRO 0 and 3; 2 ranks equal 1 rank at global batch 8;
- bf16 (BF16_Optimizer) trains and tracks fp32 within the transformer's 5e-3; fp16 needs a GPU (DeepSpeed's CPU
  accelerator refuses it): tests/test_fp16_gpu.py runs both families there;
- stop at step 3 and resume equals the uninterrupted run bit for bit (dropout on: RNG states restored) at ZeRO 1, 3
  and tensor 2; DeepSpeed's activation checkpointing in the engine (ZeRO 1; partitioned over the tensor group at
  tensor 2) and selective recomputation under ZeRO-3 (the operator's D passes through the checkpoint) equal the plain
  runs exactly;
- tensor 2 (ZeRO 1, one data-parallel rank, micro 8) equals the dense 1-rank run (losses, grad norms, weights merged
  from the mp_rank files by the family's partition_dims); pipeline 2 (micro 4 x 2) equals it too, partitioned by
  parameters and by type:Hyena (the weights reassembled from the layer files by the family's prefixes);
- universal checkpoints: 2 ranks at ZeRO 1 (data 2) and tensor 2 x ZeRO 1, stopped at step 3, converted and resumed on
  1 rank at the same global batch give the uninterrupted 2-rank run's steps 4-6 and weights.

Tolerances are the transformer's (support/runs.py, tests/test_tensor_parallel.py, tests/test_universal_checkpoint.py).
Measured (fp32, both families, repeated runs identical): losses <= 1.8e-7, weights <= 2.4e-7, gradient norms <= 1.5e-7
relative, everywhere a layout or stage changes the summation order; 0 for resume and recomputation; bf16 against
fp32 4.4e-4 (hyena) and 5.6e-4 (striped_hyena). Tensor-parallel gradients <= 4.5e-8 (|grad| up to 0.37), the filter
MLP's 7.3e-12 of gradients up to 4.2e-5 (2e-7 relative); without the all-reduce the MLP is off by 34-86%.
"""

from __future__ import annotations

import functools
import json

import pytest
from support.helpers import cli_here, copy_genome
from support.runs import BF16_LOSS_ATOL, STEPS, STOP, Runs, assert_equivalent, ds, max_abs_diff, run_worker, scenario

from megagenome.config import ConfigError
from megagenome.config.load import config_from_dict
from megagenome.run.assembly import validate

FAMILIES = {
    "hyena": {"family": "hyena", "n_layer": 2, "filter_width": 16},
    "striped_hyena": {"family": "striped_hyena", "n_layer": 4, "layer_pattern": "SE MR LI A", "mr_filter_len": 16},
}
ZERO = ["zero0", "zero1", "zero2", "zero3"]
OFFLOAD = {"zero2_offload": "zero2", "zero3_offload": "zero3"}
ACCUM = ["zero0", "zero3"]
RESUMED = {"zero1": {}, "zero3": {}, "tp2": {"parallel": {"tensor": 2}}}  # resumed from step 3, dropout on
# Universal checkpoints: the split run, its DeepSpeed JSON and micro batch on 2 ranks, its uninterrupted reference.
UNIVERSAL = {"zero1_split": ("zero1", 4, "zero1_d0"), "tp2_zero1_split": ("zero1", 8, "tp2_zero1")}
# The seams that run no family-specific code (the optimizer's partitions, offload, gradient accumulation, a resume or
# universal conversion over data-parallel ranks only) run for striped_hyena, the family with every operator kind but
# H; hyena's H layers (an MLP inside each filter) run those that gather, split, cast or recompute their parameters.
SEAMS = {
    "hyena": {"zero": ["zero0", "zero1", "zero3"], "offload": [], "accum": [], "resumed": ["zero3", "tp2"],
              "pp": ["pp2"], "universal": ["tp2_zero1_split"]},
    "striped_hyena": {"zero": ZERO, "offload": list(OFFLOAD), "accum": ACCUM, "resumed": list(RESUMED),
                      "pp": ["pp2", "pp2_type"], "universal": list(UNIVERSAL)},
}  # fmt: skip
LOSS_ATOL = WEIGHT_ATOL = 1e-6  # fp32 after 6 steps (support/runs.py): a 0.1% lr change moves losses by ~1e-4
GRAD_ATOL = 1e-6  # the tensor-parallel model's gradients against dense (fp32, |grad| up to ~0.4)
FILTER_MLP_RTOL = 1e-5  # the implicit filter MLP's, relative to its largest gradient (~1e-5 in absolute terms)


# ----- tier 1: before launch --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def phix(tmp_path_factory):
    return copy_genome("phiX174_NC_001422.1.fna", tmp_path_factory.mktemp("genome"))


def run(root, fasta: str, family: str, name: str, ds_config, micro: int, accum: int = 1, parallel=None, **train):
    """support/runs.py's tiny scenario (dropout 0.1 unless given) as `family`, named family/name."""
    model = train.pop("model", {})
    s = scenario(root, fasta, f"{family}/{name}", ds_config, micro, accum, **train)
    s["config"]["model"].update(FAMILIES[family], **model)
    s["config"]["parallel"] = parallel or {}
    return s


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pipeline_partition_names_the_family_classes(tmp_path, phix, family):
    config = run(tmp_path, phix, family, "pp", ds("zero0"), 4, 2, parallel={"pipeline": 2, "pipeline_partition":
                 "type:Attention"})["config"]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        validate(config_from_dict(config), [], world_size=2)
    blocks = "HyenaBlock, Block" if family == "striped_hyena" else "HyenaBlock"
    assert e.value.problems == [
        "--parallel.pipeline_partition='type:Attention': use parameters, uniform or type:NAME with NAME matching a "
        f"layer class (Embedding, {blocks}, RMSNorm), e.g. type:HyenaBlock"
    ]


@pytest.mark.parametrize("family", ["transformer", *FAMILIES])
def test_selective_recompute_with_partitioned_activations_is_refused(tmp_path, phix, family):
    """DeepSpeed's partition_activations treats a checkpointed function's inputs as replicated activations; selective
    recomputation hands it this rank's heads and (Hyena) parameters, so the pair is refused before launch, for every
    family (measured wrong without the refusal: engine/ds_config.py run_problems); full with partitioning runs."""
    config = scenario(tmp_path, phix, "ac", ds("zero0", "activation_partitioned"), 4)["config"]
    config["model"].update(FAMILIES.get(family, {}), checkpointing="selective")
    with pytest.raises(ConfigError) as e:
        validate(config_from_dict(config), [], world_size=2)
    assert len(e.value.problems) == 1, e.value.problems
    assert "activation_checkpointing.partition_activations with --model.checkpointing=selective" in e.value.problems[0]
    config["model"]["checkpointing"] = "full"
    validate(config_from_dict(config), [], world_size=2).data.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pipeline_optimizer_groups_are_the_model_groups(family):
    """The pipeline builds its AdamW groups from its stage's parameters (engine/pipeline.py param_groups): they must
    be the model's own, the filters (2-D, marked no_weight_decay) without decay, or pp=2 would decay what pp=1 does
    not (weight decay 0.1 at lr 3e-3 shrinks them by ~2e-3 relative over 6 steps)."""
    import torch

    from megagenome.config import ModelConfig
    from megagenome.engine import pipeline
    from megagenome.model import family_of

    cfg = ModelConfig(d_model=32, n_head=2, max_seq_len=64, **FAMILIES[family])
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg, 5)
    groups = [({id(p) for p in g["params"]}, g["weight_decay"]) for g in model.param_groups(0.1)]
    assert [({id(p) for p in g["params"]}, g["weight_decay"]) for g in pipeline.param_groups(model, 0.1)] == groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert any(".filter." in names[i] and model.get_parameter(names[i]).dim() >= 2 for i in groups[1][0])


# ----- the workers ---------------------------------------------------------------------------------------------


def family_scenarios(root, fasta: str, family: str) -> tuple[list[dict], list[dict]]:
    """(the 2-rank runs, the second halves of the resumed ones): global batch 8 = micro 4 x 2 ranks unless named."""
    s = functools.partial(run, root, fasta, family)
    seams, tp2 = SEAMS[family], {"tensor": 2}
    resumed = {c: RESUMED[c] for c in seams["resumed"]}
    first = [s(c, ds(c), 4) for c in seams["zero"]] + [s(c, ds(c), 4) for c in seams["offload"]]
    first += [s(f"resume_{c}", ds("zero0" if c == "tp2" else c), 4, stop_at=STOP, **kw) for c, kw in resumed.items()]
    first.append(s("zero0_micro4", ds("zero0"), 4, dropout=0.0))  # 1 rank's reference, and accumulation's
    for c in seams["accum"]:
        first += [s(f"{c}_micro4", ds(c), 4, dropout=0.0)] if c != "zero0" else []
        first.append(s(f"{c}_micro2_accum2", ds(c), 2, 2, dropout=0.0))
    first += [
        s("zero1_bf16", ds("zero1", "bf16"), 4),
        s("zero1_ds_checkpointing", ds("zero1", "activation_checkpointing"), 4, model={"checkpointing": "full"}),
        s("zero3_selective", ds("zero3"), 4, model={"checkpointing": "selective"}),
        s("tp2", ds("zero0"), 4, parallel=tp2),  # dropout on: resume_tp2's reference
        s("tp2_partitioned", ds("zero0", "activation_partitioned"), 4, parallel=tp2, model={"checkpointing": "full"}),
        s("tp2_zero1", ds("zero1"), 8, dropout=0.0, parallel=tp2),  # data-parallel size 1: micro 8 = global 8
    ]
    pipelines = {"pp2": {"pipeline": 2}, "pp2_type": {"pipeline": 2, "pipeline_partition": "type:Hyena"}}
    first += [s(name, ds("zero0"), 4, 2, dropout=0.0, parallel=pipelines[name]) for name in seams["pp"]]
    for name in seams["universal"]:
        config, micro, reference = UNIVERSAL[name]
        first.append(s(name, ds(config), micro, dropout=0.0, stop_at=STOP, parallel=tp2 if "tp2" in name else None))
        if reference == "zero1_d0":
            first.append(s("zero1_d0", ds("zero1"), 4, dropout=0.0))
    second = [s(f"resume_{c}", ds("zero0" if c == "tp2" else c), 4, **kw) for c, kw in resumed.items()]
    return first, second


def one_rank_scenarios(root, fasta: str, family: str) -> list[dict]:
    """The dense reference (micro 8 = global 8) and the universal checkpoints' second halves, in the 2-rank runs' own
    directories."""
    out = [run(root, fasta, family, "dense_micro8", ds("zero0"), 8, dropout=0.0)]
    for name in SEAMS[family]["universal"]:
        s = run(root, fasta, family, name, ds(UNIVERSAL[name][0]), 8, dropout=0.0)
        s["config"]["checkpoint"].update({"resume": str(root / family / name / "checkpoints_universal"),
                                          "universal": True})  # fmt: skip
        out.append(s)
    return out


class Workers:
    """The 2-rank runs (with the tensor-parallel check), the universal conversions, the 1-rank runs."""

    def __init__(self, root, fasta: str):
        self.root = root
        check = "support.hyena_checks:tensor_parallel_gradients"
        scenarios = [{"name": "checks", "check": check, "run_dir": str(root / "checks")}]
        halves = [family_scenarios(root, fasta, f) for f in FAMILIES]
        self.two = run_worker(root, scenarios + [s for first, _ in halves for s in first] +
                              [s for _, second in halves for s in second], 2)  # fmt: skip
        self.converted = {
            (f, name): cli_here("convert-checkpoint", "--checkpoint", str(root / f / name), "--workers", "1")
            for f in FAMILIES
            for name in SEAMS[f]["universal"]
        }
        self.one = run_worker(root, [s for f in FAMILIES for s in one_rank_scenarios(root, fasta, f)], 1)


@pytest.fixture(scope="module")
def workers(phix, tmp_path_factory) -> Workers:
    return Workers(tmp_path_factory.mktemp("hyena_engine"), phix)


def ds_json(runs: Runs, name: str) -> dict:
    return json.loads((runs.root / name / "ds_config.json").read_text())


FAMILY = pytest.mark.parametrize("family", list(FAMILIES))


def each(seam: str, skip_first: bool = False) -> list[tuple[str, str]]:
    """(family, case) for every case of `seam` a family runs (SEAMS)."""
    return [(f, c) for f in FAMILIES for c in SEAMS[f][seam][1 if skip_first else 0 :]]


# ----- tier 2: tensor-parallel gradients -----------------------------------------------------------------------


@pytest.mark.slow
def test_tensor_parallel_model_equals_dense_gradient_by_gradient(workers):
    for rank, result in enumerate(workers.two.checks()):
        cases = {k: v for k, v in result.items() if not k.startswith("control/")}
        assert len(cases) == 8  # hyena, striped_hyena, an imported Evo 2's and HyenaDNA's forms, without and selective
        for case, d in cases.items():
            print(f"rank {rank} {case}: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items() if k != "local_params"))
            assert d["initial_weights"] == 0.0 and d["weight"] == 0.0, (case, d)  # the shards are the dense slices
            assert d["loss"] <= 1e-6 and d["nll"] <= 3e-7 * d["nll_scale"], (case, d)
            assert max(d["sharded"], d["replicated"]) <= GRAD_ATOL, (case, d)
            assert d["filter_mlp"] <= FILTER_MLP_RTOL * d["filter_mlp_scale"], (case, d)
            has_mlp = case.startswith(("hyena/", "hyenadna_form/"))
            assert (d["filter_mlp_scale"] > 0) == has_mlp, (case, d)  # H layers have the MLP
            assert d["local_params"] < 0.6 * d["dense_params"], (case, d)
        control = result["control/filter_mlp_without_all_reduce"]
        print(f"rank {rank}: filter MLP gradient without the all-reduce off by {control:.3g} (relative)")
        assert control > 0.1


# ----- tier 3: ZeRO, offload, accumulation, precision -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family, stage", each("zero", skip_first=True))
def test_zero_stage_equals_zero0(workers, family, stage):
    runs = workers.two
    assert ds_json(runs, f"{family}/{stage}")["zero_optimization"]["stage"] == int(stage[-1])
    shards = list((runs.root / family / stage / "checkpoints" / f"step_{STEPS:08d}").glob("*optim_states.pt"))
    assert len(shards) == 2, shards  # the optimizer state really was partitioned over both ranks
    assert_equivalent(runs, f"{family}/{stage}", runs, f"{family}/zero0", grad_norms=True)


@pytest.mark.slow
@pytest.mark.parametrize("family, offload", each("offload"))
def test_offload_equals_in_memory(workers, family, offload):
    zero = ds_json(workers.two, f"{family}/{offload}")["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert zero.get("offload_param", {}).get("device", "none") == ("cpu" if zero["stage"] == 3 else "none")
    assert_equivalent(workers.two, f"{family}/{offload}", workers.two, f"{family}/{OFFLOAD[offload]}")


@pytest.mark.slow
@pytest.mark.parametrize("family, stage", each("accum"))
def test_grad_accumulation_equals_the_large_batch(workers, family, stage):
    name = f"{family}/{stage}_micro2_accum2"
    d = ds_json(workers.two, name)
    assert (d["train_micro_batch_size_per_gpu"], d["gradient_accumulation_steps"], d["train_batch_size"]) == (2, 2, 8)
    assert_equivalent(workers.two, name, workers.two, f"{family}/{stage}_micro4")


@pytest.mark.slow
@FAMILY
def test_one_rank_equals_two_ranks_at_the_same_global_batch(workers, family):
    assert_equivalent(workers.one, f"{family}/dense_micro8", workers.two, f"{family}/zero0_micro4", grad_norms=True)


@pytest.mark.slow
@FAMILY
def test_bf16_trains_and_tracks_fp32(workers, family):
    runs, name = workers.two, f"{family}/zero1_bf16"
    assert ds_json(runs, name)["bf16"]["enabled"]
    rows = runs.train_rows(name)
    assert all(r["grad_norm"] > 0 for r in rows), rows
    losses, fp32 = runs.losses(name), runs.losses(f"{family}/zero1")
    assert losses[STEPS - 1] < losses[0] - 0.1, losses
    diff = max(abs(x - y) for x, y in zip(losses, fp32))
    print(f"{name} vs fp32: loss {diff:.3g}")
    assert diff <= BF16_LOSS_ATOL, (losses, fp32)


# ----- tier 3: resuming and recomputation, exact -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family, config", each("resumed"))
def test_resume_equals_uninterrupted(workers, family, config):
    name = f"{family}/resume_{config}"
    ckpts = sorted(p.name for p in (workers.two.root / name / "checkpoints").glob("step_*"))
    assert ckpts == [f"step_{STOP:08d}", f"step_{STEPS:08d}"], ckpts
    assert_equivalent(workers.two, name, workers.two, f"{family}/{config}", loss_atol=0.0, weight_atol=0.0)
    assert workers.two.grad_norms(name) == workers.two.grad_norms(f"{family}/{config}")


@pytest.mark.slow
@FAMILY
@pytest.mark.parametrize(
    "name, reference", [("zero1_ds_checkpointing", "zero1"), ("zero3_selective", "zero3"), ("tp2_partitioned", "tp2")]
)
def test_recomputation_in_the_engine_is_exact(workers, family, name, reference):
    """Dropout on: DeepSpeed's checkpoint function (full policy; partitioned over the tensor group for tp2) and
    torch's selective recompute under ZeRO-3 replay the masks and the gathered parameters."""
    if name != "zero3_selective":
        block = ds_json(workers.two, f"{family}/{name}")["activation_checkpointing"]
        assert block["partition_activations"] == (name == "tp2_partitioned")
    assert_equivalent(workers.two, f"{family}/{name}", workers.two, f"{family}/{reference}", 0.0, 0.0)


# ----- tier 3: tensor and pipeline parallelism against one rank --------------------------------------------------


@pytest.mark.slow
@FAMILY
def test_tp2_equals_dense(workers, family):
    name = f"{family}/tp2_zero1"
    assert ds_json(workers.two, name)["train_batch_size"] == 8  # data-parallel size 1
    tag = workers.two.root / name / "checkpoints" / f"step_{STEPS:08d}"
    assert sorted(p.name for p in tag.glob("mp_rank_*")) == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    dense = workers.one.train_rows(f"{family}/dense_micro8")
    assert any(r["grad_norm"] > ds_json(workers.two, name)["gradient_clipping"] for r in dense), "clipping never acted"
    # The weights merged from the mp_rank files by the family's partition_dims: every operator of the family is there.
    keys = set(workers.two.weights(name))
    if family == "hyena":
        expected = ["mixer.filter.mlp.0.weight"] * 2
    else:
        expected = ["mixer.filter.h", "mixer.filter.h", "mixer.filter.log_rate", "attn.qkv.weight"]  # SE MR LI A
    assert all(f"blocks.{i}.{key}" in keys for i, key in enumerate(expected)), sorted(keys)
    assert_equivalent(workers.two, name, workers.one, f"{family}/dense_micro8", LOSS_ATOL, WEIGHT_ATOL, True)


@pytest.mark.slow
@pytest.mark.parametrize("family, name", each("pp"))
def test_pp2_equals_dense(workers, family, name):
    tag = workers.two.root / family / name / "checkpoints" / f"step_{STEPS:08d}"
    workers.two.rows(f"{family}/{name}")
    layers = sorted(p.name for p in tag.glob("layer_*"))
    n_layer = FAMILIES[family]["n_layer"]
    assert layers == [f"layer_{i:02d}-model_states.pt" for i in range(n_layer + 2)]  # the tied head: no file
    assert_equivalent(workers.two, f"{family}/{name}", workers.one, f"{family}/dense_micro8", grad_norms=True)


# ----- tier 3: universal checkpoints, 2 ranks -> 1 ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family, name", each("universal"))
def test_universal_checkpoint_resumes_on_one_rank(workers, family, name):
    proc = workers.converted[(family, name)]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = f"{family}/{name}"
    assert json.loads((workers.root / run_dir / "env.json").read_text())["world_size"] == 1
    assert ds_json(workers.one, run_dir)["checkpoint"]["load_universal"] is True
    reference = f"{family}/{UNIVERSAL[name][2]}"
    la, lb = workers.one.losses(run_dir), workers.two.losses(reference)
    assert la[:STOP] == lb[:STOP]  # steps 1-3 as the 2-rank half logged them
    loss_diff = max(abs(x - y) for x, y in zip(la[STOP:], lb[STOP:]))
    weight_diff = max_abs_diff(workers.one.weights(run_dir), workers.two.weights(reference))
    print(f"{run_dir} (2 ranks -> universal -> 1 rank) vs {reference}: loss {loss_diff:.3g}, weights {weight_diff:.3g}")
    assert loss_diff <= LOSS_ATOL and weight_diff <= WEIGHT_ATOL, (la, lb, weight_diff)
