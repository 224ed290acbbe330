"""Peak memory of `megagenome embed` over one long window, against the planner's inference estimate.

The model is issue 39's: a striped_hyena model with Evo 2 1B's layer pattern and filter lengths (25 layers: SE, MR,
LI and attention in Evo 2 1B's order; SE 7 taps, MR 128, LI 16 poles) and the options an imported Evo 2 carries
(byte table, StripedHyena's norm, GELU in block 0, output biases, MR taps without decay), at a reduced width
(--d_model, default 256; 2 heads of 128 like Evo 2's, MLP 2.75 x d_model like Evo 2 1B's 5120/1920), random
weights, exported in bf16 with the context of the longest window. For each window length (default 8,192, 32,768
and 131,072 bases) one `megagenome embed --dtype bf16 --window L --layers -1 --pool mean` runs in a fresh process
over one window of GRCh37 chr22 (tests/data), with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors go back to the
kernel and the peak RSS (VmHWM) is the peak of what was live. Beside it:

- the import baseline: the RSS of a process that has imported what `megagenome embed` imports (python, torch,
  megagenome), measured the same way; what the model and its window add is the peak minus it;
- the planner's estimate of that addition (model/hyena/inference_memory.py through planner/inference.py and
  run/plan.py inference_memory_of): the
  larger of loading (the file's tensors, the float32 model they are loaded into, the float32 copies loaded) and the
  forward (the bf16 weights and rotary tables, the largest layer's live tensors, the FFT blocks).

    python benchmarks/long_context_memory.py [--lengths 8192 32768 131072] [--d_model 256]

Writes benchmarks/results/long_context_memory.{md,json}. One invocation: ~10-20 minutes on 2 cores (the 131,072-base
window's four causal attention layers are most of it).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import harness

REPO = pathlib.Path(__file__).resolve().parents[1]
GENOME = REPO / "tests" / "data" / "GRCh37_chr22_20000001-21000000.fa"
CONTIG = "chr22_window"
START = 100_001  # 1-based: a window of N-free sequence from here (the record's N block is at 900,001-1,000,000)
# Evo 2 1B's layers (its config's hcs/hcm/hcl/attn_layer_idxs, model/hyena/evo2.py reads them so).
EVO2_1B_PATTERN = "SE MR LI A SE MR LI SE MR LI A SE MR LI SE MR LI A SE MR LI SE MR LI A"
PROBE = "import torch, megagenome.after_training.embedding, megagenome.cli; print(open('/proc/self/status').read())"


def model_config(d_model: int, context: int):
    from megagenome.config import ModelConfig

    return ModelConfig(
        family="striped_hyena", layer_pattern=EVO2_1B_PATTERN, n_layer=25, d_model=d_model, n_head=d_model // 128,
        d_ff=64 * -(-(d_model * 5120 // 1920) // 64), se_filter_len=7, mr_filter_len=128, state_size=16,
        short_filter_len=3, max_seq_len=context, vocabulary="bytes", norm_form="divide", mlp_activation="gelu_first",
        biases=["mixer_out", "attention_out"], mr_decay=False, norm_eps=1e-6,
    )  # fmt: skip


def write_export(cfg, out: pathlib.Path) -> None:
    import torch

    from megagenome.after_training.export import staged_export
    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model import family_of

    torch.manual_seed(0)
    state = family_of(cfg).build(cfg, VOCAB_SIZE).state_dict()
    with staged_export(str(out), cfg, state, "bf16", {"benchmark": "long_context_memory"}):
        pass


def vm(status: str, key: str) -> int:
    line = next(line for line in status.splitlines() if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def env() -> dict:
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}


def baseline() -> int:
    """VmHWM of a process that imported what embed imports."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env(), check=True)
    return vm(out.stdout, "VmHWM")


def write_genome(work: pathlib.Path, length: int) -> pathlib.Path:
    """One record of `length` N-free bases of the bundled chr22 piece, from START (a simple contig name)."""
    text = "".join(GENOME.read_text().splitlines()[1:])[START - 1 : START - 1 + length]
    assert len(text) == length and "N" not in text.upper(), "the chr22 piece has no such N-free stretch"
    path = work / "window.fa"
    path.write_text(f">{CONTIG}\n" + "\n".join(text[i : i + 80] for i in range(0, length, 80)) + "\n")
    return path


