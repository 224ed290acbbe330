"""Tiers 1 and 3: what a run prints (observe/console.py) and what a rerun of a finished run reports (summary.py).

Issue 16 items 5 and 6: the default job's console was 64 lines, 38 of them DeepSpeed's or torch's ("Setting
accelerator to CPU" x4, the launcher's INFO lines, 18 lines of bf16_optimizer memory debug, a scheduler warning,
FutureWarnings on the progress bar); and rerunning a finished job rewrote summary.json with the rerun's 3.6 s of
wall time next to the original tokens/s and MFU. Now the console holds megagenome's own lines (at most 15 besides
the progress bar), the rest is in <run dir>/logs/, and a rerun prints the finished run's summary, unchanged.

The README's default job, `bash launch/local.sh --config configs/tiny.yaml` (2 CPU ranks, 6 steps), as the README
run shared with tests/test_readme.py launched it in a fresh clone, and one rerun of it; the routing and summary rules
themselves are pure functions, tested without a process group.
"""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import warnings
from dataclasses import replace

import pytest
from support.helpers import env, free_port
from support.readme_commands import DEFAULT_JOB_MAX_STEPS

from megagenome.config import RootConfig
from megagenome.observe import console
from megagenome.run import summary

DS_INFO = "[2026-12-02 00:44:05,037] [INFO] [launch.py:174:main] Setting CUDA_VISIBLE_DEVICES=0,1\n"
DS_QUIET = (
    "[2026-12-02 00:43:57,185] [WARNING] [runner.py:214:fetch_hostfile] Unable to find hostfile, will proceed with "
    "training with local resources only.\n"
)
DS_WARNING = "[2026-12-02 00:44:05,037] [WARNING] [engine.py:1:f] The checkpoint was written by another version\n"
DS_ERROR = "[2026-12-02 00:43:40,502] [ERROR] [launch.py:259:sigkill_handler] [...] exits with return code = 2\n"
STEPS = DEFAULT_JOB_MAX_STEPS  # the README's default job as the README run launches it
BAR = re.compile(r"^\s*pretrain:\s+\d+%\|")


def test_console_line_keeps_megagenome_lines_errors_and_warnings_that_matter():
    assert console.console_line("megagenome: resumed from x at step 3\n")
    assert console.console_line("Traceback (most recent call last):\n")
    assert console.console_line(DS_WARNING) and console.console_line(DS_ERROR)
    assert not console.console_line(DS_INFO)
    assert not console.console_line(DS_QUIET)
    assert not console.console_line("node-7: " + DS_INFO)  # pdsh prefixes each line with its host
    assert console.console_line("node-7: " + DS_ERROR)


def test_route_logs_every_deepspeed_line_and_clears_the_progress_bar_on_a_terminal(tmp_path):
    class Terminal(io.BytesIO):
        def isatty(self):
            return True

    source = io.BytesIO((DS_INFO + "megagenome: start\n" + DS_QUIET + DS_ERROR + "tail").encode())
    shown, log = Terminal(), tmp_path / "run" / "logs" / "launcher.log"
    console.route(source, shown, str(log))
    assert shown.getvalue() == b"\r\x1b[Kmegagenome: start\n\r\x1b[K" + DS_ERROR.encode() + b"\r\x1b[Ktail"
    lines = log.read_text().splitlines()
    assert lines[0].startswith("== launch started ") and lines[1:] == [DS_INFO[:-1], DS_QUIET[:-1], DS_ERROR[:-1]]
    everything, piped = io.BytesIO((DS_INFO + "x\n").encode()), io.BytesIO()
    console.route(everything, piped, None)  # no run directory to log to: nothing is left out
    assert piped.getvalue() == (DS_INFO + "x\n").encode()
    (tmp_path / "file").write_text("")  # a log that cannot be written: nothing is left out either
    unwritable, piped = io.BytesIO((DS_INFO + "x\n").encode()), io.BytesIO()
    console.route(unwritable, piped, str(tmp_path / "file" / "logs" / "launcher.log"))
    assert piped.getvalue() == (DS_INFO + "x\n").encode()


