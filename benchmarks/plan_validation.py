"""The figures behind `megagenome plan`'s validation that a script can produce (benchmarks/results/plan_validation.md).

- (a) model states per rank: the planner's bytes (planner.states model_states + resident_buffers) for every
  scenario of tests/test_plan.py (d_model 256, 4 layers, 2 ranks; ZeRO 0-3, bf16 / bf16 + fp32 accumulation / fp32,
  ZeRO-2/3 offload), and the paper's formula next to them; with --measure also the bytes DeepSpeed holds, from the
  memory.json of a 2-step `megagenome pretrain` per scenario, each through the real `deepspeed` launcher on 2 CPU
  ranks (one launch per scenario: 17 x 20-30 s on 2 cores; --scenarios picks some);
- (b) the per-layer activation formula (model/transformer/costs.py) against the bytes autograd saves in one forward
  pass (saved_tensors_hooks, distinct storages, parameters excluded), one process: B 2, T 64, d 64, 4 heads,
  4 layers, every_k with k 2, fp32 and bf16, dropout 0.1 (SDPA math kernel) and 0 (memory-efficient kernel);
- (c) the output of `python -m megagenome plan --config configs/dna_125m.yaml --gpus 8 --gpu_memory_gb 80 --gpu H100`;
- (d) the planner's weak-scaling prediction for Megatron-LM's published study (Shoeybi et al. 2019,
  arXiv:1909.08053v4, section 5.1, Table 1, Figure 5): pure arithmetic.

    python benchmarks/plan_validation.py [--measure [--scenarios zero0_bf16,zero3_fp32,...]] [--results_dir DIR]

Writes plan_validation.json and plan_validation_tables.md (all of it) in --results_dir (default benchmarks/results).
"""

from __future__ import annotations

import json
import pathlib
import shlex
import subprocess
import sys
import time

import harness
from plan_validation_megatron import data_parallel_steps, megatron_md, megatron_rows

REPO = harness.REPO
N = 2
MODEL = {"d_model": 256, "n_layer": 4, "n_head": 4, "max_seq_len": 128}  # tests/test_plan.py's MODEL
PRECISIONS = [  # name, precision fragment (None: none; bf16_only: {"bf16": {"enabled": true}}), weights, accumulation
    ("bf16", "bf16_only", "bf16", "bf16"),
    ("bf16acc32", "bf16.json", "bf16", "fp32"),
    ("fp32", None, "fp32", "fp32"),
]
# name -> (ZeRO fragment, precision fragment, weights, accumulation, offload): tests/test_plan.py's SCENARIOS
SCENARIOS = {
    f"zero{s}_{p}": (f"zero{s}.json", frag, w, g, False)
    for s in range(4)
    for p, frag, w, g in PRECISIONS
    if not (s == 0 and p == "bf16acc32")  # DeepSpeed refuses fp32 accumulation at stage 0
}
SCENARIOS.update(
    {f"zero{s}off_{p}": (f"zero{s}_offload.json", frag, w, g, True) for s in (2, 3) for p, frag, w, g in PRECISIONS}
)
B, T, D, HEADS, LAYERS, K = 2, 64, 64, 4, 4, 2  # (b): the shape of tests/test_activation_checkpointing.py
PLAN_ARGS = ["plan", "--config", "configs/dna_125m.yaml", "--gpus", "8", "--gpu_memory_gb", "80", "--gpu", "H100"]
MEASURE_TIMEOUT_S = 900


def shape(model: dict):
    from megagenome.config import ModelConfig, RootConfig
    from megagenome.run.plan import shape_of

    return shape_of(RootConfig(model=ModelConfig(**model)))


# ----- (a) model states ------------------------------------------------------------------------------------------


