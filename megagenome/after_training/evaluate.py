"""`megagenome eval` (layer L4): a trained model's bits per base on any FASTA, overall, per record and for soft-masked
vs unmasked bases, and the per-sequence mean negative log-likelihood (nats/base averaged over records) that BioNeMo's
OpenGenome2 recipe reports.

Windows. A causal model scores every base of a record except its first exactly once: windows of `window` tokens
overlap by one base (window k starts at k x (window - 1)), and each base is predicted from the up to window - 1 bases
before it in its window. A masked model scores every base once per non-overlapping window by masked pseudo-likelihood
(inference.masked_log_probs). N bases are never targets (as in training); they are counted apart.

Reverse complement (--reverse_complement): each record is scored on both strands and a base's log-likelihood is the
mean of its two predictions (one where a strand has none, e.g. a causal model's first base).

Ranks. Under the `deepspeed` launcher the batches (formed once, the same at any world size) are dealt round-robin
over ranks and their log-probabilities gathered on rank 0, which sums in a fixed order: the result equals one
process's. Sums are float64.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from megagenome.after_training.inference import (
    World,
    batched,
    load_model,
    log_probs,
    pad_batch,
    read_stretches,
    start_world,
)
from megagenome.data.fasta import FastaError, Genome
from megagenome.data.tokenizer import N_ID, reverse_complement
from megagenome.files.outputs import OutputError, check_outputs, describe_os_error, write_text
from megagenome.weights.consolidate import CheckpointError

PROG = "megagenome eval"


@dataclass
class Sequence:
    """One scored stretch: a record or a region of it."""

    name: str
    tokens: np.ndarray  # uint8 token ids
    softmask: np.ndarray  # bool, True where the base was lowercase


@dataclass
class Window:
    seq: int  # index into the sequences
    strand: int  # 0 forward, 1 reverse complement
    start: int  # first token of the window on its strand
    tokens: np.ndarray


class EvalError(ValueError):
    """Bad input to `megagenome eval`; the message names the flag or file."""


def read_sequences(fasta: str, regions: list[str]) -> list[Sequence]:
    """The records of `fasta` (or the given regions of it) as token arrays."""
    with Genome(fasta) as genome:
        return [Sequence(s.name, s.tokens, s.softmask) for s in read_stretches(genome, regions, EvalError)]


def windows(seqs: list[Sequence], window: int, causal: bool, rc: bool) -> list[Window]:
    """Every window to score, strand by strand, record by record (see the module docstring)."""
    step = window - 1 if causal else window
    out = []
    for i, seq in enumerate(seqs):
        for strand in (0, 1) if rc else (0,):
            tokens = reverse_complement(seq.tokens) if strand else seq.tokens
            n = len(tokens)
            start = 0
            while start < n and (not causal or start + 1 < n):
                out.append(Window(i, strand, start, tokens[start : start + window]))
                start += step
    return out


def make_batches(wins: list[Window], batch_size: int) -> list[list[int]]:
    """Window indices in batches of up to batch_size consecutive windows of equal length (a masked model's windows
    must not be padded; the same batches at every world size)."""
    out: list[list[int]] = []
    run: list[int] = []
    for i, w in enumerate(wins):
        if run and len(w.tokens) != len(wins[run[-1]].tokens):
            out.extend(batched(run, batch_size))
            run = []
        run.append(i)
    out.extend(batched(run, batch_size))
    return out


def score_batches(loaded, wins: list[Window], batches: list[list[int]], world: World, progress: bool) -> list:
    """This rank's batches scored: [(batch index, [log-prob array per window])]."""
    from tqdm import tqdm

    mine = world.mine(list(enumerate(batches)))
    out = []
    for b, idx in tqdm(mine, desc="eval", unit="batch", disable=not (progress and world.main), file=sys.stderr):
        tokens, lengths = pad_batch([torch.from_numpy(wins[i].tokens.astype(np.int64)) for i in idx], loaded.device)
        logp = log_probs(loaded, tokens).cpu().numpy()  # (B, T) float32
        out.append((b, [logp[j, : int(lengths[j])] for j in range(len(idx))]))
    return out


def per_base(seqs: list[Sequence], wins: list[Window], logps: dict[int, np.ndarray], causal: bool) -> list[np.ndarray]:
    """Per record, each base's mean log-likelihood over the strands that predicted it (NaN: none did)."""
    sums = [np.zeros(len(s.tokens)) for s in seqs]
    counts = [np.zeros(len(s.tokens)) for s in seqs]
    for i, w in enumerate(wins):
        lp = logps[i].astype(np.float64)
        first = 1 if causal else 0  # a causal window's first token has no context in it
        pos = np.arange(w.start + first, w.start + len(lp))
        if w.strand:
            pos = len(seqs[w.seq].tokens) - 1 - pos  # reverse-complement position -> forward position
        sums[w.seq][pos] += lp[first:]
        counts[w.seq][pos] += 1
    return [np.where(c > 0, s / np.maximum(c, 1), np.nan) for s, c in zip(sums, counts)]


def _stats(ll: np.ndarray, scored: np.ndarray) -> dict:
    n = int(scored.sum())
    nll = float(-ll[scored].sum())
    return {"bases": n, "nll_nats": nll, "bits_per_base": nll / n / math.log(2) if n else None}


