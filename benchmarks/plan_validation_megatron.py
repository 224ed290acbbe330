"""(d) of benchmarks/plan_validation.py: the planner's weak-scaling prediction for Megatron-LM's published study
(Shoeybi et al. 2019, arXiv:1909.08053v4, section 5.1, Table 1, Figure 5), pure arithmetic, and its table.
"""

from __future__ import annotations

# (d) Table 1: hidden size, attention heads, layers, model-parallel GPUs; Figure 5: weak-scaling efficiency at tp
# GPUs (model parallel) and at 64 x tp GPUs (model + data parallel), against the 1.2B model on 1 GPU.
MEGATRON = [(1536, 16, 40, 1, 1.00, 0.96), (1920, 20, 54, 2, 0.95, 0.83), (2304, 24, 64, 4, 0.82, 0.79)]
MEGATRON.append((3072, 32, 72, 8, 0.77, 0.74))


def megatron_setup(hidden: int, heads: int, layers: int, tp: int):
    """GPT shapes of Table 1 with d_ff = 8d/3 (12d² parameters per layer), fp16, 16 V100 per node, 150 GB/s in a
    node (one direction of NVSwitch's 300), 100 GB/s across, MFU calibrated on the published 1-GPU rate (39 of 125
    TFLOP/s, hardware FLOPs with full recomputation)."""
    from megagenome.model.transformer.costs import TransformerShape
    from megagenome.planner.choose import Setup
    from megagenome.planner.states import Precision
    from megagenome.planner.timing import Cluster

    # Every attention score counted (causal=False), as the calibration's FLOP rate was: Narayanan et al. 2021.
    s = TransformerShape(hidden, layers, heads, 8 * hidden // 3, 51200, 51200, True, 1024, 0.1, causal=False)
    cluster = Cluster(
        gpus=tp, gpus_per_node=16, gpu_memory_gb=32, gpu="V100", intra_node_gbps=150, inter_node_gbps=100, mfu=0.312
    )
    return Setup(s, 1024, 8, Precision("fp16", "fp16"), cluster, 125.0, tp=tp)


def megatron_rows() -> list[dict]:
    """Per Table 1 configuration, at tp GPUs and 64 x tp GPUs: published and predicted efficiency (per-GPU training
    FLOP rate over the 1.2B model's on 1 GPU; stage 0, fp16 gradients all-reduced after backward, full
    recomputation)."""
    from megagenome.model.transformer.costs import n_params, recompute_flops_per_token
    from megagenome.model.transformer.flops import flops_per_token
    from megagenome.planner.choose import Candidate, evaluate

    rows, base = [], None
    for hidden, heads, layers, tp, model_only, model_data in MEGATRON:
        setup = megatron_setup(hidden, heads, layers, tp)
        s, cand = setup.shape, Candidate(0, False, "full", 8)
        per_token = flops_per_token(n_params(s), layers, hidden, 1024, causal=False) + recompute_flops_per_token(
            s, 1024, "full"
        )
        small, large = evaluate(setup, cand), evaluate(setup, cand, gpus=64 * tp)
        base = base or 8 * 1024 * per_token / small["step_s"]
        for row, published in ((small, model_only), (large, model_data)):
            rate = 8 * 1024 * per_token / tp / row["step_s"]
            rows.append({"params": n_params(s), "tp": tp, "gpus": row["gpus"], "published": published})
            rows[-1] |= {"predicted": rate / base, "step_s": row["step_s"], "tensor_comm_s": row["tensor_comm_s"]}
            rows[-1]["dp_comm_s"] = row["dp_comm_s"]
    return rows


def data_parallel_steps(rows: list[dict]) -> list[dict]:
    """The x 64 data-parallel step alone: published (model+data)/(model) against the planner's t(tp) / t(64 tp)."""
    out = []
    for small, large in zip(rows[::2], rows[1::2]):
        published, predicted_eff = large["published"] / small["published"], small["step_s"] / large["step_s"]
        out.append({"tp": small["tp"], "gpus": [small["gpus"], large["gpus"]], "published": published})
        out[-1] |= {"predicted": predicted_eff, "difference": predicted_eff - published}
    return out


def _seconds(value: float) -> str:
    return f"{value:.3f}" if value else "0"


def megatron_md(r: dict) -> list[str]:
    """(d): the planner's weak-scaling prediction against Megatron-LM's published figures."""
    lines = [
        "## (d) Megatron-LM weak scaling (Shoeybi et al. 2019, arXiv:1909.08053v4, Table 1, Figure 5)",
        "",
        "Published: Figure 5's efficiency against the 1.2B model on 1 GPU. Predicted: the planner's per-GPU training "
        "FLOP rate over that baseline (Table 1 shapes, d_ff = 8d/3, fp16, stage 0, full recomputation, 16 GPUs per "
        "node, 150 GB/s in a node, 100 GB/s across, 5 µs latency, MFU 0.312 = 39/125 TFLOP/s).",
        "",
        "| params | tensor parallel | GPUs | published | predicted | step s | tensor-parallel all-reduces s "
        "| gradient all-reduce s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    d = r["megatron"]
    for x in d["rows"]:
        lines.append(
            f"| {x['params'] / 1e9:.1f}B | {x['tp']} | {x['gpus']} | {x['published']:.0%} | {x['predicted']:.1%} | "
            f"{x['step_s']:.3f} | {_seconds(x['tensor_comm_s'])} | {_seconds(x['dp_comm_s'])} |"
        )
    lines += [
        "",
        "The data-parallel step alone: published (model+data)/(model) against the planner's t(tp GPUs)/t(64·tp GPUs):",
        "",
        "| tensor parallel | GPUs | published | predicted | difference |",
        "|---|---|---|---|---|",
    ]
    for x in d["data_parallel"]:
        lines.append(
            f"| {x['tp']} | {x['gpus'][0]} -> {x['gpus'][1]} | {x['published']:.3f} | {x['predicted']:.3f} | "
            f"{x['difference']:+.3f} |"
        )
    far = d["largest_distance"]
    lines += [
        "",
        f"Largest distance from a published value over both tables: {far['distance']:.3f} ({far['where']}).",
        "",
    ]
    return lines
