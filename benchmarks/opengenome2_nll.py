"""Per-sequence mean NLL on the OpenGenome2 metagenomics test windows, beside BioNeMo's published figures.

    python benchmarks/opengenome2_nll.py [--runs runs/tiny runs/brca1] [--ranks 2]

For each run directory (default: the default job's runs/tiny), runs `megagenome eval` on
examples/data/opengenome2_metagenomics_test_100x8192.fasta (100 records of 8,192 bp) through the `deepspeed` launcher
and writes benchmarks/results/opengenome2_nll.md and .json: the per-sequence mean negative log-likelihood (nats/base,
averaged over records, the figure BioNeMo's OpenGenome2 recipe reports), bits/base overall, the model's size and
training (from the run's config.yaml and metrics.jsonl), the context window, wall time, next to BioNeMo's 0.920
(7B Llama-3 trained on OpenGenome2) and 1.019 (Evo2-style baseline). Every file it writes comes from this command.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import tempfile

import harness
import yaml

FASTA = harness.REPO / "examples" / "data" / "opengenome2_metagenomics_test_100x8192.fasta"
# (model as published, its size as published, per-sequence mean NLL in nats/base)
PUBLISHED = [
    ("BioNeMo OpenGenome2 recipe: Llama-3 trained on OpenGenome2", "7B", 0.920),
    ("BioNeMo OpenGenome2 recipe: Evo2-style baseline", "not stated", 1.019),
]


def training(run_dir: pathlib.Path) -> dict:
    """Size and training of a run, from its records."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    train, val = harness.run_rows(run_dir)
    return {
        "genome": os.path.basename(cfg["data"]["fasta"] or cfg["data"]["prepared"]),
        "steps": train[-1]["step"] if train else 0,
        "tokens": train[-1]["tokens"] if train else 0,
        "held_out_bits_per_base": val[-1]["bits_per_base"] if val else None,
        "model": {k: cfg["model"][k] for k in ("d_model", "n_layer", "n_head", "max_seq_len", "objective")},
    }


def evaluate(run_dir: pathlib.Path, ranks: int, work: pathlib.Path) -> dict:
    """`megagenome eval` on the OpenGenome2 windows through the deepspeed launcher; its JSON result."""
    fasta = harness.copy_input(FASTA, work)  # pyfaidx writes its index beside the FASTA: keep the checkout clean
    out = work / f"{run_dir.name}.json"
    cmd = harness.deepspeed_cmd(ranks, "--module", "megagenome", "eval", run_dir)
    cmd += ["--fasta", str(fasta), "--output", str(out), "--progress", "false"]
    subprocess.run(cmd, cwd=harness.REPO, check=True, env=harness.child_env())
    return json.loads(out.read_text())


def markdown(result: dict) -> str:
    lines = [
        "# Per-sequence mean NLL on the OpenGenome2 metagenomics test windows",
        "",
        f"Written by `python benchmarks/opengenome2_nll.py {' '.join(result['argv'])}` on {result['date']}.",
        f"Hardware: {result['hardware']}; {result['software']}.",
        "",
        f"Data: `examples/data/{FASTA.name}` (100 records x 8,192 bp, 13 N). Each record is scored by "
        "`megagenome eval` with windows of the model's context (each base but a record's first predicted once, "
        "from up to context - 1 bases before it; the context column is the megagenome model's); the figure is the "
        "mean over records of each record's NLL per base (nats), as BioNeMo's recipe reports it.",
        "",
        "| model | parameters | trained on | steps | tokens | context | per-sequence mean NLL (nats/base) | "
        "bits/base | eval wall s |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        t, e = row["training"], row["eval"]
        m = t["model"]
        lines.append(
            f"| `{row['run']}` ({m['d_model']}x{m['n_layer']}, {m['objective']}) | {e['run']['parameters']:,} | "
            f"{t['genome']} | {t['steps']:,} | {t['tokens']:,} | {e['run']['window']:,} | "
            f"{e['per_sequence_mean_nll']:.4f} | {e['overall']['bits_per_base']:.4f} | {e['run']['seconds']} |"
        )
    for name, size, value in result["published"]:
        bits = value / math.log(2)
        lines.append(f"| {name} (published) | {size} | OpenGenome2 | | | | {value:.3f} | {bits:.3f} (converted) | |")
    lines += [
        "",
        "The megagenome rows are small CPU models trained on one genome for minutes; they are not comparable to the "
        "published models in size, data or context (a uniform guess is ln 4 = 1.386 nats/base). They show that the "
        "number is computed the same way and what a model of this size reaches.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--runs", nargs="+", default=["runs/tiny"], help="Run directories to evaluate.")
    ap.add_argument("--ranks", type=int, default=2, help="Ranks of the eval launch.")
    ap.add_argument("--results", default=str(harness.RESULTS))
    ap.add_argument("--render", action="store_true", help="Rewrite the .md from the saved .json, evaluating nothing.")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.results)
    if args.render:
        result = json.loads((out / "opengenome2_nll.json").read_text())
        result["published"] = PUBLISHED
        harness.write_results(out, "opengenome2_nll", result, markdown(result), indent=2)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in args.runs:
            run_dir = (harness.REPO / run).resolve()
            rows.append(
                {"run": run, "training": training(run_dir), "eval": evaluate(run_dir, args.ranks, pathlib.Path(tmp))}
            )
    for row in rows:
        row["eval"].pop("records")  # 100 per-record rows: kept out of the results file
    result = {
        "date": harness.today(),
        "argv": harness.argv_of(argv),
        "hardware": harness.hardware(),
        "software": harness.software(),
        "published": PUBLISHED,
        "rows": rows,
    }
    harness.write_results(out, "opengenome2_nll", result, markdown(result), indent=2)
    print(markdown(result))


if __name__ == "__main__":
    main()
