"""Generation speed on CPU: cached decoding against full recompute, per family, prompt length and model size.

For each family (striped_hyena, the default job's; the transformer; hyena) at two sizes -- the default job's
(configs/tiny.yaml, tiny_transformer.yaml, tiny_hyena.yaml, ~0.86M parameters) and ~100M (configs/striped_125m.yaml
and dna_125m.yaml; hyena at dna_125m's width and depth) -- with random weights (speed does not depend on them),
fp32, one sample, and each prompt length (default 1,024, 8,192 and 32,768 bases; 32,768 at the default job's size
only unless --big_32k):

- cached: the prefill of the prompt (one forward that also fills the caches), then --steps one-base steps
  (model/decoding.py): seconds per step, bases/s, and the cache's bytes per sample;
- recompute: a full forward of the prompt per generated base, what decoding without a cache costs (the mean of two
  forwards at the prompt's length): seconds per step, bases/s;
- cached / recompute: the speedup at that prompt.

The step times at the three prompt lengths show how a step grows with the context: attention's and HyenaDNA's
implicit filter's steps grow linearly (they read every position so far), the FIR and LI states' stay flat (a
striped_hyena model's steps still grow with its attention layers).

    python benchmarks/generate.py [--prompts 1024 8192 32768] [--steps 64] [--big_32k] [--fresh]

Resumable: each (size, family, prompt) piece is written to benchmarks/results/generate.json as it finishes, and a
rerun skips the pieces there (--fresh: start over). One invocation: ~15-25 minutes on 2 cores.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import harness

REPO = pathlib.Path(__file__).resolve().parents[1]
SIZES = {
    "default job (~0.86M)": {"striped_hyena": "tiny.yaml", "transformer": "tiny_transformer.yaml",
                             "hyena": "tiny_hyena.yaml"},
    "~100M": {"striped_hyena": "striped_125m.yaml", "transformer": "dna_125m.yaml", "hyena": "dna_125m.yaml"},
}  # fmt: skip


def model_of(size: str, family: str, context: int):
    """A seeded model of the config's model section (family set, context raised to what the piece needs)."""
    import dataclasses

    import torch

    from megagenome.config.load import config_from_args
    from megagenome.data.tokenizer import VOCAB_SIZE
    from megagenome.model import family_of

    cfg = config_from_args(["--config", str(REPO / "configs" / SIZES[size][family])]).model
    extra = {"family": family} if family == "hyena" else {}
    cfg = dataclasses.replace(cfg, max_seq_len=context, compile=False, **extra)
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg, VOCAB_SIZE).eval()
    return model, sum(p.numel() for p in model.parameters())


def measure(size: str, family: str, prompt: int, steps: int) -> dict:
    import torch

    torch.manual_seed(1)
    model, params = model_of(size, family, prompt + steps)
    ids = torch.randint(3, 7, (1, prompt))
    with torch.no_grad():
        state = model.decode_state(1, prompt + steps)
        start = time.perf_counter()
        logits = model.decode(ids, state)[:, -1]
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(steps):
            logits = model.decode(3 + logits[:, 3:7].argmax(-1, keepdim=True), state)[:, -1]
        cached = (time.perf_counter() - start) / steps
        recompute = []
        for _ in range(2):
            start = time.perf_counter()
            model.table_logits(ids)
            recompute.append(time.perf_counter() - start)
    full = sum(recompute) / len(recompute)
    return {"size": size, "family": family, "prompt": prompt, "parameters": params, "steps": steps,
            "prefill_s": prefill, "cached_step_s": cached, "cached_bases_per_s": 1 / cached,
            "cache_bytes": state.nbytes(), "recompute_step_s": full, "recompute_bases_per_s": 1 / full,
            "speedup": full / cached}  # fmt: skip


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--prompts", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--big_32k", action="store_true", help="Also the ~100M models at prompts above 8,192 bases.")
    ap.add_argument("--fresh", action="store_true", help="Discard the pieces already measured.")
    ap.add_argument("--results", type=pathlib.Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(harness.argv_of(argv))
    path = args.results / "generate.json"
    record = {} if args.fresh or not path.exists() else json.loads(path.read_text())
    record.update({"date": harness.today(), "command": harness.command("generate.py", harness.argv_of(argv)),
                   "hardware": harness.hardware(), "software": harness.software()})  # fmt: skip
    rows = record.setdefault("rows", [])
    done = {(r["size"], r["family"], r["prompt"]) for r in rows}
    for size, families in SIZES.items():
        for family in families:
            for prompt in args.prompts:
                if (size, family, prompt) in done or (size.startswith("~100M") and prompt > 8192 and not args.big_32k):
                    continue
                row = measure(size, family, prompt, args.steps)
                rows.append(row)
                print(f"{size} {family} prompt {prompt:,}: cached {row['cached_bases_per_s']:,.1f} bases/s, "
                      f"recompute {row['recompute_bases_per_s']:,.2f} bases/s, x{row['speedup']:,.0f}, cache "
                      f"{row['cache_bytes'] / 2**20:,.1f} MiB", flush=True)  # fmt: skip
                harness.write_results(args.results, "generate", record, render(record))
    harness.write_results(args.results, "generate", record, render(record))
    return 0


def _order(row: dict) -> tuple:
    """Rows by size, family (SIZES' order), then prompt, however the resumed pieces were appended."""
    sizes = list(SIZES)
    return sizes.index(row["size"]), list(SIZES[row["size"]]).index(row["family"]), row["prompt"]


def render(record: dict) -> str:
    lines = ["# Generation on CPU: cached decoding against full recompute", ""]
    lines += harness.header(record)
    how = (
        "One sample, fp32, random weights; a step is one generated base. Recompute runs a full forward of the "
        "prompt per base (the mean of two); cached runs the prefill once (its time apart), then one step per base "
        "over the caches (model/decoding.py). `python benchmarks/generate.py` writes this file."
    )
    lines += ["", how, ""]
    cols = ["size", "family", "parameters", "prompt", "prefill (s)", "cached step (ms)", "cached bases/s",
            "cache per sample (MiB)", "recompute step (s)", "recompute bases/s", "cached / recompute"]  # fmt: skip
    rows = [[r["size"], r["family"], f"{r['parameters']:,}", f"{r['prompt']:,}", f"{r['prefill_s']:.2f}",
             f"{1000 * r['cached_step_s']:.2f}", f"{r['cached_bases_per_s']:,.1f}", f"{r['cache_bytes'] / 2**20:,.2f}",
             f"{r['recompute_step_s']:.3f}", f"{r['recompute_bases_per_s']:,.2f}", f"{r['speedup']:,.0f}x"]
            for r in sorted(record["rows"], key=_order)]  # fmt: skip
    lines += harness.table(cols, rows)
    skipped = "" if "--big_32k" in record.get("command", "") else (
        " The ~100M models were not run at prompts above 8,192 bases (--big_32k): a full forward of a 32,768-base "
        "prompt is minutes per base on 2 cores for the transformer.")  # fmt: skip
    lines += ["", "How a step grows with the context: compare a family's cached step at the three prompts. Attention "
              "and HyenaDNA's implicit filter read every position so far (linear); the FIR and LI states are flat, "
              f"so a striped_hyena model's step grows only with its attention layers.{skipped}", ""]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
