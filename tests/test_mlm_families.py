"""The masked-LM families (caduceus: BiMamba, RC-PS and post-hoc; gpn: the dilated CNN) through the engine's seams
and after training, on real `megagenome pretrain` runs: one 2-rank launch, the universal conversions in this
process, one 1-rank run (support/worker.py), fp32 unless named, 6 AdamW steps with clipping active, the mlm
objective (15% of bases selected, 80/10/10), as tests/test_hyena_engine.py does it for the Hyena families.

Tier 1 (no processes): sequence and pipeline parallelism are refused before launch for both families, each with its
reason (ParallelRules.refused).

Tier 2 (one check in the 2-rank launch, support/mlm_tp_checks.py): the tensor-parallel model (caduceus ps and
post-hoc, gpn; selective recomputation too) equals the dense one: the initial weights are exactly the dense slices,
the loss equal, every gradient this rank's slice of the dense one (RC-PS's eval-mode logits too); B and C not
entering the region (caduceus) or the convolution's input not entering it (gpn) is caught.

Tier 3, caduceus (RC-PS) and gpn, every seam; caduceus post-hoc (the same blocks, no parameter sharing) the ones
whose code differs (the stages and the dense reference):

- ZeRO 1 and 3 equal ZeRO 0 (dropout on, gradient norms too; post-hoc ZeRO 3); CPU offload at ZeRO 3 equals ZeRO 3
  in memory; gradient accumulation (micro 2 x 2) equals micro 4 x 1 at ZeRO 3; 2 ranks equal 1 rank at global batch
  8;
- bf16 (BF16_Optimizer) trains and tracks fp32 within the transformer's 5e-3;
- stop at step 3 and resume equals the uninterrupted run bit for bit at ZeRO 3 (dropout on: RNG states restored);
  DeepSpeed's activation checkpointing (full, ZeRO 1) and selective recomputation under ZeRO 3 equal the plain runs
  exactly;
- a universal checkpoint of 2 ranks at ZeRO 1 resumes on 1 rank and gives the uninterrupted run's steps 4-6;
- tensor 2 (ZeRO 0, one data-parallel rank, micro 8) equals the dense 1-rank run: losses, gradient norms
  and the weights merged from the mp_rank files by the family's partition_dims.

After training, on those runs: `eval` reads the ZeRO-3 partitions back (its masked pseudo-likelihood of the
ZeRO-3 run equals the ZeRO-0 run's within their training difference); score-variants' SNV score is GPN's masked
marginal of the consolidated model; the export (safetensors + megagenome.json) reads back to the same logits; a gpn
student distilled from the caduceus teacher trains and differs from its plain twin; `megagenome report` summarises
a run; `megagenome plan` prices both families.
"""

from __future__ import annotations

import csv
import functools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.helpers import cli_here, copy_genome
from support.runs import BF16_LOSS_ATOL, STEPS, STOP, assert_equivalent, ds, max_abs_diff, run_worker, scenario
from support.scoring_checks import options, phix_records, write_test_vcf

from megagenome.config import ConfigError
from megagenome.config.load import config_from_dict
from megagenome.data.tokenizer import MASK_ID, encode
from megagenome.run.assembly import validate

MLM = {"objective": "mlm"}
FAMILIES = {
    "caduceus": {"family": "caduceus", "n_layer": 2, "state_size": 4, "rc_equivariance": "ps", **MLM},
    "caduceus_ph": {"family": "caduceus", "n_layer": 2, "state_size": 4, "rc_equivariance": "post_hoc", **MLM},
    "gpn": {"family": "gpn", "n_layer": 3, "first_kernel_size": 5, "kernel_size": 3, "d_ff": 64, **MLM},
}
FULL = ("caduceus", "gpn")  # every seam; caduceus_ph the stages and the dense reference
# ZeRO 2 partitions gradients as ZeRO 1 partitions the optimizer state, with no code of the family's own: the Hyena
# families and the transformer test it (test_hyena_engine, test_ds_equivalence); post-hoc shares ps's blocks.
ZERO = {"caduceus": ["zero0", "zero1", "zero3"], "caduceus_ph": ["zero0", "zero3"], "gpn": ["zero0", "zero1", "zero3"]}
TEACHER = {"distill_alpha": 0.5, "distill_temperature": 2.0}


