"""GPU check: the GPU-marked tests, then MFU of megagenome and of a Hugging Face peer at 125M and ~1B parameters and
sequence lengths 2048 and 8192 (bf16, flash-attn where installed), on one GPU in under 8 minutes.

What it does (every step inside --budget_s, default 450 s; a cell that cannot finish in the time left is skipped and
recorded as skipped, with the reason):

1. `pytest -m gpu -v` on the test files that hold GPU-marked tests (flash-attn equals SDPA, DeepSpeed fp16 loss
   scaling); passed/failed/skipped counts and the failures' names (partial counts if it runs out of time).
2. megagenome cells: `python -m megagenome pretrain` with configs/dna_125m.yaml or configs/dna_1b.yaml at seq 2048 or
   8192, ds_configs/zero1_bf16.json (bf16 weights, fp32 master weights and gradient accumulation), --model.attention
   flash when flash-attn imports (else sdpa), torch's AdamW (--train.torch_adam true: no JIT build of DeepSpeed's
   fused Adam in the cells), 3 warm-up + 10 timed optimizer steps of one micro batch each, run by
   megagenome.trials.run_trial (the find-micro-batch trial runner). tokens/s, TFLOP/s and MFU are the medians of the
   timed steps' metrics rows. MFU = model FLOPs (6N + 12*L*d*s per token, megagenome.metrics.flops_per_token)
   x tokens/s / peak, the peak being the datasheet bf16 dense value of megagenome.metrics.PEAK_TFLOPS (989 TFLOP/s
   for H100/H200 SXM).
3. Hugging Face peer cells of the same shapes: transformers' LlamaForCausalLM from a LlamaConfig (vocabulary 8, width,
   layers, heads, SwiGLU width and tied embeddings as ours), attn_implementation "flash_attention_2" when flash-attn
   is installed, else "sdpa"; a plain torch loop with fp32 weights under bf16 autocast, fused AdamW and clipping at
   1.0 (what megagenome's bf16 engine computes), random DNA tokens, the same micro batch, steps and arithmetic.

Cells run shape by shape, megagenome then the peer, the goal cell first (1B at 8192), so a time-boxed run still yields
side-by-side pairs. Micro batch per cell: an estimate, not a search: the largest power of two whose activations
(61 x d_model bytes per token per layer in bf16, measured on this model's Block with saved-tensor hooks, x 1.25 for
transient buffers) and model states (20 bytes per parameter on one rank) fit in 85% of the GPU's memory, capped at
65,536 tokens per micro batch; a cell that runs out of memory is retried at half the micro batch while time allows.
(`megagenome find-micro-batch` measures it instead, at about a minute per trial of the 1B model: not within 8 minutes
for every cell; run it on its own, e.g. `--config configs/dna_1b.yaml --data.seq_len 8192 --max_micro 8`.)

Goal: at least 45% MFU for megagenome at ~1B and seq 8192 on an H100/H200-class GPU. Results: gpu_check.json and
gpu_check.md in --out (default: $OUT when set, else benchmarks/results/).

Running it on a lent GPU machine (one command, under 8 minutes). The machine's image has torch, transformers and
pytest but not deepspeed, jsonargparse, pyfaidx or their needs, and nothing can be downloaded there, so carry wheels
(CPython 3.12, x86-64). Once, here, in the repository root:

    echo /.whl/ >> .git/info/exclude
    pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8   # pure Python: no ops compiled
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 pyfaidx==0.9.2.2 biopython==1.88 \\
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0

Then one run with carry [".whl"] and timeout_s 540:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT

flash-attn is not in that image and needs a wheel built for its torch and CUDA (or a build there, minutes): without
it both implementations use PyTorch SDPA (its own flash kernels on Hopper) and the results say so.

On CPU, `--smoke` runs the same steps with tiny shapes (sequence 64 and 128), SDPA, 1 warm-up + 1 timed step, no GPU
tests, and the peer cells only if transformers is installed: tests/test_gpu_check.py runs it end to end.

    python benchmarks/gpu_check.py [--out DIR] [--budget_s 450] [--smoke] [--skip_tests]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import pathlib
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from importlib import metadata

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout that is not installed
    sys.path.insert(0, str(REPO))

from megagenome import trials  # noqa: E402
from megagenome.config import RootConfig, d_ff  # noqa: E402
from megagenome.config.load import config_from_args  # noqa: E402
from megagenome.metrics import flops_per_token, gpu_peak  # noqa: E402

GOAL_MFU = 0.45
GOAL_CELL = ("megagenome", "1B", 8192)
MODELS = {"125M": "configs/dna_125m.yaml", "1B": "configs/dna_1b.yaml"}
SHAPES = [("1B", 8192), ("1B", 2048), ("125M", 8192), ("125M", 2048)]  # the goal cell first
# Smoke mode: the same cells at tiny shapes on CPU (name -> model overrides; sequence 2048 -> 64, 8192 -> 128).
SMOKE_MODELS = {"125M": {"d_model": 32, "n_layer": 2, "n_head": 2}, "1B": {"d_model": 64, "n_layer": 2, "n_head": 4}}
SMOKE_SEQ = {2048: 64, 8192: 128}
# Seconds a cell needs at least (start-up, model build, steps, the end-of-run checkpoint of a 1B model: ~14 GB).
NEEDS = {("megagenome", "1B"): 75, ("megagenome", "125M"): 35, ("hf", "1B"): 45, ("hf", "125M"): 25}
TESTS_CAP_S = 200
ACT_BYTES_PER_TOKEN_LAYER = 61  # x d_model, bf16: measured saved activations of one Block (see the docstring)
STATE_BYTES_PER_PARAM = 20  # bf16 weights and gradients, fp32 gradient accumulation, fp32 master weights, Adam m and v
MAX_TOKENS_PER_MICRO = 65536
RESULT_TAG = "GPU_CHECK_RESULT "


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
    for dist in ("torch", "deepspeed", "flash-attn", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    import torch

    out["cuda"] = torch.version.cuda
    return out


def device_info() -> dict:
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found = gpu_peak(props.name)
        return {
            "type": "cuda",
            "name": props.name,
            "memory_bytes": int(props.total_memory),
            "peak_tflops": found[1] if found else None,
            "peak_name": found[0] if found else None,
        }
    sys.path.insert(0, str(REPO / "benchmarks"))
    from hardware import cpu_name

    return {"type": "cpu", "name": f"{cpu_name()}, {os.cpu_count()} cores", "memory_bytes": None}


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
    files = gpu_test_files()
    timeout = max(1.0, min(TESTS_CAP_S, clock.left() * 0.45))
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
        "tail": _tail(text) if rc not in (0, 5) or timed_out else "",
    }


# ----- steps 2 and 3: the cells --------------------------------------------------------------------------------------


def estimate_micro(params: int, n_layer: int, d_model: int, seq: int, device_bytes: int) -> int:
    """The largest power-of-two micro batch whose activations and model states fit in 85% of device_bytes (at least
    1), capped at MAX_TOKENS_PER_MICRO tokens."""
    per_window = 1.25 * ACT_BYTES_PER_TOKEN_LAYER * d_model * n_layer * seq
    usable = 0.85 * device_bytes - STATE_BYTES_PER_PARAM * params - 2 * 2**30
    fit = max(1, int(usable // per_window))
    fit = min(fit, max(1, MAX_TOKENS_PER_MICRO // seq))
    return 2 ** int(math.log2(fit))


def cell_config(model: str, seq: int, attention: str, smoke: bool, fasta: str) -> RootConfig:
    """The run config of a megagenome cell: the shipped YAML at this sequence length, as a trial (trials.trial_config
    sets the steps, the run directory and everything that only costs time)."""
    args = ["--config", MODELS[model], "--data.fasta", fasta, "--model.attention", attention]
    args += ["--train.torch_adam", "true"]
    if smoke:
        args += [f"--model.{k}={v}" for k, v in SMOKE_MODELS[model].items()]
        args += ["--model.max_seq_len", str(max(SMOKE_SEQ.values()))]
    args += ["--data.seq_len", str(seq)]
    return config_from_args(args)


def megagenome_cell(cfg: RootConfig, micro: int, warmup: int, steps: int, work: str, timeout: float) -> dict:
    trial = trials.run_trial(
        trials.trial_config(cfg, warmup + steps), micro, work, warmup=warmup, timeout=timeout, name=f"mg_micro{micro}"
    )
    status = {trials.FITS: "ok", trials.OOM: "oom", trials.KILLED: "oom"}.get(trial.outcome, "failed")
    return {
        "status": status,
        "micro": micro,
        "parameters": trial.parameters,
        "tokens_per_s": trial.tokens_per_s,
        "tflops_per_gpu": trial.tflops_per_gpu,
        "mfu": trial.mfu,
        "peak_tflops": trial.peak_tflops,
        "peak_source": trial.peak_source,
        "peak_mem_bytes": trial.peak_bytes,
        "wall_s": round(trial.wall_s, 1),
        "reason": "" if status == "ok" else f"{trial.outcome}: {trial.detail}"[-2000:],
    }


def hf_cell(spec: dict, work: str, timeout: float) -> dict:
    """Run one peer cell in a child process (its own CUDA context and allocator, freed when it ends)."""
    log = os.path.join(work, f"hf_{spec['d_model']}_{spec['seq']}_micro{spec['micro']}.log")
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--hf_cell", json.dumps(spec)]
    started = time.monotonic()
    rc, timed_out = trials.run_child(cmd, log, trials.child_env(), timeout)
    text = pathlib.Path(log).read_text(encoding="utf-8", errors="replace")
    found = [line[len(RESULT_TAG) :] for line in text.splitlines() if line.startswith(RESULT_TAG)]
    wall = round(time.monotonic() - started, 1)
    if rc == 0 and found:
        return {"status": "ok", **json.loads(found[-1]), "wall_s": wall}
    oom = trials.oom_line(text)
    if timed_out:
        reason = f"timeout after {timeout:.0f} s"
    else:
        reason = oom or _tail(text)
    return {"status": "oom" if oom else "failed", "micro": spec["micro"], "wall_s": wall, "reason": reason[-2000:]}


def run_hf_cell(spec: dict) -> None:
    """The peer's training loop (runs in the child of hf_cell); prints one RESULT_TAG line of JSON."""
    import resource

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from megagenome.metrics import measure_matmul_tflops, resolve_peak

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    conf = LlamaConfig(
        vocab_size=8,
        hidden_size=spec["d_model"],
        intermediate_size=spec["d_ff"],
        num_hidden_layers=spec["n_layer"],
        num_attention_heads=spec["n_head"],
        num_key_value_heads=spec["n_head"],
        max_position_embeddings=spec["seq"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(conf, attn_implementation=spec["attn_implementation"])
    model = model.to(device=device, dtype=torch.float32).train()  # fp32 master weights; bf16 compute via autocast
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    micro, accum, seq = spec["micro"], spec["grad_accum"], spec["seq"]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for _ in range(spec["warmup"] + spec["steps"]):
        sync()
        started = time.perf_counter()
        for _ in range(accum):
            ids = torch.randint(3, 8, (micro, seq), device=device)  # A, C, G, T, N of megagenome's vocabulary
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - started)
    n_params = sum(p.numel() for p in model.parameters())  # a tied embedding is one parameter
    tokens_per_s = micro * accum * seq / statistics.median(times[spec["warmup"] :])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak, source = resolve_peak(None, name, lambda: measure_matmul_tflops(device, torch.bfloat16), device.type)
    tflops = flops_per_token(n_params, spec["n_layer"], spec["d_model"], seq) * tokens_per_s / 1e12
    if device.type == "cuda":
        mem = int(torch.cuda.max_memory_allocated(device))
    else:
        mem = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    result = {
        "micro": micro,
        "parameters": n_params,
        "tokens_per_s": tokens_per_s,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak,
        "peak_tflops": peak,
        "peak_source": source,
        "peak_mem_bytes": mem,
        "attn_implementation": model.config._attn_implementation,
        "loss": float(loss.detach()),
    }
    print(RESULT_TAG + json.dumps(result), flush=True)


def run_cells(args, clock: Clock, work: pathlib.Path, dev: dict, flash: bool) -> list[dict]:
    smoke = args.smoke
    attention = "flash" if flash else "sdpa"
    hf_attention = "flash_attention_2" if flash else "sdpa"
    hf_missing = None
    if importlib.util.find_spec("transformers") is None:
        hf_missing = "transformers is not installed (pip install -e '.[bench]')"
    cells = []
    for model, full_seq in SHAPES:
        seq = SMOKE_SEQ[full_seq] if smoke else full_seq
        cfg = cell_config(model, seq, attention, smoke, genome_copy(model, work))
        m = cfg.model
        params = _parameters(cfg)
        if smoke:
            micro = 2
        else:
            micro = estimate_micro(params, m.n_layer, m.d_model, seq, dev["memory_bytes"])
        base = {"model": model, "seq": seq, "d_model": m.d_model, "n_layer": m.n_layer, "n_head": m.n_head}
        for impl in ("megagenome", "hf"):
            cell = {"impl": impl, **base, "micro": micro, "grad_accum": 1, "warmup": args.warmup, "steps": args.steps}
            cell["attention"] = attention if impl == "megagenome" else hf_attention
            need = 10 if smoke else NEEDS[(impl, model)]
            if impl == "hf" and hf_missing:
                cells.append({**cell, "status": "skipped", "reason": hf_missing})
                continue
            if clock.left() < need:
                cells.append(
                    {**cell, "status": "skipped", "reason": f"time budget: {clock.left():.0f} s left, needs ~{need} s"}
                )
                continue
            attempts = []
            try_micro = micro
            while True:
                timeout = max(need, clock.left() - 2)
                if impl == "megagenome":
                    out = megagenome_cell(cfg, try_micro, args.warmup, args.steps, str(work), timeout)
                else:
                    spec = {**base, "d_ff": d_ff(m), "micro": try_micro, "grad_accum": 1}
                    spec.update(warmup=args.warmup, steps=args.steps, attn_implementation=hf_attention)
                    out = hf_cell(spec, str(work), timeout)
                attempts.append({"micro": try_micro, "status": out["status"], "reason": out.get("reason", "")[:300]})
                if out["status"] != "oom" or try_micro == 1 or clock.left() < need:
                    break
                try_micro //= 2
            print(_cell_line({**cell, **out}), file=sys.stderr, flush=True)
            cells.append({**cell, **out, "attempts": attempts})
            if impl == "megagenome" and out["status"] == "ok":
                micro = out["micro"]  # the peer starts where megagenome fitted (lower after an out-of-memory retry)
    return cells


def genome_copy(model: str, work: pathlib.Path) -> str:
    """A copy of the model config's FASTA in the work directory: pyfaidx writes its index beside the FASTA, so the
    checked-in file is never read directly."""
    import yaml

    with open(REPO / MODELS[model], encoding="utf-8") as fh:
        source = REPO / yaml.safe_load(fh)["data"]["fasta"]
    dest = work / "genome" / source.name
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, dest)
    return str(dest)


