"""Tier 1: strict flags and YAML, every problem at once with where it came from, and the supervisor's check before
launch (issue 16, items 2, 3 and 7). Pure parsing through the real CLI, and `python -m megagenome.run.supervise` with a
stand-in for DeepSpeed's launcher: nothing here starts a rank."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys

import pytest
from support.helpers import DATA, REPO, copy_genome, env, tiny_config, write_yaml

from megagenome import cli
from megagenome.config import ConfigError
from megagenome.config.load import command_line_keys, config_files, root_config
from megagenome.run.assembly import validate
from megagenome.run.supervise import pretrain_problems


@pytest.fixture
def run_yaml(tmp_path):
    cfg = tiny_config(tmp_path, copy_genome("phiX174_NC_001422.1.fna", tmp_path), tmp_path / "run")
    return write_yaml(tmp_path / "run.yaml", cfg)


def errors(capsys, argv: list[str]) -> list[str]:
    """cli.main's stderr lines for ARGV, which must be refused with exit status 2."""
    assert cli.main(argv) == 2
    return capsys.readouterr().err.splitlines()


RUN_CONFIG_COMMANDS = [["pretrain"], ["preflight"], ["plan", "--gpus", "8"], ["find-micro-batch"]]


@pytest.mark.parametrize("command", RUN_CONFIG_COMMANDS, ids=[c[0] for c in RUN_CONFIG_COMMANDS])
def test_abbreviated_flags_are_refused_with_the_flag_they_abbreviate(command, run_yaml, capsys):
    lines = errors(capsys, [*command, "--config", run_yaml, "--train.micro", "4", "--train.stop", "7"])
    assert lines == [
        f"megagenome {command[0]}: error: 2 problems with the arguments:",
        "  - command line: unknown flag --train.micro; did you mean --train.micro_batch_size?",
        "  - command line: unknown flag --train.stop; did you mean --train.stop_at?",
        f"every flag: megagenome {command[0]} --help",
    ]  # one line per problem: no usage


def test_every_command_refuses_abbreviations_and_typos(capsys):
    assert errors(capsys, ["prepare", "--manifest", "m.yaml", "--out", "o", "--work", "2"])[0] == (
        "megagenome prepare: error: command line: unknown flag --work; did you mean --workers?"
    )
    assert "did you mean --fasta?" in errors(capsys, ["eval", "runs/x", "--fasat", "g.fa"])[0]
    assert "did you mean --nodelist?" in errors(capsys, ["hostfile", "--nodelsit", "n[1-2]"])[0]


def test_a_missing_required_flag_is_named_as_typed(capsys):
    assert errors(capsys, ["eval", "runs/x"])[0] == "megagenome eval: error: missing --fasta (required)"
    assert errors(capsys, ["eval"])[0] == "megagenome eval: error: missing RUN, --fasta (required)"


def test_a_yaml_file_given_as_a_word_is_named_with_the_fix(capsys):
    (line, hint) = errors(capsys, ["pretrain", "configs/tiny.yaml"])
    assert "'configs/tiny.yaml' is not a flag's value" in line and "did you mean --config configs/tiny.yaml?" in line
    assert hint == "every flag: megagenome pretrain --help"


def test_unknown_yaml_keys_are_named_with_file_and_line(tmp_path, capsys):
    bad = tmp_path / "x.yaml"
    bad.write_text("model:\n  d_model: 64\ntrain:\n  lr: 1e-3\n  micro_bach_size: 4\nlogs:\n  run_dir: r\n")
    lines = errors(capsys, ["pretrain", "--config", str(bad), "--model.n_layr", "2"])
    assert lines[1:4] == [
        f"  - {bad}:5: unknown key train.micro_bach_size; did you mean train.micro_batch_size?",
        f"  - {bad}:6: unknown key logs; did you mean log?",
        "  - command line: unknown flag --model.n_layr; did you mean --model.n_layer?",
    ]


def test_yaml_syntax_errors_name_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "x.yaml"
    bad.write_text("model:\n  d_model: [64\ntrain:\n  lr: 1\n")
    (line, _) = errors(capsys, ["pretrain", "--config", str(bad)])
    assert line.startswith(f"megagenome pretrain: error: {bad}:3:") and "not valid YAML" in line
    assert "<unicode string>" not in line
    (line, _) = errors(capsys, ["pretrain", "--config", str(tmp_path / "missing.yaml")])
    assert line.endswith(f"command line: --config {tmp_path / 'missing.yaml'}: No such file or directory")


def test_type_errors_are_all_reported_where_they_were_given(tmp_path, capsys):
    bad = tmp_path / "x.yaml"
    bad.write_text("model:\n  d_model: wide\n  n_layer: 2\ntrain:\n  lr: 1e-3\n  ds_config: [a.json, b.json]\n")
    lines = errors(capsys, ["pretrain", "--config", str(bad), "--train.max_steps", "many", "--model.attention=x"])
    assert lines[0] == "megagenome pretrain: error: 3 problems with the arguments:"
    assert lines[1] == f"  - {bad}:2: model.d_model: Expected a <class 'int'>. Got value: wide"
    assert lines[2] == "  - command line: --train.max_steps many: Expected a <class 'int'>. Got value: many"
    assert lines[3].startswith("  - command line: --model.attention=x: Expected a typing.Literal['auto'")


def test_type_errors_of_one_file_come_in_file_order(tmp_path, capsys):
    bad = tmp_path / "x.yaml"
    bad.write_text("train:\n  lr: abc\ndata:\n  seq_len: x\nmodel:\n  n_layer: y\n")
    lines = errors(capsys, ["pretrain", "--config", str(bad)])
    assert [line.split(": ")[0] for line in lines[1:4]] == [f"  - {bad}:{n}" for n in (2, 4, 6)], lines


