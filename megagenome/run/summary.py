"""The summary that closes a run (layer L4): held-out bits per base next to Markov baselines fitted on the
training split, throughput, MFU/HFU, memory and wall time, printed and saved as <run dir>/summary.json.

A masked (mlm) run is compared with two-sided k-mer context baselines under its own masking
(data/masked_baseline.py): its figure and the Markov chains' are different tasks, so the chains stay for scale only.

wall_s is the time of the invocation that wrote it (first_step: the step it started after, 0 for a fresh start); a
rerun of a run that has nothing left to train leaves summary.json as it is and prints it as the finished run's
(`stored`, `print_finished`), rather than pairing the rerun's few seconds with the original throughput.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from megagenome.config import RootConfig
from megagenome.data import masked_baseline
from megagenome.data.dataset import GenomeData
from megagenome.data.markov import markov_bits_per_base
from megagenome.files.run_files import SUMMARY
from megagenome.model import family_of
from megagenome.observe.metrics import read_metrics
from megagenome.observe.record import write_json
from megagenome.weights import checkpoint


def summarise(
    cfg: RootConfig, data: GenomeData, metrics_path: str, result: dict, n_params: int, wall_s: float, first_step=0
) -> dict:
    """Held-out bits/base next to Markov baselines, throughput and wall time (of this invocation, which started after
    step first_step); printed and saved."""
    rows = read_metrics(metrics_path)
    train_rows = [r for r in rows if "split" not in r]
    eval_rows = [r for r in rows if r.get("split") == "val"]
    train_pairs = data.train_tokens()
    heldout_pairs = data.heldout_tokens()
    w = cfg.data.eval_softmask_weight
    heldout_weights = [np.where(mask, w, 1.0) for _, mask in heldout_pairs]
    baselines = markov_bits_per_base(
        [t for t, _ in train_pairs],
        [t for t, _ in heldout_pairs],
        heldout_weights=heldout_weights,
        both_strands=cfg.data.rc_prob > 0,  # the model sees both strands under reverse-complement augmentation
    )
    best_k = min(baselines, key=baselines.get)
    final_eval = eval_rows[-1] if eval_rows else result.get("eval", {})
    model_bits = final_eval.get("bits_per_base")
    timed = train_rows[1:] or train_rows  # the first window includes warm-up

    def median(key: str) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return float(np.median(values)) if values else None

    tps = [r["tokens_per_s"] for r in timed]
    real = [r.get("window_real_tokens") for r in train_rows]
    padded = sum(r.get("window_tokens") or 0 for r in train_rows)
    last = train_rows[-1] if train_rows else {}
    summary = {
        "run_dir": os.path.abspath(cfg.log.run_dir),
        "parameters": n_params,
        "model": family_of(cfg.model).describe(cfg.model),  # the family's one line of its shape (the report's)
        "steps": train_rows[-1]["step"] if train_rows else 0,
        "max_steps": cfg.train.max_steps,
        "train_loss": train_rows[-1]["loss"] if train_rows else None,
        "objective": cfg.model.objective,
        "heldout_bits_per_base": model_bits,
        "markov_bits_per_base": {str(k): v for k, v in baselines.items()},
        "markov_strands": "both" if cfg.data.rc_prob > 0 else "forward",  # what the chains were fitted on
        "best_markov_order": best_k,
        **_comparison(cfg, data, model_bits, baselines[best_k]),
        "tokens_per_s_median": float(np.median(tps)) if tps else None,
        "tflops_per_gpu_median": median("tflops_per_gpu"),
        "mfu_median": median("mfu"),
        "hfu_median": median("hfu"),
        "mfu_full_attn_median": median("mfu_full_attn"),  # every attention score counted (PaLM)
        "peak_tflops": last.get("peak_tflops"),
        "peak_source": last.get("peak_source"),
        "real_token_fraction": sum(real) / padded if padded and real and None not in real else None,
        "mem_peak_bytes_max": max((r.get("mem_peak_bytes_max") or 0 for r in train_rows), default=None),
        "wall_s": wall_s,
        "first_step": first_step,  # the step this invocation started after: wall_s covers the steps since
        # train/divergence.py: the run's bad steps (every invocation's event rows) and what was done about them
        "bad_steps": _bad_steps([r for r in rows if r.get("split") == "event"]),
        "data_changes": result.get("data_changes") or [],  # resumed with --checkpoint.allow_data_change
    }
    write_json(os.path.join(cfg.log.run_dir, SUMMARY), summary)
    print_summary(summary)
    return summary


def _comparison(cfg: RootConfig, data: GenomeData, model_bits: float | None, best_markov: float) -> dict:
    """Whether the model's held-out figure is below its baseline: a causal model's the best order-k Markov chain
    (beats_best_markov); a masked model's the best two-sided k-mer context model under the same masking, fitted and
    scored as data/masked_baseline.py says (beats_best_masked_baseline; the Markov chains, one-sided, stay in
    summary.json for scale, not as its baseline)."""
    value = model_bits if model_bits is not None else math.inf
    if cfg.model.objective != "mlm":
        return {"beats_best_markov": value < best_markov}
    masked = masked_baseline.of_run(data)
    best = min(masked, key=masked.get)
    return {
        "masked_baseline_bits_per_base": {str(k): v for k, v in masked.items()},
        "best_masked_baseline_k": best,
        "beats_best_masked_baseline": value < masked[best],
    }


def _bad_steps(events: list[dict]) -> dict:
    """Counts of the event rows by what was done (skip, rollback, stop) and by reason (nonfinite, spike)."""
    out = {"total": len(events)}
    for key in ("event", "reason"):
        for row in events:
            out[row.get(key)] = out.get(row.get(key), 0) + 1
    return out


def finished_rerun(cfg: RootConfig, resume_from: str | None, rank: int, broadcast) -> dict | None:
    """A rerun of a run with nothing left to train (the checkpoint it resumes from is at --train.stop_at, else
    --train.max_steps) builds nothing and rewrites nothing: rank 0 prints the finished run's summary.json as
    recorded. Returns it ({} on the other ranks), or None to run as usual: something to train, or no summary of that
    step to show (the run then writes one, saying that this invocation trained no steps). broadcast: rank 0's
    object to every rank (engine/engine.py broadcast_object), so that all ranks take the same way."""
    if resume_from is None:
        return None
    step = checkpoint.read_info(resume_from).get("step")
    step = int(step) if step is not None else checkpoint.tag_step(os.path.basename(resume_from))
    if step < (cfg.train.stop_at or cfg.train.max_steps):
        return None
    found = stored(cfg.log.run_dir, step) if rank == 0 else None
    if not broadcast(found is not None):
        return None
    if rank == 0:
        print_finished(found)
    return found or {}


def stored(run_dir: str, step: int) -> dict | None:
    """The summary.json in run_dir when it is that of a run finished at `step`, else None."""
    try:
        with open(os.path.join(run_dir, SUMMARY), encoding="utf-8") as fh:
            found = json.load(fh)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("steps") == step else None


def print_finished(s: dict) -> None:
    """A finished run's summary, said to be that: what a rerun with nothing left to train prints."""
    print(
        f"megagenome: {s['run_dir']} already finished at step {s['steps']}: nothing to train; its summary as "
        "recorded (summary.json, unchanged):",
        flush=True,
    )
    print_summary(s)