def summarise(seqs: list[Sequence], lls: list[np.ndarray]) -> dict:
    """Overall, per-record and soft-masked/unmasked figures from per-base log-likelihoods."""
    rows, total, masked, unmasked = [], [], [], []
    for seq, ll in zip(seqs, lls):
        scored = ~np.isnan(ll) & (seq.tokens != N_ID)
        row = {"name": seq.name, "length": len(seq.tokens), "n_bases": int((seq.tokens == N_ID).sum())}
        row |= _stats(ll, scored)
        row["nll_per_base"] = row["nll_nats"] / row["bases"] if row["bases"] else None
        row["softmasked"] = _stats(ll, scored & seq.softmask)
        row["unmasked"] = _stats(ll, scored & ~seq.softmask)
        rows.append(row)
        total.append(ll[scored])
        masked.append(ll[scored & seq.softmask])
        unmasked.append(ll[scored & ~seq.softmask])

    def pooled(parts: list[np.ndarray]) -> dict:
        values = np.concatenate(parts) if parts else np.zeros(0)
        return _stats(values, np.ones(len(values), dtype=bool))

    per_seq = [r["nll_per_base"] for r in rows if r["nll_per_base"] is not None]
    return {
        "overall": pooled(total),
        "softmasked": pooled(masked),
        "unmasked": pooled(unmasked),
        "per_sequence_mean_nll": float(np.mean(per_seq)) if per_seq else None,
        "records": rows,
        "records_without_bases": [r["name"] for r in rows if not r["bases"]],  # all N: in no mean
    }


def evaluate(loaded, fasta: str, regions: list[str], window: int, batch_size: int, rc: bool, progress: bool) -> dict:
    """The whole evaluation on every rank (collective under a launcher); the result on rank 0, None elsewhere."""
    world = start_world()
    seqs = read_sequences(fasta, regions)
    wins = windows(seqs, window, loaded.causal, rc)
    batches = make_batches(wins, batch_size)
    started = time.perf_counter()
    mine = score_batches(loaded, wins, batches, world, progress)
    gathered = world.gather(mine)
    if not world.main:
        return None
    logps = {}
    for b, arrays in (item for rank_items in gathered for item in rank_items):
        logps.update(zip(batches[b], arrays))
    result = summarise(seqs, per_base(seqs, wins, logps, loaded.causal))
    seconds = time.perf_counter() - started
    result["run"] = {
        "source": loaded.source,
        "objective": loaded.model_cfg.objective,
        "parameters": loaded.model.num_parameters(),
        "fasta": fasta,
        "window": window,
        "reverse_complement": rc,
        "ranks": world.size,
        "seconds": round(seconds, 2),
        "bases_per_s": round(result["overall"]["bases"] * (2 if rc else 1) / max(seconds, 1e-9), 1),
    }
    return result


def table(result: dict) -> str:
    """A readable table of the result."""

    def fmt(v) -> str:
        return "-" if v is None else f"{v:.4f}"

    lines = [f"{'record':<40} {'bases':>10} {'bits/base':>10} {'masked':>10} {'unmasked':>10} {'nats/base':>10}"]
    for r in result["records"]:
        lines.append(
            f"{r['name'][:40]:<40} {r['bases']:>10,} {fmt(r['bits_per_base']):>10} "
            f"{fmt(r['softmasked']['bits_per_base']):>10} {fmt(r['unmasked']['bits_per_base']):>10} "
            f"{fmt(r['nll_per_base']):>10}"
        )
    o = result["overall"]
    lines.append(
        f"{'overall':<40} {o['bases']:>10,} {fmt(o['bits_per_base']):>10} "
        f"{fmt(result['softmasked']['bits_per_base']):>10} {fmt(result['unmasked']['bits_per_base']):>10} "
        f"{fmt(o['nll_nats'] / o['bases'] if o['bases'] else None):>10}"
    )
    empty = result["records_without_bases"]
    lines.append(
        f"per-sequence mean NLL: {fmt(result['per_sequence_mean_nll'])} nats/base over "
        f"{len(result['records']) - len(empty)} records"
        + (f" ({len(empty)} with no base to score, all N, left out: {', '.join(empty[:5])})" if empty else "")
    )
    run = result["run"]
    lines.append(
        f"{run['parameters']:,} parameters ({run['objective']}), window {run['window']}, "
        f"{'both strands' if run['reverse_complement'] else 'forward strand'}, {run['ranks']} rank(s), "
        f"{run['seconds']} s ({run['bases_per_s']:,.0f} bases/s)"
    )
    return "\n".join(lines)


def main(ns) -> int:
    try:
        check_outputs([("--output", ns.output)], ns.overwrite)
        loaded = load_model(ns.run, ns.step, ns.dtype)
        window = ns.window or loaded.context
        if not 2 <= window <= loaded.context:
            raise EvalError(
                f"--window={window}: must be within [2, the model's context --model.max_seq_len={loaded.context}]"
            )
        if ns.batch_size < 1:
            raise EvalError(f"--batch_size={ns.batch_size}: must be positive")
        result = evaluate(loaded, ns.fasta, ns.regions, window, ns.batch_size, ns.reverse_complement, ns.progress)
    except (EvalError, CheckpointError, FastaError, OutputError, OSError) as e:
        print(f"{PROG}: error: {describe_os_error(e) if isinstance(e, OSError) else e}", file=sys.stderr)
        return 2
    if result is None:
        return 0
    if not result["overall"]["bases"]:
        print(f"{PROG}: error: --fasta {ns.fasta}: no base to score (every record or region is N); nothing written",
              file=sys.stderr)  # fmt: skip
        return 2
    print(table(result))
    if ns.output:
        write_text(ns.output, json.dumps(result, indent=2) + "\n")  # whole or not at all: an earlier file survives
        print(f"{PROG}: results written to {ns.output}")
    return 0
