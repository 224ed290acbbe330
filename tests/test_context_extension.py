"""Context extension (issue 15 part 4): rotary scaling (model/layers.py rope_frequencies), its flags and their
validation (config/checks.py), continuing a run or an export at a longer context, and the scaled export's Hugging
Face config (model/transformer/hf.py rope_fields).

Pure tests (no process group):
- factor 1 (and none) gives the unscaled tables bit for bit; linear is positions / factor exactly; ntk's base is
  theta x factor^(d/(d-2)) (the slowest frequency slows by exactly the factor, the fastest stays); yarn against a
  table worked out by hand from its formula and against transformers' _compute_yarn_parameters; yarn's mscale scales
  cos and sin;
- every flag problem named; a resume at another context refused without --checkpoint.allow_context_change, listing
  the keys, and allowed with it; a checkpoint recorded before the rope keys existed still resumes;
- an exported scaled model loads in transformers as the same function (logits within 1e-4), where the unscaled
  function differs by far more.

One 2-rank launch (support/worker.py): 4 steps at seq 64 stopped (ZeRO-1, fp32), exported at step 4, resumed at seq
128 / max_seq_len 128 with linear scaling x2 for steps 5-6, and a new run started from the export at the same
context for 3 steps; checked from what the runs wrote.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest
import torch
import yaml
from support.helpers import copy_genome, tiny_config
from support.runs import ds, run_worker

from megagenome.after_training import hf_files
from megagenome.after_training.inference import build_model, read_weights
from megagenome.config import ModelConfig, RootConfig, config_differences, resume_record, validate
from megagenome.config.load import config_from_dict
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.model.transformer import DNATransformer
from megagenome.model.transformer import hf as llama_hf
from megagenome.model.transformer.blocks import RotaryEmbedding, rope_frequencies, yarn_mscale
from megagenome.observe.metrics import read_metrics
from megagenome.run import resume_checks

LR = 3e-3  # tiny_config's peak learning rate
GLOBAL_BATCH = 8  # micro 4 x 2 ranks


# ----- the scaled tables ------------------------------------------------------------------------------------------


def _old_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables as RotaryEmbedding built them before rotary scaling existed."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


@pytest.mark.parametrize("scaling", ["none", "linear", "ntk"])
def test_factor_one_is_the_unscaled_rotary_bit_for_bit(scaling):
    cos, sin = _old_tables(16, 96, 10000.0)
    rope = RotaryEmbedding(16, 96, 10000.0, scaling, 1.0, 96)
    assert rope.mscale == 1.0
    assert torch.equal(rope.cos, cos) and torch.equal(rope.sin, sin)
    yarn = RotaryEmbedding(16, 96, 10000.0, "yarn", 1.0, 96)  # ramp weights sum to 1: equal up to one rounding
    assert yarn.mscale == 1.0 and torch.allclose(yarn.cos, cos, atol=1e-6, rtol=0)


def test_linear_is_positions_over_factor():
    base = RotaryEmbedding(16, 64)
    for factor in (2.0, 4.0):  # powers of two: position p x (inv_freq / f) is (p / f) x inv_freq exactly
        scaled = RotaryEmbedding(16, 64 * int(factor), scaling="linear", factor=factor)
        positions = torch.arange(64) * int(factor)
        assert torch.equal(scaled.cos[positions], base.cos) and torch.equal(scaled.sin[positions], base.sin)
    inv, mscale = rope_frequencies(16, 10000.0, "linear", 3.0)
    unscaled, _ = rope_frequencies(16, 10000.0)
    p = torch.arange(300, dtype=torch.float64)
    assert mscale == 1.0
    assert torch.allclose(torch.outer(p, inv), torch.outer(p / 3.0, unscaled), rtol=1e-15, atol=1e-12)


def test_ntk_changes_the_base():
    d, theta, factor = 16, 10000.0, 4.0
    inv, mscale = rope_frequencies(d, theta, "ntk", factor)
    base = theta * factor ** (d / (d - 2))
    expected = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    assert mscale == 1.0 and torch.allclose(inv, expected, rtol=1e-14, atol=0)
    unscaled, _ = rope_frequencies(d, theta)
    assert inv[0] == unscaled[0] == 1.0  # the fastest frequency (position resolution) is kept
    assert unscaled[-1] / inv[-1] == pytest.approx(factor, rel=1e-12)  # the slowest turns `factor` times slower


def test_yarn_matches_a_hand_worked_table():
    """head size 16, theta 1e4, factor 4, trained context 256. The ramp's bounds: the dimension turning 32 times over
    256 positions is 16 ln(256 / (32 * 2 pi)) / (2 ln 1e4) = 0.2098 -> floor 0; once: 16 ln(256 / (2 pi)) / (2 ln 1e4)
    = 3.2201 -> ceil 4. So frequency i (of 8) keeps (1 - i/4) of itself and takes i/4 of itself / 4: weights 1,
    0.8125, 0.625, 0.4375 and 0.25 from i = 4 on; mscale 0.1 ln 4 + 1 = 1.1386294361."""
    inv, mscale = rope_frequencies(16, 10000.0, "yarn", 4.0, 256)
    weights = torch.tensor([1.0, 0.8125, 0.625, 0.4375, 0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    unscaled = torch.tensor([10000.0 ** (-i / 8) for i in range(8)], dtype=torch.float64)
    assert torch.allclose(inv, unscaled * weights, rtol=1e-14, atol=0)
    assert mscale == pytest.approx(1.1386294361, abs=1e-10) == yarn_mscale(4.0)
    # A longer trained context moves the ramp up: 16 ln(4096 / (2 pi)) / (2 ln 1e4) = 5.629 -> 6, low 16 ln(4096 /
    # (64 pi)) / (2 ln 1e4) = 2.62 -> 2: frequencies 0-2 kept whole, 6-7 interpolated whole.
    inv, _ = rope_frequencies(16, 10000.0, "yarn", 4.0, 4096)
    ramp = torch.tensor([0, 0, 0, 0.25, 0.5, 0.75, 1, 1], dtype=torch.float64)
    assert torch.allclose(inv, unscaled * (1 - ramp) + unscaled / 4 * ramp, rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "head_dim,factor,original,theta", [(16, 4, 256, 1e4), (64, 8, 2048, 1e4), (128, 16, 8192, 1e6)]
)
def test_yarn_matches_transformers(head_dim, factor, original, theta):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor)}
    params["original_max_position_embeddings"] = original
    config = transformers.LlamaConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, max_position_embeddings=original * factor
    )
    config.rope_parameters = params
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours, mscale = rope_frequencies(head_dim, theta, "yarn", factor, original)
    assert torch.allclose(theirs.double(), ours, rtol=1e-6, atol=0)  # theirs is float32
    assert mscale == pytest.approx(attention_factor, rel=1e-15)


def test_yarn_mscale_scales_cos_and_sin():
    rope = RotaryEmbedding(16, 128, scaling="yarn", factor=4.0)  # trained context default: 128 / 4
    m = 0.1 * math.log(4.0) + 1
    assert rope.mscale == pytest.approx(m, rel=1e-15)
    assert torch.allclose(rope.cos[0], torch.full((8,), m))  # cos 0 = 1
    assert torch.allclose(rope.cos**2 + rope.sin**2, torch.full_like(rope.cos, m * m), rtol=1e-6)
    default = rope_frequencies(16, 10000.0, "yarn", 4.0, 32)[0]
    angles = torch.outer(torch.arange(128, dtype=torch.float64), default)
    assert torch.allclose(rope.sin, (angles.sin() * m).float())


# ----- flags ------------------------------------------------------------------------------------------------------


def _cfg(**model) -> RootConfig:
    cfg = RootConfig()
    return replace(cfg, model=replace(cfg.model, **model), data=replace(cfg.data, fasta="x.fa", val_contigs=["chr2"]))


def test_rope_flags_are_validated_naming_the_flag():
    assert validate(_cfg()) == []
    for good in [
        {"rope_scaling": "linear", "rope_factor": 4.0},
        {"rope_scaling": "ntk", "rope_factor": 2.0},
        {"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_len": 256},
    ]:
        assert validate(_cfg(**good)) == [], good
    bad = {
        "--model.rope_factor=4.0 has no effect with --model.rope_scaling none": {"rope_factor": 4.0},
        "--model.rope_original_max_len=256 has no effect": {"rope_original_max_len": 256},
        "--model.rope_factor=0.5: must be a finite context multiple >= 1": {
            "rope_scaling": "linear",
            "rope_factor": 0.5,
        },
        "--model.rope_factor=inf": {"rope_scaling": "yarn", "rope_factor": math.inf},
        "--model.rope_original_max_len=2048: the context trained at must be within [1, --model.max_seq_len=1024]": {
            "rope_scaling": "yarn",
            "rope_factor": 2.0,
            "rope_original_max_len": 2048,
        },
        "--model.rope_original_max_len=512 x --model.rope_factor=4.0 must equal --model.max_seq_len=1024 with yarn": {
            "rope_scaling": "yarn",
            "rope_factor": 4.0,
            "rope_original_max_len": 512,
        },
        "--model.rope_scaling ntk needs a head size above 2": {
            "rope_scaling": "ntk",
            "rope_factor": 2.0,
            "d_model": 8,
            "n_head": 4,
        },
    }
    for message, model in bad.items():
        problems = validate(_cfg(**model))
        assert len(problems) == 1 and problems[0].startswith(message), (model, problems)


def test_a_context_change_on_resume_needs_the_flag():
    short = _cfg(max_seq_len=256)
    saved = resume_record(replace(short, data=replace(short.data, seq_len=256)))
    longer = _cfg(rope_scaling="linear", rope_factor=4.0)
    longer = replace(longer, data=replace(longer.data, seq_len=1024))
    hint = " (a context change: --checkpoint.allow_context_change true)"
    assert config_differences(saved, longer) == [
        "--model.max_seq_len: checkpoint 256, this run 1024" + hint,
        "--model.rope_factor: checkpoint 1.0, this run 4.0" + hint,
        "--model.rope_scaling: checkpoint 'none', this run 'linear'" + hint,
        "--data.seq_len: checkpoint 256, this run 1024" + hint,
    ]
    allowed = replace(longer, checkpoint=replace(longer.checkpoint, allow_context_change=True))
    assert config_differences(saved, allowed) == []
    wider = replace(allowed, model=replace(allowed.model, d_model=256))  # the flag allows the context only
    assert config_differences(saved, wider) == ["--model.d_model: checkpoint 128, this run 256"]


def test_a_run_without_rotary_scaling_records_what_it_did_before_the_flags():
    """The rope keys are recorded only when set (config/record.py RECORDED_WHEN_SET): an unscaled run's record and
    config_hash are those of a checkpoint written before the keys existed, which therefore still resumes."""
    record = resume_record(_cfg())
    assert not {"rope_scaling", "rope_factor", "rope_original_max_len"} & set(record["model"])
    assert config_differences(record, _cfg()) == []
    scaled = _cfg(rope_scaling="yarn", rope_factor=2.0)
    assert {"rope_scaling": "yarn", "rope_factor": 2.0}.items() <= resume_record(scaled)["model"].items()
    assert [d.split(":")[0] for d in config_differences(record, scaled)] == [
        "--model.rope_factor",
        "--model.rope_scaling",
    ]
    hint = " (a context change: --checkpoint.allow_context_change true)"  # back to none: its default, not None
    assert config_differences(resume_record(scaled), _cfg()) == [
        "--model.rope_factor: checkpoint 2.0, this run 1.0" + hint,
        "--model.rope_scaling: checkpoint 'yarn', this run 'none'" + hint,
    ]


# ----- Hugging Face export ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scaling,factor,original", [("linear", 4.0, None), ("ntk", 4.0, None), ("yarn", 3.0, None), ("yarn", 3.2, 40)]
)
def test_scaled_export_loads_in_transformers_as_the_same_function(tmp_path, scaling, factor, original):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    cfg = ModelConfig(d_model=64, n_layer=2, n_head=2, max_seq_len=128)
    cfg = replace(cfg, rope_scaling=scaling, rope_factor=factor, rope_original_max_len=original)
    torch.manual_seed(0)
    model = DNATransformer(cfg, VOCAB_SIZE).eval()
    with torch.no_grad():  # sharp attention, so that the positions (and yarn's temperature) show in the logits
        for block in model.blocks:
            block.attn.qkv.weight.mul_(15.0)
    state = model.state_dict()
    save_file(llama_hf.to_llama(state, cfg, VOCAB_SIZE), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf_files.write_hf_files(str(tmp_path), cfg, torch.float32, llama_hf.LlamaForm(cfg))
    written = json.loads((tmp_path / "config.json").read_text())
    want = {"linear": "linear", "ntk": "default", "yarn": "yarn"}[scaling]
    assert written["rope_parameters"]["rope_type"] == want
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    plain = build_model(replace(cfg, rope_scaling="none", rope_factor=1.0, rope_original_max_len=None), state).eval()
    tokens = torch.randint(3, 8, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.logits(tokens)
        diff = (hf(tokens).logits - ours).abs().max().item()
        unscaled = (plain.logits(tokens) - ours).abs().max().item()
    print(f"{scaling} x{factor:g}: transformers vs megagenome {diff:.2g}; unscaled vs scaled {unscaled:.2g}")
    assert diff < 1e-4
    assert unscaled > 1e-2  # the comparison can tell the scaling apart


# ----- one 2-rank launch: resume and init_from at a longer context ------------------------------------------------


def export_on_rank0(run_dir: str, source: str) -> None:
    """A worker check scenario: rank 0 exports `source`'s newest checkpoint into run_dir; every rank waits for it."""
    import torch.distributed as dist

    from megagenome.after_training.export import export

    if dist.get_rank() == 0:
        export(source, run_dir)
    dist.barrier()


