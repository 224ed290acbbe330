"""What the default job's model generates: 5 kb from a K-12 promoter, its GC content and 3-mer spectrum against the
genome's.

The worked example of docs/after-training.md (Generating DNA), on the model the default job trains
(`bash launch/local.sh`: configs/tiny.yaml, 600 steps, runs/tiny). `megagenome generate` (a subprocess, one
process) continues the lac promoter (K-12 MG1655 365,530-365,603, minus strand: the -35 and -10 boxes, the CAP
site and the operator, read towards lacZ) by --length bases, --num_samples samples at each --temperatures, and
writes each generated base's log-probability (--scores). Each sample's generated bases (the prompt left out) are
compared with the whole genome, both strands (the model trains on both: rc_prob 0.5):

- GC content;
- the 3-mer spectrum: the Jensen-Shannon divergence (bits) between the sample's 64 3-mer frequencies and the
  genome's, and their Pearson correlation;
- the longest run of one base (a model that degenerates repeats itself);
- the model's own bits/base on its samples (the mean -log2 p of each drawn base), against its held-out bits/base
  (the run's last evaluation): at temperature 1 a calibrated model draws bases as surprising as real DNA is to it.

Reference points, each the same length and count: random windows of the genome itself on a random strand (how far a
real 5-kb stretch is from the whole genome: the noise floor), bases drawn independently at the genome's base
frequencies (the GC content right, nothing else), and an order-2 Markov chain fitted on the genome (its 3-mer
spectrum right by construction, nothing longer).

    python benchmarks/generate_composition.py [--run runs/tiny] [--length 5000] [--num_samples 16]
        [--temperatures 1.0 0.7] [--seed 1]

Writes benchmarks/results/generate_composition.{md,json}. One invocation: about a minute on 2 cores (after the
default job).
"""

from __future__ import annotations

import itertools
import pathlib
import subprocess
import sys
import tempfile

import harness
import numpy as np

LAC = ("K-12-MG1655", 365529, 365603)  # 0-based, end-exclusive; minus strand
LAC_PROMOTER = "TTTACACTTTATGCTTCCGGCTCGTATGTTGTGTGGAATTGTGAGCGGATAACAATTTCACACAGGAAACAGCT"
KMERS = ["".join(p) for p in itertools.product("ACGT", repeat=3)]
CODE = np.full(256, 255, dtype=np.uint8)
for _i, _b in enumerate(b"ACGT"):
    CODE[_b] = _i


def reverse_complement(seq: str) -> str:
    return seq[::-1].translate(str.maketrans("ACGTN", "TGCAN"))