def _wall(s: dict) -> str:
    first, steps = s.get("first_step") or 0, s["steps"]
    if not first:
        return f"{s['wall_s']:.1f} s"
    if first >= steps:
        return f"{s['wall_s']:.1f} s (this invocation trained no steps; the run's time was not recorded)"
    return f"{s['wall_s']:.1f} s (this invocation: steps {first + 1}-{steps}, resumed at step {first})"


def print_summary(s: dict) -> None:
    """The summary as the console shows it: nine lines for a run without bad steps or data changes (the console of
    the default job stays within ~15 lines besides the progress bar, tests/test_console.py)."""
    lines = ["", f"== megagenome pretrain summary: {s['run_dir']} =="]
    trained = f"{s['steps']} steps of {s['parameters']:,} parameters"
    if s["train_loss"] is not None:
        trained += f"; train loss {s['train_loss']:.4f} nats/token"
    if s.get("real_token_fraction") is not None:
        trained += f"; {100 * s['real_token_fraction']:.2f}% of positions carry loss"
    lines.append(f"training           {trained}")
    lines += _heldout(s)
    if s["tokens_per_s_median"] is not None:
        speed = f"{s['tokens_per_s_median']:,.0f} (median over logged intervals, all ranks)"
        if s.get("tflops_per_gpu_median") is not None:
            speed += (
                f"; {s['tflops_per_gpu_median']:.3g} TFLOP/s per device of {s['peak_tflops']:.3g} ({s['peak_source']})"
            )
        lines.append(f"tokens/s           {speed}")
    if s.get("mfu_median") is not None:
        mfu = f"{100 * s['mfu_median']:.2f}%  (HFU {100 * s['hfu_median']:.2f}%)"
        full = s.get("mfu_full_attn_median")
        if full is not None and full != s["mfu_median"]:
            mfu += f"; causal attention counted at half (Megatron-LM), {100 * full:.2f}% counting every score (PaLM)"
        if str(s.get("peak_source") or "").startswith("measured"):  # no datasheet peak (a CPU): a rough figure
            mfu += "; an estimate (a peak timed at start-up: it varies between runs)"
        lines.append(f"MFU                {mfu}")
    if s.get("mem_peak_bytes_max"):
        lines.append(f"peak memory        {s['mem_peak_bytes_max'] / 2**30:.2f} GiB (largest rank)")
    bad = s.get("bad_steps") or {}
    if bad.get("total"):
        done = ", ".join(f"{bad[a]} {a}" for a in ("skip", "rollback", "stop") if bad.get(a))
        lines.append(f"bad steps          {bad['total']} ({done}; metrics.jsonl rows with split 'event')")
    if s.get("data_changes"):
        lines.append(f"data changed       {len(s['data_changes'])} difference(s), allowed on resume")
    lines.append(f"wall time          {_wall(s)}")
    print("\n".join(lines), flush=True)