def run(root, fasta: str, family: str, name: str, ds_config, micro: int, accum: int = 1, **train):
    """support/runs.py's tiny scenario (dropout 0.1 unless given) as `family`, named family/name."""
    model, parallel = train.pop("model", {}), train.pop("parallel", {})
    s = scenario(root, fasta, f"{family}/{name}", ds_config, micro, accum, **train)
    s["config"]["model"].update(FAMILIES[family], **model)
    s["config"]["parallel"] = parallel
    return s


# Every run masks 15% of the bases. The mlm objective selects a random number of positions per window, so the runs
# that regroup the global batch (1 rank against 2, accumulation, a universal checkpoint resumed at another
# data-parallel size) agree only because a step's loss is the mean over the whole global batch
# (engine/token_mean.py); with each micro batch's own mean they differed by 0.4-0.9% in gradient norm.


def family_scenarios(root, fasta: str, family: str) -> tuple[list[dict], list[dict]]:
    """(the 2-rank runs, the second halves of the resumed one): global batch 8 = micro 4 x 2 ranks unless named."""
    s = functools.partial(run, root, fasta, family)
    first = [s(c, ds(c), 4) for c in ZERO[family]] + [s("zero0_micro4", ds("zero0"), 4, dropout=0.0)]
    if family not in FULL:
        return first, []
    first += [
        s("zero3_offload", ds("zero3_offload"), 4),
        s("zero3_micro4", ds("zero3"), 4, dropout=0.0),
        s("zero3_micro2_accum2", ds("zero3"), 2, 2, dropout=0.0),
        s("zero1_bf16", ds("zero1", "bf16"), 4),
        s("resume_zero3", ds("zero3"), 4, stop_at=STOP),
        s("zero1_ds_checkpointing", ds("zero1", "activation_checkpointing"), 4, model={"checkpointing": "full"}),
        s("zero3_selective", ds("zero3"), 4, model={"checkpointing": "selective"}),
        s("zero1_split", ds("zero1"), 4, dropout=0.0, stop_at=STOP),
        s("zero1_d0", ds("zero1"), 4, dropout=0.0),
        s("tp2", ds("zero0"), 8, dropout=0.0, parallel={"tensor": 2}),  # data-parallel size 1
    ]
    return first, [s("resume_zero3", ds("zero3"), 4)]


def student(root, fasta: str, name: str, teacher: str | None) -> dict:
    """A gpn run at ZeRO 0 distilled from the caduceus ZeRO-0 run (None: its plain twin)."""
    s = run(root, fasta, "gpn", name, ds("zero0"), 4, dropout=0.0)
    if teacher:
        s["config"]["train"].update(distill_from=str(root / teacher), **TEACHER)
    return s


class Workers:
    """The 2-rank runs, the universal conversions, the 1-rank runs."""

    def __init__(self, root, fasta: str):
        self.root, self.fasta = root, fasta
        halves = [family_scenarios(root, fasta, f) for f in FAMILIES]
        students = [student(root, fasta, "student", "caduceus/zero0"), student(root, fasta, "twin", None)]
        checks = [{"name": "checks", "check": "support.mlm_tp_checks:tensor_parallel_gradients",
                   "run_dir": str(root / "checks")}]  # fmt: skip
        self.two = run_worker(root, checks + [s for first, _ in halves for s in first] + [s for _, second in halves
                              for s in second] + students, 2, timeout_s=900)  # fmt: skip
        self.converted = {
            f: cli_here("convert-checkpoint", "--checkpoint", str(root / f / "zero1_split"), "--workers", "1")
            for f in FULL
        }
        ones = [run(root, fasta, f, "dense_micro8", ds("zero0"), 8, dropout=0.0) for f in FAMILIES]
        for f in FULL:
            s = run(root, fasta, f, "zero1_split", ds("zero1"), 8, dropout=0.0)
            s["config"]["checkpoint"].update(resume=str(root / f / "zero1_split" / "checkpoints_universal"),
                                             universal=True)  # fmt: skip
            ones.append(s)
        self.one = run_worker(root, ones, 1)