def predicted(name: str, rank: int) -> dict[str, float]:
    """The planner's bytes of each model state and of the buffers on `rank` of scenario `name` (as tests/test_plan.py
    predicts them)."""
    from megagenome.model.transformer.costs import n_params, param_groups
    from megagenome.planner.states import (
        STATES,
        Precision,
        gradient_buffer_elements,
        model_states,
        persistent_params,
        resident_buffers,
    )

    zero_file, _, weights, accum, offload = SCENARIOS[name]
    zero = json.loads((REPO / "ds_configs" / zero_file).read_text())["zero_optimization"]
    stage, prec, s = zero["stage"], Precision(weights, accum), shape(MODEL)
    psi = n_params(s)
    persistent = persistent_params(s, zero.get("stage3_param_persistence_threshold", 100_000))
    edges = gradient_buffer_elements(param_groups(s), N)[rank]
    states = model_states(psi, persistent, stage, N, prec, offload, edges)
    largest = 3 * MODEL["d_model"] ** 2
    buffers = resident_buffers(psi, stage, N, prec.at_stage(stage), zero, largest, offload)
    return {**{k: states[k].total for k in STATES}, "buffers": buffers.total}


def run_config(work: pathlib.Path, fasta: str, name: str) -> dict:
    """A 2-step run of the scenario's model and DeepSpeed fragments on phiX174 (tests/helpers.py's tiny run)."""
    zero_file, frag, *_ = SCENARIOS[name]
    files = [str(REPO / "ds_configs" / zero_file)]
    if frag == "bf16_only":
        files.append(str(work / harness.BF16_ONLY))
    elif frag:
        files.append(str(REPO / "ds_configs" / frag))
    return {
        "model": dict(MODEL),
        "data": {"fasta": fasta, "seq_len": 64, "val_ranges": ["NC_001422.1:4301-5386"], "eval_windows": 8},
        "train": {"ds_config": files, "micro_batch_size": 2, "max_steps": 2, "warmup_steps": 2, "log_interval": 1}
        | {"eval_interval": 0, "lr": 3e-3, "min_lr": 3e-4, "num_threads": 1},
        "checkpoint": {"interval": 0, "resume": "none"},
        "log": {"run_dir": str(work / name), "progress": False},
    }


def measure(names: list[str], work: pathlib.Path) -> dict[str, dict]:
    """One `deepspeed --num_gpus 2 --module megagenome pretrain` launch per scenario; its memory.json, exit code and
    wall time."""
    import yaml

    fasta = str(harness.copy_input(harness.PHIX, work / "genome"))  # pyfaidx indexes beside the FASTA
    harness.write_bf16_only(work)
    env = harness.child_env(OMP_NUM_THREADS="1")
    out = {}
    for name in names:
        config = work / f"{name}.yaml"
        config.write_text(yaml.safe_dump(run_config(work, fasta, name), sort_keys=False))
        target = ["--module", "megagenome", "pretrain", "--config", config]
        cmd = harness.deepspeed_cmd(N, *target, port=harness.free_port())
        started = time.time()
        rc, _ = harness.run_session(cmd, work / f"{name}.log", MEASURE_TIMEOUT_S, env=env)
        path = work / name / "memory.json"
        memory = json.loads(path.read_text()) if path.exists() else None
        out[name] = {
            "rc": rc,
            "wall_s": round(time.time() - started, 1),
            "parameters": memory and memory["parameters"],
            "world_size": memory and memory["world_size"],
            "memory": memory,
            "log_tail": None if rc == 0 else (work / f"{name}.log").read_text(errors="replace")[-2000:],
        }
        print(f"{name}: rc {rc}, {out[name]['wall_s']:.0f} s", flush=True)
    return out


def model_state_rows(measured: dict[str, dict]) -> list[dict]:
    """Per scenario and rank: predicted (and, where measured, measured) bytes of each component."""
    rows = []
    for name in SCENARIOS:
        run = measured.get(name)
        for rank in range(N):
            row = {"scenario": name, "rank": rank, "predicted": predicted(name, rank), "measured": None}
            if run and run["memory"]:
                got = run["memory"]["ranks"][rank]
                row["measured"] = {k: got[k] for k in row["predicted"]}
                row["ratio"] = {  # as the test judges: a zero prediction means nothing but scalars (<= 64 bytes)
                    k: got[k] / want if want else float(got[k] <= 64) for k, want in row["predicted"].items()
                }
            rows.append(row)
    return rows