def kmer_counts(seq: str, k: int = 3) -> np.ndarray:
    """Counts of the 4**k k-mers of seq (upper case), k-mers with a non-ACGT base skipped; index = base-4 number."""
    codes = CODE[np.frombuffer(seq.encode(), dtype=np.uint8)].astype(np.int64)
    if len(codes) < k:
        return np.zeros(4**k, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(codes, k)
    windows = windows[(windows < 4).all(axis=1)]
    index = (windows * 4 ** np.arange(k - 1, -1, -1)).sum(axis=1)
    return np.bincount(index, minlength=4**k)


def js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence of two distributions, in bits."""
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a, b):
        keep = a > 0
        return float((a[keep] * np.log2(a[keep] / b[keep])).sum())

    return (kl(p, m) + kl(q, m)) / 2


def longest_run(seq: str) -> int:
    return max((len(list(g)) for _, g in itertools.groupby(seq)), default=0)


def composition(seq: str, genome_3mers: np.ndarray) -> dict:
    counts = kmer_counts(seq)
    return {
        "gc": (seq.count("G") + seq.count("C")) / len(seq),
        "js_3mer_bits": js_divergence(counts, genome_3mers),
        "pearson_3mer": float(np.corrcoef(counts, genome_3mers)[0, 1]),
        "longest_run": longest_run(seq),
    }


def genome_of() -> str:
    import pyfaidx

    with pyfaidx.Fasta(str(harness.ECOLI)) as fasta:
        return str(fasta[LAC[0]]).upper()


def references(genome: str, length: int, count: int, seed: int) -> dict[str, list[str]]:
    """Sequences of the reference points (module docstring), `count` of each, `length` bases."""
    rng = np.random.default_rng(seed)
    both = genome + "N" + reverse_complement(genome)
    windows = []
    for start in rng.integers(0, len(genome) - length, count):
        window = genome[start : start + length]
        windows.append(window if rng.random() < 0.5 else reverse_complement(window))
    base_counts = kmer_counts(both, 1)
    iid = ["".join(rng.choice(list("ACGT"), length, p=base_counts / base_counts.sum())) for _ in range(count)]
    trimer = kmer_counts(both, 3).reshape(16, 4).astype(float)  # rows: the 2 bases before; columns: the next base
    trimer /= trimer.sum(axis=1, keepdims=True)
    markov = []
    for _ in range(count):
        codes = list(rng.choice(4, 2, p=base_counts / base_counts.sum()))
        for _ in range(length - 2):
            codes.append(rng.choice(4, p=trimer[codes[-2] * 4 + codes[-1]]))
        markov.append("".join("ACGT"[c] for c in codes))
    return {"genome windows (noise floor)": windows, "independent bases at the genome's frequencies": iid,
            "order-2 Markov chain of the genome": markov}  # fmt: skip


def read_fasta(path: pathlib.Path) -> list[tuple[str, str]]:
    records, name, parts = [], None, []
    for line in path.read_text().splitlines():
        if line.startswith(">"):
            if name is not None:
                records.append((name, "".join(parts)))
            name, parts = line[1:], []
        else:
            parts.append(line.strip())
    if name is not None:
        records.append((name, "".join(parts)))
    return records


def generate(run: str, prompt: str, args, temperature: float, work: pathlib.Path) -> tuple[list[str], list[float]]:
    """`megagenome generate` in a subprocess: the generated bases of each sample, and every drawn base's log2 p."""
    fasta, scores = work / f"t{temperature}.fa", work / f"t{temperature}.tsv"
    cmd = [sys.executable, "-m", "megagenome", "generate", run, "--prompt", prompt, "--length", str(args.length),
           "--num_samples", str(args.num_samples), "--temperature", str(temperature), "--seed", str(args.seed),
           "--output", str(fasta), "--scores", str(scores), "--progress", "false"]  # fmt: skip
    done = subprocess.run(cmd, cwd=harness.REPO, env=harness.child_env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"megagenome generate failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    samples = [seq[len(prompt) :] for _, seq in read_fasta(fasta)]
    rows = [line.split("\t") for line in scores.read_text().splitlines()[1:] if line.strip()]
    log2p = [float(r[-1]) / np.log(2) for r in rows]
    return samples, log2p


def summary(values: list[float]) -> dict:
    return {"mean": float(np.mean(values)), "sd": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
            "min": float(np.min(values)), "max": float(np.max(values))}  # fmt: skip


def rows_of(sequences: list[str], genome_3mers: np.ndarray) -> dict:
    each = [composition(s, genome_3mers) for s in sequences]
    return {key: summary([e[key] for e in each]) for key in each[0]}


def run_facts(run: pathlib.Path) -> dict:
    """The run's steps and last held-out bits/base (its metrics.jsonl), where it has them."""
    train, val = harness.run_rows(run) if (run / "metrics.jsonl").exists() else ([], [])
    last = val[-1] if val else {}
    return {"steps": train[-1].get("step") if train else None, "val_bits_per_base": last.get("bits_per_base")}


def main(argv=None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--run", default="runs/tiny", help="The default job's run directory (or an export).")
    ap.add_argument("--length", type=int, default=5000)
    ap.add_argument("--num_samples", type=int, default=16)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--results", type=pathlib.Path, default=harness.RESULTS)
    args = ap.parse_args(harness.argv_of(argv))
    run = pathlib.Path(args.run) if pathlib.Path(args.run).is_absolute() else harness.REPO / args.run
    if not run.is_dir():
        sys.exit(f"--run {args.run}: no such run directory (train the default job first: bash launch/local.sh)")
    genome = genome_of()
    prompt = reverse_complement(genome[LAC[1] : LAC[2]])
    assert prompt == LAC_PROMOTER, "the lac promoter is not where LAC says"
    genome_3mers = kmer_counts(genome + "N" + reverse_complement(genome))
    base_counts = kmer_counts(genome, 1)
    record = {"date": harness.today(), "command": harness.command("generate_composition.py", harness.argv_of(argv)),
              "hardware": harness.hardware(), "software": harness.software(), "run": args.run, **run_facts(run),
              "prompt": prompt, "length": args.length, "num_samples": args.num_samples, "seed": args.seed,
              "genome": {"gc": float(base_counts[1:3].sum() / base_counts.sum()), "length": len(genome),
                         "longest_run": longest_run(genome)}, "rows": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        for temperature in args.temperatures:
            samples, log2p = generate(str(run), prompt, args, temperature, pathlib.Path(work))
            row = {"source": f"megagenome generate, temperature {temperature:g}", **rows_of(samples, genome_3mers)}
            row["model_bits_per_base"] = -float(np.mean(log2p))
            counts = sum(kmer_counts(s) for s in samples)
            ratio = (counts / counts.sum()) / (genome_3mers / genome_3mers.sum())
            row["kmer_ratio"] = dict(zip(KMERS, ratio.tolist()))
            record["rows"].append(row)
            print(f"temperature {temperature:g}: GC {row['gc']['mean']:.3f}, 3-mer JS "
                  f"{row['js_3mer_bits']['mean']:.4f} bits, {row['model_bits_per_base']:.3f} bits/base")  # fmt: skip
    for name, sequences in references(genome, args.length, args.num_samples, args.seed).items():
        record["rows"].append({"source": name, **rows_of(sequences, genome_3mers)})
    harness.write_results(args.results, "generate_composition", record, render(record))
    return 0


def render(r: dict) -> str:
    lines = ["# What the default job's model generates: composition against the genome", ""]
    lines += harness.header(r)
    val = f"{r['val_bits_per_base']:.4f}" if r.get("val_bits_per_base") is not None else "not recorded"
    lines += ["", f"Model: `{r['run']}` after {r['steps']} steps (held-out bits/base {val}). Prompt: the lac promoter "
              f"(K-12 MG1655 365,530-365,603, minus strand, {len(r['prompt'])} bases): `{r['prompt']}`. Each row: "
              f"{r['num_samples']} sequences of {r['length']:,} bases (the generated bases only), each compared with "
              f"the whole genome, both strands (GC {100 * r['genome']['gc']:.2f}%); mean ± sd over the sequences. "
              "JS: the Jensen-Shannon divergence between the sequence's 3-mer frequencies and the genome's (bits; 0 = "
              "the same). `python benchmarks/generate_composition.py` writes this file.", ""]  # fmt: skip
    cols = ["sequences", "GC %", "3-mer JS (bits)", "3-mer Pearson r", "longest one-base run",
            "model's bits/base on them"]  # fmt: skip
    table = []
    for row in r["rows"]:
        bits = f"{row['model_bits_per_base']:.3f}" if "model_bits_per_base" in row else ""
        table.append([row["source"], f"{100 * row['gc']['mean']:.2f} ± {100 * row['gc']['sd']:.2f}",
                      f"{row['js_3mer_bits']['mean']:.4f} ± {row['js_3mer_bits']['sd']:.4f}",
                      f"{row['pearson_3mer']['mean']:.3f}",
                      f"{row['longest_run']['mean']:.1f} (max {row['longest_run']['max']:.0f})", bits])  # fmt: skip
    lines += harness.table(cols, table)
    g = r["genome"]
    lines += ["", f"The genome's longest one-base run: {g['longest_run']} bases in {g['length']:,}.", ""]
    for row in r["rows"]:
        if "kmer_ratio" not in row:
            continue
        ranked = sorted(row["kmer_ratio"].items(), key=lambda kv: kv[1])
        low = ", ".join(f"{k} {v:.2f}" for k, v in ranked[:4])
        high = ", ".join(f"{k} {v:.2f}" for k, v in ranked[::-1][:4])
        lines += [f"- {row['source']}: the 3-mers furthest below the genome's frequency (sample/genome) {low}; "
                  f"furthest above {high}."]  # fmt: skip
    return "\n".join(lines + [""])


if __name__ == "__main__":
    sys.exit(main())
