"""The measured cells of benchmarks/gpu_check.py: megagenome at 125M and ~1B parameters x sequence 2048 / 8192 / 32768,
a `--model.compile true` variant of the goal cell, and a Hugging Face peer of the same shapes (docstring of
gpu_check.py). Imported only after gpu_check.py has probed every package these imports need.

A megagenome cell is `python -m megagenome pretrain` in a child (megagenome/run/trials.py's trial config: one micro
batch per step, no evaluation or checkpoint before the last step), ended once its timed rows are written, so the
last step's held-out batch and checkpoint (~16 GB at 1B) never run. It writes a metrics row, and syncs with the GPU
(train/sync_points.py), only every `log_interval` steps (step_plan; --train.sync_interval the same): the timed rows,
those after the warm-up rows, each cover their window's wall time from one sync point to the next.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import pathlib
import re
import shutil
import statistics
import sys
import time
import traceback

import harness

from megagenome.config import RootConfig, d_ff, to_dict
from megagenome.config.load import config_from_args
from megagenome.model.transformer.flops import flops_per_token
from megagenome.observe.record import write_yaml
from megagenome.run import trials

REPO = harness.REPO
MODELS = {"125M": "configs/dna_125m.yaml", "1B": "configs/dna_1b.yaml", "S1B": "configs/striped_1b.yaml"}
# (model, sequence, variant): the goal cells first (1B at 8192 and 32768), then the compiled goal cell, the rest.
# Variants: "eager" runs --model.attention auto, "compile" adds --model.compile true, "flash" forces flash-attn 2
# (only where it imports: auto prefers cuDNN attention or FA3 on Hopper, so flash-attn would otherwise never run).
MEGAGENOME_CELLS = [("1B", 8192, "eager"), ("1B", 32768, "eager"), ("1B", 8192, "compile"), ("1B", 8192, "flash")]
MEGAGENOME_CELLS += [("1B", 2048, "eager"), ("125M", 8192, "eager"), ("125M", 32768, "eager"), ("125M", 2048, "eager")]
# StripedHyena 2 at Evo 2 1B's shape (model/hyena/): its FFT convolutions and attention stripes at 8k and 32k.
MEGAGENOME_CELLS += [("S1B", 8192, "eager"), ("S1B", 32768, "eager")]
PEER_CELLS = [("1B", 8192), ("1B", 2048), ("125M", 8192), ("125M", 2048), ("1B", 32768), ("125M", 32768)]
# --smoke runs a subset (each cell is a process start on a CPU): both goal cells, the compiled one, the flash one
# (skipped: no flash-attn on CPU), one 125M cell, and the peer at two shapes.
SMOKE_CELLS = [*MEGAGENOME_CELLS[:4], ("125M", 2048, "eager"), ("S1B", 8192, "eager")]
SMOKE_PEER_CELLS = [("1B", 8192), ("125M", 2048)]
# Smoke mode: the same cells at tiny shapes on CPU (name -> model overrides; sequence 2048 -> 64, 8192 -> 128, ...).
SMOKE_MODELS = {
    "125M": {"d_model": 32, "n_layer": 2, "n_head": 2, "d_ff": 128},
    "1B": {"d_model": 64, "n_layer": 2, "n_head": 4, "d_ff": 192},  # 8/3 x d rounded up to 64, as the YAMLs' widths
    "S1B": {"d_model": 64, "n_layer": 4, "n_head": 4, "d_ff": 192, "layer_pattern": "SE MR LI A"},
}
SMOKE_SEQ = {2048: 64, 8192: 128, 32768: 256}
# Seconds a cell needs at least: start-up (imports, model build, engine), the steps; the compiled variant adds
# inductor's compilation of the block (once, in the warm-up steps).
NEEDS = {("megagenome", "1B"): 60, ("megagenome", "125M"): 30, ("megagenome", "S1B"): 60, ("hf", "1B"): 45,
         ("hf", "125M"): 25}  # fmt: skip
COMPILE_EXTRA_S = 60
ACT_BYTES_PER_TOKEN_LAYER = 61  # x d_model, bf16: measured saved activations of one Block (gpu_check docstring)
STATE_BYTES_PER_PARAM = 20  # bf16 weights and gradients, fp32 gradient accumulation, fp32 master weights, Adam m and v
MAX_TOKENS_PER_MICRO = 65536
RESULT_TAG = "GPU_CHECK_RESULT "
_PARAMETERS = re.compile(r"megagenome: ([\d,]+) parameters")
_ATTENTION = re.compile(r"\battention: (sdpa|math|cudnn|flash|fa3)\b")  # the start-up line of megagenome/model


def estimate_micro(params: int, n_layer: int, d_model: int, seq: int, device_bytes: int) -> int:
    """The largest power-of-two micro batch whose activations and model states fit in 85% of device_bytes (at least
    1), capped at MAX_TOKENS_PER_MICRO tokens."""
    per_window = 1.25 * ACT_BYTES_PER_TOKEN_LAYER * d_model * n_layer * seq
    usable = 0.85 * device_bytes - STATE_BYTES_PER_PARAM * params - 2 * 2**30
    fit = max(1, int(usable // per_window))
    fit = min(fit, max(1, MAX_TOKENS_PER_MICRO // seq))
    return 2 ** int(math.log2(fit))


def cell_config(model: str, seq: int, variant: str, smoke: bool, fasta: str) -> RootConfig:
    """The run config of a megagenome cell: the shipped YAML at this sequence length, attention auto (the fastest
    backend installed: megagenome/model/attention.py), torch's fused AdamW (the GPU default of build_ds_config:
    nothing JIT-built), compiled blocks for the "compile" variant, flash-attn 2 for the "flash" one."""
    args = [
        "--config",
        MODELS[model],
        "--data.fasta",
        fasta,
        "--model.attention",
        "flash" if variant == "flash" else "auto",
    ]
    args += ["--model.compile", "true" if variant == "compile" else "false"]
    if smoke:
        args += [f"--model.{k}={v}" for k, v in SMOKE_MODELS[model].items()]
    args += ["--model.max_seq_len", str(seq), "--data.seq_len", str(seq)]
    return config_from_args(args)


def expected_backend(device_type: str) -> str:
    """The backend --model.attention auto chooses here in bf16 (as the cells' start-up line): a prediction, not the
    kernel that ran (under cuDNN attention SDPA may fall back to another kernel for a shape cuDNN refuses, silently)."""
    try:
        import torch

        from megagenome.model.attention import attention_backend

        return attention_backend("auto", device_type, torch.bfloat16)
    except Exception as e:  # the check goes on; the cells say what ran
        return f"unknown ({type(e).__name__}: {e})"[:200]


def step_plan(warmup: int, steps: int, log_interval: int) -> dict:
    """Warm-up and timed steps of a cell in whole metrics rows of `log_interval` steps (each rounded up, with a
    note; at least one timed row): the rows after the warm-up ones are timed."""
    k = max(1, log_interval)
    w, s = math.ceil(max(0, warmup) / k) * k, max(1, math.ceil(steps / k)) * k
    notes = [
        f"{flag} {n} rounded up to {m}" for flag, n, m in (("--warmup", warmup, w), ("--steps", steps, s)) if n != m
    ]
    note = ", ".join(notes) + f" (a metrics row every {k} steps)" if notes else ""
    return {"log_interval": k, "warmup": w, "steps": s, "warmup_rows": w // k, "timed_rows": s // k, "note": note}


def cell_trial_config(cfg: RootConfig, micro: int, plan: dict, run_dir: pathlib.Path) -> RootConfig:
    """trials.trial_config of `cfg` for the plan's steps at micro batch `micro`, with a metrics row and a sync point
    every plan["log_interval"] steps (the trial's: a row, so a sync, every step)."""
    r, k = dataclasses.replace, plan["log_interval"]
    trial = trials.trial_config(cfg, plan["warmup"] + plan["steps"])
    train = r(trial.train, micro_batch_size=micro, log_interval=k, sync_interval=k)
    return r(trial, train=train, log=r(trial.log, run_dir=str(run_dir)))


def timed_rows(rows: list[dict], plan: dict) -> list[dict]:
    """The rows of the timed steps: those after the warm-up steps, plan["timed_rows"] of them."""
    return [row for row in rows if row["step"] > plan["warmup"]][: plan["timed_rows"]]


def throughput(timed: list[dict]) -> dict:
    """tokens/s over the timed rows (their tokens over their summed window times) and each row's."""
    tokens = [row["window_tokens"] for row in timed]
    seconds = sum(n / row["tokens_per_s"] for n, row in zip(tokens, timed))
    rates = [round(row["tokens_per_s"], 1) for row in timed]
    return {"tokens_per_s": sum(tokens) / seconds, "timed_s": round(seconds, 3), "row_tokens_per_s": rates}


def megagenome_cell(cfg: RootConfig, micro: int, plan: dict, work: pathlib.Path, timeout: float) -> dict:
    """Train `cfg` at micro batch `micro` in a child until the plan's warm-up and timed rows exist, then end it."""
    name = f"mg_micro{micro}"
    run_dir, config_path, log_path = work / name, work / f"{name}.yaml", work / f"{name}.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    write_yaml(str(config_path), to_dict(cell_trial_config(cfg, micro, plan, run_dir)))
    cmd = [sys.executable, "-m", "megagenome", "pretrain", "--config", str(config_path)]
    started, want = time.monotonic(), plan["warmup_rows"] + plan["timed_rows"]
    metrics = run_dir / "metrics.jsonl"
    until = lambda: len(train_rows(metrics)) >= want  # noqa: E731  (its timed rows are written: end it)
    _, how = harness.run_session(cmd, log_path, timeout, cwd=None, env=trials.child_env(), until=until)
    rows = train_rows(metrics)
    wall = round(time.monotonic() - started, 1)
    text = log_path.read_text(encoding="utf-8", errors="replace")
    shutil.rmtree(run_dir, ignore_errors=True)
    found, backend = _PARAMETERS.search(text), _ATTENTION.findall(text)
    out = {
        "micro": micro,
        "wall_s": wall,
        "ended": how,
        "parameters": int(found[1].replace(",", "")) if found else None,
    }
    out["attention_auto_choice"] = backend[-1] if backend else None  # the start-up line: what auto chose
    timed = timed_rows(rows, plan)
    if len(timed) == plan["timed_rows"]:
        out.update(status="ok", **throughput(timed))
        out["peak_tflops"], out["peak_source"] = rows[-1].get("peak_tflops"), rows[-1].get("peak_source")
        peaks = [r.get("mem_peak_bytes_max") or r.get("mem_peak_bytes") for r in rows]
        out["peak_mem_bytes"] = max((p for p in peaks if p), default=None)
        out["loss"] = rows[-1].get("loss")
        return out
    oom = trials.oom_line(text)
    reason = f"timeout after {timeout:.0f} s" if how == "timeout" else oom or _tail(text)
    return {**out, "status": "oom" if oom else "failed", "reason": reason[-2000:]}


def train_rows(path: pathlib.Path) -> list[dict]:
    """The training rows of a metrics.jsonl being written (a line still being written is left out)."""
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return rows
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        if "split" not in row and row.get("tokens_per_s") is not None:
            rows.append(row)
    return rows


def hf_cell(spec: dict, work: pathlib.Path, timeout: float) -> dict:
    """Run one peer cell in a child process (its own CUDA context and allocator, freed when it ends)."""
    log = work / f"hf_{spec['d_model']}_{spec['seq']}_micro{spec['micro']}.log"
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--hf_cell", json.dumps(spec)]
    started = time.monotonic()
    rc, timed_out = trials.run_child(cmd, str(log), trials.child_env(), timeout)
    text = log.read_text(encoding="utf-8", errors="replace")
    found = [line[len(RESULT_TAG) :] for line in text.splitlines() if line.startswith(RESULT_TAG)]
    wall = round(time.monotonic() - started, 1)
    if rc == 0 and found:
        return {"status": "ok", **json.loads(found[-1]), "wall_s": wall}
    oom = trials.oom_line(text)
    reason = f"timeout after {timeout:.0f} s" if timed_out else oom or _tail(text)
    return {"status": "oom" if oom else "failed", "micro": spec["micro"], "wall_s": wall, "reason": reason[-2000:]}


def run_hf_cell(spec: dict) -> None:
    """The peer's training loop (runs in the child of hf_cell); prints one RESULT_TAG line of JSON: transformers'
    LlamaForCausalLM of our shape, fp32 weights under bf16 autocast, fused AdamW (CUDA), clipping at 1.0."""
    import resource

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

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
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    micro, seq = spec["micro"], spec["seq"]
    times = []
    for _ in range(spec["warmup"] + spec["steps"]):
        if fused:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        ids = torch.randint(3, 8, (micro, seq), device=device)  # A, C, G, T, N of megagenome's vocabulary
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fused:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    n_params = sum(p.numel() for p in model.parameters())  # a tied embedding is one parameter
    mem = (
        torch.cuda.max_memory_allocated(device) if fused else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    result = {
        "micro": micro,
        "parameters": n_params,
        "tokens_per_s": micro * seq / statistics.median(times[spec["warmup"] :]),
        "peak_mem_bytes": int(mem),
        "attn_implementation": model.config._attn_implementation,
        "loss": loss.item(),
    }
    print(RESULT_TAG + json.dumps(result), flush=True)


def with_mfu(cell: dict, peak_tflops: float | None) -> dict:
    """cell with TFLOP/s and MFU in both conventions: causal attention at half (Megatron-LM, the headline: 6N +
    6*L*d*s per token) and every score counted (PaLM: 6N + 12*L*d*s); metrics.flops_per_token."""
    if cell.get("status") != "ok" or not cell.get("parameters"):
        return cell
    out = dict(cell)
    args = (cell["parameters"], cell["n_layer"], cell["d_model"], cell["seq"])
    for i, (suffix, causal) in enumerate((("", True), ("_full_attn", False))):
        # A Hyena family's cell carries its own count (the family's run_flops: model/hyena/costs.py).
        per_token = cell["flops_per_token"][i] if cell.get("flops_per_token") else flops_per_token(*args, causal=causal)
        tflops = per_token * cell["tokens_per_s"] / 1e12
        out[f"tflops_per_gpu{suffix}"] = tflops
        out[f"mfu{suffix}"] = tflops / peak_tflops if peak_tflops else None
    return out


def genome_copy(model: str, work: pathlib.Path) -> str:
    """A copy of the model config's FASTA in the work directory: pyfaidx writes its index beside the FASTA, so the
    checked-in file is never read directly."""
    import yaml

    with open(REPO / MODELS[model], encoding="utf-8") as fh:
        source = REPO / yaml.safe_load(fh)["data"]["fasta"]
    return str(harness.copy_input(source, work / "genome", keep=True))


def parameters(cfg: RootConfig) -> int:
    """Parameter count of the model (built on the meta device: no memory, no time)."""
    import torch

    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model import family_of

    with torch.device("meta"):
        return family_of(cfg.model).build(cfg.model, VOCAB_SIZE).num_parameters()


def peer_available() -> str | None:
    """None when the peer can run, else why not."""
    missing = importlib.util.find_spec("transformers") is None
    return "transformers is not installed (pip install -e '.[bench]')" if missing else None


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_cells(smoke: bool, plan: dict, clock, work: pathlib.Path, dev: dict, on_cell=None) -> list[dict]:
    """Every cell in order (MEGAGENOME_CELLS, then PEER_CELLS), each skipped with the reason when the time left
    (clock: gpu_check.Clock) is below what it needs; an out-of-memory cell is retried at half the micro batch while
    time allows. MFU against the GPU's datasheet peak (the rows' measured matmul peak on CPU). A cell that raises is
    recorded with status "error" (guarded) and the next runs; on_cell(cells) runs after every cell."""
    cells, fitted = [], {}
    flash = dev["type"] == "cuda" and importlib.util.find_spec("flash_attn") is not None
    expected = expected_backend(dev["type"])
    steps = {k: plan[k] for k in ("warmup", "steps", "log_interval")}
    for model, full_seq, variant in SMOKE_CELLS if smoke else MEGAGENOME_CELLS:
        seq = SMOKE_SEQ[full_seq] if smoke else full_seq
        base = {"impl": "megagenome", "variant": variant, "model": model, "seq": seq, **steps}
        base["attention"] = "flash" if variant == "flash" else f"auto's choice: {expected}"
        run = lambda base=base: _megagenome_one(base, smoke, plan, clock, work, dev, flash)  # noqa: E731
        cell = _finish(guarded(run, base), cells, on_cell)
        if cell["status"] == "ok" and variant == "eager":
            fitted[(model, seq)] = cell["micro"]
    hf_attention = "flash_attention_2" if flash else "sdpa"
    for model, full_seq in SMOKE_PEER_CELLS if smoke else PEER_CELLS:
        seq = SMOKE_SEQ[full_seq] if smoke else full_seq
        base = {"impl": "hf", "variant": "eager", "model": model, "seq": seq, **steps, "attention": hf_attention}
        run = lambda base=base: _peer_one(base, smoke, plan, clock, work, dev, fitted, cells)  # noqa: E731
        _finish(guarded(run, base), cells, on_cell)
    return cells


def guarded(run, base: dict) -> dict:
    """run(), or `base` with status "error" and the traceback's tail when it raises."""
    try:
        return run()
    except Exception as e:
        return {**base, "status": "error", "reason": f"{type(e).__name__}: {e}\n{_tail(traceback.format_exc())}"}


def _finish(cell: dict, cells: list[dict], on_cell) -> dict:
    _report(cell)
    cells.append(cell)
    if on_cell is not None:
        on_cell(cells)
    return cell


def _megagenome_one(base: dict, smoke: bool, plan: dict, clock, work: pathlib.Path, dev: dict, flash: bool) -> dict:
    model, seq, variant = base["model"], base["seq"], base["variant"]
    cfg, base = _shaped(base, variant, smoke, work)
    micro = _micro(cfg, seq, smoke, dev)
    if variant == "flash" and not flash:
        return {**base, "status": "skipped", "micro": micro, "reason": "flash-attn is not importable here"}
    need = 10 if smoke else NEEDS[("megagenome", model)] + (COMPILE_EXTRA_S if variant == "compile" else 0)
    out = _attempts(lambda mb, t: megagenome_cell(cfg, mb, plan, work, t), micro, need, clock)
    return with_mfu({**base, **out}, dev.get("peak_tflops") or out.get("peak_tflops"))


def _peer_one(base: dict, smoke, plan: dict, clock, work: pathlib.Path, dev: dict, fitted: dict, cells) -> dict:
    model, seq = base["model"], base["seq"]
    cfg, base = _shaped(base, "eager", smoke, work)
    missing = peer_available()
    if missing:
        return {**base, "status": "skipped", "reason": missing}
    micro = fitted.get((model, seq)) or _micro(cfg, seq, smoke, dev)
    spec = {**base, "d_ff": d_ff(cfg.model), "attn_implementation": base["attention"]}
    need = 10 if smoke else NEEDS[("hf", model)]
    out = _attempts(lambda mb, t: hf_cell({**spec, "micro": mb}, work, t), micro, need, clock)
    return with_mfu({**base, **out}, dev.get("peak_tflops") or _cpu_peak(cells))


def _shaped(base: dict, variant: str, smoke: bool, work: pathlib.Path) -> tuple[RootConfig, dict]:
    cfg = cell_config(base["model"], base["seq"], variant, smoke, genome_copy(base["model"], work))
    m = cfg.model
    out = {**base, "d_model": m.d_model, "n_layer": m.n_layer, "n_head": m.n_head}
    if m.family != "transformer":  # its FLOPs per token in both conventions, for with_mfu
        from megagenome.data.tokenizer import VOCAB_SIZE
        from megagenome.model import family_of

        family = family_of(m)
        n, block = family.parameter_counts(m, VOCAB_SIZE)
        out["family"], out["flops_per_token"] = (
            m.family,
            list(family.run_flops(m, n, block, base["seq"], True, False)[:2]),
        )
    return cfg, out


def _micro(cfg: RootConfig, seq: int, smoke: bool, dev: dict) -> int:
    m = cfg.model
    return 2 if smoke else estimate_micro(parameters(cfg), m.n_layer, m.d_model, seq, dev["memory_bytes"])


def _attempts(run, micro: int, need: float, clock) -> dict:
    """run(micro, timeout) at `micro`, halved after an out-of-memory error while time allows; the last outcome with
    the list of attempts, or a skipped cell when there is not the time to start it."""
    if clock.left() < need:
        reason = f"time budget: {clock.left():.0f} s left, needs ~{need} s"
        return {"status": "skipped", "micro": micro, "reason": reason}
    attempts = []
    while True:
        out = run(micro, max(need, clock.left() - 2))
        attempts.append({"micro": micro, "status": out["status"], "reason": out.get("reason", "")[:300]})
        if out["status"] != "oom" or micro == 1 or clock.left() < need:
            return {**out, "attempts": attempts}
        micro //= 2


def _cpu_peak(cells: list[dict]) -> float | None:
    """The matmul peak the megagenome cells measured (CPU smoke runs: no datasheet peak)."""
    return next((c["peak_tflops"] for c in cells if c.get("peak_tflops")), None)


def _report(c: dict) -> None:
    head = f"gpu_check: {c['impl']:<10} {c['variant']:<7} {c['model']:>4} seq {c['seq']:>5}: {c['status']}"
    if c["status"] != "ok":
        print(f"{head} ({c.get('reason', '')[:200]})", file=sys.stderr, flush=True)
        return
    mfu = "-" if c.get("mfu") is None else f"{100 * c['mfu']:.1f}% causal, {100 * c['mfu_full_attn']:.1f}% full"
    print(f"{head}, micro {c['micro']}, {c['tokens_per_s']:,.0f} tokens/s, MFU {mfu}", file=sys.stderr, flush=True)
