"""Tier 1: checkpoint layouts and universal-checkpoint plumbing, without a process group.

What a resume under another layout is told (megagenome, before DeepSpeed loads anything), which checkpoints
convert-checkpoint refuses and how, --checkpoint.universal in the DeepSpeed dict and its ownership, and the
universal_checkpoint_info a tensor-parallel model saves. The conversions themselves, on real DeepSpeed, are in
test_universal_checkpoint.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.helpers import REPO, cli_here, copy_genome, final_ds_config, tiny_config, write_yaml
from support.helpers import run_config as parse

from megagenome.config import ConfigError
from megagenome.engine import universal
from megagenome.engine.ds_config import check_ds_config
from megagenome.files.run_files import UNIVERSAL
from megagenome.parallel.layout import ParallelLayout
from megagenome.run.assembly import validate
from megagenome.weights import checkpoint


def layout(world_size=2, tensor=1, pipeline=1, sequence=1, zero_stage=1) -> dict:
    return ParallelLayout(world_size, tensor, sequence, pipeline, zero_stage).record()


def fake_tag(tmp_path, saved: dict | None, step: int = 3, universal: bool = False, shards: int = 0):
    tag = tmp_path / "run" / "checkpoints" / checkpoint.tag_for(step)
    tag.mkdir(parents=True)
    (tag / checkpoint.MARKER).write_text(f"{step}\n")
    if saved is not None:
        info = {"step": step, "format": "universal" if universal else "deepspeed", "layout": saved}
        (tag / checkpoint.INFO).write_text(json.dumps(info))
    if universal:
        (tag / "zero" / "embed.weight").mkdir(parents=True)
    for dp in range(shards):
        (tag / f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt").write_bytes(b"")
    return tag


def test_same_layout_resumes_and_a_changed_one_names_convert_checkpoint(tmp_path):
    tag = fake_tag(tmp_path, layout(2))
    assert checkpoint.resume_problems(str(tag), layout(2), universal=False) == []
    (msg,) = checkpoint.resume_problems(str(tag), layout(1), universal=False)
    assert "saved by 2 ranks (tensor 1 x pipeline 1 x sequence 1 x data 2, ZeRO stage 1)" in msg
    assert "this run has 1 rank (tensor 1 x pipeline 1 x sequence 1 x data 1, ZeRO stage 1)" in msg
    assert f"`megagenome convert-checkpoint --checkpoint {tag}`" in msg and "--checkpoint.universal true" in msg
    # A tensor-parallel change at the same world size is a layout change too, and so is another ZeRO partition count
    # (ZeRO partitions over sequence x data ranks: sequence 2 x data 1 keeps the 2 partitions of data 2).
    assert checkpoint.resume_problems(str(tag), layout(2, tensor=2), universal=False)
    assert checkpoint.resume_problems(str(tag), layout(4, sequence=2), universal=False)
    assert checkpoint.resume_problems(str(tag), layout(2, sequence=2), universal=False) == []


def test_another_global_batch_is_refused(tmp_path):
    tag = fake_tag(tmp_path, layout(2))
    info = json.loads((tag / checkpoint.INFO).read_text())
    (tag / checkpoint.INFO).write_text(json.dumps({**info, "samples_consumed": 24}))  # 3 steps of 8
    assert checkpoint.resume_problems(str(tag), layout(2), universal=False, global_batch=8) == []
    (msg,) = checkpoint.resume_problems(str(tag), layout(2), universal=False, global_batch=4)
    assert "global batch of 8 (24 samples in 3 steps); this run's is 4" in msg


def test_zero0_changes_data_parallel_size_freely_but_not_tensor_parallelism(tmp_path):
    tag = fake_tag(tmp_path, layout(2, zero_stage=0))
    assert checkpoint.resume_problems(str(tag), layout(1, zero_stage=0), universal=False) == []
    assert checkpoint.resume_problems(str(tag), layout(4, zero_stage=1), universal=False) == []
    (msg,) = checkpoint.resume_problems(str(tag), layout(2, tensor=2, zero_stage=0), universal=False)
    assert "ZeRO stage 0 checkpoint cannot be converted" in msg


def test_pipeline_layout_change_is_refused_without_promising_a_conversion(tmp_path):
    tag = fake_tag(tmp_path, layout(2, pipeline=2))
    (msg,) = checkpoint.resume_problems(str(tag), layout(1), universal=False)
    assert "pipeline-parallel checkpoints cannot be converted" in msg and "convert-checkpoint --" not in msg


def test_checkpoint_without_client_state_json_is_judged_by_its_zero_shards(tmp_path):
    """Checkpoints saved before client_state.json: the number of ZeRO optimizer shards is the partition count."""
    tag = fake_tag(tmp_path, None, shards=2)
    assert checkpoint.resume_problems(str(tag), layout(2), universal=False) == []
    (msg,) = checkpoint.resume_problems(str(tag), layout(1), universal=False)
    assert "saved by 2 ZeRO partition(s)" in msg and "convert-checkpoint" in msg


def test_universal_flag_and_checkpoint_format_must_agree(tmp_path):
    plain = fake_tag(tmp_path / "a", layout(2))
    uni = fake_tag(tmp_path / "b", layout(2), universal=True)
    assert checkpoint.is_universal(str(uni)) and not checkpoint.is_universal(str(plain))
    (msg,) = checkpoint.resume_problems(str(plain), layout(1), universal=True)
    assert "is not a universal checkpoint" in msg and "convert-checkpoint --checkpoint" in msg
    (msg,) = checkpoint.resume_problems(str(uni), layout(1), universal=False)
    assert "add --checkpoint.universal true" in msg
    assert checkpoint.resume_problems(str(uni), layout(1), universal=True) == []
    assert checkpoint.resume_problems(str(uni), layout(4, tensor=2, zero_stage=3), universal=True) == []
    problems = checkpoint.resume_problems(str(uni), layout(2, pipeline=2, zero_stage=0), universal=True)
    assert len(problems) == 2 and "pipeline" in problems[0] and "ZeRO" in problems[1]


def test_rng_states_are_restored_only_under_the_layout_that_saved_them(tmp_path):
    tag = fake_tag(tmp_path / "a", layout(2))
    assert checkpoint.rng_applies(str(tag), layout(2))
    assert not checkpoint.rng_applies(str(tag), layout(1))
    assert not checkpoint.rng_applies(str(tag), layout(2, tensor=2))
    assert checkpoint.rng_applies(str(fake_tag(tmp_path / "b", None, shards=2)), layout(2))  # older checkpoints


def test_converting_an_incomplete_checkpoint_fails_clearly(tmp_path):
    """Through the CLI (cli.main, in this process): a step_* directory without COMPLETE, and a run directory
    holding only such a one."""
    run_dir = tmp_path / "run"
    tag = run_dir / "checkpoints" / "step_00000003"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"half-written")
    for target, expected in [(tag, "has no COMPLETE marker"), (run_dir, "no complete checkpoint there")]:
        proc = cli_here("convert-checkpoint", "--checkpoint", str(target))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith("megagenome convert-checkpoint: error:"), proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]  # nothing written


def test_convert_refuses_universal_pipeline_and_zero0_sources(tmp_path):
    uni = fake_tag(tmp_path / "u", layout(2), universal=True)
    with pytest.raises(ValueError, match="already a universal checkpoint"):
        checkpoint.convert_to_universal(str(uni))
    pipe = fake_tag(tmp_path / "p", layout(2, pipeline=2), shards=1)
    with pytest.raises(ValueError, match="pipeline parallelism .* resume it with the original layout"):
        checkpoint.convert_to_universal(str(pipe))
    zero0 = fake_tag(tmp_path / "z", layout(2, zero_stage=0))
    with pytest.raises(ValueError, match="ZeRO stage 0"):
        checkpoint.convert_to_universal(str(zero0))
    for root in ("u", "p", "z"):  # nothing written beside any of them
        assert sorted(p.name for p in (tmp_path / root / "run").iterdir()) == ["checkpoints"]


def test_convert_refuses_to_overwrite(tmp_path):
    tag = fake_tag(tmp_path, layout(2), shards=2)
    (tmp_path / "run" / UNIVERSAL / tag.name).mkdir(parents=True)
    with pytest.raises(ValueError, match="already exists"):
        checkpoint.convert_to_universal(str(tmp_path / "run"))


def test_universal_flag_sets_load_universal_and_the_json_may_not(tmp_path):
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path / "genome")
    cfg, files = parse(["--config", write_yaml(tmp_path / "r.yaml", tiny_config(tmp_path, fasta, tmp_path / "run"))])
    assert "checkpoint" not in final_ds_config({}, cfg.train)
    from megagenome.engine.ds_final import build_ds_config

    batch = ParallelLayout(1).batch(cfg.train)
    built = build_ds_config({"zero_optimization": {"stage": 1}}, batch, cfg.train, universal=True, on_gpu=False)
    assert built["checkpoint"] == {"load_universal": True}
    (msg,) = check_ds_config({"checkpoint": {"load_universal": True}}, "x.json", "run.yaml", on_gpu=False)
    assert "'checkpoint.load_universal' is set in both x.json and the run config run.yaml" in msg
    assert "--checkpoint.universal" in msg
    assert check_ds_config({"checkpoint": {"tag_validation": "Warn"}}, "x.json", "run.yaml", False) == []


def test_universal_flag_without_a_checkpoint_is_a_config_error(tmp_path):
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path / "genome")
    config = tiny_config(tmp_path, fasta, tmp_path / "run")
    config["train"]["ds_config"] = str(REPO / "ds_configs" / "zero1.json")
    config["checkpoint"]["universal"] = True
    cfg, files = parse(["--config", write_yaml(tmp_path / "r.yaml", config)])
    with pytest.raises(ConfigError, match="--checkpoint.universal true but --checkpoint.resume=auto names no"):
        validate(cfg, files, world_size=1)


def test_validation_refuses_another_world_size_before_any_process_group(tmp_path):
    """Without --checkpoint.convert_on_resize, another world size is refused before any process group; with it (the
    default) the run's own ZeRO checkpoint is to be converted, the global batch kept by the accumulation."""
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path / "genome")
    config = tiny_config(tmp_path, fasta, tmp_path / "run")
    config["train"]["ds_config"] = str(REPO / "ds_configs" / "zero1.json")
    tag = fake_tag(tmp_path, layout(2))  # tmp_path/run/checkpoints/step_00000003, found by --checkpoint.resume auto
    info = json.loads((tag / checkpoint.INFO).read_text())
    (tag / checkpoint.INFO).write_text(json.dumps({**info, "samples_consumed": 12}))  # 3 steps of 2 ranks x micro 2
    yaml_file = write_yaml(tmp_path / "r.yaml", config)
    cfg, files = parse(["--config", yaml_file, "--checkpoint.convert_on_resize", "false"])
    with pytest.raises(ConfigError, match="saved by 2 ranks .* this run has 1 rank"):
        validate(cfg, files, world_size=1)
    validate(cfg, files, world_size=2).data.close()  # the layout that wrote it
    cfg, files = parse(["--config", yaml_file])
    resized = validate(cfg, files, world_size=1)
    resized.data.close()
    assert resized.resume.convert and resized.cfg.checkpoint.universal
    assert resized.cfg.train.grad_accum_steps * resized.cfg.train.micro_batch_size == 4  # 2 ranks x micro 2


