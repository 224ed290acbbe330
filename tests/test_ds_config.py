"""Tier 1: the DeepSpeed JSON as data (engine/ds_config.py, engine/ds_schema.py): reading, checks, the final dict,
and the copy of DeepSpeed's section models that lets all of it run without importing deepspeed."""

import json

import pytest
from support.helpers import REPO

from megagenome.config import TrainConfig
from megagenome.engine.ds_config import DSConfigError, check_ds_config, load_ds_json, scaled_lr
from megagenome.engine.ds_final import build_ds_config
from megagenome.parallel.layout import ParallelLayout


def test_lr_scaling_rules():
    train = TrainConfig(lr=1e-3, min_lr=1e-4)
    assert scaled_lr(train, 64) == (1e-3, 1e-4)
    train.lr_scaling, train.reference_batch = "linear", 16
    assert scaled_lr(train, 64) == pytest.approx((4e-3, 4e-4))
    train.lr_scaling = "sqrt"
    assert scaled_lr(train, 64) == pytest.approx((2e-3, 2e-4))
    merged = build_ds_config({}, ParallelLayout(8).batch(train), train, False, on_gpu=False)  # 8 x 1 x 8 = 64
    assert merged["optimizer"]["params"]["lr"] == pytest.approx(2e-3)
    assert merged["scheduler"]["params"]["cos_min_ratio"] == pytest.approx(0.1)