def _short(root, fasta: str) -> dict:
    cfg = tiny_config(root, fasta, root / "run")
    cfg["model"]["max_seq_len"] = 64
    cfg["train"].update(ds_config=ds("zero1"), micro_batch_size=4, stop_at=4, eval_interval=2)
    cfg["checkpoint"] = {"interval": 0, "resume": "auto", "keep_last": 2}
    return cfg


def _longer(cfg: dict) -> dict:
    """cfg at max_seq_len 128, seq 128, linear rotary scaling x2, continuing to step 6."""
    cfg = json.loads(json.dumps(cfg))
    cfg["model"].update(max_seq_len=128, rope_scaling="linear", rope_factor=2.0)
    cfg["data"]["seq_len"] = 128
    cfg["train"].pop("stop_at")
    cfg["checkpoint"]["allow_context_change"] = True
    return cfg


@pytest.fixture(scope="module")
def extended(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctx")
    fasta = copy_genome("phiX174_NC_001422.1.fna", root / "genome")
    short = _short(root, fasta)
    from_export = _longer(short)
    from_export["model"]["init_from"] = str(root / "export")
    # Another seed: a random start would show. Three steps: the cosine schedule's first two updates are at LR 0.
    from_export["train"].update(max_steps=3, warmup_steps=0, seed=99)
    from_export["log"]["run_dir"] = str(root / "from_export")
    scenarios = [
        {"name": "short", "config": short},
        {"name": "export", "check": "test_context_extension:export_on_rank0", "run_dir": str(root / "export")},
        {"name": "resumed", "config": _longer(short)},
        {"name": "from_export", "config": from_export},
    ]
    scenarios[1]["args"] = {"source": str(root / "run")}
    runs = run_worker(root, scenarios, 2)
    runs.short = short
    return runs


def _finished(runs, name: str) -> list[dict]:
    assert (runs.root / name / "summary.json").exists(), runs._output_tail(name)
    return read_metrics(str(runs.root / name / "metrics.jsonl"))


def _heldout_bits(run_dir: str, model_cfg: ModelConfig) -> float:
    """The held-out bits/base of run_dir's newest weights in a model built with model_cfg, over the run's own
    evaluation windows (what its eval rows report)."""
    from megagenome.after_training import quantize

    _, state, _, run_cfg = read_weights(run_dir)
    data, _ = quantize.eval_data(model_cfg, run_cfg, None, None)
    try:
        batches = quantize.eval_batches(data)
    finally:
        data.close()
    return quantize.heldout_bits(build_model(model_cfg, state).eval(), batches)[0]


@pytest.mark.slow
def test_resume_at_a_longer_context_with_linear_scaling(extended):
    rows = _finished(extended, "run")
    assert [r["step"] for r in rows if "split" not in r] == list(range(1, 7))  # resumed, not restarted
    config = yaml.safe_load((extended.root / "run" / "config.yaml").read_text())
    assert {"max_seq_len": 128, "rope_scaling": "linear", "rope_factor": 2.0}.items() <= config["model"].items()
    assert config["data"]["seq_len"] == 128 and config["checkpoint"]["allow_context_change"] is True
    ckpts = extended.root / "run" / "checkpoints"
    before = json.loads((ckpts / "step_00000004" / "client_state.json").read_text())
    after = json.loads((ckpts / "step_00000006" / "client_state.json").read_text())
    assert (before["run_config"]["model"]["max_seq_len"], before["run_config"]["data"]["seq_len"]) == (64, 64)
    assert "rope_scaling" not in before["run_config"]["model"]  # unscaled: recorded as before the flags existed
    assert after["run_config"]["model"]["rope_scaling"] == "linear" and after["run_config"]["data"]["seq_len"] == 128
    assert after["samples_consumed"] == 6 * GLOBAL_BATCH
    # Cumulative tokens: steps 1-4 at 8 x 64 as the step-4 checkpoint saved them, steps 5-6 at 8 x 128 on top
    short, longer = GLOBAL_BATCH * 64, GLOBAL_BATCH * 128
    assert (before["tokens"], after["tokens"]) == (4 * short, 4 * short + 2 * longer)
    assert [r["tokens"] for r in rows if "split" not in r] == [short * s for s in (1, 2, 3, 4)] + [
        4 * short + longer,
        4 * short + 2 * longer,
    ]
    # The step-6 evaluation scored windows of 128 (8 x 128 predicted bases, 8 x 64 at step 4) with the final weights
    # in the model the recorded config builds, whose rotary tables are linear x2's.
    evals = {r["step"]: r for r in rows if r.get("split") == "val"}
    assert (evals[4]["bases"], evals[6]["bases"]) == (8 * 64, 8 * 128)
    cfg = config_from_dict(_longer(extended.short)).model
    assert ModelConfig(**config["model"]) == cfg
    scaled = _heldout_bits(str(extended.root / "run"), cfg)
    print(f"held-out bits/base at step 6: logged {evals[6]['bits_per_base']:.6f}, recomputed {scaled:.6f}")
    assert scaled == pytest.approx(evals[6]["bits_per_base"], rel=2e-6)
    rotary = DNATransformer(cfg, VOCAB_SIZE).blocks[0].attn.rotary
    unscaled = RotaryEmbedding(16, 64)  # head size 32 / 2
    assert torch.equal(rotary.cos[::2], unscaled.cos) and torch.equal(rotary.sin[::2], unscaled.sin)


@pytest.mark.slow
def test_resume_at_another_context_is_refused_without_the_flag(extended):
    _finished(extended, "run")
    cfg = _longer(extended.short)
    step4 = str(extended.root / "run" / "checkpoints" / "step_00000004")
    cfg["checkpoint"].update(allow_context_change=False, resume=step4)
    refused = resume_checks.resolve(config_from_dict(cfg), None, os.path.dirname(step4), None)
    assert len(refused.problems) == 1, refused.problems
    for key in ("--model.max_seq_len: checkpoint 64, this run 128", "--data.seq_len: checkpoint 64, this run 128"):
        assert key in refused.problems[0]
    assert "--model.rope_scaling: checkpoint 'none', this run 'linear'" in refused.problems[0]
    assert "--checkpoint.allow_context_change true" in refused.problems[0]
    cfg["checkpoint"]["allow_context_change"] = True
    assert resume_checks.resolve(config_from_dict(cfg), None, os.path.dirname(step4), None).problems == []


@pytest.mark.slow
def test_init_from_an_export_at_a_longer_context(extended):
    rows = _finished(extended, "from_export")
    assert [r["step"] for r in rows if "split" not in r] == [1, 2, 3]
    config = yaml.safe_load((extended.root / "from_export" / "config.yaml").read_text())
    assert config["model"]["rope_scaling"] == "linear" and config["model"]["max_seq_len"] == 128
    manifest = json.loads((extended.root / "export" / "megagenome.json").read_text())
    assert manifest["source"]["step"] == 4 and manifest["model"]["max_seq_len"] == 64
    _, exported, _, _ = read_weights(str(extended.root / "export"))
    _, final, _, _ = read_weights(str(extended.root / "from_export"))
    moved = max(float((final[k] - exported[k]).abs().max()) for k in exported)
    # One Adam update at LR > 0 moves a weight by about lr; a random start (seed 99) would be far from the export.
    torch.manual_seed(99)
    fresh = DNATransformer(config_from_dict(_longer(extended.short)).model, VOCAB_SIZE).state_dict()
    print(f"from the export: weights moved {moved:.3g} in 3 steps")
    assert 0 < moved < 4 * LR
    assert max(float((fresh[k] - exported[k]).abs().max()) for k in exported) > 10 * LR


@pytest.mark.slow
def test_the_extended_run_exports_with_its_scaling(extended, tmp_path):
    """`megagenome export` of the resumed run: megagenome.json and the card carry the scaling, config.json names it
    as transformers does, and the export loads back (megagenome and transformers) as the run's model."""
    from megagenome.after_training.export import export
    from megagenome.after_training.inference import load_model

    _finished(extended, "run")
    out = tmp_path / "extended"
    manifest = export(str(extended.root / "run"), str(out))
    assert (manifest["model"]["rope_scaling"], manifest["model"]["rope_factor"]) == ("linear", 2.0)
    assert "| rotary scaling | linear x2 (trained at context 64) |" in (out / "README.md").read_text()
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    ours = load_model(str(extended.root / "run")).model
    tokens = torch.randint(3, 8, (2, 128), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(load_model(str(out)).model.logits(tokens), ours.logits(tokens))
        transformers = pytest.importorskip("transformers")
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert (hf(tokens).logits - ours.logits(tokens)).abs().max().item() < 1e-4