def test_tensor_parallel_model_records_how_to_merge_its_shards():
    """What a tensor-parallel model saves for ds_to_universal: replicated weights and dim-1 splits, by exact name."""
    from deepspeed.checkpoint import constants as C

    model = torch.nn.Module()
    model.embed = torch.nn.Parameter(torch.zeros(4, 2))
    model.proj = torch.nn.Parameter(torch.zeros(2, 1))
    model.norm = torch.nn.Parameter(torch.zeros(2))
    for name, dim in [("embed", 0), ("proj", 1)]:
        p = getattr(model, name)
        p.tensor_model_parallel, p.partition_dim = True, dim
    info = universal.universal_checkpoint_info(model)
    assert info[C.TP_REPLICATED_PARAMETER_PATTERNS] == ["norm$"]
    assert info[C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] == ["proj$"]
    dense = universal.universal_checkpoint_info(torch.nn.Linear(2, 2))
    assert dense == {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE}


def test_tensor_parallel_checkpoint_without_merge_info_is_refused(tmp_path):
    tag = tmp_path / "step_00000003"
    tag.mkdir()
    for tp_rank in range(2):
        torch.save({"module": {}, "universal_checkpoint_info": {}}, tag / f"mp_rank_{tp_rank:02d}_model_states.pt")
    with pytest.raises(ValueError, match="2 tensor-parallel shards but no record of how to merge them"):
        universal.to_universal(str(tag), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
