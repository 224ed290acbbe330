"""`megagenome find-micro-batch`: the largest micro batch that fits on one device, and the gradient accumulation
it implies for a run's global batch (layer L4).

The search trains for real (trials.py: each trial a child process, `python -m megagenome pretrain` in a world of
one): the run's model, data and DeepSpeed JSON, `--steps` optimizer steps per trial, for micro = 1, 2, 4, ... up to
--max_micro, then a binary search between the last micro batch that fitted and the first that did not.

A trial that trains but peaks above the memory budget counts as not fitting: a budget, not an out-of-memory error.
The budget defaults to the device's memory on a GPU (so only a real out-of-memory error ends the search there) and
to none on CPU, where memory is the machine's and an allocation rarely fails: on CPU, --memory_budget_gb is the way
to end the search before --max_micro.

Single-process assumption: the trials run one rank holding the whole model state (16 bytes per parameter with
mixed-precision Adam). With ZeRO >= 1 and more data-parallel ranks, each rank holds a share of that state and
the activations per rank are the same, so a micro batch that fits here fits on every rank of a larger run: the
answer is conservative. Model parallelism (tensor, pipeline, sequence) needs several processes and is refused.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Callable

from megagenome.config import ConfigError, RootConfig
from megagenome.observe.record import write_json
from megagenome.parallel.layout import ParallelLayout
from megagenome.run import assembly
from megagenome.run.trials import (
    FITS,
    KILLED,
    NOT_FITTING,
    OOM,
    OVER_BUDGET,
    GiB,
    Trial,
    TrialError,
    describe,
    gib,
    run_trial,
    trial_config,
)

PROG = "megagenome find-micro-batch"


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
        return f"cuda:0 ({props.name}, {gib(props.total_memory)})", int(props.total_memory)
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
    problems = flag_problems(max_micro, steps, memory_budget_gb, data_parallel) + _layout_problems(cfg)
    if problems:
        for p in problems:
            _err(f"error: {p}")
        return 2
    # The run the answer is for: data_parallel ranks of one whole model each (model parallelism is refused above).
    target = ParallelLayout(world_size=data_parallel or int(os.environ.get("WORLD_SIZE", "1") or 1))
    base = trial_config(cfg, steps)
    work = tempfile.mkdtemp(prefix="mg-find-micro-", dir=work_dir)
    try:
        probe = dataclasses.replace(base, log=dataclasses.replace(base.log, run_dir=os.path.join(work, "validate")))
        probe = dataclasses.replace(probe, train=dataclasses.replace(probe.train, micro_batch_size=1))
        try:  # the trials' own validation, in their world of one, before the first child starts
            assembly.validate(probe, config_files, world_size=1).data.close()
        except ConfigError as e:
            _err(f"error: {e}")
            return 2
        device, device_bytes = _device()
        budget, budget_source = _budget(memory_budget_gb, device_bytes)
        shown = f"{gib(budget)} ({budget_source})" if budget is not None else budget_source
        _err(f"{steps} step(s) per trial in one process on {device}, micro batches up to {max_micro}; budget {shown}")

        def trial(micro: int) -> Trial:
            return run_trial(base, micro, work, budget_bytes=budget, warmup=1 if steps > 1 else 0)

        try:
            best, trials = search(trial, max_micro, log=_err)
        except TrialError as e:
            _err(f"error: {e}")
            return 2 if e.trial.outcome == "config error" else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    t, dp = cfg.train, target.data_parallel
    global_batch = target.global_batch(t)
    source = (
        "--train.global_batch_size"
        if t.global_batch_size is not None
        else f"--train.micro_batch_size {t.micro_batch_size} x --train.grad_accum_steps {t.grad_accum_steps} x {dp}"
    )
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
        "accumulation": accumulation(global_batch, best, dp) if best else None,
        "single_process": "one rank holds the whole model state; with ZeRO >= 1 over more ranks the answer is "
        "conservative (fits on one rank => fits on more)",
    }
    print(report(result, global_batch, dp))
    if json_out:
        write_json(json_out, result)
    return 0 if best else 1


def _err(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _layout_problems(cfg: RootConfig) -> list[str]:
    """The search runs as one plain process, and each trial in a world of one."""
    problems = []
    if os.environ.get("RANK", "0") != "0" or int(os.environ.get("LOCAL_RANK", "0") or 0) != 0:
        problems.append("run it as one plain process, not under a launcher: it starts one process per trial itself")
    for name in ("tensor", "pipeline", "sequence"):
        degree = getattr(cfg.parallel, name)
        if degree > 1:
            problems.append(
                f"--parallel.{name}={degree}: the search trains in one process, and this degree needs {degree}; "
                "search with it at 1 (splitting the model only shrinks what each rank holds: a conservative answer)"
            )
    return problems


def _budget(memory_budget_gb: float | None, device_bytes: int | None) -> tuple[int | None, str]:
    """(the peak above which a trial does not fit, or None; where that figure comes from)."""
    if memory_budget_gb is not None:
        return int(memory_budget_gb * GiB), "--memory_budget_gb"
    if device_bytes is not None:
        return device_bytes, "the device's memory"
    return None, "none (CPU): only an allocation failure or --max_micro ends the search"


def report(result: dict, global_batch: int, dp: int) -> str:
    """The table of trials and the answer, as printed."""
    lines = [f"{'micro':>6}  {'fits':<4}  {'peak memory':>11}  {'tokens/s':>10}  outcome"]
    for t in sorted(result["trials"], key=lambda t: t["micro"]):
        speed = f"{t['tokens_per_s']:,.0f}" if t["tokens_per_s"] else "-"
        outcome = t["outcome"] + (f": {t['detail']}" if t["outcome"] in (OVER_BUDGET, OOM, KILLED) else "")
        lines.append(
            f"{t['micro']:>6}  {'yes' if t['outcome'] == FITS else 'no':<4}  {gib(t['peak_bytes']):>11}  "
            f"{speed:>10}  {outcome}"
        )
    best = result["largest_micro_batch"]
    budget = result["budget_bytes"]
    limit = f"a memory budget of {gib(budget)} ({result['budget_source']})" if budget else result["budget_source"]
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