@pytest.mark.parametrize("argv", [["pretrain", "-h"], ["plan", "-h"], ["prepare", "-h"], ["pretrain", "--help"]])
def test_short_help_flag_prints_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


def test_a_value_from_the_command_line_is_blamed_on_the_command_line(run_yaml):
    problems = pretrain_problems(["--config", run_yaml, "--train.micro_batch_size", "0", "--model.n_head", "3"])
    d_model = open(run_yaml).read().splitlines().index("  d_model: 32") + 1
    assert problems == [
        f"--model.d_model=32 is not divisible by --model.n_head=3 [{run_yaml}:{d_model}, command line]",
        "--train.micro_batch_size=0: must be positive [command line]",
    ]
    text = open(run_yaml).read().replace("micro_batch_size: 2", "micro_batch_size: 0")
    open(run_yaml, "w").write(text)
    line = text.splitlines().index("  micro_batch_size: 0") + 1
    # A --config given after the flag sets the key again: the value in force is the YAML's.
    problems = pretrain_problems(["--train.micro_batch_size", "0", "--config", run_yaml])
    assert problems == [f"--train.micro_batch_size=0: must be positive [{run_yaml}:{line}]"]


def test_command_line_keys_follow_the_order_of_flags_and_files(run_yaml):
    argv = ["--train.lr", "1", "--config", run_yaml, "--model.n_layer=3", "--data.seed", "2"]
    assert command_line_keys(argv) == {"model.n_layer", "data.seed"}  # train.lr: the YAML after it sets it again
    parser = cli.build_parser()
    ns = parser.parse_args(["pretrain", *argv])
    files = config_files(ns.pretrain, argv)
    assert list(files) == [run_yaml] and files.command_line == {"model.n_layer", "data.seed"}
    assert root_config(parser.instantiate(ns).pretrain).model.n_layer == 3


def plain_gzip_without_split(tmp_path):
    fasta = tmp_path / "phix.fa.gz"
    with open(DATA / "phiX174_NC_001422.1.fna", "rb") as src, gzip.open(fasta, "wb") as dst:
        shutil.copyfileobj(src, dst)
    cfg = tiny_config(tmp_path, str(fasta), tmp_path / "run")
    del cfg["data"]["val_ranges"]
    return str(fasta), write_yaml(tmp_path / "run.yaml", cfg)


def test_config_and_data_file_problems_come_together(tmp_path):
    """Staged no more: a plain-gzip FASTA with no held-out range names both, before launch and in the ranks."""
    fasta, path = plain_gzip_without_split(tmp_path)
    early = pretrain_problems(["--config", path])
    line = open(path).read().splitlines().index(f"  fasta: {fasta}") + 1
    assert early == [
        "--data.val_contigs or --data.val_ranges must name the held-out data used for evaluation",
        f"--data.fasta={fasta}: plain gzip cannot be read at random offsets; recompress with `bgzip` (htslib) or "
        f"decompress with `gunzip` [{path}:{line}]",
    ]
    parser = cli.build_parser()
    ns = parser.parse_args(["pretrain", "--config", path])
    with pytest.raises(ConfigError) as e:
        validate(root_config(parser.instantiate(ns).pretrain), config_files(ns.pretrain), world_size=1)
    assert e.value.problems == early


def test_prepared_data_beside_a_fasta_config_says_the_fix():
    problems = pretrain_problems(["--config", "configs/tiny.yaml", "--data.prepared", "nowhere"], data=False)
    both = next(p for p in problems if "--data.prepared=nowhere" in p)
    assert "configs/tiny_prepared.yaml" in both and '--data.fasta "" --data.val_ranges "[]"' in both
    lines = (REPO / "configs" / "tiny.yaml").read_text().splitlines()
    fasta, val = (next(n for n, t in enumerate(lines, 1) if t.startswith(f"  {k}:")) for k in ("fasta", "val_ranges"))
    assert both.endswith(f"[configs/tiny.yaml:{fasta}, command line]")  # data.fasta's line, and --data.prepared
    assert any(f'clear it with --data.val_ranges "[]" [configs/tiny.yaml:{val}]' in p for p in problems)


def supervise(*command: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megagenome.run.supervise", "--", *command]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)


def test_the_supervisor_refuses_a_bad_launch_once_without_starting_it(tmp_path):
    """launch/local.sh's `python -m megagenome.run.supervise -- deepspeed ... pretrain ARGS`: a missing
    --config is reported once and nothing starts (`deepspeed` here is a stand-in that would leave a file)."""
    marker = tmp_path / "launched"
    launcher = tmp_path / "deepspeed"
    launcher.write_text(f"#!/bin/sh\ntouch {marker}\n")
    launcher.chmod(0o755)
    done = supervise(str(launcher), "--num_gpus", "2", "--module", "megagenome", "pretrain", "configs/tiny.yaml")
    assert done.returncode == 2 and not marker.exists()
    assert done.stderr.splitlines() == [
        "megagenome pretrain: error: command line: 'configs/tiny.yaml' is not a flag's value (flags take the form "
        "--name VALUE); did you mean --config configs/tiny.yaml?",
        "every flag: megagenome pretrain --help",
        "megagenome.run.supervise: nothing launched",
    ]


def test_the_supervisor_launches_a_valid_config(run_yaml, tmp_path):
    marker = tmp_path / "launched"
    ran = [sys.executable, "-c", f"open({str(marker)!r}, 'w')", "megagenome", "pretrain", "--config", run_yaml]
    done = supervise(*ran)
    assert done.returncode == 0 and marker.exists(), done.stderr