def paper_rows(rows: list[dict]) -> list[dict]:
    """Model states per rank (rank 1, bytes/Ψ) by stage and precision, as the planner predicts them, beside the ZeRO
    paper's formula for mixed-precision Adam."""
    from megagenome.model.transformer.costs import n_params
    from megagenome.planner.states import STATES, paper_bytes

    psi = n_params(shape(MODEL))
    by_name = {r["scenario"]: r for r in rows if r["rank"] == 1}
    out = []
    for stage in range(4):
        row = {"stage": stage, "paper": paper_bytes(psi, stage, N) / psi}
        for p, *_ in PRECISIONS:
            r = by_name.get(f"zero{stage}_{p}")
            row[p] = sum(r["predicted"][k] for k in STATES) / psi if r else None
        out.append(row)
    return out


# ----- (b) activations ---------------------------------------------------------------------------------------------


def activation_rows() -> list[dict]:
    import torch

    from megagenome.config import ModelConfig
    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model.transformer import DNATransformer
    from megagenome.model.transformer.costs import activation_bytes

    sys.path.insert(0, str(REPO / "tests"))
    from support.saved import saved_bytes  # the measurement the activation-checkpointing tests make

    rows = []
    for policy in ("none", "full", "every_k", "selective"):
        for dropout in (0.1, 0.0):
            for dtype, e in ((torch.float32, 4), (torch.bfloat16, 2)):
                cfg = ModelConfig(
                    d_model=D,
                    n_layer=LAYERS,
                    n_head=HEADS,
                    max_seq_len=T,
                    dropout=dropout,
                    checkpointing=policy,
                    checkpoint_every=K,
                )
                kernel = "math" if dropout > 0 else "flash"
                s = shape({"d_model": D, "n_layer": LAYERS, "n_head": HEADS, "max_seq_len": T, "dropout": dropout})
                formula = activation_bytes(s, T, B, policy, e, K, kernel, math_bytes=4, mask_bytes=e)["saved"]
                torch.manual_seed(0)
                model = DNATransformer(cfg, VOCAB_SIZE).to(dtype).train()
                g = torch.Generator().manual_seed(7)
                ids = torch.randint(0, VOCAB_SIZE, (B, T), generator=g)  # (B, T), its own storage
                labels = torch.randint(0, VOCAB_SIZE, (B, T), generator=g)  # (B, T)
                params = {p.untyped_storage().data_ptr() for p in model.parameters()}
                torch.manual_seed(1)
                got = saved_bytes(lambda: model(ids, labels, torch.ones(B, T)), params)  # noqa: B023
                dt = "fp32" if e == 4 else "bf16"
                rows.append({"policy": policy, "dtype": dt, "dropout": dropout, "kernel": kernel})
                rows[-1] |= {"formula_bytes": formula, "measured_bytes": got}
    return rows


def window_view_figures() -> dict[str, int]:
    """The formula plus 8·B bytes for input ids that are a view of (B, T + 1) windows (fp32, dropout 0.1): what
    tests/test_activation_checkpointing.py's batches hold."""
    from megagenome.model.transformer.costs import activation_bytes

    s = shape({"d_model": D, "n_layer": LAYERS, "n_head": HEADS, "max_seq_len": T, "dropout": 0.1})
    kw = {"act_bytes": 4, "every": K, "kernel": "math", "math_bytes": 4, "mask_bytes": 4}
    return {p: activation_bytes(s, T, B, p, **kw)["saved"] + 8 * B for p in ("none", "full")}


# ----- (c) the CLI -------------------------------------------------------------------------------------------------


def plan_example() -> dict:
    cmd = [sys.executable, "-m", "megagenome", *PLAN_ARGS]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    return {"command": shlex.join(["python", "-m", "megagenome", *PLAN_ARGS]), "rc": proc.returncode} | {
        "stdout": proc.stdout,
        "stderr": proc.stderr[-2000:],
    }


# ----- results -----------------------------------------------------------------------------------------------------


def write_results(result: dict, results: pathlib.Path) -> None:
    harness.write_json(results / "plan_validation.json", result)
    harness.write_text(results / "plan_validation_tables.md", markdown(result))