def test_ds_json_syntax_error_names_line_and_column(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('{\n  "bf16": {"enabled": true,}\n}\n')
    with pytest.raises(DSConfigError, match=r"bad.json:2:\d+: not valid JSON"):
        load_ds_json(str(f))


def test_ds_json_unknown_keys_rejected_at_every_level():
    ds = {
        "zero_optimisation": {"stage": 1},
        "zero_optimization": {"stage": 1, "bucket": 3},
        "bf16": {"enabled": True, "enable": 1},
    }
    problems = check_ds_config(ds, "z.json", "run.yaml", on_gpu=False)
    text = "\n".join(problems)
    assert "unknown DeepSpeed key 'zero_optimisation' (did you mean 'zero_optimization'?)" in text
    assert "unknown DeepSpeed key 'zero_optimization.bucket'" in text
    assert "unknown DeepSpeed key 'bf16.enable'" in text


def test_root_owned_key_in_json_names_both_files():
    problems = check_ds_config({"train_batch_size": 32, "gradient_clipping": 1.0}, "z.json", "run.yaml", False)
    assert len(problems) == 2
    assert all("z.json" in p and "run.yaml" in p for p in problems)


def test_fp16_rejected_on_cpu_with_reason():
    problems = check_ds_config({"fp16": {"enabled": True}}, "f.json", "run.yaml", on_gpu=False)
    assert any("fp16.enabled needs a GPU" in p for p in problems)
    assert check_ds_config({"fp16": {"enabled": True}}, "f.json", "run.yaml", on_gpu=True) == []


def test_stage0_accumulates_gradients_in_the_model_dtype_only():
    bf16_fp32 = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    problems = check_ds_config({**bf16_fp32, "zero_optimization": {"stage": 0}}, "z.json", "run.yaml", False)
    assert (
        len(problems) == 1 and "grad_accum_dtype='fp32' with bf16 weights needs ZeRO stage 1 or higher" in problems[0]
    )
    assert check_ds_config({**bf16_fp32, "zero_optimization": {"stage": 1}}, "z.json", "run.yaml", False) == []
    same = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bfloat16"}}
    assert check_ds_config(same, "z.json", "run.yaml", False) == []


def test_merged_config_carries_root_keys_and_leaves_json_untouched():
    train = TrainConfig(micro_batch_size=2, grad_accum_steps=3)
    ds = {"zero_optimization": {"stage": 2}}
    merged = build_ds_config(ds, ParallelLayout(4).batch(train), train, False, on_gpu=False)
    assert ds == {"zero_optimization": {"stage": 2}}
    assert merged["train_batch_size"] == 24
    assert merged["train_micro_batch_size_per_gpu"] == 2
    assert merged["gradient_accumulation_steps"] == 3
    assert merged["optimizer"]["params"]["torch_adam"] is True
    assert merged["scheduler"]["params"]["cos_min_ratio"] == pytest.approx(train.min_lr / train.lr)
    json.dumps(merged)


# ----- the section schema: DeepSpeed's own models, copied -------------------------------------------------------


def test_the_section_schema_is_the_installed_deepspeeds():
    """ds_sections.json holds exactly what the installed DeepSpeed's pydantic models declare; after an upgrade this
    fails until the file is written again (engine.write_section_schema)."""
    from megagenome.engine import ds_schema, engine

    assert ds_schema.section_schema() == engine.section_schema(), (
        'regenerate: python -c "from megagenome.engine import engine; engine.write_section_schema()"'
    )


SAMPLES = [  # (section, value): each is accepted or refused by megagenome's copy as DeepSpeed's own model does
    *[
        (section, value)
        for path in sorted(REPO.glob("ds_configs/*.json"))
        for section, value in json.loads(path.read_text()).items()
        if section in ("zero_optimization", "bf16", "fp16")
    ],
    ("zero_optimization", {"stage": 5}),
    ("zero_optimization", {"stage": 2.0}),
    ("zero_optimization", {"stage": "1"}),
    ("zero_optimization", {"stage": "two"}),
    ("zero_optimization", {"overlap_comm": "yes"}),
    ("zero_optimization", {"overlap_comm": "maybe"}),
    ("zero_optimization", {"overlap_comm": None}),
    ("zero_optimization", {"contiguous_gradients": None}),
    ("zero_optimization", {"reduce_bucket_size": 5e8}),
    ("zero_optimization", {"reduce_bucket_size": "1_000"}),
    ("zero_optimization", {"reduce_bucket_size": "5e8"}),
    ("zero_optimization", {"reduce_bucket_size": 1.5}),
    ("zero_optimization", {"reduce_bucket_size": 0}),
    ("zero_optimization", {"allgather_bucket_size": 0}),
    ("zero_optimization", {"allgather_bucket_size": -1}),
    ("zero_optimization", {"reduce_bucket_size": "auto"}),
    ("zero_optimization", {"stage3_prefetch_bucket_size": 5e7}),
    ("zero_optimization", {"prefetch_bucket_size": 5e7}),
    ("zero_optimization", {"stage3_prefetch_bucket_size": 5e7, "prefetch_bucket_size": 1}),
    ("zero_optimization", {"stage3_max_live_parameters": "1e9"}),
    ("zero_optimization", {"offload_optimizer": {"device": "gpu"}}),
    ("zero_optimization", {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}),
    ("zero_optimization", {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5, "pin_memory": True}}),
    ("zero_optimization", {"offload_optimizer": None}),
    ("zero_optimization", {"offload_param": {"device": "nvme", "nvme_path": "/local", "buffer_count": 4}}),
    ("zero_optimization", {"offload_param": {"device": "cpu", "nvme_path": 3}}),
    ("zero_optimization", {"offload_param": "cpu"}),
    ("zero_optimization", {"offload_param": {"device": "cpu", "buffers": 4}}),
    ("zero_optimization", {"zenflow": {"topk_ratio": 1.0}}),
    ("zero_optimization", {"zenflow": {"select_interval": "auto", "update_interval": 4}}),
    ("zero_optimization", {"leaf_module": {"classes": ["Block"], "names": 3}}),
    ("bf16", {"enabled": True, "immediate_grad_update": False}),
    ("bf16", {"enabled": "true"}),
    ("bf16", {"enabled": 2}),
    ("fp16", {"enabled": True, "loss_scale": 0, "initial_scale_power": 16.0, "hysteresis": 2}),
    ("fp16", {"loss_scale": "dynamic"}),
    ("fp16", {"min_loss_scale": 0.5}),
    ("fp16", {"enabled": True, "auto_cast": None}),
]
# Rules of DeepSpeed's models that a field-by-field copy cannot hold (cross-field and custom validators): the copy
# lets these through and a launch refuses them with DeepSpeed's own models (engine.section_problems).
DEEPSPEED_ONLY = [
    ("zero_optimization", {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
    ("zero_optimization", {"stage": 0, "compute_grad_norm": False}),
    ("fp16", {"loss_scale": -1}),
    ("fp16", {"loss_scale": True}),
]


def _judgements(section: str, value) -> tuple[list[str], list[str]]:
    """(megagenome's copy's problems, DeepSpeed's own models' problems) of one section."""
    from megagenome.engine import ds_schema, engine

    ours = ds_schema.section_problems(ds_schema.section_schema()[section], value, section, "x.json")
    return ours, engine.section_problems({section: value}, {}, "x.json")


@pytest.mark.parametrize("section, value", SAMPLES, ids=[f"{s}-{json.dumps(v)[:60]}" for s, v in SAMPLES])
def test_sections_are_judged_as_deepspeed_judges_them(section, value):
    ours, theirs = _judgements(section, value)
    assert bool(ours) == bool(theirs), (ours, theirs)


@pytest.mark.parametrize("section, value", DEEPSPEED_ONLY, ids=[json.dumps(v)[:60] for _, v in DEEPSPEED_ONLY])
def test_rules_only_deepspeeds_models_hold_are_checked_at_launch(section, value):
    ours, theirs = _judgements(section, value)
    assert ours == [] and theirs, (ours, theirs)
    assert check_ds_config({section: value}, "x.json", "run.yaml", False, sections=None) == []  # --dry_run
    from megagenome.engine import engine

    launch = check_ds_config({section: value}, "x.json", "run.yaml", False, sections=engine.section_problems)
    assert launch and all(p.startswith("x.json: ") for p in launch), launch


def test_unknown_section_keys_suggest_the_nearest_and_aliases_count_once():
    from megagenome.engine import ds_schema

    fields = ds_schema.section_schema()["zero_optimization"]
    (msg,) = ds_schema.section_problems(fields, {"overlap_com": True}, "zero_optimization", "z.json")
    assert msg == (
        "z.json: unknown DeepSpeed key 'zero_optimization.overlap_com' (did you mean 'zero_optimization.overlap_comm'?)"
    )
    (msg,) = ds_schema.section_problems(
        fields, {"stage3_max_live_parameters": 1, "max_live_parameters": 2}, "zero_optimization", "z.json"
    )
    assert "set twice" in msg
    (msg,) = ds_schema.section_problems(fields, {"offload_param": {"device": "gpu"}}, "zero_optimization", "z.json")
    assert msg == "z.json: zero_optimization.offload_param.device: 'gpu' is not one of 'none', 'cpu', 'nvme'"


# ----- the optimizer DeepSpeed builds, and the shipped JSONs -----------------------------------------------------


def _adam(ds: dict, on_gpu: bool, torch_adam: bool | None = None) -> dict:
    train = TrainConfig(torch_adam=torch_adam)
    params = build_ds_config(ds, ParallelLayout(1).batch(train), train, False, on_gpu=on_gpu)["optimizer"]["params"]
    return {k: params[k] for k in ("torch_adam", "fused") if k in params}


def test_adam_is_torchs_fused_on_gpu_and_deepspeeds_cpu_adam_where_offloaded():
    """GPU: torch's AdamW with fused=True (prebuilt, no JIT build of DeepSpeed's FusedAdam); a GPU run offloading the
    optimizer keeps DeepSpeedCPUAdam (torch_adam false: DeepSpeed picks its CPU Adam for an offloaded optimizer);
    CPU: torch's AdamW, unfused, as before. An explicit --train.torch_adam wins."""
    shipped = {name: load_ds_json(str(REPO / "ds_configs" / f"{name}.json")) for name in SHIPPED}
    for name, ds in shipped.items():
        offloaded = name in ("zero2_offload", "zero3_offload", "zero3_nvme")
        assert _adam(ds, on_gpu=True) == ({"torch_adam": False} if offloaded else {"torch_adam": True, "fused": True})
        assert _adam(ds, on_gpu=False) == {"torch_adam": True}, name
    param_offload_only = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert _adam(param_offload_only, on_gpu=True) == {"torch_adam": True, "fused": True}
    assert _adam({}, on_gpu=True, torch_adam=False) == {"torch_adam": False}  # DeepSpeed's FusedAdam, on request
    assert _adam(shipped["zero3_offload"], on_gpu=True, torch_adam=True) == {"torch_adam": True}  # on the host


SHIPPED = sorted(p.stem for p in REPO.glob("ds_configs/*.json"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_json_turns_deepspeeds_timers_off(name):
    """The throughput timer synchronises the device at every forward and step; wall_clock_breakdown adds more."""
    ds = load_ds_json(str(REPO / "ds_configs" / f"{name}.json"))
    assert ds["timers"] == {"throughput": {"enabled": False}} and ds["wall_clock_breakdown"] is False
    from deepspeed.runtime.config import DeepSpeedConfig  # noqa: F401 (the accelerator is set up before utils)
    from deepspeed.utils.config import get_timers_config

    assert get_timers_config(ds).enabled is False  # DeepSpeed reads the key where we put it


def test_the_timers_schema_is_the_installed_deepspeeds():
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

    from megagenome.engine import engine
    from megagenome.engine.ds_config import TIMERS_SCHEMA

    assert TIMERS_SCHEMA["throughput"]["fields"] == engine._model_fields(DeepSpeedThroughputTimerConfig)
    bad = {"timers": {"throughput": {"enabled": "sometimes", "synchronised": False}, "tput": {}}}
    text = "\n".join(check_ds_config(bad, "t.json", "run.yaml", on_gpu=False))
    assert "timers.throughput.enabled: 'sometimes' is not a boolean" in text
    assert "unknown DeepSpeed key 'timers.throughput.synchronised' (did you mean" in text
    assert "unknown DeepSpeed key 'timers.tput'" in text


@pytest.fixture(scope="module")
def deepspeed_world():
    from support.helpers import world_of_one

    with world_of_one():
        yield


# (fragments, the wrapper DeepSpeed 0.19.8 picks, overlap_comm, gradient accumulation dtype, communication dtype)
WRAPPERS = [
    (["zero1_bf16"], "DeepSpeedZeroOptimizer", True, "bfloat16", "float32"),
    (["zero2_bf16"], "DeepSpeedZeroOptimizer", True, "float32", "float32"),
    (["zero1", "bf16"], "BF16_Optimizer", None, "float32", "bfloat16"),  # ZeRO-1 + bf16 + fp32 accumulation
]


@pytest.mark.parametrize("fragments, wrapper, overlap, accum, comm", WRAPPERS, ids=["+".join(w[0]) for w in WRAPPERS])
def test_which_optimizer_wrapper_each_bf16_json_gets_and_that_it_trains(
    deepspeed_world, fragments, wrapper, overlap, accum, comm
):
    """A real engine (one gloo rank) for each bf16 JSON: the wrapper DeepSpeed chooses (engine.py
    _do_optimizer_sanity_check: bf16 + ZeRO-1 + fp32 accumulation -> BF16_Optimizer, which reduces after backward
    without overlap; otherwise the ZeRO optimizer), its overlap and dtypes as ds_configs/README.md states them, and four
    optimizer steps of two micro batches that change every weight and lower the loss on a repeated batch (the first
    step's learning rate is 0: the warm-up starts there)."""
    import torch

    from megagenome.config import ModelConfig
    from megagenome.engine import engine
    from megagenome.engine.ds_config import merge_fragments
    from megagenome.model.transformer import DNATransformer

    merged, _, problems = merge_fragments([str(REPO / "ds_configs" / f"{f}.json") for f in fragments])
    assert problems == [] and check_ds_config(merged, "x.json", "run.yaml", on_gpu=False) == []
    torch.manual_seed(0)
    model = DNATransformer(ModelConfig(d_model=32, n_layer=2, n_head=2, max_seq_len=64), 8)
    train = TrainConfig(micro_batch_size=2, grad_accum_steps=2, lr=1e-2, warmup_steps=1)
    conf = build_ds_config(merged, ParallelLayout(1).batch(train), train, False, on_gpu=False)
    eng = engine.initialize(model, model.param_groups(0.1), conf)
    opt = eng.optimizer
    assert type(opt).__name__ == wrapper and type(eng.basic_optimizer) is torch.optim.AdamW
    assert getattr(opt, "overlap_comm", None) is overlap
    assert eng.get_data_types() == (torch.bfloat16, getattr(torch, accum))
    assert eng.communication_data_type == getattr(torch, comm)
    before = [p.detach().float().clone() for p in model.parameters()]
    ids = torch.randint(3, 8, (2, 65), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(4):
        for _ in range(2):
            loss, _, _ = eng(ids[:, :-1], ids[:, 1:], torch.ones(2, 64))
            eng.backward(loss)
            eng.step()
        losses.append(loss.item())
    assert all(not torch.equal(b, p.detach().float()) for b, p in zip(before, model.parameters()))
    assert losses[-1] < losses[0] - 0.05, losses
