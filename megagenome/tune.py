"""`megagenome find-micro-batch`: the largest micro batch that fits on one device, and the gradient accumulation
it implies for a run's global batch (layer L4).

The search trains for real: the run's model, data and DeepSpeed JSON, `--steps` optimizer steps per trial, for
micro = 1, 2, 4, ... up to --max_micro, then a binary search between the last micro batch that fitted and the first
that did not. Each trial is a child process, `python -m megagenome pretrain` in a world of one with a temporary run
directory (trial_config), so

- an out-of-memory error ends only that child, and is read from its exit status and output: torch.OutOfMemoryError
  on a GPU, the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory"), or SIGKILL from the
  kernel's out-of-memory killer;
- every trial starts from an empty device and its peak is its own: the largest mem_peak_bytes_max of its
  metrics.jsonl rows (the CUDA allocator's peak, or the peak RSS of the process on CPU).

Why not one process: measured on CPU, two pretrain.run calls at micro 8 then one at micro 1 in one process freed
their engines after gc (RSS back to ~352 MiB each time), but the peak RSS (ru_maxrss) is a high-water mark that
cannot be reset, so every later trial would report the first large trial's peak; on a GPU a caught out-of-memory
error leaves the caching allocator fragmented, and a fresh process is the only clean slate for the next trial.

A trial that trains but peaks above the memory budget counts as not fitting: a budget, not an out-of-memory error.
The budget defaults to the device's memory on a GPU (so only a real out-of-memory error ends the search there) and
to none on CPU, where memory is the machine's and an allocation rarely fails: on CPU, --memory_budget_gb is the way
to end the search before --max_micro.

Single-process assumption: the trials run one rank holding the whole model state (16 bytes per parameter with
mixed-precision Adam). With ZeRO >= 1 and more data-parallel ranks, each rank holds a share of that state and
the activations per rank are the same, so a micro batch that fits here fits on every rank of a larger run: the
answer is conservative. Model parallelism (tensor, pipeline, sequence) needs several processes and is refused.

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
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from megagenome.config import ConfigError, RootConfig, to_dict
from megagenome.record import write_json, write_yaml

GiB = 2**30
PROG = "megagenome find-micro-batch"

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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    rows = _train_rows(os.path.join(run_dir, "metrics.jsonl"))
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
        trial.detail = f"peak {_gib(trial.peak_bytes)} > budget {_gib(budget_bytes)}"
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
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as fh:
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


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def search(trial: Callable[[int], Trial], max_micro: int, log: Callable[[str], None] = print) -> tuple[int, list]:
    """(largest micro batch that fits, every Trial in the order run): micro = 1, 2, 4, ... while they fit (and
    max_micro itself when it is no power of two), then a binary search between the last fit and the first failure.
    0 when even micro 1 does not fit. Raises TrialError when a trial fails for another reason than memory."""
    trials: list[Trial] = []

    def fits(micro: int) -> bool:
        result = trial(micro)
        trials.append(result)
        log(describe(result))
        if result.outcome not in (FITS, *NOT_FITTING):
            raise TrialError(result)
        return result.fits

    best, failed, micro = 0, None, 1
    while micro <= max_micro:
        if not fits(micro):
            failed = micro
            break
        best, micro = micro, micro * 2
    if failed is None and best < max_micro:
        if fits(max_micro):
            best = max_micro
        else:
            failed = max_micro
    if best and failed is not None:
        low, high = best, failed
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        best = low
    return best, trials


def describe(t: Trial) -> str:
    """One line of the search log."""
    if t.fits:
        speed = f", {t.tokens_per_s:,.0f} tokens/s" if t.tokens_per_s else ""
        return f"micro {t.micro}: fits (peak {_gib(t.peak_bytes)}{speed}, {t.wall_s:.0f} s)"
    if t.outcome == OVER_BUDGET:
        return f"micro {t.micro}: does not fit: over the memory budget ({t.detail}; it trained: no out-of-memory error)"
    if t.outcome in (OOM, KILLED):
        return f"micro {t.micro}: does not fit: {t.outcome} ({t.detail})"
    return f"micro {t.micro}: {t.outcome} (exit status {t.returncode})"


def accumulation(global_batch: int, micro: int, dp: int) -> dict:
    """Gradient accumulation for `global_batch` = micro x accumulation x dp, with the nearest valid alternatives
    when it does not divide: the largest micro batch <= micro that divides it, and the nearest global batch that
    micro x dp divides."""
    per_step = micro * dp
    out: dict = {"global_batch": global_batch, "micro": micro, "data_parallel": dp}
    if global_batch % per_step == 0:
        return {**out, "grad_accum": global_batch // per_step, "divisible": True}
    out.update(grad_accum=None, divisible=False)
    if global_batch % dp == 0:
        smaller = next(m for m in range(micro, 0, -1) if (global_batch // dp) % m == 0)
        out["smaller_micro"] = {"micro": smaller, "grad_accum": global_batch // (smaller * dp)}
    below = global_batch // per_step * per_step
    above = below + per_step
    nearest = above if below == 0 or above - global_batch < global_batch - below else below
    out["nearest_global_batch"] = {"global_batch": nearest, "grad_accum": nearest // per_step}
    return out


def flag_problems(max_micro: int, steps: int, memory_budget_gb: float | None, data_parallel: int | None) -> list[str]:
    problems = []
    if max_micro < 1:
        problems.append(f"--max_micro={max_micro}: must be positive")
    if steps < 1:
        problems.append(f"--steps={steps}: must be positive")
    if memory_budget_gb is not None and not memory_budget_gb > 0:
        problems.append(f"--memory_budget_gb={memory_budget_gb:g}: must be positive (GiB)")
    if data_parallel is not None and data_parallel < 1:
        problems.append(f"--data_parallel={data_parallel}: must be positive")
    return problems


def _device() -> tuple[str, int | None]:
    """(description, memory in bytes or None) of the device a trial trains on."""
    import torch

    if torch.cuda.is_available():
        # Properties only: no CUDA context is created here, so the children get the whole device.
        props = torch.cuda.get_device_properties(0)
        return f"cuda:0 ({props.name}, {_gib(props.total_memory)})", int(props.total_memory)
    return "cpu", None


def find_micro_batch(
    cfg: RootConfig,
    config_files: list[str],
    *,
    max_micro: int = 64,
    steps: int = 2,
    memory_budget_gb: float | None = None,
    data_parallel: int | None = None,
    json_out: str | None = None,
    work_dir: str | None = None,
) -> int:
    """The body of `megagenome find-micro-batch`; returns the exit status (0 found, 1 none fits or a trial failed,
    2 bad flags or config). The search log goes to stderr, the table and the answer to stdout."""

    def err(message: str) -> None:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)

    problems = flag_problems(max_micro, steps, memory_budget_gb, data_parallel)
    if os.environ.get("RANK", "0") != "0" or int(os.environ.get("LOCAL_RANK", "0") or 0) != 0:
        problems.append("run it as one plain process, not under a launcher: it starts one process per trial itself")
    for name in ("tensor", "pipeline", "sequence"):
        degree = getattr(cfg.parallel, name)
        if degree > 1:
            problems.append(
                f"--parallel.{name}={degree}: the search trains in one process, and this degree needs {degree}; "
                "search with it at 1 (splitting the model only shrinks what each rank holds: a conservative answer)"
            )
    if problems:
        for p in problems:
            err(f"error: {p}")
        return 2
    dp = data_parallel or int(os.environ.get("WORLD_SIZE", "1") or 1)
    base = trial_config(cfg, steps)
    work = tempfile.mkdtemp(prefix="mg-find-micro-", dir=work_dir)
    try:
        from megagenome import pretrain

        probe = dataclasses.replace(base, log=dataclasses.replace(base.log, run_dir=os.path.join(work, "validate")))
        probe = dataclasses.replace(probe, train=dataclasses.replace(probe.train, micro_batch_size=1))
        try:
            pretrain.prepare(probe, config_files, world_size=1).data.close()
        except ConfigError as e:
            err(f"error: {e}")
            return 2
        device, device_bytes = _device()
        if memory_budget_gb is not None:
            budget, budget_source = int(memory_budget_gb * GiB), "--memory_budget_gb"
        elif device_bytes is not None:
            budget, budget_source = device_bytes, "the device's memory"
        else:
            budget, budget_source = None, "none (CPU): only an allocation failure or --max_micro ends the search"
        shown = f"{_gib(budget)} ({budget_source})" if budget is not None else budget_source
        err(f"{steps} step(s) per trial in one process on {device}, micro batches up to {max_micro}; budget {shown}")

        def trial(micro: int) -> Trial:
            return run_trial(base, micro, work, budget_bytes=budget, warmup=1 if steps > 1 else 0)

        try:
            best, trials = search(trial, max_micro, log=err)
        except TrialError as e:
            err(f"error: {e}")
            return 2 if e.trial.outcome == "config error" else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    t = cfg.train
    if t.global_batch_size is not None:
        global_batch, source = t.global_batch_size, "--train.global_batch_size"
    else:
        global_batch = t.micro_batch_size * t.grad_accum_steps * dp
        source = f"--train.micro_batch_size {t.micro_batch_size} x --train.grad_accum_steps {t.grad_accum_steps} x {dp}"
    accum = accumulation(global_batch, best, dp) if best else None
    result = {
        "config_files": config_files,
        "device": device,
        "steps_per_trial": steps,
        "max_micro": max_micro,
        "budget_bytes": budget,
        "budget_source": budget_source,
        "trials": [dataclasses.asdict(x) for x in trials],
        "largest_micro_batch": best,
        "global_batch_source": source,
        "accumulation": accum,
        "single_process": "one rank holds the whole model state; with ZeRO >= 1 over more ranks the answer is "
        "conservative (fits on one rank => fits on more)",
    }
    print(report(result, global_batch, dp))
    if json_out:
        write_json(json_out, result)
    return 0 if best else 1


def report(result: dict, global_batch: int, dp: int) -> str:
    """The table of trials and the answer, as printed."""
    lines = [f"{'micro':>6}  {'fits':<4}  {'peak memory':>11}  {'tokens/s':>10}  outcome"]
    for t in sorted(result["trials"], key=lambda t: t["micro"]):
        speed = f"{t['tokens_per_s']:,.0f}" if t["tokens_per_s"] else "-"
        outcome = t["outcome"] + (f": {t['detail']}" if t["outcome"] in (OVER_BUDGET, OOM, KILLED) else "")
        lines.append(
            f"{t['micro']:>6}  {'yes' if t['outcome'] == FITS else 'no':<4}  {_gib(t['peak_bytes']):>11}  "
            f"{speed:>10}  {outcome}"
        )
    best = result["largest_micro_batch"]
    budget = result["budget_bytes"]
    limit = f"a memory budget of {_gib(budget)} ({result['budget_source']})" if budget else result["budget_source"]
    if not best:
        lines += [
            "",
            f"Even micro batch 1 does not fit within {limit}. Reduce memory per rank: ZeRO-2/3 "
            "(ds_configs/zero3.json), offload (ds_configs/zero3_offload.json), --model.checkpointing full, a shorter "
            "--data.seq_len, or tensor/sequence parallelism over several GPUs.",
        ]
        return "\n".join(lines)
    ceiling = " (the --max_micro ceiling)" if best == result["max_micro"] else ""
    lines += ["", f"Largest micro batch that fits: {best}{ceiling}, within {limit}."]
    a = result["accumulation"]
    where = f"global batch {global_batch} ({result['global_batch_source']}) at data-parallel size {dp}"
    if a["divisible"]:
        lines.append(
            f"For the {where}: --train.micro_batch_size {best} --train.grad_accum_steps {a['grad_accum']} "
            f"({best} x {a['grad_accum']} x {dp} = {global_batch})."
        )
    else:
        lines.append(f"The {where} is not divisible by micro {best} x data-parallel {dp} = {best * dp}. Nearest valid:")
        if "smaller_micro" in a:
            s = a["smaller_micro"]
            lines.append(
                f"  --train.micro_batch_size {s['micro']} --train.grad_accum_steps {s['grad_accum']} "
                f"({s['micro']} x {s['grad_accum']} x {dp} = {global_batch}), or"
            )
        n = a["nearest_global_batch"]
        lines.append(
            f"  --train.micro_batch_size {best} --train.grad_accum_steps {n['grad_accum']} "
            f"--train.global_batch_size {n['global_batch']} ({best} x {n['grad_accum']} x {dp})"
        )
    lines.append(
        "Measured in one process holding the whole model state: with ZeRO >= 1 over more ranks each holds less, "
        "so this micro batch fits there too (conservative)."
    )
    return "\n".join(lines)
