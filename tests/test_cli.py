"""Tier 1: the real CLI: --help from docstrings, every shipped YAML and JSON parsed, bad input named clearly."""

import json
import pathlib

import pytest
from support.helpers import REPO, copy_genome, tiny_config, write_yaml

from megagenome import cli
from megagenome.config import ConfigError
from megagenome.config.load import checked_run_config, config_files, root_config
from megagenome.run.assembly import validate

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


def parse(argv):
    """Parse like `megagenome pretrain ARGV` and return (RootConfig, config files)."""
    parser = cli.build_parser()
    ns = parser.parse_args(["pretrain", *argv])
    return root_config(parser.instantiate(ns).pretrain), config_files(ns.pretrain)


def test_help_comes_from_field_docstrings(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["pretrain", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Width of the residual stream." in out
    assert "--checkpoint.resume" in out and "--train.ds_config" in out


PRINTS_CONFIG = {  # every command with --print_config, and arguments it needs
    "pretrain": ["--config", "configs/tiny.yaml", "--train.lr", "1e-3", "--dry_run"],
    "preflight": ["--config", "configs/tiny.yaml", "--sizes", "1KiB"],
    "plan": ["--config", "configs/dna_1b.yaml", "--gpus", "16", "--json"],
    "find-micro-batch": ["--config", "configs/tiny.yaml", "--max_micro", "8"],
}


def printed_config(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--print_config"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", PRINTS_CONFIG)
def test_print_config_round_trips(command, capsys, tmp_path, monkeypatch):
    """`megagenome COMMAND ... --print_config > my.yaml`, then `--config my.yaml`, through the real CLI (the checks
    of config/load.py included): the identical config, and printed again, the identical YAML. Switches such as
    --dry_run and plan's --json are printed too, so they must be keys a --config file may set."""
    monkeypatch.chdir(REPO)
    printed = printed_config(capsys, [command, *PRINTS_CONFIG[command]])
    saved = tmp_path / "my.yaml"
    saved.write_text(printed)
    assert printed_config(capsys, [command, "--config", str(saved)]) == printed
    parser = cli.build_parser(command)
    direct = parser.instantiate(parser.parse_args([command, *PRINTS_CONFIG[command]]))
    again = parser.instantiate(parser.parse_args([command, "--config", str(saved)]))
    assert root_config(again[command]) == root_config(direct[command])
    given = {k: v for k, v in vars(direct[command]).items() if k not in ("config", "__path__")}
    assert {k: v for k, v in vars(again[command]).items() if k in given} == given
    if command == "pretrain":  # the launch scripts' supervisor checks a pretrain command line with the same parser
        problems, cfg, _ = checked_run_config(["--config", str(saved)])
        assert not problems and cfg == root_config(direct[command])


@pytest.fixture(scope="module")
def example_prepared(tmp_path_factory):
    """`megagenome prepare --manifest examples/manifest.yaml --out DIR`, what configs/tiny_prepared.yaml trains on."""
    out = tmp_path_factory.mktemp("prepared") / "example"
    manifest = str(REPO / "examples" / "manifest.yaml")
    assert cli.main(["prepare", "--manifest", manifest, "--out", str(out), "--progress", "false"]) == 0
    return str(out)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_yaml_parses_and_validates(path, monkeypatch, request):
    monkeypatch.chdir(REPO)
    args = ["--config", str(path), "--log.run_dir", "/nonexistent/never-written"]
    if "prepared:" in path.read_text():  # its data.prepared, written here as README says
        args += ["--data.prepared", request.getfixturevalue("example_prepared")]
    cfg, files = parse(args)
    validated = validate(cfg, files, world_size=2)
    try:
        assert validated.data.train_sampler.num_windows > 0
        assert validated.ds_json
    finally:
        validated.data.close()


@pytest.mark.parametrize("path", DS_CONFIGS, ids=[p.name for p in DS_CONFIGS])
def test_every_shipped_ds_json_is_accepted(path):
    from megagenome.engine.ds_config import check_ds_config, load_ds_json

    ds = load_ds_json(str(path))
    # bf16.json accumulates gradients in fp32, which DeepSpeed allows from ZeRO stage 1 on: a fragment to pair
    # with a zero*.json, refused on its own (stage 0) with the reason.
    own = ["needs ZeRO stage 1 or higher"] if path.name == "bf16.json" else []
    on_gpu = check_ds_config(ds, str(path), "run.yaml", on_gpu=True)
    assert len(on_gpu) == len(own) and all(m in p for m, p in zip(own, on_gpu)), on_gpu
    on_cpu = check_ds_config(ds, str(path), "run.yaml", on_gpu=False)
    if path.name.startswith("fp16"):
        own = ["fp16.enabled needs a GPU"]
    assert len(on_cpu) == len(own) and all(m in p for m, p in zip(own, on_cpu)), on_cpu


def test_shipped_fragments_compose_through_the_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    fragments = "[ds_configs/zero2.json, ds_configs/bf16.json, ds_configs/activation_checkpointing.json]"
    args = [
        "pretrain",
        "--config",
        "configs/tiny.yaml",
        "--train.ds_config",
        fragments,
        "--model.checkpointing",
        "full",
        "--log.run_dir",
        str(tmp_path / "run"),
        "--dry_run",
    ]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    merged = json.loads(out[: out.index("# world size")])
    assert merged["zero_optimization"]["stage"] == 2 and merged["bf16"]["enabled"] is True
    assert merged["activation_checkpointing"]["partition_activations"] is False
    tiny, _ = parse(["--config", "configs/tiny.yaml"])
    assert merged["train_batch_size"] == tiny.train.micro_batch_size * tiny.train.grad_accum_steps * 2  # 2 ranks
    assert "deepspeed --num_gpus 2 --module megagenome pretrain --config configs/tiny.yaml" in out
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_conflicting_fragments_name_the_key_and_both_files(tmp_path):
    from megagenome.engine.ds_config import merge_fragments

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}}))
    b.write_text(json.dumps({"zero_optimization": {"stage": 3, "overlap_comm": True}, "bf16": {"enabled": True}}))
    merged, sources, problems = merge_fragments([str(a), str(b)])
    assert len(problems) == 1
    assert "'zero_optimization.stage' is set to 2 in" in problems[0] and str(a) in problems[0] and str(b) in problems[0]
    assert sources["bf16"] == str(b) and merged["bf16"] == {"enabled": True}