def embed_peak(export: pathlib.Path, fasta: pathlib.Path, length: int, work: pathlib.Path) -> tuple[int, float]:
    """(VmHWM of one `megagenome embed` of one window of `length` bases, its wall seconds)."""
    region = f"{CONTIG}:1-{length}"
    out = work / f"embed_{length}.safetensors"
    # A wrapper process runs the command and reports its child's peak RSS (ru_maxrss: the child's VmHWM), so that
    # each measurement is one fresh process's alone.
    wrapper = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]).returncode; "
        "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r)"
    )
    cmd = [sys.executable, "-c", wrapper, sys.executable, "-m", "megagenome", "embed", str(export), "--fasta",
           str(fasta), "--regions", region, "--window", str(length), "--layers", "-1", "--pool", "mean", "--dtype",
           "bf16", "--batch_size", "1", "--output", str(out), "--progress", "false"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or "MAXRSS" not in proc.stderr:
        raise RuntimeError(f"embed at {length} failed:\n{proc.stderr[-3000:]}")
    kib = int(proc.stderr.split("MAXRSS")[-1].split()[0])
    return kib * 1024, wall


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--work", type=pathlib.Path, default=None, help="Scratch directory (default: a temporary one).")
    ap.add_argument("--results", type=pathlib.Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(harness.argv_of(argv))
    from megagenome.run.plan import inference_memory_of

    cfg = model_config(args.d_model, max(args.lengths))
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="long_context_memory-"))
    export = work / "export"
    if not export.exists():
        write_export(cfg, export)
    fasta = write_genome(work, max(args.lengths))
    base = baseline()
    rows = []
    for length in args.lengths:
        peak, wall = embed_peak(export, fasta, length, work)
        estimate = inference_memory_of(cfg, length, batch=1, dtype="bf16", file_dtype="bf16")
        rows.append({"length": length, "peak_rss": peak, "baseline_rss": base, "added": peak - base,
                     "estimate": estimate, "ratio": (peak - base) / estimate["peak"], "wall_s": wall})  # fmt: skip
        print(
            f"{length}: peak {peak / 2**20:.0f} MiB, added {(peak - base) / 2**20:.0f} MiB, estimate "
            f"{estimate['peak'] / 2**20:.0f} MiB ({rows[-1]['ratio']:.2f}x), {wall:.0f} s",
            flush=True,
        )
    meta = {"date": harness.today(), "command": harness.command("benchmarks/long_context_memory.py", sys.argv[1:]),
            "hardware": harness.hardware(), "software": harness.software()}  # fmt: skip
    record = {**meta, "model": dataclasses.asdict(cfg), "rows": rows}
    harness.write_results(args.results, "long_context_memory", record, render(record))
    return 0


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def render(record: dict) -> str:
    m = record["model"]
    lines = ["# Peak memory of a long-window embed against the planner's inference estimate", ""]
    lines += harness.header(record)
    model = (f"Model: striped_hyena with Evo 2 1B's 25-layer pattern (`{m['layer_pattern']}`), d_model {m['d_model']}, "
             f"{m['n_head']} heads, MLP {m['d_ff']}, SE {m['se_filter_len']} / MR {m['mr_filter_len']} taps, "
             f"{m['state_size']} LI poles, the Evo 2 options (bytes, divide norm, gelu_first, biases, no MR decay), "
             "random weights, bf16; `megagenome embed --dtype bf16 --window L --layers -1 --pool mean`, one window per "
             "process.")  # fmt: skip
    lines += ["", model, ""]
    cols = ["window (bases)", "peak RSS (MiB)", "imports (MiB)", "added (MiB)", "estimate (MiB)", "of which weights + "
            "tables", "of which activations", "added / estimate", "wall (s)"]  # fmt: skip
    rows = []
    for r in record["rows"]:
        e = r["estimate"]
        rows.append([f"{r['length']:,}", mib(r["peak_rss"]), mib(r["baseline_rss"]), mib(r["added"]), mib(e["peak"]),
                     mib(e["weights"] + e["tables"]), mib(e["activations"]), f"{r['ratio']:.2f}",
                     f"{r['wall_s']:.0f}"])  # fmt: skip
    lines += harness.table(cols, rows)
    lines += ["", "The estimate's peak is the larger of loading and the forward (planner/inference.py); its parts here "
              "are the forward's.", ""]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
