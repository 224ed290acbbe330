"""Training trials (layer L4): one short `megagenome pretrain` in a child process, measured and classified.

`megagenome find-micro-batch` (tune.py) searches with them, and benchmarks/sweep.py and benchmarks/gpu_check.py
measure with them. A trial is `python -m megagenome pretrain` in a world of one with a temporary run directory
(trial_config), so

- an out-of-memory error ends only that child, and is read from its exit status and output: torch.OutOfMemoryError
  on a GPU, the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory"), or SIGKILL from the
  kernel's out-of-memory killer;
- every trial starts from an empty device and its peak is its own: the largest mem_peak_bytes_max of its
  metrics.jsonl rows (the CUDA allocator's peak, or the peak RSS of the process on CPU).

Why not one process: measured on CPU, two pretrain.run calls at micro 8 then one at micro 1 in one process freed
their engines after gc (RSS back to ~352 MiB each time), but the peak RSS (ru_maxrss) is a high-water mark that
cannot be reset, so every later trial would report the first large trial's peak; on a GPU a caught out-of-memory
error leaves the caching allocator fragmented, and a fresh process is the only clean slate for the next trial.

A trial that trains but peaks above a memory budget counts as not fitting: a budget, not an out-of-memory error.
Each trial also runs what every run does at its last step: one batch of held-out windows and a checkpoint (16 bytes
per parameter on disk, deleted with the trial's run directory).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import megagenome
from megagenome.config import RootConfig, to_dict
from megagenome.files.run_files import METRICS, SUMMARY
from megagenome.observe.record import write_yaml

GiB = 2**30

# Environment of the deepspeed/torchrun launchers: a trial must not try to join the caller's world.
LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)

# What an out-of-memory error prints: torch.OutOfMemoryError on CUDA/ROCm, cuBLAS failing to get its workspace,
# and the CPU allocator ("[enforce fail at alloc_cpu.cpp] . DefaultCPUAllocator: can't allocate memory").
_OOM = re.compile(
    r"OutOfMemoryError|CUDA out of memory|HIP out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|"
    r"DefaultCPUAllocator|can't allocate memory|Cannot allocate memory"
)

FITS, OVER_BUDGET, OOM, KILLED = "fits", "over budget", "out of memory", "killed"
NOT_FITTING = (OVER_BUDGET, OOM, KILLED)  # outcomes that answer "no"; anything else stops the search


@dataclass
class Trial:
    """One micro batch size tried: what happened and what it measured."""

    micro: int
    outcome: str  # FITS, OVER_BUDGET, OOM, KILLED; or "config error", "error", "timeout" (no answer)
    peak_bytes: int | None = None
    tokens_per_s: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    peak_tflops: float | None = None
    peak_source: str | None = None
    parameters: int | None = None
    wall_s: float = 0.0
    returncode: int | None = None
    detail: str = ""  # the out-of-memory line, or the end of the output of a failed trial

    @property
    def fits(self) -> bool:
        return self.outcome == FITS


class TrialError(RuntimeError):
    """A trial failed for another reason than memory: the search has no answer."""

    def __init__(self, trial: Trial):
        self.trial = trial
        super().__init__(f"micro batch {trial.micro}: {trial.outcome} (exit status {trial.returncode})\n{trial.detail}")


def trial_config(cfg: RootConfig, steps: int, grad_accum: int = 1) -> RootConfig:
    """`cfg` as a short trial: `steps` optimizer steps of `grad_accum` micro batches, a metrics row per step, no
    global batch check, no evaluation or checkpoint before the last step (one held-out batch then), no resume, no
    progress bar. run_trial sets the micro batch size and the run directory."""
    r = dataclasses.replace
    return r(
        cfg,
        train=r(
            cfg.train,
            grad_accum_steps=grad_accum,
            global_batch_size=None,
            max_steps=steps,
            stop_at=None,
            warmup_steps=0,
            log_interval=1,
            eval_interval=0,
        ),
        data=r(cfg.data, eval_windows=1),
        checkpoint=r(cfg.checkpoint, interval=0, resume="none"),
        log=r(cfg.log, progress=False),
    )


def child_env() -> dict:
    """The environment of a trial: this one without launcher variables, with this package importable."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    root = os.path.dirname(os.path.dirname(os.path.abspath(megagenome.__file__)))  # the package's parent
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_child(cmd: list[str], log_path: str, env: dict, timeout: float | None) -> tuple[int | None, bool]:
    """Run cmd with its output in log_path, in a session of its own so that a timeout or an interrupt ends it and
    anything it started (DeepSpeed's op builds). Returns (exit status, timed out)."""
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None, True
        except BaseException:
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _median(values: list[float | None]) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def run_trial(
    cfg: RootConfig,
    micro: int,
    work_dir: str,
    *,
    budget_bytes: int | None = None,
    warmup: int = 1,
    timeout: float | None = None,
    name: str | None = None,
) -> Trial:
    """Train `cfg` (a trial_config) at micro batch `micro` in a child process; classify and measure the result.

    tokens/s, TFLOP/s and MFU are medians over the steps after the first `warmup` (all steps if there are no
    more). The trial's run directory is deleted afterwards; its output stays in <work_dir>/<name>.log."""
    name = name or f"micro{micro}"
    run_dir = os.path.join(work_dir, name)
    config_path = os.path.join(work_dir, f"{name}.yaml")
    log_path = os.path.join(work_dir, f"{name}.log")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(work_dir, exist_ok=True)
    trial_cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, micro_batch_size=micro),
        log=dataclasses.replace(cfg.log, run_dir=run_dir),
    )
    write_yaml(config_path, to_dict(trial_cfg))
    started = time.time()
    cmd = [sys.executable, "-m", "megagenome", "pretrain", "--config", config_path]
    rc, timed_out = run_child(cmd, log_path, child_env(), timeout)
    wall = time.time() - started
    with open(log_path, encoding="utf-8", errors="replace") as fh:
        output = fh.read()
    rows = _train_rows(os.path.join(run_dir, METRICS))
    parameters = _parameters(run_dir, output)
    shutil.rmtree(run_dir, ignore_errors=True)
    peaks = [r.get("mem_peak_bytes_max") or r.get("mem_peak_bytes") for r in rows]
    timed = rows[warmup:] or rows
    trial = Trial(
        micro=micro,
        outcome=FITS,
        peak_bytes=max((p for p in peaks if p), default=None),
        tokens_per_s=_median([r.get("tokens_per_s") for r in timed]),
        tflops_per_gpu=_median([r.get("tflops_per_gpu") for r in timed]),
        mfu=_median([r.get("mfu") for r in timed]),
        peak_tflops=rows[-1].get("peak_tflops") if rows else None,
        peak_source=rows[-1].get("peak_source") if rows else None,
        parameters=parameters,
        wall_s=wall,
        returncode=rc,
    )
    if timed_out:
        trial.outcome, trial.detail = "timeout", f"stopped after {timeout:.0f} s\n{_tail(output)}"
    elif rc != 0:
        oom = oom_line(output)
        if oom:
            trial.outcome, trial.detail = OOM, oom
        elif rc == -signal.SIGKILL:
            trial.outcome = KILLED
            trial.detail = "killed by SIGKILL (on Linux most likely the kernel's out-of-memory killer)"
        else:
            trial.outcome = "config error" if rc == 2 else "error"
            trial.detail = _tail(output)
    elif not rows:
        trial.outcome, trial.detail = "error", "the trial wrote no metrics rows\n" + _tail(output)
    elif budget_bytes is not None and trial.peak_bytes is not None and trial.peak_bytes > budget_bytes:
        trial.outcome = OVER_BUDGET
        trial.detail = f"peak {gib(trial.peak_bytes)} > budget {gib(budget_bytes)}"
    return trial