def test_engine_knob_problems_need_the_run_config(tmp_path):
    from megagenome.engine.ds_config import check_ds_config, run_problems
    from megagenome.engine.engine import nvme_problems

    ac = {"activation_checkpointing": {"cpu_checkpointing": True}}
    assert any("needs partition_activations" in p for p in check_ds_config(ac, "ac.json", "run.yaml", False))
    assert any("--model.checkpointing=none" in p for p in run_problems(ac, "ac.json", "none", False, None))
    assert run_problems(ac, "ac.json", "full", False, None) == []
    assert run_problems(ac, "ac.json", "none", True, None) == []  # pipeline stages recompute segments
    nvme = json.loads((REPO / "ds_configs" / "zero3_nvme.json").read_text())
    assert any("--train.nvme_path" in p for p in run_problems(nvme, "zero3_nvme.json", "full", False, None))
    assert run_problems(nvme, "zero3_nvme.json", "full", False, str(tmp_path)) == []
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        assert nvme_problems() == []
    else:  # this machine has no libaio: the message says what to install
        assert ["libaio" in p for p in nvme_problems()] == [True]


def test_cli_overrides_beat_yaml():
    cfg, _ = parse(["--config", str(REPO / "configs" / "tiny.yaml"), "--train.lr", "0.5", "--model.n_layer=7"])
    assert cfg.train.lr == 0.5 and cfg.model.n_layer == 7
    assert cfg.model.d_model == 128  # from the YAML


def test_unknown_key_in_yaml_is_rejected(tmp_path, capsys):
    bad = write_yaml(tmp_path / "bad.yaml", {"model": {"d_modle": 64}})
    assert cli.main(["pretrain", "--config", bad]) == 2
    assert f"{bad}:2: unknown key model.d_modle; did you mean model.d_model?" in capsys.readouterr().err


def test_wrong_type_is_rejected(capsys):
    assert cli.main(["pretrain", "--model.d_model", "wide"]) == 2
    assert "command line: --model.d_model wide: Expected a <class 'int'>" in capsys.readouterr().err