@pytest.fixture(scope="module")
def phix(tmp_path_factory):
    return copy_genome("phiX174_NC_001422.1.fna", tmp_path_factory.mktemp("genome"))


@pytest.fixture(scope="module")
def workers(phix, tmp_path_factory) -> Workers:
    return Workers(tmp_path_factory.mktemp("mlm_families"), phix)


def ds_json(runs, name: str) -> dict:
    return json.loads((runs.root / name / "ds_config.json").read_text())


# ----- tier 1: before launch --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["caduceus", "gpn"])
@pytest.mark.parametrize("degree", ["sequence", "pipeline"])
def test_model_parallelism_is_refused_with_the_reason(tmp_path, phix, family, degree):
    config = run(tmp_path, phix, family, degree, ds("zero0"), 4)["config"]
    config["parallel"] = {degree: 2}
    with pytest.raises(ConfigError) as e:
        validate(config_from_dict(config), [], world_size=2)
    refusals = [p for p in e.value.problems if p.startswith(f"--parallel.{degree}=2 with --model.family={family}: ")]
    assert len(refusals) == 1 and len(refusals[0]) > 60, e.value.problems


# ----- tier 2: tensor-parallel gradients ------------------------------------------------------------------------

GRAD_ATOL = 1e-6  # the tensor-parallel model's gradients against dense (fp32, |grad| up to ~0.5; measured ~3e-8)


@pytest.mark.slow
def test_tensor_parallel_model_equals_dense_gradient_by_gradient(workers):
    for rank, result in enumerate(workers.two.checks()):
        cases = {k: v for k, v in result.items() if not k.startswith("control/")}
        assert len(cases) == 5
        for case, d in cases.items():
            print(f"rank {rank} {case}: " + ", ".join(f"{k} {v:.3g}" for k, v in d.items() if "params" not in k))
            assert d["initial_weights"] == 0.0 and d["weight"] == 0.0, (case, d)  # the shards are the dense slices
            assert d["loss"] <= 1e-6 and d["nll"] <= 3e-7 * d["nll_scale"], (case, d)
            assert max(d["sharded"], d["replicated"]) <= GRAD_ATOL, (case, d)
            assert d.get("eval_logits", 0.0) <= 1e-5 and d["local_params"] < 0.6 * d["dense_params"], (case, d)
        for control in ("caduceus_ps", "gpn"):
            moved = result[f"control/{control}"]
            print(f"rank {rank}: {control} with a region entry removed: gradients off by {moved:.3g} (relative)")
            assert moved > 0.1