def markdown(r: dict) -> str:
    lines = [
        "# `megagenome plan` validation: the generated tables",
        "",
        "Written entirely by benchmarks/plan_validation.py; plan_validation.md is the hand-written analysis of them.",
        "",
        *harness.header(r["meta"]),
        "",
    ]
    lines += model_states_md(r) + activations_md(r) + cli_md(r) + megatron_md(r)
    return "\n".join(lines)


def model_states_md(r: dict) -> list[str]:
    """(a): predicted (and measured) model states per rank and scenario, and the paper's formula beside them."""
    a = r["model_states"]
    measured = any(row["measured"] for row in a["rows"])
    lines = [
        "## (a) Model states per rank, ZeRO 0-3, 2 ranks",
        "",
        f"d_model {MODEL['d_model']}, {MODEL['n_layer']} layers, {MODEL['n_head']} heads, Ψ = {a['parameters']:,} "
        "parameters. Predicted: planner.states model_states + resident_buffers. Precision: `bf16` = "
        '`{"bf16": {"enabled": true}}`, `bf16acc32` = ds_configs/bf16.json (fp32 gradient accumulation), `fp32` = no '
        "mixed precision; `off` = ds_configs/zero{2,3}_offload.json.",
        "",
    ]
    parts = ["params", "grads", "master_params", "optimizer_states", "buffers"]
    if measured:
        lines += [
            "Measured: memory.json of a 2-step `megagenome pretrain` per scenario, one `deepspeed --num_gpus 2` launch "
            "each on CPU ranks (tensor bytes at step 2 between backward and the optimizer step). Bytes/Ψ, measured / "
            "predicted; worst ratio: the measured/predicted ratio farthest from 1 (a zero prediction counts 1 when at "
            "most 64 bytes, scalars, were measured).",
            "",
            "| scenario | rank | " + " | ".join(parts) + " | worst ratio | launch |",
            "|---|---|" + "---|" * (len(parts) + 2),
        ]
    else:
        lines += [
            "Measured: not in this run (`--measure` launches the measuring runs); the measured side is "
            "tests/test_plan.py::test_model_states_match_measured_bytes. Bytes/Ψ, predicted:",
            "",
            "| scenario | rank | " + " | ".join(parts) + " |",
            "|---|---|" + "---|" * len(parts),
        ]
    psi = a["parameters"]
    for row in a["rows"]:
        want = row["predicted"]
        if not measured:
            cells = [f"{want[k] / psi:.3f}" for k in parts]
            lines.append(f"| {row['scenario']} | {row['rank']} | " + " | ".join(cells) + " |")
            continue
        run = a["launches"].get(row["scenario"])
        launch = f"rc {run['rc']}, {run['wall_s']:.0f} s" if run else "not launched"
        if run and run["parameters"] is not None and (run["parameters"], run["world_size"]) != (psi, N):
            launch += f"; ran Ψ = {run['parameters']:,} on {run['world_size']} ranks, not as predicted"
        if row["measured"]:
            got = row["measured"]
            cells = [f"{got[k] / psi:.3f} / {want[k] / psi:.3f}" for k in parts]
            worst = max(row["ratio"].values(), key=lambda v: abs(v - 1))
            lines.append(f"| {row['scenario']} | {row['rank']} | " + " | ".join(cells) + f" | {worst:.4f} | {launch} |")
        else:
            cells = [f"- / {want[k] / psi:.3f}" for k in parts]
            lines.append(f"| {row['scenario']} | {row['rank']} | " + " | ".join(cells) + f" | | {launch} |")
    lines += [
        "",
        "The ZeRO paper's formula for mixed-precision Adam (docs/architecture.md) next to the planner's model states "
        "(rank 1, bytes/Ψ; stage 0 with fp32 accumulation is refused by DeepSpeed):",
        "",
        "| stage | paper | bf16 | bf16 + fp32 accumulation | fp32 |",
        "|---|---|---|---|---|",
    ]
    for p in r["paper_vs_planner"]:
        cols = [f"{p[k]:.2f}" if p[k] is not None else "refused" for k in ("bf16", "bf16acc32", "fp32")]
        lines.append(f"| {p['stage']} | {p['paper']:.2f} | " + " | ".join(cols) + " |")
    return lines


