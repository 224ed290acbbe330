"""GPU check: every package probed first, then the GPU-marked tests, then MFU of megagenome and of a Hugging Face peer
at 125M and ~1B parameters x sequence 2048 / 8192 / 32768 (bf16, one GPU), in one command under 8 minutes.

What it does (every step inside --budget_s, default 450 s; a cell that cannot finish in the time left is skipped and
recorded as skipped, with the reason):

0. Imports every package megagenome and DeepSpeed need (PROBE_REQUIRED: deepspeed, psutil, msgpack, einops,
   py-cpuinfo, ninja, hjson, pydantic, packaging, tqdm, jsonargparse, pyfaidx, numpy, PyYAML, torch, ...) before
   anything else; one line per missing package with its pip name, and exit status 3 when a needed one is missing.
   Optional ones (pytest for step 1, transformers for the peer, flash-attn, FlashAttention-3) are reported and their
   steps skipped with the reason.
1. `pytest -m gpu -v` on the test files that hold GPU-marked tests (gpu_test_files: flash-attn and the fused paths
   against eager on the GPU, DeepSpeed fp16 loss scaling, ...); passed/failed/skipped counts and the failures' names.
2. megagenome cells (gpu_check_cells.py): `python -m megagenome pretrain` with configs/dna_1b.yaml or
   configs/dna_125m.yaml at seq 8192, 32768, 2048, their DeepSpeed JSON (ds_configs/zero2_bf16.json: bf16, fp32
   gradient accumulation and master weights), --model.attention auto (the fastest backend installed: FA3, cuDNN
   attention, flash-attn, SDPA; each cell records auto's choice, as its start-up line names it: SDPA may still fall
   back from cuDNN to another kernel for a shape cuDNN refuses, silently), torch's fused AdamW (build_ds_config's GPU
   default: nothing is JIT-built), 5 warm-up + 10 timed optimizer steps of one micro batch each, with a metrics row,
   and so a wait for the GPU (train/sync_points.py), only every 5 steps. The goal cells (1B at 8192 and 32768) come
   first, then the goal cell with --model.compile true; then the rest, the StripedHyena 2 cells last
   (configs/striped_1b.yaml, Evo 2 1B's shape, at 8192 and 32768: FFT convolutions and attention stripes; their MFU
   from the family's own FLOP count, model/hyena/costs.py). A cell's child process is ended as soon as its timed rows
   are written, so no held-out evaluation and no checkpoint (~16 GB at 1B) happens in or after it; tokens/s is that of
   the 2 timed rows (their tokens over their wall time, each from one sync point to the next).
3. Hugging Face peer cells of the same shapes: transformers' LlamaForCausalLM (vocabulary 8, width, layers, heads,
   SwiGLU width and tied embeddings as ours), "flash_attention_2" where flash-attn imports, else "sdpa"; fp32
   weights under bf16 autocast, fused AdamW, clipping at 1.0, random DNA tokens, the micro batch megagenome fitted.

MFU in two conventions (observe/metrics.py flops_per_token): causal attention counted at half, as Megatron-LM counts
it (6N + 6*L*d*s per token: the headline and the goal's), and every score counted (PaLM: 6N + 12*L*d*s); the peak is
the datasheet dense bf16 value of observe/metrics.py PEAK_TFLOPS for the device name torch reports ("NVIDIA H200":
H200 SXM, 989 TFLOP/s; "NVIDIA H200 NVL": 835). Micro batch per cell: an estimate, not a search: the largest power of
two whose activations (61 x d_model bytes per token per layer in bf16, measured on this model's Block with
saved-tensor hooks, x 1.25 for transient buffers) and model states (20 bytes per parameter) fit in 85% of the GPU's
memory, capped at 65,536 tokens; halved after an out-of-memory error while time allows.

Goals (issue 14, Megatron's causal convention): at least 45% MFU for megagenome 1B at 8192 and at least 35% at 32768
on an H100/H200-class GPU. Results: gpu_check.json and gpu_check.md in --out (default: $OUT when set, else
benchmarks/results/): date, device, versions, every cell, the tests, the verdicts; rewritten after the tests and
after every cell ("complete": false until the end), and a cell that raises is recorded with status "error".

Running it on a lent GPU machine (one command, under 8 minutes). The machine's image has torch, transformers and
pytest but not deepspeed, jsonargparse, pyfaidx or their needs, and nothing can be downloaded there, so carry wheels
(CPython 3.12, x86-64). Once, here, in the repository root:

    echo /.whl/ >> .git/info/exclude
    pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8   # pure Python: no ops compiled
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 pyfaidx==0.9.2.2 biopython==1.88 \\
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0 \\
        einops==0.8.2 msgpack==1.2.4 psutil==7.2.2 py-cpuinfo==9.0.0 ninja==1.13.2 mambapy==1.2.0

Then one run with carry [".whl"] and timeout_s 540:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT

Step 0 names anything still missing (numpy, packaging, tqdm and PyYAML come with the image's torch and
transformers). flash-attn is not in that image and needs a wheel built for its torch and CUDA: without it the cells
run cuDNN attention or SDPA and the results say which.

On CPU, `--smoke` runs the same steps at tiny shapes (sequence 64, 128, 256), SDPA, 2 warm-up + 2 timed steps in
rows of 2, no GPU tests, and the peer cells only if transformers is installed: tests/test_gpu_check.py runs it.

    python benchmarks/gpu_check.py [--out DIR] [--budget_s 450] [--smoke] [--skip_tests] [--log_interval 5]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):  # run as a script from a checkout that is not installed
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import harness  # noqa: E402  (standard library only: safe before the package probe)

# (import name, pip name): what `megagenome pretrain` and DeepSpeed 0.19.8 import or call on a GPU run (DeepSpeed's
# own requirements, megagenome's, and what those import at start-up).
PROBE_REQUIRED = [
    ("torch", "torch"),
    ("numpy", "numpy"),
    ("yaml", "PyYAML"),
    ("tqdm", "tqdm"),
    ("packaging", "packaging"),
    ("psutil", "psutil"),
    ("msgpack", "msgpack"),
    ("einops", "einops"),
    ("cpuinfo", "py-cpuinfo"),
    ("ninja", "ninja"),
    ("hjson", "hjson"),
    ("annotated_types", "annotated-types"),
    ("typing_inspection", "typing-inspection"),
    ("pydantic_core", "pydantic-core"),
    ("pydantic", "pydantic"),
    ("docstring_parser", "docstring-parser"),
    ("typeshed_client", "typeshed-client"),
    ("jsonargparse", "jsonargparse"),
    ("pyfaidx", "pyfaidx"),
    ("mambapy", "mambapy"),
    ("deepspeed", "deepspeed"),
]
# (import name, pip name, what is skipped without it)
PROBE_OPTIONAL = [
    ("pytest", "pytest", "step 1, the GPU-marked tests"),
    ("transformers", "transformers", "the Hugging Face peer cells"),
    ("flash_attn", "flash-attn", "flash-attn 2 (attention auto then runs FA3, cuDNN or SDPA)"),
    ("flash_attn_interface", "flash-attn-3 (FlashAttention-3's hopper/ build)", "FlashAttention-3"),
    ("mamba_ssm", "mamba-ssm", "Caduceus' fused CUDA scan against a float64 loop (tests/test_caduceus_scan.py)"),
]
TESTS_CAP_S = 200
GOALS = [("1B", 8192, 0.45), ("1B", 32768, 0.35)]  # (model, seq, MFU in the causal convention)
HOPPER = ("H100 SXM", "H100 NVL", "H100 PCIe", "H200 SXM", "H200 NVL", "GH200", "H800 SXM", "H800 PCIe")
MISSING_EXIT = 3


def probe_imports() -> tuple[list[dict], list[dict]]:
    """(missing required, missing optional) packages: each {"module", "pip", "error"} (and "skips" for optional
    ones). Imports each for real: a wheel present but broken (a missing shared library, a version clash) fails here
    and not minutes later."""
    missing, optional = [], []
    for module, pip, *skips in [*PROBE_REQUIRED, *PROBE_OPTIONAL]:
        try:
            importlib.import_module(module)
        except Exception as e:  # ImportError, or whatever a broken package raises while importing
            entry = {"module": module, "pip": pip, "error": f"{type(e).__name__}: {e}"[:300]}
            (optional if skips else missing).append({**entry, **({"skips": skips[0]} if skips else {})})
    return missing, optional


def report_probe(missing: list[dict], optional: list[dict]) -> None:
    for m in missing:
        print(f"gpu_check: missing package: pip install {m['pip']}  (import {m['module']}: {m['error']})", flush=True)
    for m in optional:
        print(f"gpu_check: optional package not importable: {m['pip']} ({m['skips']} skipped)", flush=True)
    if missing:
        print(
            f"gpu_check: {len(missing)} needed package(s) missing; install them (the wheel recipe is in this "
            "script's docstring) and run again",
            file=sys.stderr,
            flush=True,
        )


class Clock:
    """The wall-clock budget of the whole check."""

    def __init__(self, budget_s: float):
        self.started = time.monotonic()
        self.deadline = self.started + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def spent(self) -> float:
        return time.monotonic() - self.started


def versions() -> dict:
    out = {"python": platform.python_version()}
    out |= {dist: harness.version(dist) for dist in ("torch", "deepspeed", "flash-attn", "transformers")}
    import torch

    out["cuda"] = torch.version.cuda
    out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return out


def device_info() -> dict:
    """The device the cells run on, with its datasheet peak (observe/metrics.py gpu_peak of its name)."""
    import torch

    from megagenome.observe.metrics import gpu_peak

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found = gpu_peak(props.name)
        return {
            "type": "cuda",
            "name": props.name,
            "memory_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}",
            "peak_tflops": found[1] if found else None,
            "peak_name": found[0] if found else None,
        }
    return {"type": "cpu", "name": harness.cpu(), "memory_bytes": None}


# ----- step 1: the GPU-marked tests ---------------------------------------------------------------------------------

_TEST_LINE = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)
_SKIP_LINE = re.compile(r"^SKIPPED \[\d+\] (.+)$", re.M)


def gpu_test_files() -> list[str]:
    """Test files that hold GPU-marked tests (only those are collected: the rest may need packages the GPU image
    lacks, and a collection error would stop the whole session)."""
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").glob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", p.read_text(encoding="utf-8"))
    )


def run_gpu_tests(clock: Clock, work: pathlib.Path) -> dict:
    from megagenome.run import trials

    files = gpu_test_files()
    timeout = max(1.0, min(TESTS_CAP_S, clock.left() * 0.4))
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider", *files]
    log = work / "gpu_tests.log"
    started = time.monotonic()
    rc, timed_out = trials.run_child(cmd, str(log), trials.child_env(), timeout)
    text = log.read_text(encoding="utf-8", errors="replace")
    outcomes = _TEST_LINE.findall(text)
    counts = {k: sum(1 for _, o in outcomes if o == k.upper()) for k in ("passed", "failed", "error", "skipped")}
    return {
        "status": "timeout" if timed_out else "ran",
        "command": "pytest -m gpu -v -rs " + " ".join(files),
        "exit_status": rc,
        **counts,
        "failures": [name for name, o in outcomes if o in ("FAILED", "ERROR")],
        "skip_reasons": sorted(set(_SKIP_LINE.findall(text))),
        "wall_s": round(time.monotonic() - started, 1),
        "timeout_s": round(timeout),
        "tail": "\n".join(text.rstrip().splitlines()[-15:]) if rc not in (0, 5) or timed_out else "",
    }


# ----- report ---------------------------------------------------------------------------------------------------------


def goals(cells: list[dict], dev: dict, smoke: bool) -> list[dict]:
    """The verdict of each goal (GOALS) on the eager megagenome cell of its shape, in the causal convention."""
    out = []
    for model, seq, target in GOALS:
        cell = next(
            (
                c
                for c in cells
                if (c["impl"], c["variant"], c["model"], c["seq"]) == ("megagenome", "eager", model, seq)
            ),
            None,
        )
        mfu = cell.get("mfu") if cell else None
        if smoke:
            met, note = None, "not applicable: CPU smoke run"
        elif mfu is None:
            met, note = None, "not measured: " + (cell.get("reason", "") if cell else "no such cell")[:300]
        elif dev.get("peak_name") not in HOPPER:
            met, note = None, f"measured on {dev.get('name')}, not an H100/H200-class GPU"
        else:
            met, note = mfu >= target, f"{_pct(mfu)} against {_pct(target)}"
        out.append(
            {"target_mfu": target, "cell": f"megagenome {model} seq {seq}", "mfu": mfu, "met": met, "note": note}
        )
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown(r: dict) -> str:
    dev, v, t, s = r["device"], r["versions"], r["tests"], r["steps"]
    partial = "" if r.get("complete", True) else f", PARTIAL: written after {len(r['cells'])} cells"
    lines = [
        f"# GPU check ({r['date']}{', smoke run on CPU' if r['smoke'] else ''}{partial})",
        "",
        f"Device: {dev['name']}" + (f", {dev['memory_bytes'] / 2**30:.0f} GiB" if dev.get("memory_bytes") else ""),
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"Command: `{r['command']}`; wall time {r['wall_s']:.0f} s of a {r['budget_s']:.0f} s budget.",
        "Packages not importable (optional): " + (", ".join(m["pip"] for m in r["optional_missing"]) or "none") + ".",
        f"Attention: megagenome --model.attention auto, {r['attention']}: what auto picks (the cells' start-up line),"
        " not a record of the kernel: under cuDNN attention torch's SDPA may fall back to flash, efficient or math"
        " attention for a shape cuDNN refuses, silently.",
        f"Steps per cell: {s['warmup']} warm-up + {s['steps']} timed, a metrics row and the loop's only wait for the"
        f" GPU every {s['log_interval']}; tokens/s over the timed rows. {s['note']}".rstrip(),
        f"Micro batch: {r['micro_batch_method']}.",
        "",
        "## GPU-marked tests",
        "",
    ]
    if t["status"] == "skipped":
        lines.append(f"Skipped: {t['reason']}.")
    else:
        lines.append(
            f"`{t['command']}`: {t['passed']} passed, {t['failed']} failed, {t['error']} errors, "
            f"{t['skipped']} skipped in {t['wall_s']:.0f} s ({t['status']}, exit status {t['exit_status']})."
        )
        lines += [f"- failed: {name}" for name in t["failures"]]
        lines += [f"- skipped: {reason}" for reason in t["skip_reasons"]]
    lines += [
        "",
        "## MFU (bf16, one GPU; causal: 6N + 6·L·d·s per token as Megatron-LM counts; full: 6N + 12·L·d·s, PaLM)",
        "",
        "| implementation | model | params | seq | micro | attention (auto's choice) | tokens/s | MFU causal "
        "| MFU full | TFLOP/s causal | peak memory | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(c) for c in r["cells"]]
    for g in r["goals"]:
        verdict = {True: "met", False: "NOT met", None: "not decided"}[g["met"]]
        lines.append(f"\nGoal (>= {_pct(g['target_mfu'])} MFU causal, {g['cell']}): {verdict} ({g['note']}).")
    return "\n".join(lines) + "\n"


def _row(c: dict) -> str:
    ok = c["status"] == "ok"
    impl = c["impl"] + (" (compiled)" if c.get("variant") == "compile" else "")
    attention = c.get("attention_auto_choice") or c.get("attn_implementation") or c.get("attention") or "-"
    row = [
        impl,
        c["model"],
        f"{c['parameters']:,}" if c.get("parameters") else "-",
        str(c["seq"]),
        str(c.get("micro", "-")),
        attention,
        f"{c['tokens_per_s']:,.0f}" if ok else "-",
        _pct(c.get("mfu")) if ok else "-",
        _pct(c.get("mfu_full_attn")) if ok else "-",
        f"{c['tflops_per_gpu']:.3g}" if ok else "-",
        f"{c['peak_mem_bytes'] / 2**30:.1f} GiB" if ok and c.get("peak_mem_bytes") else "-",
        c["status"] if ok else f"{c['status']}: {c.get('reason', '').splitlines()[-1] if c.get('reason') else ''}",
    ]
    return "| " + " | ".join(x.replace("|", "/") for x in row) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--out", default=None, help="output directory (default: $OUT, else benchmarks/results)")
    ap.add_argument("--budget_s", type=float, default=450.0, help="wall-clock budget of the whole check")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, no GPU tests (for the CPU test)")
    ap.add_argument("--skip_tests", action="store_true", help="skip step 1 (pytest -m gpu)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per cell (default 5; smoke 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per cell (default 10; smoke 2)")
    ap.add_argument("--log_interval", type=int, default=None, help="steps per metrics row (default 5; smoke 2)")
    ap.add_argument("--hf_cell", default=None, help=argparse.SUPPRESS)  # internal: one peer cell, in a child
    args = ap.parse_args(argv)
    if args.hf_cell:
        import gpu_check_cells

        gpu_check_cells.run_hf_cell(json.loads(args.hf_cell))
        return 0
    clock = Clock(args.budget_s)
    missing, optional = probe_imports()  # before anything imports megagenome, DeepSpeed or their needs
    report_probe(missing, optional)
    if missing:
        return MISSING_EXIT
    out = pathlib.Path(args.out or os.environ.get("OUT") or REPO / "benchmarks" / "results")
    os.chdir(REPO)  # the shipped configs name their files relative to the repository root
    dev = device_info()
    if dev["type"] != "cuda" and not args.smoke:
        print("gpu_check: no CUDA device; use --smoke on CPU", file=sys.stderr)
        return 2
    import gpu_check_cells as cells_mod

    default = 2 if args.smoke else None
    plan = cells_mod.step_plan(
        args.warmup if args.warmup is not None else default or 5,
        args.steps if args.steps is not None else default or 10,
        args.log_interval or default or 5,
    )
    if plan["note"]:
        print(f"gpu_check: {plan['note']}", file=sys.stderr, flush=True)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": harness.command("gpu_check.py", harness.argv_of(argv)),
        "smoke": args.smoke,
        "budget_s": args.budget_s,
        "device": dev,
        "versions": versions(),
        "optional_missing": optional,
        "attention": f"auto's choice here: {cells_mod.expected_backend(dev['type'])}",
        "micro_batch_method": "fixed at 2 (smoke)" if args.smoke else _MICRO_METHOD,
        "steps": {**plan, "grad_accum": 1},
    }
    out.mkdir(parents=True, exist_ok=True)
    result = run_steps(args, result, plan, clock, out, optional)
    write_results(out, result)
    print(markdown(result))
    return 0


def run_steps(args, result: dict, plan: dict, clock: Clock, out: pathlib.Path, optional: list[dict]) -> dict:
    """Steps 1 and 2 and 3; the results so far are written to `out` after the tests and after every cell (marked
    "complete": false), so that a check killed half-way leaves what it measured."""
    import gpu_check_cells as cells_mod

    def partial(tests: dict, cells: list[dict], complete: bool = False) -> dict:
        now = {"complete": complete, "wall_s": round(clock.spent(), 1), "tests": tests, "cells": cells}
        return {**result, **now, "goals": goals(cells, result["device"], args.smoke)}

    work = harness.work_dir("mg-gpu-check-")
    try:
        if args.smoke or args.skip_tests or any(m["module"] == "pytest" for m in optional):
            reason = (
                "--smoke: no GPU tests on CPU" if args.smoke else "--skip_tests" if args.skip_tests else "no pytest"
            )
            tests = {"status": "skipped", "reason": reason}
        else:
            tests = run_gpu_tests(clock, work)
            print(f"gpu_check: tests: {json.dumps({k: tests[k] for k in ('passed', 'failed', 'skipped')})}", flush=True)
        write_results(out, partial(tests, []))
        on_cell = lambda cells: write_results(out, partial(tests, cells))  # noqa: E731
        cells = cells_mod.run_cells(args.smoke, plan, clock, work, result["device"], on_cell)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return partial(tests, cells, complete=True)


def write_results(out: pathlib.Path, result: dict) -> None:
    """gpu_check.json and gpu_check.md in `out`, each replaced whole (never left half-written); a failure to write
    is reported and the check goes on."""
    try:
        harness.write_results(out, "gpu_check", result, markdown(result), indent=2)
    except Exception as e:
        print(f"gpu_check: could not write the results to {out}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


_MICRO_METHOD = (
    "estimated per cell from measured activation bytes (61 x d_model per token per layer, bf16, x 1.25) and 20 bytes "
    "of model state per parameter in 85% of the GPU's memory, power of two, <= 65,536 tokens; halved on out-of-memory"
)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM: end the cell's child, clean up
    sys.exit(main())
