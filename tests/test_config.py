"""Tier 1: config validation, region parsing, YAML line lookup (the batch identity and the parallel layout are
tests/test_layout.py's, the DeepSpeed JSON tests/test_ds_config.py's)."""

import pytest

from megagenome.config import RootConfig, config_hash, d_ff, parse_region, validate
from megagenome.config.load import yaml_line


def valid_config() -> RootConfig:
    cfg = RootConfig()
    cfg.data.fasta = "genome.fa"
    cfg.data.val_ranges = ["chr1:1-1000"]
    return cfg


def test_defaults_with_data_are_valid():
    assert validate(valid_config()) == []


def test_every_problem_is_reported_at_once():
    cfg = valid_config()
    cfg.model.d_model, cfg.model.n_head = 100, 3
    cfg.data.seq_len, cfg.model.max_seq_len = 4096, 1024
    cfg.train.max_steps = 0
    problems = validate(cfg)
    text = "\n".join(problems)
    assert len(problems) == 4, problems
    assert "--model.d_model=100 is not divisible by --model.n_head=3" in text
    assert "--data.seq_len=4096 is above the model's maximum --model.max_seq_len=1024" in text
    assert "--train.max_steps=0: must be positive" in text
    assert "--train.warmup_steps=100: must be within [0, --train.max_steps=0]" in text
    cfg.train.max_steps = 40  # a user shortening a 600-step job: told of --train.stop_at
    assert any("give --train.stop_at 40" in p for p in validate(cfg))


def test_missing_split_and_fasta_are_named():
    problems = validate(RootConfig())
    assert any("give exactly one of --data.fasta" in p and "--data.prepared" in p for p in problems)
    cfg = RootConfig()
    cfg.data.fasta = "genome.fa"
    assert any("--data.val_contigs or --data.val_ranges" in p for p in validate(cfg))


def test_prepared_data_takes_no_split_flags_and_group_aware_needs_it():
    cfg = valid_config()
    cfg.data.prepared = "prepared/"
    problems = validate(cfg)
    both = [p for p in problems if p.startswith(f"--data.fasta={cfg.data.fasta} and --data.prepared=prepared/")]
    assert len(both) == 1 and "configs/tiny_prepared.yaml" in both[0]  # both given: the message says the fix
    assert any("give exactly one of --data.fasta" in p for p in validate(RootConfig()))  # neither
    cfg.data.fasta = ""
    assert any(p.startswith("--data.val_ranges does not apply with --data.prepared") for p in validate(cfg))
    cfg.data.val_ranges = []
    assert not [p for p in validate(cfg) if "--data." in p]
    cfg.data.prepared, cfg.data.fasta, cfg.data.group_aware = "", "genome.fa", True
    assert any(p.startswith("--data.group_aware needs --data.prepared") for p in validate(cfg))


def test_lr_scaling_needs_a_reference_batch():
    cfg = valid_config()
    cfg.train.lr_scaling = "linear"
    assert any("--train.reference_batch" in p for p in validate(cfg))
    cfg.train.reference_batch = 16
    assert validate(cfg) == []


def test_region_parsing_is_one_based_inclusive():
    r = parse_region("NC_000913.2:4,400,001-4639675")
    assert (r.contig, r.start, r.end) == ("NC_000913.2", 4400000, 4639675)
    for bad in ["chr1", "chr1:0-5", "chr1:9-5", "chr1:a-b"]:
        with pytest.raises(ValueError):
            parse_region(bad)


def test_bad_region_is_a_config_problem():
    cfg = valid_config()
    cfg.data.val_ranges = ["chr1:10"]
    assert any(p.startswith("--data.val_ranges:") for p in validate(cfg))


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