def _parameters(cfg: RootConfig) -> int:
    """Parameter count of the model (built on the meta device: no memory, no time)."""
    import torch

    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model import DNATransformer

    with torch.device("meta"):
        return DNATransformer(cfg.model, VOCAB_SIZE).num_parameters()


def _cell_line(c: dict) -> str:
    head = f"gpu_check: {c['impl']:<10} {c['model']:>4} seq {c['seq']:>5}: {c['status']}"
    if c["status"] != "ok":
        return f"{head} ({c.get('reason', '')[:200]})"
    return f"{head}, micro {c['micro']}, {c['tokens_per_s']:,.0f} tokens/s, MFU {_pct(c['mfu'])}"


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


# ----- report ---------------------------------------------------------------------------------------------------------


def goal(cells: list[dict], dev: dict, smoke: bool) -> dict:
    impl, model, seq = GOAL_CELL
    cell = next((c for c in cells if (c["impl"], c["model"]) == (impl, model) and c["seq"] == seq), None)
    mfu = cell.get("mfu") if cell else None
    hopper = dev.get("peak_name") in ("H100 SXM", "H200 SXM", "GH200", "H800 SXM")
    if smoke:
        met, note = None, "not applicable: CPU smoke run"
    elif mfu is None:
        met, note = None, "not measured: " + (cell.get("reason", "") if cell else "no such cell")[:300]
    elif not hopper:
        met, note = None, f"measured on {dev.get('name')}, not an H100/H200-class GPU"
    else:
        met, note = mfu >= GOAL_MFU, f"{_pct(mfu)} against {_pct(GOAL_MFU)}"
    return {"target_mfu": GOAL_MFU, "cell": f"{impl} {model} seq {seq}", "mfu": mfu, "met": met, "note": note}