def test_semantic_problems_name_flag_file_and_line(tmp_path, capsys):
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path)
    cfg = tiny_config(tmp_path, fasta, tmp_path / "run")
    cfg["model"]["n_head"] = 3
    cfg["data"]["seq_len"] = 256
    cfg["train"]["global_batch_size"] = 7
    path = write_yaml(tmp_path / "bad.yaml", cfg)
    assert cli.main(["pretrain", "--config", path]) == 2
    err = capsys.readouterr().err
    assert "3 configuration problem(s)" in err
    assert "--model.d_model=32 is not divisible by --model.n_head=3" in err
    assert f"{path}:" in err  # file and line of the offending key
    assert "--train.global_batch_size=7" in err
    assert not (tmp_path / "run").exists()  # nothing written before validation passed


def test_bad_ds_json_reports_line_and_column(tmp_path):
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path)
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 1}\n "bf16": {}}')
    cfg, files = parse(
        [
            "--config",
            write_yaml(tmp_path / "r.yaml", tiny_config(tmp_path, fasta, tmp_path / "run")),
            "--train.ds_config",
            str(bad),
        ]
    )
    with pytest.raises(ConfigError, match=r"ds.json:2:2: not valid JSON"):
        validate(cfg, files, world_size=1)


def test_root_owned_key_in_ds_json_names_both_files(tmp_path):
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    run_yaml = write_yaml(tmp_path / "r.yaml", tiny_config(tmp_path, fasta, tmp_path / "run"))
    cfg, files = parse(["--config", run_yaml, "--train.ds_config", str(ds)])
    with pytest.raises(ConfigError) as e:
        validate(cfg, files, world_size=1)
    assert str(ds) in str(e.value) and run_yaml in str(e.value)


def test_resume_dir_without_complete_checkpoint_is_refused(tmp_path):
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path)
    half = tmp_path / "old" / "checkpoints" / "step_00000003"
    half.mkdir(parents=True)  # a save that never finished: no COMPLETE marker
    cfg, files = parse(
        [
            "--config",
            write_yaml(tmp_path / "r.yaml", tiny_config(tmp_path, fasta, tmp_path / "run")),
            "--checkpoint.resume",
            str(tmp_path / "old"),
        ]
    )
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        validate(cfg, files, world_size=1)


def test_fresh_start_refuses_to_overwrite_checkpoints(tmp_path):
    fasta = copy_genome("phiX174_NC_001422.1.fna", tmp_path)
    (tmp_path / "run" / "checkpoints" / "step_00000003").mkdir(parents=True)
    cfg, files = parse(
        [
            "--config",
            write_yaml(tmp_path / "r.yaml", tiny_config(tmp_path, fasta, tmp_path / "run")),
            "--checkpoint.resume",
            "none",
        ]
    )
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        validate(cfg, files, world_size=1)


def test_malformed_fasta_is_a_config_problem(tmp_path):
    bad = tmp_path / "bad.fa"
    bad.write_text(">a\nACGT\n>a\nACGT\n")
    cfg, files = parse(["--config", write_yaml(tmp_path / "r.yaml", tiny_config(tmp_path, str(bad), tmp_path / "run"))])
    with pytest.raises(ConfigError, match="bad.fa"):
        validate(cfg, files, world_size=1)


def test_launcher_local_rank_argument_is_accepted():
    assert cli._strip_launcher_args(["pretrain", "--local_rank=1", "--x", "1"]) == ["pretrain", "--x", "1"]
    assert cli._strip_launcher_args(["--local_rank", "0", "pretrain"]) == ["pretrain"]


def test_readme_commands_exist():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    test_cmd = next(line.strip() for line in ci.splitlines() if "pytest" in line and "pip install" in line)
    assert test_cmd in readme, "the README's test command must be the one .ci/run runs"
    assert pathlib.Path(REPO / "launch" / "local.sh").exists()


# ----- find-micro-batch's flags (the search itself: tests/test_tune.py) ----------------------------------------


@pytest.fixture
def find_micro_yaml(tmp_path):
    cfg = tiny_config(tmp_path, copy_genome("phiX174_NC_001422.1.fna", tmp_path), tmp_path / "run")
    return write_yaml(tmp_path / "run.yaml", cfg)