def test_rank_logs_route_deepspeed_records_warnings_and_prints(tmp_path):
    stream = io.StringIO()
    logger = logging.getLogger("test_console.DeepSpeed")
    logger.propagate, logger.level = False, logging.WARNING
    logger.addHandler(logging.StreamHandler(stream))
    seen = []
    before = warnings.showwarning
    warnings.showwarning = lambda message, *a, **k: seen.append(str(message))
    try:
        logs = console.RankLogs(str(tmp_path), 1, logger)
        logger.info("engine configuration")
        logger.warning("Attempting to get learning rate from scheduler before it has started")
        logger.warning("a warning that matters")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("all_gather_into_tensor is deprecated", FutureWarning, stacklevel=1)
            warnings.warn("a user warning", UserWarning, stacklevel=1)
        with logs.quiet():
            print("begin bf16_optimizer")
        print_after = stream.getvalue()
        logs.close()
        assert logger.level == logging.WARNING and len(logger.handlers) == 1 and not logger.handlers[0].filters
    finally:
        warnings.showwarning = before
    assert print_after == "a warning that matters\n"
    assert seen == ["a user warning"]
    text = (tmp_path / "logs" / "rank1.log").read_text()
    for expected in ("engine configuration", "Attempting to get", "all_gather_into_tensor", "begin bf16_optimizer"):
        assert expected in text, expected


def test_run_dir_of_resolves_as_the_ranks_do():
    assert console.run_dir_of(["--config", "configs/tiny.yaml"]) == "runs/tiny"
    assert console.run_dir_of(["--config", "configs/tiny.yaml", "--log.run_dir", "x", "--dry_run"]) == "x"
    assert console.run_dir_of(["--config", "configs/tiny.yaml", "--help"]) is None
    assert console.run_dir_of(["--config", "no/such.yaml"]) is None


def _summary(**changes) -> dict:
    s = {
        "run_dir": "/r", "parameters": 854144, "steps": 600, "train_loss": 1.2, "heldout_bits_per_base": 1.9,
        "markov_bits_per_base": {str(k): 2.0 - k / 100 for k in range(9)}, "markov_strands": "both",
        "best_markov_order": 8, "beats_best_markov": True, "tokens_per_s_median": 3800.0,
        "tflops_per_gpu_median": 0.0128, "mfu_median": 0.05, "hfu_median": 0.05, "mfu_full_attn_median": 0.06,
        "peak_tflops": 0.25, "peak_source": "measured-cpu-matmul", "real_token_fraction": 1.0,
        "mem_peak_bytes_max": 6.5e8, "wall_s": 352.8, "first_step": 0, "bad_steps": {"total": 0},
    }  # fmt: skip
    return {**s, **changes}