def activations_md(r: dict) -> list[str]:
    """(b): the activation formula against the saved tensor bytes."""
    b = r["activations"]
    lines = [
        "",
        "## (b) Activations: the formula against saved tensor bytes",
        "",
        f"B {B}, T {T}, d {D}, {HEADS} heads, {LAYERS} layers, every_k with k {K}, one process; measured: bytes of the "
        "distinct storages autograd saves in the forward pass (saved_tensors_hooks, parameters excluded). "
        "formula = measured:",
        "",
        "| policy | fp32, dropout 0.1 (math kernel) | bf16, dropout 0.1 | fp32, no dropout (efficient kernel) "
        "| bf16, no dropout |",
        "|---|---|---|---|---|",
    ]
    for policy in ("none", "full", "every_k", "selective"):
        cells = []
        for dropout in (0.1, 0.0):
            for dt in ("fp32", "bf16"):
                c = next(x for x in b["rows"] if (x["policy"], x["dtype"], x["dropout"]) == (policy, dt, dropout))
                sign = "=" if c["formula_bytes"] == c["measured_bytes"] else "!="
                cells.append(f"{c['formula_bytes']:,} {sign} {c['measured_bytes']:,}")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    equal = sum(x["formula_bytes"] == x["measured_bytes"] for x in b["rows"])
    w = b["window_view"]
    lines += [
        "",
        f"Equal in {equal} of {len(b['rows'])} cases. With input ids that are a view of (B, T + 1) windows (8·B bytes "
        f"more; fp32, dropout 0.1) the formula gives none {w['none']:,} and full {w['full']:,} bytes.",
        "",
    ]
    return lines


def cli_md(r: dict) -> list[str]:
    """(c): the output of `megagenome plan` for the 125M config."""
    lines = [
        "## (c) The CLI",
        "",
        f"`{r['plan_example']['command']}` (exit code {r['plan_example']['rc']}):",
        "",
        "```",
        r["plan_example"]["stdout"].rstrip("\n"),
        "```",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = harness.argv_of(argv)
    ap = harness.parser(__doc__)
    ap.add_argument("--measure", action="store_true", help="(a): launch the 2-rank runs and read their memory.json")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="scenarios --measure launches (comma-separated)")
    ap.add_argument("--results_dir", type=pathlib.Path, default=harness.RESULTS, help="where the results files go")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"--scenarios: {', '.join(unknown)} not in {', '.join(SCENARIOS)}")
    from megagenome.model.transformer.costs import n_params

    launches = {}
    if args.measure:
        work = harness.work_dir("mg-plan-validation-")
        launches = measure(names, work)
        print(f"work dir {work}")
    rows = model_state_rows(launches)
    megatron = megatron_rows()
    steps = data_parallel_steps(megatron)
    distances = [
        (abs(x["predicted"] - x["published"]), f"{x['params'] / 1e9:.1f}B on {x['gpus']} GPUs") for x in megatron
    ]
    distances += [(abs(x["difference"]), f"data-parallel step at tensor parallel {x['tp']}") for x in steps]
    far = max(distances)
    result = {
        "meta": {
            "date": harness.today(),
            "command": harness.command("plan_validation.py", argv),
            "hardware": harness.hardware(),
            "software": harness.software(),
        },
        "model_states": {
            "model": MODEL,
            "ranks": N,
            "parameters": n_params(shape(MODEL)),
            "launches": {k: {kk: vv for kk, vv in v.items() if kk != "memory"} for k, v in launches.items()},
            "rows": rows,
        },
        "paper_vs_planner": paper_rows(rows),
        "activations": {"rows": activation_rows(), "window_view": window_view_figures()},
        "plan_example": plan_example(),
        "megatron": {
            "rows": megatron,
            "data_parallel": steps,
            "largest_distance": {"distance": far[0], "where": far[1]},
        },
    }
    write_results(result, args.results_dir)
    print(f"wrote {args.results_dir}/plan_validation.json and plan_validation_tables.md")


if __name__ == "__main__":
    main()