def markdown(r: dict) -> str:
    dev, v, t = r["device"], r["versions"], r["tests"]
    lines = [
        f"# GPU check ({r['date']}{', smoke run on CPU' if r['smoke'] else ''})",
        "",
        f"Device: {dev['name']}" + (f", {dev['memory_bytes'] / 2**30:.0f} GiB" if dev.get("memory_bytes") else ""),
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"Command: `{r['command']}`; wall time {r['wall_s']:.0f} s of a {r['budget_s']:.0f} s budget.",
        f"Attention: megagenome {r['attention']['megagenome']}, peer {r['attention']['hf']}"
        + (f" ({r['attention']['note']})" if r["attention"]["note"] else "")
        + ".",
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
        "## MFU (model FLOPs 6N + 12·L·d·s per token, bf16, one GPU)",
        "",
        "| implementation | model | params | seq | micro | tokens/s | TFLOP/s | MFU | peak memory | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in r["cells"]:
        ok = c["status"] == "ok"
        params = f"{c['parameters']:,}" if c.get("parameters") else "-"
        row = [
            c["impl"] + (f" ({c['attention']})" if c.get("attention") else ""),
            c["model"],
            params,
            str(c["seq"]),
            str(c.get("micro", "-")),
            f"{c['tokens_per_s']:,.0f}" if ok else "-",
            f"{c['tflops_per_gpu']:.3g}" if ok else "-",
            _pct(c.get("mfu")) if ok else "-",
            f"{c['peak_mem_bytes'] / 2**30:.1f} GiB" if ok and c.get("peak_mem_bytes") else "-",
            c["status"] if ok else f"{c['status']}: {c.get('reason', '').splitlines()[-1] if c.get('reason') else ''}",
        ]
        lines.append("| " + " | ".join(x.replace("|", "/") for x in row) + " |")
    ratios = []
    for c in r["cells"]:
        if c["impl"] != "megagenome" or c["status"] != "ok":
            continue
        peer = next(
            (p for p in r["cells"] if p["impl"] == "hf" and (p["model"], p["seq"]) == (c["model"], c["seq"])), {}
        )
        if peer.get("status") == "ok":
            ratios.append(f"{c['model']} seq {c['seq']}: {c['tokens_per_s'] / peer['tokens_per_s']:.2f}x")
    if ratios:
        lines += ["", "megagenome / peer tokens/s: " + "; ".join(ratios) + "."]
    g = r["goal"]
    verdict = {True: "met", False: "NOT met", None: "not decided"}[g["met"]]
    lines += ["", f"Goal (>= {_pct(g['target_mfu'])} MFU, {g['cell']}): {verdict} ({g['note']}).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output directory (default: $OUT, else benchmarks/results)")
    ap.add_argument("--budget_s", type=float, default=450.0, help="wall-clock budget of the whole check")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, no GPU tests (for the CPU test)")
    ap.add_argument("--skip_tests", action="store_true", help="skip step 1 (pytest -m gpu)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per cell (default 3; smoke 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per cell (default 10; smoke 1)")
    ap.add_argument("--hf_cell", default=None, help=argparse.SUPPRESS)  # internal: one peer cell, in a child
    args = ap.parse_args(argv)
    if args.hf_cell:
        run_hf_cell(json.loads(args.hf_cell))
        return 0
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    args.steps = args.steps if args.steps is not None else (1 if args.smoke else 10)
    out = pathlib.Path(args.out or os.environ.get("OUT") or REPO / "benchmarks" / "results")
    os.chdir(REPO)  # the shipped configs name their files relative to the repository root
    clock = Clock(args.budget_s)
    dev = device_info()
    if dev["type"] != "cuda" and not args.smoke:
        print("gpu_check: no CUDA device; use --smoke on CPU", file=sys.stderr)
        return 2
    from megagenome.model.attention import flash_available

    flash = dev["type"] == "cuda" and flash_available()
    work = pathlib.Path(tempfile.mkdtemp(prefix="mg-gpu-check-"))
    try:
        if args.smoke or args.skip_tests:
            reason = "--smoke: no GPU tests on CPU" if args.smoke else "--skip_tests"
            tests = {"status": "skipped", "reason": reason}
        else:
            tests = run_gpu_tests(clock, work)
            print(f"gpu_check: tests: {json.dumps({k: tests[k] for k in ('passed', 'failed', 'skipped')})}", flush=True)
        cells = run_cells(args, clock, work, dev, flash)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.smoke:
        method = "fixed at 2 (smoke)"
    else:
        method = (
            "estimated per cell from measured activation bytes (61 x d_model per token per layer, bf16, x 1.25) and "
            "20 bytes of model state per parameter in 85% of the GPU's memory, power of two, <= 65,536 tokens; "
            "halved on out-of-memory"
        )
    result = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "smoke": args.smoke,
        "budget_s": args.budget_s,
        "wall_s": round(clock.spent(), 1),
        "device": dev,
        "versions": versions(),
        "attention": {
            "megagenome": "flash" if flash else "sdpa",
            "hf": "flash_attention_2" if flash else "sdpa",
            "note": "" if flash else "flash-attn not importable here: PyTorch SDPA for both",
        },
        "micro_batch_method": method,
        "steps": {"warmup": args.warmup, "timed": args.steps, "grad_accum": 1},
        "tests": tests,
        "cells": cells,
        "goal": goal(cells, dev, args.smoke),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