def test_the_summary_is_nine_lines_and_names_the_invocation_it_timed(capsys):
    summary.print_summary(_summary())
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 9 and out.startswith("\n== megagenome pretrain summary: /r ==")
    assert "order-0..8: 2.0000 1.9900" in out
    assert "1.9000 (model): 0.0200 below the best Markov baseline, order-8 at 1.9200\n" in out  # one number, one sign
    assert "wall time          352.8 s\n" in out
    assert "MFU                5.00%" in out and "an estimate (a peak timed at start-up" in out  # a measured CPU peak
    summary.print_summary(_summary(heldout_bits_per_base=1.95, beats_best_markov=False))
    out = capsys.readouterr().out
    assert "1.9500 (model): 0.0300 above, not yet below the best Markov baseline, order-8 at 1.9200\n" in out
    summary.print_summary(_summary(heldout_bits_per_base=None, beats_best_markov=False, steps=30, max_steps=600))
    out = capsys.readouterr().out  # a run stopped by --train.stop_at 30 before its first evaluation
    assert "held-out bits/base not evaluated: stopped at step 30 of 600; rerun the same command to continue" in out
    masked = {str(k): 1.92 - k / 100 for k in range(5)}  # an mlm run: compared with its masked baselines
    mlm = _summary(masked_baseline_bits_per_base=masked, best_masked_baseline_k=4, beats_best_masked_baseline=False)
    del mlm["beats_best_markov"]  # an mlm run's summary.json has no such key (run/summary.py _comparison)
    summary.print_summary(mlm)
    lines = capsys.readouterr().out.splitlines()
    assert (
        "held-out bits/base 1.9000 (model, masked positions): 0.0200 above, not yet below the best masked "
        "baseline, k=4 each side at 1.8800" in lines
    )  # not "below" the causal order-8 chain at 1.9200
    assert (
        "masked baselines   k=0..4 bases each side: 1.9200 1.9100 1.9000 1.8900 1.8800 (two-sided k-mer "
        "context, same masking; fitted on both strands)" in lines
    )
    assert next(line for line in lines if line.startswith("Markov baselines")).endswith(
        "1.9200 (causal: one side, for scale only; fitted on both strands)"
    )
    summary.print_summary(_summary(first_step=400, wall_s=120.0))
    assert "120.0 s (this invocation: steps 401-600, resumed at step 400)" in capsys.readouterr().out
    summary.print_summary(_summary(first_step=600, wall_s=3.6))
    assert "3.6 s (this invocation trained no steps; the run's time was not recorded)" in capsys.readouterr().out


def test_finished_rerun_needs_the_finished_step_and_its_summary(tmp_path, capsys):
    run_dir, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_00000600"
    ckpt.mkdir(parents=True)
    (ckpt / "client_state.json").write_text(json.dumps({"step": 600}))
    cfg = RootConfig()
    cfg = replace(cfg, train=replace(cfg.train, max_steps=600), log=replace(cfg.log, run_dir=str(run_dir)))
    same = lambda x: x  # noqa: E731  (a world of one: rank 0's object is everyone's)
    assert summary.finished_rerun(cfg, str(ckpt), 0, same) is None  # no summary.json: the run writes one
    (run_dir / "summary.json").write_text(json.dumps(_summary(steps=500)))
    assert summary.finished_rerun(cfg, str(ckpt), 0, same) is None  # another step's summary
    (run_dir / "summary.json").write_text(json.dumps(_summary()))
    longer = replace(cfg, train=replace(cfg.train, max_steps=800))
    assert summary.finished_rerun(longer, str(ckpt), 0, same) is None  # steps left to train
    assert summary.finished_rerun(cfg, None, 0, same) is None
    capsys.readouterr()
    assert summary.finished_rerun(cfg, str(ckpt), 0, same) == _summary()
    assert "already finished at step 600: nothing to train" in capsys.readouterr().out
    assert summary.finished_rerun(cfg, str(ckpt), 1, lambda x: True) == {}  # another rank: rank 0's answer


def console_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The lines a terminal would keep: stdout's, and stderr's without the progress bar's redraws."""
    lines = proc.stdout.splitlines()
    for line in proc.stderr.split("\n"):
        kept = [part for part in line.split("\r") if part.strip() and not BAR.match(part)]
        lines += kept[-1:]
    return [line for line in lines if line.strip()]


def summary_block(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("== megagenome pretrain summary"))
    return lines[start:]