# ----- tier 3: the engine's seams ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family, stage", [(f, stage) for f in FAMILIES for stage in ZERO[f][1:]])
def test_zero_stage_equals_zero0(workers, family, stage):
    runs = workers.two
    assert ds_json(runs, f"{family}/{stage}")["zero_optimization"]["stage"] == int(stage[-1])
    shards = list((runs.root / family / stage / "checkpoints" / f"step_{STEPS:08d}").glob("*optim_states.pt"))
    assert len(shards) == 2, shards
    assert_equivalent(runs, f"{family}/{stage}", runs, f"{family}/zero0", grad_norms=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_rank_equals_two_ranks_at_the_same_global_batch(workers, family):
    assert_equivalent(workers.one, f"{family}/dense_micro8", workers.two, f"{family}/zero0_micro4", grad_norms=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", FULL)
def test_offload_and_accumulation_equal_their_references(workers, family):
    zero = ds_json(workers.two, f"{family}/zero3_offload")["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert_equivalent(workers.two, f"{family}/zero3_offload", workers.two, f"{family}/zero3")
    d = ds_json(workers.two, f"{family}/zero3_micro2_accum2")
    assert (d["train_micro_batch_size_per_gpu"], d["gradient_accumulation_steps"], d["train_batch_size"]) == (2, 2, 8)
    assert_equivalent(workers.two, f"{family}/zero3_micro2_accum2", workers.two, f"{family}/zero3_micro4")


@pytest.mark.slow
@pytest.mark.parametrize("family", FULL)
def test_bf16_trains_and_tracks_fp32(workers, family):
    runs, name = workers.two, f"{family}/zero1_bf16"
    assert ds_json(runs, name)["bf16"]["enabled"]
    losses, fp32 = runs.losses(name), runs.losses(f"{family}/zero1")
    assert losses[STEPS - 1] < losses[0] - 0.05, losses
    diff = max(abs(x - y) for x, y in zip(losses, fp32))
    print(f"{name} vs fp32: loss {diff:.3g}")
    assert diff <= BF16_LOSS_ATOL, (losses, fp32)


@pytest.mark.slow
@pytest.mark.parametrize("family", FULL)
def test_resume_and_recomputation_are_exact(workers, family):
    runs = workers.two
    ckpts = sorted(p.name for p in (runs.root / family / "resume_zero3" / "checkpoints").glob("step_*"))
    assert ckpts == [f"step_{STOP:08d}", f"step_{STEPS:08d}"], ckpts
    assert_equivalent(runs, f"{family}/resume_zero3", runs, f"{family}/zero3", loss_atol=0.0, weight_atol=0.0)
    assert runs.grad_norms(f"{family}/resume_zero3") == runs.grad_norms(f"{family}/zero3")
    assert "activation_checkpointing" in ds_json(runs, f"{family}/zero1_ds_checkpointing")
    assert_equivalent(runs, f"{family}/zero1_ds_checkpointing", runs, f"{family}/zero1", 0.0, 0.0)
    assert_equivalent(runs, f"{family}/zero3_selective", runs, f"{family}/zero3", 0.0, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("family", FULL)
def test_universal_checkpoint_resumes_on_one_rank(workers, family):
    proc = workers.converted[family]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    name = f"{family}/zero1_split"
    assert ds_json(workers.one, name)["checkpoint"]["load_universal"] is True
    la, lb = workers.one.losses(name), workers.two.losses(f"{family}/zero1_d0")
    assert la[:STOP] == lb[:STOP]
    loss_diff = max(abs(x - y) for x, y in zip(la[STOP:], lb[STOP:]))
    weight_diff = max_abs_diff(workers.one.weights(name), workers.two.weights(f"{family}/zero1_d0"))
    print(f"{name} (2 ranks -> universal -> 1 rank): loss {loss_diff:.3g}, weights {weight_diff:.3g}")
    assert loss_diff <= 1e-6 and weight_diff <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("family", FULL)
def test_tp2_equals_dense(workers, family):
    name = f"{family}/tp2"
    assert ds_json(workers.two, name)["train_batch_size"] == 8  # data-parallel size 1
    tag = workers.two.root / name / "checkpoints" / f"step_{STEPS:08d}"
    assert sorted(p.name for p in tag.glob("mp_rank_*")) == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    dense = workers.one.train_rows(f"{family}/dense_micro8")
    assert any(r["grad_norm"] > ds_json(workers.two, name)["gradient_clipping"] for r in dense), "clipping never acted"
    merged, whole = workers.two.weights(name), workers.one.weights(f"{family}/dense_micro8")
    assert {k: tuple(v.shape) for k, v in merged.items()} == {k: tuple(v.shape) for k, v in whole.items()}
    loss_diff, weight_diff = assert_equivalent(
        workers.two, name, workers.one, f"{family}/dense_micro8", 1e-6, 1e-6, True
    )
    print(f"{name} vs 1-rank dense: loss {loss_diff:.3g}, weights {weight_diff:.3g}")


# ----- after training -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_eval_reads_zero3_partitions_back(workers, family):
    from megagenome.after_training.evaluate import evaluate
    from megagenome.after_training.inference import load_model

    bits = {}
    for stage in ("zero0", "zero3"):
        loaded = load_model(str(workers.root / family / stage))
        result = evaluate(loaded, workers.fasta, ["NC_001422.1:4301-5386"], 64, 8, False, False)
        assert result["run"]["objective"] == "mlm"
        bits[stage] = result["overall"]["bits_per_base"]
    print(f"{family}: held-out masked pseudo-likelihood, bits/base {bits}")
    # 6 steps from initialisation: below a uniform guess over the 8 tokens (3 bits), not yet over the 4 bases
    assert 1.0 < bits["zero0"] < 3.0 and bits["zero3"] == pytest.approx(bits["zero0"], abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", FULL)
def test_snv_scores_are_masked_marginals(workers, family, tmp_path):
    from megagenome.after_training.inference import load_model
    from megagenome.after_training.variant_scoring import run as score_variants

    run_dir, fasta = str(workers.root / family / "zero3"), workers.fasta
    vcf = write_test_vcf(str(tmp_path / "v.vcf"), fasta)
    score_variants(options(run_dir, fasta, vcf, str(tmp_path / "out"), window=40))
    with open(tmp_path / "out.tsv") as f:
        rows = {(int(r["pos"]), r["alt"]): r for r in csv.DictReader(f, delimiter="\t")}
    loaded = load_model(run_dir)
    seq = open(fasta).read().split("\n", 1)[1].replace("\n", "").encode()
    ref, alt = {pos: (r, a) for pos, r, a, _ in phix_records(seq.decode())}[150]
    tokens = torch.from_numpy(encode(seq[150 - 21 : 150 + 19])[0].astype(np.int64))[None]
    tokens[0, 20] = MASK_ID
    with torch.no_grad():
        logp = F.log_softmax(loaded.model.logits(tokens).double(), dim=-1)[0]
    expected = float(logp[20, encode(alt)[0][0]] - logp[20, encode(ref)[0][0]])
    assert rows[(150, alt)]["method"] == "masked_marginal"
    assert float(rows[(150, alt)]["score"]) == pytest.approx(expected, abs=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_reads_back_to_the_same_logits(workers, family, tmp_path):
    from megagenome.after_training import export
    from megagenome.after_training.inference import load_model

    run_dir = str(workers.root / family / "zero3")
    export.export(run_dir, str(tmp_path / "export"))
    manifest = json.loads((tmp_path / "export" / "megagenome.json").read_text())
    assert (tmp_path / "export" / "model.safetensors").exists()
    assert manifest["model"]["family"] == FAMILIES[family]["family"], manifest
    tokens = torch.randint(3, 7, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = load_model(run_dir).model.logits(tokens)
        theirs = load_model(str(tmp_path / "export")).model.logits(tokens)
    assert torch.equal(ours, theirs)


@pytest.mark.slow
def test_a_gpn_student_of_a_caduceus_teacher_trains(workers):
    runs = workers.two
    student_losses, twin = runs.losses("gpn/student"), runs.losses("gpn/twin")
    assert student_losses[STEPS - 1] < student_losses[0] and student_losses != twin
    assert sorted(runs.weights("gpn/student")) == sorted(runs.weights("gpn/twin"))  # only its own tensors


@pytest.mark.slow
@pytest.mark.parametrize("family", FULL)
def test_report_and_plan(workers, family, tmp_path):
    proc = cli_here("report", str(workers.root / family / "zero3"), "--output", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # A masked run's summary compares it with two-sided k-mer baselines under its own masking, not with the causal
    # Markov chains it also records for scale; the report shows the same (tests/test_masked_baseline.py: the values).
    summary = json.loads((workers.root / family / "zero3" / "summary.json").read_text())
    masked = {int(k): v for k, v in summary["masked_baseline_bits_per_base"].items()}
    assert sorted(masked) == [0, 1, 2, 3, 4] and summary["best_masked_baseline_k"] == min(masked, key=masked.get)
    model = summary["heldout_bits_per_base"]
    assert (
        summary["beats_best_masked_baseline"] == (model < min(masked.values())) and "beats_best_markov" not in summary
    )
    md = (tmp_path / "report" / "report.md").read_text()
    assert "against the masked baselines" in md and "| order-0 Markov" not in md
    config = workers.root / family / "zero3" / "config.yaml"
    proc = cli_here("plan", "--config", str(config), "--gpu", "H200", "--gpu_memory_gb", "141", "--gpus", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert FAMILIES[family]["family"] in proc.stdout
