"""Tier 1: config validation, batch arithmetic, region parsing, YAML line lookup, DeepSpeed JSON checks."""

import json

import pytest

from megagenome.config import (
    RootConfig,
    batch_sizes,
    config_hash,
    d_ff,
    parse_region,
    scaled_lr,
    validate,
    yaml_line,
)
from megagenome.train.engine import DSConfigError, build_ds_config, check_ds_config, load_ds_json


def valid_config() -> RootConfig:
    cfg = RootConfig()
    cfg.data.fasta = "genome.fa"
    cfg.data.val_ranges = ["chr1:1-1000"]
    return cfg


def test_defaults_with_data_are_valid():
    assert validate(valid_config(), dp_size=2) == []


def test_every_problem_is_reported_at_once():
    cfg = valid_config()
    cfg.model.d_model, cfg.model.n_head = 100, 3
    cfg.data.seq_len, cfg.model.max_seq_len = 4096, 1024
    cfg.train.global_batch_size = 20
    problems = validate(cfg, dp_size=2)
    text = "\n".join(problems)
    assert len(problems) == 3, problems
    assert "--model.d_model=100 is not divisible by --model.n_head=3" in text
    assert "--data.seq_len=4096 is above the model's maximum --model.max_seq_len=1024" in text
    assert (
        "--train.global_batch_size=20 is not --train.micro_batch_size=8 x --train.grad_accum_steps=1 x "
        "data-parallel size 2 = 16" in text
    )


def test_batch_arithmetic_is_one_identity():
    cfg = valid_config()
    cfg.train.micro_batch_size, cfg.train.grad_accum_steps = 4, 3
    assert batch_sizes(cfg.train, 5) == (4, 3, 60)
    cfg.train.global_batch_size = 60
    assert validate(cfg, dp_size=5) == []
    assert validate(cfg, dp_size=4) != []


def test_missing_split_and_fasta_are_named():
    problems = validate(RootConfig(), dp_size=1)
    assert any("give exactly one of --data.fasta" in p and "--data.prepared" in p for p in problems)
    cfg = RootConfig()
    cfg.data.fasta = "genome.fa"
    assert any("--data.val_contigs or --data.val_ranges" in p for p in validate(cfg, dp_size=1))


def test_prepared_data_takes_no_split_flags_and_group_aware_needs_it():
    cfg = valid_config()
    cfg.data.prepared = "prepared/"
    problems = validate(cfg, dp_size=1)
    assert any("give exactly one of --data.fasta" in p for p in problems)  # both given
    cfg.data.fasta = ""
    assert any(p.startswith("--data.val_ranges does not apply with --data.prepared") for p in validate(cfg, 1))
    cfg.data.val_ranges = []
    assert not [p for p in validate(cfg, 1) if "--data." in p]
    cfg.data.prepared, cfg.data.fasta, cfg.data.group_aware = "", "genome.fa", True
    assert any(p.startswith("--data.group_aware needs --data.prepared") for p in validate(cfg, 1))


def test_lr_scaling_rules():
    cfg = valid_config()
    cfg.train.lr, cfg.train.min_lr = 1e-3, 1e-4
    assert scaled_lr(cfg.train, 64) == (1e-3, 1e-4)
    cfg.train.lr_scaling = "linear"
    assert any("--train.reference_batch" in p for p in validate(cfg, 1))
    cfg.train.reference_batch = 16
    assert scaled_lr(cfg.train, 64) == pytest.approx((4e-3, 4e-4))
    cfg.train.lr_scaling = "sqrt"
    assert scaled_lr(cfg.train, 64) == pytest.approx((2e-3, 2e-4))
    merged = build_ds_config(cfg, {}, dp_size=8, on_gpu=False)  # global batch 8 x 1 x 8 = 64
    assert merged["optimizer"]["params"]["lr"] == pytest.approx(2e-3)
    assert merged["scheduler"]["params"]["cos_min_ratio"] == pytest.approx(0.1)


def test_region_parsing_is_one_based_inclusive():
    r = parse_region("NC_000913.2:4,400,001-4639675")
    assert (r.contig, r.start, r.end) == ("NC_000913.2", 4400000, 4639675)
    for bad in ["chr1", "chr1:0-5", "chr1:9-5", "chr1:a-b"]:
        with pytest.raises(ValueError):
            parse_region(bad)


def test_bad_region_is_a_config_problem():
    cfg = valid_config()
    cfg.data.val_ranges = ["chr1:10"]
    assert any(p.startswith("--data.val_ranges:") for p in validate(cfg, 1))


def test_swiglu_width_rule():
    cfg = RootConfig().model
    cfg.d_model = 768
    assert d_ff(cfg) == 2048
    cfg.d_ff = 1000
    assert d_ff(cfg) == 1000


def test_config_hash_tracks_model_and_data_only():
    a, b = valid_config(), valid_config()
    b.train.max_steps = 5
    assert config_hash(a) == config_hash(b)
    b.model.n_layer = 7
    assert config_hash(a) != config_hash(b)


def test_yaml_line_finds_nested_keys(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("model:\n  d_model: 3  # comment\n  n_head: 2\ntrain:\n  micro_batch_size: 1\n")
    assert yaml_line(str(f), "model.n_head") == 3
    assert yaml_line(str(f), "train.micro_batch_size") == 5
    assert yaml_line(str(f), "data.fasta") is None


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
    cfg = valid_config()
    cfg.train.micro_batch_size, cfg.train.grad_accum_steps = 2, 3
    ds = {"zero_optimization": {"stage": 2}}
    merged = build_ds_config(cfg, ds, dp_size=4, on_gpu=False)
    assert ds == {"zero_optimization": {"stage": 2}}
    assert merged["train_batch_size"] == 24
    assert merged["train_micro_batch_size_per_gpu"] == 2
    assert merged["gradient_accumulation_steps"] == 3
    assert merged["optimizer"]["params"]["torch_adam"] is True
    assert merged["scheduler"]["params"]["cos_min_ratio"] == pytest.approx(cfg.train.min_lr / cfg.train.lr)
    json.dumps(merged)
