"""Shared helpers for the tests that run megagenome as a user would: the CLI and the deepspeed launcher, small run
configs, a world of one in this process."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
PYTHON = sys.executable
BIN = pathlib.Path(PYTHON).parent


def copy_genome(name: str, dest: pathlib.Path) -> str:
    """Copy a bundled genome into dest, so a test may alter or index its copy freely."""
    src = DATA / name if (DATA / name).exists() else REPO / "examples" / "data" / name
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / name
    shutil.copy(src, out)
    return str(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    """This environment, with the checkout and tests/ (for `support`) importable and the venv's scripts first."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), e.get("PYTHONPATH", "")])
    e["PATH"] = str(BIN) + os.pathsep + e.get("PATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def write_yaml(path: pathlib.Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """`python -m megagenome ARGS` in a single process."""
    return subprocess.run(
        [PYTHON, "-m", "megagenome", *args], cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout
    )


def launch(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N --module megagenome ARGS`: the real launcher, CPU ranks on gloo."""
    cmd = [
        str(BIN / "deepspeed"),
        "--num_gpus",
        str(nproc),
        "--master_port",
        str(free_port()),
        "--module",
        "megagenome",
        *args,
    ]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def tiny_config(tmp: pathlib.Path, fasta: str, run_dir: pathlib.Path, **overrides) -> dict:
    """A small, fast fp32 run config on phiX174 (5,386 bp, one contig)."""
    cfg = {
        "model": {"d_model": 32, "n_layer": 2, "n_head": 2, "max_seq_len": 128},
        "data": {"fasta": fasta, "seq_len": 64, "val_ranges": ["NC_001422.1:4301-5386"], "eval_windows": 8},
        "train": {
            "ds_config": str(REPO / "ds_configs" / "zero0.json"),
            "micro_batch_size": 2,
            "max_steps": 6,
            "warmup_steps": 2,
            "log_interval": 1,
            "eval_interval": 3,
            "lr": 3e-3,
            "min_lr": 3e-4,
            "num_threads": 1,
        },
        "checkpoint": {"interval": 3, "resume": "auto"},
        "log": {"run_dir": str(run_dir), "progress": False},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        cfg[section][key] = value
    return cfg


SIGNAL_STEPS = 60  # ~50 ms each on 2 CPU ranks: a signal sent after step 2 lands well before the end


def signal_run_config(tmp: pathlib.Path, fasta: str) -> str:
    """A YAML run config (written into tmp) for the checkpoint-signal tests: the tiny config made a little slower
    per step and longer (SIGNAL_STEPS), checkpointing only at the end (and on the signal); run dir tmp/run."""
    cfg = tiny_config(
        tmp,
        fasta,
        tmp / "run",
        train__max_steps=SIGNAL_STEPS,
        train__eval_interval=0,
        train__micro_batch_size=8,
        checkpoint__interval=0,
    )
    cfg["model"].update(d_model=64, n_layer=4)
    cfg["data"]["seq_len"] = 128
    return write_yaml(tmp / "run.yaml", cfg)


@contextlib.contextmanager
def world_of_one():
    """A real gloo process group of one rank in this process (DeepSpeed's checkpointing and PipelineModule need
    one); the group and the launcher variables it sets are undone afterwards."""
    from megagenome.engine import engine

    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    engine.init_distributed()
    try:
        yield
    finally:
        engine.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def final_ds_config(fragment: dict, train=None) -> dict:
    """The dict pretrain would give deepspeed.initialize for a DeepSpeed JSON `fragment`, one rank, the default
    run config's batch, optimizer and schedule (or `train`'s): engine/ds_final.py build_ds_config."""
    from megagenome.config import TrainConfig
    from megagenome.engine.ds_final import build_ds_config
    from megagenome.parallel.layout import ParallelLayout

    train = train or TrainConfig()
    return build_ds_config(fragment, ParallelLayout(1).batch(train), train, universal=False, on_gpu=False)


def run_config(argv: list[str]):
    """(RootConfig, YAML files) of `megagenome pretrain`-style arguments, through the config layer's parser."""
    from megagenome.config.load import config_files, root_config, run_config_parser

    parser = run_config_parser()
    ns = parser.parse_args(list(argv))
    return root_config(parser.instantiate(ns)), config_files(ns)


def cli_here(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """`python -m megagenome ARGS` in this process: megagenome/__main__.py run by runpy as `-m` runs it (it calls
    megagenome.cli.main, whose flag errors return 2), returned as `cli` returns it: CompletedProcess(args,
    returncode, stdout, stderr), the output as text.

    Why: every `cli` is a fresh interpreter that imports torch, jsonargparse and megagenome again, ~4-7 s on a busy
    2-core machine; this process has them imported already. As under `cli`, the working directory is the checkout
    and os.environ is env() (so a child the command starts, like convert-checkpoint's ds_to_universal, gets the
    same environment). sys.stdout and sys.stderr are captured, warnings printed to the latter under the
    interpreter's default filters; a SystemExit becomes the return code (None -> 0, an int -> itself, anything else
    -> 1 with it on stderr, as the interpreter does) and an uncaught exception its traceback on stderr with return
    code 1. A command still running after `timeout` seconds is stopped (SIGALRM) with an error, as `cli`'s would be.
    The working directory, os.environ, sys.argv and the root logger's level and handlers are restored afterwards.

    Use `cli` (a subprocess) instead for a command that starts a process group, a DeepSpeed engine or
    torch.distributed (pretrain that trains, preflight, find-micro-batch, eval, export, ...), installs signal
    handlers, may call os._exit, or changes process-global state it does not undo (torch threads or seeds, logging
    handlers, CUDA); for output written to the file descriptors rather than sys.stdout/sys.stderr (C code, a child
    that inherits them, a logging handler bound to the real stream at import); and wherever the real interpreter
    or console script is the point of the test.
    """
    import io
    import logging
    import runpy
    import signal
    import traceback
    import warnings

    class Timeout(BaseException):  # not an Exception: the command's own handlers do not catch it
        pass

    def alarm(signum, frame):
        raise Timeout(f"cli_here: `megagenome {' '.join(args)}` did not finish within {timeout} s")

    argv = list(args)
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_argv, cwd = dict(os.environ), list(sys.argv), os.getcwd()
    root = logging.getLogger()
    saved_logging = (root.level, list(root.handlers))
    os.environ.clear()
    os.environ.update(env())
    sys.argv = [str(REPO / "megagenome" / "__main__.py"), *argv]
    os.chdir(REPO)
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.resetwarnings()  # the interpreter's default filters, not pytest's
            warnings.filterwarnings("default", category=DeprecationWarning, module="__main__", append=True)
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=category, append=True)
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: err.write(
                warnings.formatwarning(message, category, filename, lineno, line)
            )
            try:
                runpy.run_module("megagenome", run_name="__main__")
                code = 0  # __main__.py always exits; returning is a clean end all the same
            except SystemExit as e:
                code = e.code
            except Exception:
                traceback.print_exc()
                code = 1
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(cwd)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        root.setLevel(saved_logging[0])
        root.handlers[:] = saved_logging[1]
    return subprocess.CompletedProcess(argv, code or 0, out.getvalue(), err.getvalue())