def test_bad_flags_exit_2_naming_each(find_micro_yaml, capsys):
    code = cli.main(
        [
            "find-micro-batch",
            "--config",
            find_micro_yaml,
            "--max_micro",
            "0",
            "--steps",
            "0",
            "--memory_budget_gb",
            "-1",
            "--data_parallel",
            "0",
            "--parallel.tensor",
            "2",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    for flag in ("--max_micro=0", "--steps=0", "--memory_budget_gb=-1", "--data_parallel=0", "--parallel.tensor=2"):
        assert flag in err, err
    assert cli.main(["find-micro-batch", "--config", find_micro_yaml, "--max_micro", "many"]) == 2
    assert "command line: --max_micro many:" in capsys.readouterr().err


def test_config_problems_exit_2_before_any_trial(find_micro_yaml, capsys, monkeypatch):
    from megagenome.run import tune

    monkeypatch.setattr(tune, "run_trial", lambda *a, **k: pytest.fail("a trial ran"))
    assert cli.main(["find-micro-batch", "--config", find_micro_yaml, "--data.seq_len", "4096"]) == 2
    assert "--data.seq_len=4096" in capsys.readouterr().err


def test_help_states_the_single_process_assumption(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["find-micro-batch", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "world of ONE process" in text and "conservative (fits on one rank => fits on more)" in text
    assert "--memory_budget_gb" in text and "--data_parallel" in text


# ----- after training: the commands' flags parsed for real (their behaviour: tests/test_evaluate.py, ...) --------


def test_eval_command_line(trained, tmp_path, capsys):
    """`megagenome eval RUN --fasta F --regions R1 R2 --window W --reverse_complement --output J`: flags reach the
    command; bad values exit 2 naming the flag."""
    import json

    out = tmp_path / "eval.json"
    run = str(trained.run_dir("dense"))
    argv = ["eval", run, "--fasta", trained.fasta, "--regions", "NC_001422.1:1-300", "NC_001422.1:301-700"]
    assert cli.main([*argv, "--window", "64", "--reverse_complement", "--progress", "false", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["bases"] for r in result["records"]] == [300, 400] and result["run"]["window"] == 64
    assert result["run"]["reverse_complement"] is True
    assert "overall" in capsys.readouterr().out
    assert cli.main([*argv, "--batch_size", "0"]) == 2
    assert "--batch_size=0" in capsys.readouterr().err


def test_a_mistyped_command_gets_a_did_you_mean(capsys):
    """`megagenome pretrian` names the command it resembles (flags already did), exit status 2, and nothing runs."""
    assert cli.main(["pretrian", "--config", "configs/tiny.yaml"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'pretrian'; did you mean pretrain?" in err
    assert cli.main(["score-variant"]) == 2
    assert "did you mean score-variants?" in capsys.readouterr().err
    assert cli.main(["xyzzy"]) == 2  # nothing close: every command is named
    assert "unknown command 'xyzzy' (the commands: pretrain, convert-checkpoint, prepare," in capsys.readouterr().err


def test_every_command_is_listed_and_parses_its_help(capsys):
    """`megagenome --help` lists every command module's line; each command's --help exits 0 (cli/ builds only the
    chosen command's parser, so each is built alone here as main() builds it)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out and cli.command_module(name).HELP.split()[0] in out
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0


def test_import_formats_are_the_registry():
    """cli/import_checkpoint.py lists the formats without importing the model package (the parser stays torch-free):
    they must be model/__init__.py's PUBLISHED."""
    from megagenome.cli.import_checkpoint import FORMATS
    from megagenome.model import PUBLISHED

    assert set(FORMATS) == set(PUBLISHED)


@pytest.mark.parametrize("rc", [0, 2])
def test_an_inference_commands_process_group_is_torn_down_before_exit(rc):
    """An inference command's gloo group, left to interpreter teardown, once aborted a rank of a 2-rank `embed`
    after its outputs were written (exit -6, "terminate called without an active exception"); run_command now
    closes it: through the barrier when the command ended well, alone when it failed."""
    import torch.distributed as dist
    from support.helpers import world_of_one

    from megagenome.cli import _close_world

    with world_of_one():
        assert dist.is_initialized()
        assert _close_world(rc) == rc
        assert not dist.is_initialized()
    assert _close_world(rc) == rc  # no group: nothing to do


@pytest.mark.parametrize("rc", [0, 2])
def test_run_command_closes_the_group_an_inference_command_left(monkeypatch, rc):
    """Through run_command, as `megagenome eval` ends: a command returning with its group still up leaves none."""
    import types

    import torch.distributed as dist
    from support.helpers import world_of_one

    monkeypatch.setattr(cli, "command_module", lambda name: types.SimpleNamespace(main=lambda parsed: rc))
    with world_of_one():
        assert cli.run_command("eval", types.SimpleNamespace(argv=[])) == rc
        assert not dist.is_initialized()