def _heldout(s: dict) -> list[str]:
    """The held-out line (the model against its best baseline) and the line of every baseline: a causal model's
    order-k Markov chains; a masked model's two-sided k-mer context models, then the Markov chains, said to be
    one-sided."""
    model, markov = s["heldout_bits_per_base"], s["markov_bits_per_base"]
    strands = ["fitted on both strands"] if s.get("markov_strands") == "both" else []
    masked = s.get("masked_baseline_bits_per_base")
    if masked:
        best = str(s["best_masked_baseline_k"])
        value, beats, what = masked[best], s["beats_best_masked_baseline"], "(model, masked positions)"
        baseline = f"the best masked baseline, k={best} each side at {value:.4f}"
    else:
        best = str(s["best_markov_order"])
        value, beats, what = markov[best], s["beats_best_markov"], "(model)"
        baseline = f"the best Markov baseline, order-{best} at {value:.4f}"
    if model is not None:
        side = "below" if beats else "above, not yet below"
        heldout = f"{model:.4f} {what}: {abs(model - value):.4f} {side} {baseline}"
    elif s.get("max_steps") and s["steps"] < s["max_steps"]:
        heldout = (f"not evaluated: stopped at step {s['steps']} of {s['max_steps']}; rerun the same command to "
                   f"continue ({baseline})")  # fmt: skip
    else:
        heldout = f"not evaluated (no evaluation ran: --train.eval_interval); {baseline}"
    lines = [f"held-out bits/base {heldout}"]
    if masked:
        what = "; ".join(["two-sided k-mer context, same masking", *strands])
        lines.append(
            f"masked baselines   k={min(masked, key=int)}..{max(masked, key=int)} bases each side: "
            f"{' '.join(f'{v:.4f}' for v in masked.values())} ({what})"
        )
    low, high = min(markov, key=int), max(markov, key=int)
    orders = f"order-{low}..{high}" if low != high else f"order-{low}"
    notes = (["causal: one side, for scale only"] if masked else []) + strands
    notes = f" ({'; '.join(notes)})" if notes else ""
    lines.append(f"Markov baselines   {orders}: {' '.join(f'{v:.4f}' for v in markov.values())}{notes}")
    return lines