def _train_rows(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []
    return [r for r in rows if "split" not in r]


def _parameters(run_dir: str, output: str) -> int | None:
    try:
        with open(os.path.join(run_dir, SUMMARY), encoding="utf-8") as fh:
            return int(json.load(fh)["parameters"])
    except (OSError, ValueError, KeyError, TypeError):
        m = re.search(r"megagenome: ([\d,]+) parameters", output)  # printed before training starts
        return int(m.group(1).replace(",", "")) if m else None


def oom_line(output: str) -> str | None:
    """The line of a process's output that reports an out-of-memory error (CUDA or CPU allocator), or None."""
    m = _OOM.search(output)
    return None if m is None else _line_at(output, m.start())


def _line_at(text: str, index: int) -> str:
    """The line of text holding position index (an error message), shortened to 300 characters."""
    end = text.find("\n", index)
    return text[text.rfind("\n", 0, index) + 1 : end if end >= 0 else len(text)].strip()[:300]


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def describe(t: Trial) -> str:
    """One line of the search log."""
    if t.fits:
        speed = f", {t.tokens_per_s:,.0f} tokens/s" if t.tokens_per_s else ""
        return f"micro {t.micro}: fits (peak {gib(t.peak_bytes)}{speed}, {t.wall_s:.0f} s)"
    if t.outcome == OVER_BUDGET:
        return f"micro {t.micro}: does not fit: over the memory budget ({t.detail}; it trained: no out-of-memory error)"
    if t.outcome in (OOM, KILLED):
        return f"micro {t.micro}: does not fit: {t.outcome} ({t.detail})"
    return f"micro {t.micro}: {t.outcome} (exit status {t.returncode})"
