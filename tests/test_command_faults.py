"""What the after-training commands do with a hostile or unlucky user's input (files/outputs.py, cli/__init__.py
run_command, observe/metrics.py read_metrics): outputs checked before any work, written whole and together or not
at all, an earlier result never destroyed, signals ending in one line with nothing left behind, a damaged metrics
file's last line skipped. The crafted-checkpoint and damaged-checkpoint cases are tests/test_safe_load.py's.

Each case asserts the exit code, that the message names the flag or path, that no temporary is left and that a
file already there is intact. The model is a seeded, untrained export (what is checked is the command around it).
A full disk is a file-size limit in the child (RLIMIT_FSIZE, SIGXFSZ ignored: a write past it fails with EFBIG as
one to a full disk fails with ENOSPC), the same failure path without a disk to fill.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time

import pytest
import torch
from support.helpers import PYTHON, REPO, cli_here, env

from megagenome.after_training.export import staged_export
from megagenome.config import ModelConfig
from megagenome.data.tokenizer import VOCAB_SIZE
from megagenome.files import outputs
from megagenome.model import family_of

PHIX = str(REPO / "tests" / "data" / "phiX174_NC_001422.1.fna")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    cfg = ModelConfig(d_model=32, n_layer=2, n_head=4, max_seq_len=256)
    torch.manual_seed(0)
    m = family_of(cfg).build(cfg, VOCAB_SIZE)
    path = tmp_path_factory.mktemp("faults") / "export"
    with staged_export(str(path), cfg, m.state_dict(), "fp32", {"seeded": True}):
        pass
    return str(path)


def leftovers(folder) -> list[str]:
    return [n for n in os.listdir(folder) if ".partial-" in n]


def test_outputs_are_checked_before_any_work(model, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        (["eval", model, "--fasta", PHIX, "--output", str(afile / "r.json")], f"--output {afile / 'r.json'}: {afile}"),
        (["eval", model, "--fasta", PHIX, "--output", str(tmp_path)], "is a directory"),
        (["eval", model, "--fasta", PHIX, "--output", str(afile)], "already exists (give --overwrite"),
        (["generate", model, "--output", str(afile / "s.fa"), "--progress", "false"], "is a file, not a directory"),
        (["export", model, "--output", str(afile / "x")], f"--output {afile / 'x'}"),
    ]
    for argv, fragment in cases:
        proc = cli_here(*argv)
        assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stdout == ""  # refused up front: nothing evaluated, generated or exported first
    assert afile.read_text() == "x" and not leftovers(tmp_path)


def test_eval_replaces_a_result_only_with_a_complete_one(model, tmp_path):
    out = tmp_path / "eval.json"
    out.write_text('{"earlier": true}\n')
    cmd = [PYTHON, "-m", "megagenome", "eval", model, "--fasta", PHIX, "--output", str(out), "--overwrite",
           "--progress", "false"]  # fmt: skip

    def limit():  # any file this process writes is cut at 64 bytes: the JSON (~1 kB) cannot be written whole
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))

    full = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, preexec_fn=limit, timeout=300)
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr
    assert f"error: --output {out}: File too large" in full.stderr, full.stderr
    assert out.read_text() == '{"earlier": true}\n' and not leftovers(tmp_path)
    ok = cli_here("eval", model, "--fasta", PHIX, "--output", str(out), "--overwrite", "--progress", "false")
    assert ok.returncode == 0 and "bits_per_base" in out.read_text(), ok.stderr
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~outputs.umask())  # the umask's mode, not mkstemp's 0600


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_a_command_in_one_line_with_nothing_written(model, tmp_path, sig, code):
    out = tmp_path / "s.fa"
    cmd = [PYTHON, "-m", "megagenome", "generate", model, "--output", str(out), "--scores", str(tmp_path / "s.tsv"),
           "--length", "1000000", "--progress", "false"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # generating: the cache line is printed before the first base
        if "cached decoding" in line:
            break
    time.sleep(1)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    assert f"megagenome generate: interrupted ({signal.Signals(sig).name})" in stderr and "Traceback" not in stderr
    assert os.listdir(tmp_path) == []


def test_a_killed_commands_temporaries_are_swept_by_the_next(model, tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid: a process that no longer runs
    host = outputs._host()
    (tmp_path / f".s.fa.partial-{gone.pid}-{host}-abc").write_text("half")  # a killed generate's temporary file
    (tmp_path / f".x.partial-{gone.pid}").mkdir()  # and a killed export's directory (named before hosts were)
    kept = [f".s.fa.partial-{os.getpid()}-{host}-keep", f".s.fa.partial-{gone.pid}-othernode-keep"]  # live; elsewhere
    for name in kept:
        (tmp_path / name).write_text("in use")
    proc = cli_here("generate", model, "--output", str(tmp_path / "s.fa"), "--length", "5", "--progress", "false")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "s.fa"])


def test_report_skips_a_cut_short_last_metrics_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "tokens": 8 * s, "loss": 1.5 - s / 100, "lr": 1e-3} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "tok')
    proc = cli_here("report", str(run))
    assert proc.returncode == 0, proc.stderr
    assert "metrics.jsonl:6: the last line is cut short" in proc.stderr and (run / "report" / "report.md").exists()
    (run / "metrics.jsonl").write_text('{"step": 1\n' + json.dumps(rows[1]) + "\n")  # damage before the end
    (run / "report" / "report.md").write_text("earlier")
    bad = cli_here("report", str(run))
    assert bad.returncode == 2 and "metrics.jsonl:1: not a JSON line" in bad.stderr and "Traceback" not in bad.stderr
    assert (run / "report" / "report.md").read_text() == "earlier"


def test_a_missing_or_broken_manifest_is_one_message(tmp_path):
    missing = cli_here("prepare", "--manifest", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "out"))
    assert missing.returncode == 2 and f"--manifest {tmp_path / 'm.yaml'}: no such file" in missing.stderr
    (tmp_path / "m.yaml").write_text("sources: [\n")
    broken = cli_here("prepare", "--manifest", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "out"))
    assert broken.returncode == 2 and "m.yaml" in broken.stderr and "Traceback" not in broken.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.yaml"]


def test_check_outputs_refuses_the_same_file_twice(tmp_path):
    with pytest.raises(outputs.OutputError, match="--scores .*: the same file as --output"):
        outputs.check_outputs([("--output", str(tmp_path / "a")), ("--scores", str(tmp_path / "a"))])


def vcf(path, *records: str) -> str:
    head = (
        "##fileformat=VCFv4.2\n##contig=<ID=NC_001422.1,length=5386>\n#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n"
    )
    path.write_text(head + "".join(f"NC_001422.1\t{r}\t.\t.\t.\n" for r in records))
    return str(path)


def test_variants_pos_0_is_refused_and_ambiguous_alleles_are_skipped(model, tmp_path):
    """phiX174 starts GAGTTTTATC: POS 2 is A, POS 5 T."""
    score = ["score-variants", model, "--fasta", PHIX, "--window", "64", "--progress", "false"]
    zero = cli_here(*score, "--vcf", vcf(tmp_path / "zero.vcf", "0\t.\tG\tA"), "--output", str(tmp_path / "z.vcf"))
    assert zero.returncode == 2 and "zero.vcf:4: NC_001422.1:0: POS 0: VCF positions start at 1" in zero.stderr
    records = ["2\t.\tA\tN", "2\t.\tA\tR", "5\t.\tT\tNNNNNN", "5\t.\tT\tG,N"]
    out = tmp_path / "s.vcf"
    proc = cli_here(*score, "--vcf", vcf(tmp_path / "amb.vcf", *records), "--output", str(out))
    assert proc.returncode == 0 and "1 variants scored (4 skipped)" in proc.stdout, proc.stdout + proc.stderr
    rows = [line.split("\t") for line in (tmp_path / "s.tsv").read_text().splitlines()[1:]]
    assert [(r[4], r[5]) for r in rows] == [("N", "skipped"), ("R", "skipped"), ("NNNNNN", "skipped"),
                                            ("G", "llr"), ("N", "skipped")]  # fmt: skip
    assert "ALT N has N: only A, C, G and T are scored" in proc.stdout


def test_finetune_refuses_a_training_set_too_small_to_split(tmp_path):
    from megagenome.config import ConfigError
    from megagenome.config.finetune import FinetuneConfig, TaskDataConfig
    from megagenome.run.task_data import read_task_data

    bed = tmp_path / "train.bed"
    bed.write_text("NC_001422.1\t0\t100\tpromoter\n")
    cfg = FinetuneConfig(data=TaskDataConfig(fasta=PHIX, train_bed=str(bed)))
    with pytest.raises(ConfigError, match=r"the training set has 1 example\(s\).*needs at least 2"):
        read_task_data(cfg, context=256)


def test_eval_says_which_records_had_no_base_to_score(model, tmp_path):
    fasta = tmp_path / "g.fa"
    fasta.write_text(">real\n" + "ACGTTGCAAGGCTTAC" * 8 + "\n>gap\n" + "N" * 100 + "\n")
    proc = cli_here("eval", model, "--fasta", str(fasta), "--progress", "false")
    assert proc.returncode == 0 and "over 1 records (1 with no base to score, all N, left out: gap)" in proc.stdout
    fasta.write_text(">gap\n" + "N" * 100 + "\n")
    proc = cli_here("eval", model, "--fasta", str(fasta), "--output", str(tmp_path / "r.json"), "--progress", "false")
    assert proc.returncode == 2 and "no base to score" in proc.stderr and not (tmp_path / "r.json").exists()


def test_embed_warns_of_rows_that_are_all_n_and_publishes_both_outputs(model, tmp_path):
    fasta = tmp_path / "g.fa"
    fasta.write_text(">real\n" + "ACGTTGCAAGGCTTAC" * 4 + "\n>gap\n" + "N" * 64 + "\n")
    out = tmp_path / "e.safetensors"
    proc = cli_here("embed", model, "--fasta", str(fasta), "--output", str(out), "--layers", "1", "--progress", "false")
    assert proc.returncode == 0 and "1 of 2 rows are all N, their embeddings carry no sequence: gap" in proc.stderr
    assert out.exists() and (tmp_path / "e.tsv").exists() and not leftovers(tmp_path)
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~outputs.umask())


def test_prepare_refuses_a_validation_range_that_is_all_n(tmp_path):
    (tmp_path / "g.fa").write_text(">c\n" + "ACGTTGCAAGGCTTAC" * 100 + "N" * 2000 + "\n")
    (tmp_path / "m.yaml").write_text("sources:\n  - name: g\n    fasta: g.fa\n    val_ranges: ['c:1700-3500']\n")
    proc = cli_here("prepare", "--manifest", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "source g: its val regions (c:1700-3500) hold no base" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_cpu_run_too_large_for_the_machine_is_refused_before_it_starts(monkeypatch):
    """The issue's `deepspeed --num_gpus 8 ... --config configs/dna_125m.yaml` on a 24 GiB CPU machine: each rank's
    start (run/pretrain.py, before the model is built) refuses with the planner's figures; the default job fits."""
    from megagenome.config import ConfigError
    from megagenome.config.load import config_from_args
    from megagenome.run import host_memory

    big = config_from_args(["--config", "configs/dna_125m.yaml"])
    (line,) = host_memory.problems(big, 8, 8, available=20.5)
    assert "GiB per rank" in line and "x 8 rank(s) on this machine" in line and "20.5 GiB is available" in line
    assert host_memory.problems(config_from_args(["--config", "configs/tiny.yaml"]), 2, 2, available=20.5) == []
    monkeypatch.setenv("LOCAL_SIZE", "8")  # as the deepspeed launcher sets it for 8 ranks on this node
    monkeypatch.setattr(host_memory, "available_gib", lambda: 20.5)  # this machine's figure, whatever CI's is
    with pytest.raises(ConfigError, match="x 8 rank"):
        host_memory.refuse_if_too_large(big, 8)  # what run/pretrain.py calls right after validating
    monkeypatch.setenv(host_memory.SKIP, "1")
    assert host_memory.problems(big, 8, 8, available=20.5) == []