@pytest.fixture(scope="module")
def launched(readme_run):
    """The README's default job (`bash launch/local.sh --config configs/tiny.yaml`, 6 steps with 3 evaluations and 3
    checkpoints, launched by the README run of conftest.py) and a rerun of it: (run dir, launch, its summary.json,
    rerun)."""
    first = readme_run.default_job()
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = readme_run.clone / "runs" / "tiny"
    recorded = (run_dir / "summary.json").read_text()
    e = dict(env(), MASTER_PORT=str(free_port()))
    again = subprocess.run(first.args, cwd=readme_run.clone, env=e, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    return run_dir, first, recorded, again


@pytest.mark.slow
def test_the_default_job_console_is_megagenome_lines_and_the_rest_is_in_logs(launched):
    run_dir, first, _, _ = launched
    shown = console_lines(first)
    assert len(shown) <= 15, "\n".join(shown)
    assert not [line for line in shown if console.DS_LINE.match(line)], "\n".join(shown)
    out = first.stdout
    assert "run dir runs/tiny" in out and "megagenome: attention: " in out
    assert [f"step {s}: held-out" in out for s in (2, 4, 6)] == [True] * 3
    assert summary_block(out)[-1].startswith("wall time ") and "Warning" not in first.stderr
    launcher = (run_dir / "logs" / "launcher.log").read_text()
    assert "Setting CUDA_VISIBLE_DEVICES" in launcher and "spawned with command" in launcher
    assert "Unable to find hostfile" in launcher
    rank0 = (run_dir / "logs" / "rank0.log").read_text()
    assert "begin bf16_optimizer" in rank0 and "DeepSpeed info: version=" in rank0
    assert "FutureWarning" in rank0 or "FutureWarning" in (run_dir / "logs" / "rank1.log").read_text()


@pytest.mark.slow
def test_a_rerun_of_the_finished_run_reports_it_as_it_was(launched):
    run_dir, first, recorded, again = launched
    assert (run_dir / "summary.json").read_text() == recorded  # not rewritten with the rerun's wall time
    assert f"megagenome: {run_dir} already finished at step {STEPS}: nothing to train" in again.stdout
    assert summary_block(again.stdout) == summary_block(first.stdout)  # the finished run's numbers, all of them
    assert "resumed from" not in again.stdout  # no engine built, no checkpoint loaded
    assert len(console_lines(again)) <= 12, "\n".join(console_lines(again))


def test_python_m_pretrain_prints_only_megagenomes_lines(tmp_path):
    """`python -m megagenome pretrain` outside launch/local.sh: no DeepSpeed "Setting accelerator to CPU ... unable to
    detect it" (cli sets DS_ACCELERATOR=cpu where DeepSpeed would fall back to it) and no scheduler warning."""
    from support.helpers import DATA, cli, tiny_config, write_yaml

    cfg = tiny_config(tmp_path, str(DATA / "phiX174_NC_001422.1.fna"), tmp_path / "run", train__max_steps=2,
                      train__eval_interval=0, checkpoint__interval=0)  # fmt: skip
    proc = cli("pretrain", "--config", write_yaml(tmp_path / "c.yaml", cfg), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "== megagenome pretrain summary" in out
    assert "Setting accelerator to CPU" not in out and "before it has started" not in out, out[-3000:]


def test_commands_keep_torchaos_import_noise_off_the_console():
    """peft and transformers import torchao, which logs every CUDA-only kernel library it cannot load ("Failed to load
    ..._C_mxfp8...so") and makes torch log a deprecation per enum: a command (cli.run_command) keeps both off the
    console. The command here is a stand-in whose main imports peft, as finetune --model.lora does."""
    from support.helpers import PYTHON, REPO

    code = (
        "import sys\nfrom megagenome import cli\n"
        "class M:\n    @staticmethod\n    def main(parsed):\n        import peft  # noqa\n        return 0\n"
        "cli.command_module = lambda name: M\nsys.exit(cli.run_command('embed', cli.Parsed(None, None, [])))\n"
    )
    proc = subprocess.run([PYTHON, "-c", code], cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Failed to load" not in proc.stderr and "register_constant" not in proc.stderr, proc.stderr
    bare = subprocess.run([PYTHON, "-c", "import peft"], cwd=REPO, env=env(), capture_output=True, text=True)
    assert "Failed to load" in bare.stderr or "register_constant" in bare.stderr  # what is kept off, without it
