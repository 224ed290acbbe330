"""megagenome's training step vs a bare DeepSpeed loop vs the Hugging Face Trainer: side by side, in one launch.

One `deepspeed --num_gpus N` launch of this script (a worker mode, CPU ranks on gloo here, GPUs as is) trains three
models in the same processes, on the same batches, under the same DeepSpeed JSON (ds_configs/zero1_bf16.json by default:
ZeRO-1, bf16, overlapped fp32 reduction; results/peers.md ran its earlier content, ZeRO-1 + bf16 with fp32 gradient
accumulation, which is [zero1.json, bf16.json] now; both run on DeepSpeed's CPU accelerator, docs/platform.md), the same
micro batch and gradient accumulation, merged with the run-config-owned keys by megagenome's own engine/ds_config.py
build_ds_config (AdamW, WarmupCosineLR, clipping, batch sizes), so all three get one dict:

- (a) megagenome: the step pretraining runs, train/trainer.py Trainer.step (engine(**batch), backward and step per
  micro batch, the step's loss read back, the batches' real tokens counted), on an engine built as pretrain.run
  builds it (DNATransformer, its AdamW parameter groups, engine/engine.py initialize with the ParallelState as mpu).
  Also (a') the same engine driven by the Trainer's loop, Trainer.fit(), K steps per call with one
  metrics row per call (what a run with --train.log_interval K adds: the stop-signal all-reduce every step, the
  metrics all-reduce and row, the loop's bookkeeping; not the hang watchdog, a thread that only reads a clock);
- (b) bare DeepSpeed: deepspeed.initialize on the same DNATransformer class (same seed, so the same weights) with
  the same parameter groups and dict, then `loss = engine(**batch)[0]; engine.backward(loss); engine.step()`;
- (c) Hugging Face: transformers.LlamaForCausalLM, randomly initialised from a LlamaConfig of the same shape (no
  weights downloaded), trained by transformers.Trainer with TrainingArguments(deepspeed=<the same dict>), fed a
  torch Dataset of the same token tensors through its own DataLoader (sequential sampler; accelerate shards it by
  batch, so the dataset is laid out for every rank to receive exactly the batches of (a) and (b)). Targets are given
  as shift_labels (the next base at every position, as megagenome's labels), so HF computes the same T-position loss.

Timing (docs/architecture.md, Performance method): after warm-up steps, R rounds; in each round every framework runs a
block of K optimizer steps, the others' blocks run from the Trainer's on_step_end callback at HF's block boundaries, so
the Trainer's engine stays alive and its rounds interleave with the others' (the order of a, a', b rotates every round).
A block is timed between accelerator synchronisations (for HF: from the on_step_end that opens it to the one that closes
it, so HF's dataloader, callbacks and bookkeeping are inside), per rank; the block's seconds per step is the slowest
rank's; a framework's figure is the median over rounds. Ratios: a/b (megagenome's overhead over bare DeepSpeed, target
<= 1.03) and a/c (target < 1). Every model's forward records its input tensors; after the run they are compared with the
expected batches, so "same batches" is checked, not assumed. The per-step on_step_begin ->
on_step_end spans of the Trainer are recorded too (they leave out its data fetch; unsynchronised on a GPU).

    python benchmarks/peers.py [--rounds 5] [--steps 4] [--warmup 2] [--nproc 2] [--d_model 256 --n_layer 4
        --n_head 4 --seq_len 512 --micro 2 --grad_accum 1]

Needs the bench extra (pip install -e '.[bench]': transformers, accelerate); megagenome itself never imports them.
Writes benchmarks/results/peers.{md,json}.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import time

import harness
from peers_worker import FRAMEWORKS, worker

OVERHEAD_TARGET = 1.03
PAIRS = {"a_over_b": ("a", "b"), "a_over_c": ("a", "c"), "a_fit_over_b": ("a_fit", "b"), "b_over_c": ("b", "c")}
TARGETS = {"a_over_b": ("<=", OVERHEAD_TARGET), "a_over_c": ("<", 1.0)}


def figures(ranks: list[dict], key: str, tokens_per_step: int) -> dict:
    """Seconds per step per round (slowest rank) of every framework under `key` (times or cpu_times), medians,
    ratios of the medians, and the paired per-round ratios (adjacent blocks of one round) with their quartiles."""
    per_round = harness.slowest_per_round(ranks, key, FRAMEWORKS)
    median = {name: statistics.median(v) if v else None for name, v in per_round.items()}
    out: dict = {
        "seconds_per_step_per_round": per_round,
        "seconds_per_step_median": median,
        "tokens_per_s_median": {k: tokens_per_step / v if v else None for k, v in median.items()},
        "ratio_of_medians": {},
        "paired_ratios": {},
        "paired_ratio_quartiles": {},
        "targets": {},
    }
    for pair, (x, y) in PAIRS.items():
        out["ratio_of_medians"][pair] = median[x] / median[y] if median[x] and median[y] else None
        paired = harness.paired_ratios(per_round[x], per_round[y])
        out["paired_ratios"][pair] = paired
        out["paired_ratio_quartiles"][pair] = harness.quartiles(paired)
        if pair in TARGETS and paired:
            op, limit = TARGETS[pair]
            q1, q2, q3 = out["paired_ratio_quartiles"][pair]
            out["targets"][pair] = {
                "target": f"{op} {limit}",
                "median_paired_ratio": q2,
                "median_meets_target": q2 <= limit if op == "<=" else q2 < limit,
                "verdict": harness.verdict(q1, q3, op, limit),
            }
    return out


def summarise(raw: dict) -> dict:
    """Wall-clock and CPU-time figures, the batch checks and the first losses."""
    ranks = raw["ranks"]
    tokens_per_step = raw["batch"]["global_batch"] * raw["batch"]["seq_len"]
    spans = [statistics.median(r["hf_step_spans"]) for r in ranks if r["hf_step_spans"]]
    return {
        "wall": figures(ranks, "times", tokens_per_step),
        "cpu": figures(ranks, "cpu_times", tokens_per_step),
        "hf_step_begin_to_end_median_s": max(spans) if spans else None,
        "same_batches": {k: all(r["checks"][k]["identical"] for r in ranks) for k in ranks[0]["checks"]},
        "checks": [r["checks"] for r in ranks],
        "first_loss": ranks[0]["first_loss"],
        "hf_logged_losses": ranks[0]["hf_logged_losses"],
    }


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def write_results(raw: dict, summary: dict, meta: dict, results: pathlib.Path) -> None:
    harness.write_json(results / "peers.json", {"meta": meta, "summary": summary, "raw": raw})
    b = raw["batch"]
    lines = [
        "# Peers: megagenome vs bare DeepSpeed vs the Hugging Face Trainer (one launch, interleaved)",
        "",
        *harness.header(meta),
        f"- launch: {raw['world']} ranks on {raw['device']}, exit code {meta['rc']}, {meta['wall_s']:.0f} s; "
        f"{meta['load']}",
        f"- DeepSpeed JSON: {meta['ds_config_file']} merged by megagenome's build_ds_config into one dict, given to "
        "all three (below); HF: " + raw["hf_mode"],
        f"- batch: micro {b['micro']} x accumulation {b['grad_accum']} x {raw['world']} ranks = {b['global_batch']} "
        f"sequences of {b['seq_len']} tokens per optimizer step; the same token tensors for all three (checked: "
        + ", ".join(f"{k} {'identical' if v else 'DIFFERENT'}" for k, v in summary["same_batches"].items())
        + ")",
        f"- timing: {meta['warmup']} warm-up steps, then {meta['rounds']} rounds of {meta['steps']} steps per "
        "framework, interleaved; median over rounds of the slowest rank's seconds per step",
        "",
        *timing_tables(summary),
        "",
        *model_table(raw),
        "",
        meta["parameter_note"],
        "",
        "Differences that remain by construction: megagenome fuses q, k and v into one matmul (HF: three); HF "
        "computes its rotary cos/sin every forward (megagenome: tables built once); HF's DeepSpeed integration hands "
        "DeepSpeed all parameters in one group, so AdamW decays the norm scales too (megagenome: matrices only; the "
        "same arithmetic per element); the Trainer all-reduces the step's token count for its loss normalisation "
        "(average_tokens_across_devices, its default) and fetches batches through its DataLoader and accelerate.",
        "",
        "## Exact DeepSpeed dict (all three)",
        "",
        "```json",
        json.dumps(raw["ds_config"], indent=1),
        "```",
        "",
        *meta.get("notes", []),
    ]
    if raw.get("hf_deepspeed_error"):
        lines += ["", "## HF Trainer + DeepSpeed failure (fallback used)", "", "```", raw["hf_deepspeed_error"], "```"]
    harness.write_text(results / "peers.md", "\n".join(lines) + "\n")


RATIOS = {
    "a_over_b": "a/b: megagenome step / bare DeepSpeed (our overhead)",
    "a_over_c": "a/c: megagenome step / HF Trainer",
    "a_fit_over_b": "a'/b: megagenome fit() loop / bare DeepSpeed",
    "b_over_c": "b/c: bare DeepSpeed / HF Trainer",
}


def timing_tables(summary: dict) -> list[str]:
    """Seconds per step of every framework, then the ratios (paired per round, with their verdicts)."""
    wall, cpu = summary["wall"], summary["cpu"]
    per_framework = [
        [f"({name}) {label}", _fmt(wall["seconds_per_step_median"][name], ".4f")]
        + [_fmt(wall["tokens_per_s_median"][name], ",.0f"), _fmt(cpu["seconds_per_step_median"][name], ".4f")]
        + [" ".join(f"{v:.4f}" for v in wall["seconds_per_step_per_round"][name])]
        for name, label in FRAMEWORKS.items()
    ]
    ratios = []
    for pair, label in RATIOS.items():
        wq, cq = wall["paired_ratio_quartiles"][pair], cpu["paired_ratio_quartiles"][pair]
        target = wall["targets"].get(pair, {})
        ratios.append(
            [label, f"{wq[1]:.3f} [{wq[0]:.3f}, {wq[2]:.3f}]", _fmt(wall["ratio_of_medians"][pair], ".3f")]
            + [f"{cq[1]:.3f} [{cq[0]:.3f}, {cq[2]:.3f}]", target.get("target", ""), target.get("verdict", "")]
            + [cpu["targets"].get(pair, {}).get("verdict", "")]
        )
    columns = ["framework", "wall s/step (median)", "tokens/s (wall)", "CPU s/step (median)", "wall s/step per round"]
    ratio_columns = ["ratio", "wall: median paired [IQR]", "wall: ratio of medians", "CPU: median paired [IQR]"]
    return [
        *harness.table(columns, per_framework),
        "",
        "Ratios: paired per round (the two frameworks' blocks of the same round), median and interquartile range "
        "over rounds, and the ratio of the two medians; in wall-clock time and in CPU time (process time of the "
        "slower rank, which leaves out waiting for a core that other jobs hold, but also counts gloo's busy waits). "
        "A target is met (or not) when the whole interquartile range of the paired ratios lies on one side of it.",
        "",
        *harness.table([*ratio_columns, "target", "verdict (wall)", "verdict (CPU)"], ratios),
        "",
        "Paired wall ratios per round, a/b: "
        + " ".join(f"{v:.3f}" for v in wall["paired_ratios"]["a_over_b"])
        + "; a/c: "
        + " ".join(f"{v:.3f}" for v in wall["paired_ratios"]["a_over_c"])
        + ". HF's on_step_begin -> on_step_end span (no data fetch), median: "
        + _fmt(summary["hf_step_begin_to_end_median_s"], ".4f")
        + " s.",
        "",
        "First training step's loss (same weights and batch for a and b): "
        + ", ".join(f"{k} {_fmt(v, '.6f')}" for k, v in summary["first_loss"].items())
        + f"; HF logged losses: {[round(v, 4) for v in summary['hf_logged_losses']]}.",
    ]


def model_table(raw: dict) -> list[str]:
    """The two models side by side: shape, parameters by kind, engine."""
    mg, hf = raw["megagenome_model"], raw["hf_model"]
    c = hf["config"]
    rows = [
        ["vocabulary rows", mg["vocab_rows"], c["vocab_size"]],
        ["width", mg["d_model"], c["hidden_size"]],
        ["MLP width (SwiGLU)", mg["d_ff"], c["intermediate_size"]],
        ["layers", mg["n_layer"], c["num_hidden_layers"]],
        ["heads (kv heads)", mg["n_head"], f"{c['num_attention_heads']} ({c['num_key_value_heads']})"],
        ["positions", mg["max_seq_len"], c["max_position_embeddings"]],
        ["RMSNorm eps", mg["norm_eps"], c["rms_norm_eps"]],
        ["tied embeddings", mg["tie_embeddings"], c["tie_word_embeddings"]],
    ]
    rows += [
        [f"parameters: {kind}", f"{mg['parameters_by_kind'][kind]:,}", f"{hf['parameters_by_kind'][kind]:,}"]
        for kind in mg["parameters_by_kind"]
    ]
    rows.append(["engine", "deepspeed.DeepSpeedEngine", hf["hf_engine"]])
    head = ["| | megagenome DNATransformer | transformers LlamaForCausalLM |", "|---|---|---|"]  # a blank first header
    return ["## The two models", "", *head, *(f"| {what} | {ours} | {theirs} |" for what, ours, theirs in rows)]


def parameter_note(raw: dict) -> str:
    mg, hf = raw["megagenome_model"], raw["hf_model"]
    diff = hf["parameters"] - mg["parameters"]
    if diff == 0:
        return (
            f"Parameter counts: {mg['parameters']:,} both. They match exactly here: the vocabulary (8 tokens) is "
            "already a multiple of megagenome's padding (8), both models are bias-free with tied embeddings, "
            "qkv fused (3·d·d) equals q, k, v (3 x d·d) with as many kv heads as heads, and the rotary tables are "
            "buffers, not parameters, in both. They would differ with a vocabulary that megagenome pads (its extra "
            "embedding rows) or with grouped-query attention on the HF side."
        )
    by = {k: hf["parameters_by_kind"][k] - mg["parameters_by_kind"][k] for k in mg["parameters_by_kind"]}
    return f"Parameter counts differ by {diff:,} (HF - megagenome), by kind: {by}."


def parse_args(argv: list[str]):
    ap = harness.parser(__doc__, worker=True)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per framework per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per framework first")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (GPUs, or CPU processes)")
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_head", type=int, default=4)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--micro", type=int, default=2, help="micro batch per rank")
    ap.add_argument("--grad_accum", type=int, default=1)
    ap.add_argument("--ds_config", type=pathlib.Path, default=harness.REPO / "ds_configs" / "zero1_bf16.json")
    ap.add_argument("--fasta", type=pathlib.Path, default=harness.ECOLI, help="genome the batches come from")
    ap.add_argument("--val_range", default=harness.ECOLI_VAL[0], help="held-out range of --fasta (contig:start-end)")
    ap.add_argument("--num_threads", type=int, default=None, help="torch CPU threads per rank (default cores/ranks)")
    ap.add_argument("--timeout_s", type=float, default=1800.0, help="wall-clock limit of the launch")
    ap.add_argument("--results_dir", type=pathlib.Path, default=harness.RESULTS)
    args = ap.parse_args(argv)
    if not args.worker and (args.warmup < 1 or args.steps < 1 or args.rounds < 1):
        ap.error("--warmup, --steps and --rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = harness.argv_of(argv)
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    work = harness.work_dir("mg-peers-")
    fasta = harness.copy_input(args.fasta, work)  # pyfaidx writes its index beside the FASTA
    spec = work / "spec.json"
    keys = ("rounds", "steps", "warmup", "d_model", "n_layer", "n_head", "seq_len", "micro", "grad_accum")
    extra = {"fasta": str(fasta), "val_ranges": [args.val_range], "ds_config": str(args.ds_config)}
    spec.write_text(json.dumps({k: getattr(args, k) for k in keys} | extra | {"num_threads": args.num_threads}))
    started, load_before = time.time(), harness.load_average()
    env = harness.child_env(defaults=HF_OFFLINE)  # nothing is downloaded: the HF model is built from a config
    # a hung worker is stopped with every rank
    rc, tail = harness.launch_worker(
        __file__, args.nproc, spec, work / "worker.log", args.timeout_s, env=env, tail=6000
    )
    wall, load_after = time.time() - started, harness.load_average()
    raw_path = work / "raw.json"
    if not raw_path.exists():
        raise SystemExit(f"peers.py: the worker wrote no results (exit code {rc}); log {work / 'worker.log'}:\n{tail}")
    raw = json.loads(raw_path.read_text())
    summary = summarise(raw)
    load = f"1-minute load average {load_before:.1f} before, {load_after:.1f} after (the {args.nproc} ranks alone "
    load += f"make {args.nproc}; {os.cpu_count()} cores)"
    meta = {
        "date": harness.today(),
        "command": harness.command("peers.py", argv),
        "hardware": harness.hardware() + harness.gpus(),
        "software": harness.software(
            f"transformers {raw['versions']['transformers']}", f"accelerate {raw['versions']['accelerate']}"
        ),
        "rc": rc,
        "wall_s": wall,
        "load": load,
        "ds_config_file": os.path.relpath(args.ds_config, harness.REPO),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "parameter_note": parameter_note(raw),
        "work_dir": str(work),
        "notes": NOTES,
    }
    write_results(raw, summary, meta, args.results_dir)
    for kind in ("wall", "cpu"):
        print(kind, json.dumps(summary[kind]["targets"]), flush=True)
    print(f"wrote {args.results_dir}/peers.{{md,json}} (work dir {work})")


HF_OFFLINE = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
NOTES = [
    "Notes:",
    "",
    "- Absolute times on CPU are this shared 2-core machine's only (docs/architecture.md: ratios side by side; "
    "absolute times only from a GPU). On a GPU run the same command; each block is timed between "
    "synchronisations.",
    "- (a') runs fit() for K steps per call: every call ends with a metrics row (an all-reduce and a JSON "
    "line), like --train.log_interval K, and fit() all-reduces the stop-signal flag every step.",
    "- Reading the CPU figures: the three spend their time in the same matmuls, so their CPU seconds per step "
    "agree to about 1-2%, while wall time on a shared 2-core machine also carries other jobs' load (its "
    "per-round ratios scatter by tens of percent). What a framework adds per step (Python, data loading, "
    "synchronisations) weighs most against a GPU's short steps: the targets are decided on a GPU, with "
    "this same command.",
]


if __name__ == "__main__":
    main()
