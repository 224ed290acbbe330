"""The summary that closes a run (layer L4): held-out bits per base next to Markov baselines fitted on the
training split, throughput, MFU/HFU, memory and wall time, printed and saved as <run dir>/summary.json."""

from __future__ import annotations

import math
import os
import sys

import numpy as np

from megagenome.config import RootConfig
from megagenome.data.dataset import GenomeData
from megagenome.data.markov import markov_bits_per_base
from megagenome.metrics import read_metrics
from megagenome.record import write_json


def summarise(cfg: RootConfig, data: GenomeData, metrics_path: str, result: dict, n_params: int, wall_s: float) -> dict:
    """Held-out bits/base next to Markov baselines, throughput and wall time; printed and saved."""
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
        "steps": train_rows[-1]["step"] if train_rows else 0,
        "train_loss": train_rows[-1]["loss"] if train_rows else None,
        "heldout_bits_per_base": final_eval.get("bits_per_base"),
        "markov_bits_per_base": {str(k): v for k, v in baselines.items()},
        "markov_strands": "both" if cfg.data.rc_prob > 0 else "forward",  # what the chains were fitted on
        "best_markov_order": best_k,
        "beats_best_markov": (final_eval.get("bits_per_base") or math.inf) < baselines[best_k],
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
        # train/divergence.py: the run's bad steps (every invocation's event rows) and what was done about them
        "bad_steps": _bad_steps([r for r in rows if r.get("split") == "event"]),
        "data_changes": result.get("data_changes") or [],  # resumed with --checkpoint.allow_data_change
    }
    write_json(os.path.join(cfg.log.run_dir, "summary.json"), summary)
    print_summary(summary)
    return summary


def _bad_steps(events: list[dict]) -> dict:
    """Counts of the event rows by what was done (skip, rollback, stop) and by reason (nonfinite, spike)."""
    out = {"total": len(events)}
    for key in ("event", "reason"):
        for row in events:
            out[row.get(key)] = out.get(row.get(key), 0) + 1
    return out


def print_summary(s: dict) -> None:
    out = sys.stdout
    print("\n== megagenome pretrain summary ==", file=out)
    print(f"run dir            {s['run_dir']}", file=out)
    print(f"parameters         {s['parameters']:,}", file=out)
    print(f"steps              {s['steps']}", file=out)
    print(f"train loss         {s['train_loss']:.4f} nats/token" if s["train_loss"] is not None else "", file=out)
    model_bpb = s["heldout_bits_per_base"]
    shown = "not evaluated yet" if model_bpb is None else f"{model_bpb:.4f}"
    print(f"held-out bits/base {shown}  (model)", file=out)
    for k, v in s["markov_bits_per_base"].items():
        mark = "  <- best baseline" if int(k) == s["best_markov_order"] else ""
        print(f"                   {v:.4f}  order-{k} Markov{mark}", file=out)
    verdict = "below" if s["beats_best_markov"] else "not yet below"
    strands = {"both": " (chains fitted on both strands of the training split)", "forward": ""}
    print(
        f"                   model is {verdict} the best Markov baseline{strands.get(s.get('markov_strands'), '')}",
        file=out,
    )
    if s["tokens_per_s_median"] is not None:
        print(f"tokens/s           {s['tokens_per_s_median']:,.0f} (median over logged intervals, all ranks)", file=out)
    if s.get("mfu_median") is not None:
        print(
            f"MFU                {100 * s['mfu_median']:.2f}%  (HFU {100 * s['hfu_median']:.2f}%; "
            f"{s['tflops_per_gpu_median']:.3g} TFLOP/s per device of {s['peak_tflops']:.3g}, {s['peak_source']})",
            file=out,
        )
        if s.get("mfu_full_attn_median") is not None and s["mfu_full_attn_median"] != s["mfu_median"]:
            print(
                f"                   causal attention counted at half (Megatron-LM); "
                f"{100 * s['mfu_full_attn_median']:.2f}% counting every score (PaLM)",
                file=out,
            )
    if s.get("real_token_fraction") is not None:
        print(f"real tokens        {100 * s['real_token_fraction']:.2f}% of positions carry loss", file=out)
    if s.get("mem_peak_bytes_max"):
        print(f"peak memory        {s['mem_peak_bytes_max'] / 2**30:.2f} GiB (largest rank)", file=out)
    bad = s.get("bad_steps") or {}
    if bad.get("total"):
        done = ", ".join(f"{bad[a]} {a}" for a in ("skip", "rollback", "stop") if bad.get(a))
        print(f"bad steps          {bad['total']} ({done}; metrics.jsonl rows with split 'event')", file=out)
    if s.get("data_changes"):
        print(f"data changed       {len(s['data_changes'])} difference(s), allowed on resume", file=out)
    print(f"wall time          {s['wall_s']:.1f} s", file=out, flush=True)
