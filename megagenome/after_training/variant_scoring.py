"""`megagenome score-variants` (layer L4): zero-shot variant-effect scores of a VCF's ALT alleles by a trained model,
written back into the VCF (INFO, Number=A) and a TSV, with AUROC against a label for a labelled VCF.

Windows. A variant at 0-based position p gets a REF window of `window` bases starting at p - window // 2 (the
variant at index window // 2, as in Evo 2's BRCA1 notebook) and an ALT window that shares its left flank: left flank
+ ALT + the bases after REF, up to the same length, so an indel shifts the right flank instead of changing the
window's length. Near a contig's ends the windows shift (the variant off centre) so that both keep `window` bases;
where that cannot be (a contig shorter than the window, an insertion at its very end) they keep what context fits.
Alleles longer than window - window // 2 do not fit and are skipped (`.`), like symbolic ALTs (`<DEL>`, breakends,
`*`).

Scores (higher: the ALT is more plausible; lower: predicted damaging):
- causal (clm) models, the Evo 2 method: log-likelihood of the ALT window minus that of the REF window (sums of
  log p(x_t | x_<t), float64);
- masked (mlm) models, GPN's masked marginal: the REF window with the REF bases masked, sum over those positions of
  log p(ALT base) - log p(REF base) (SNVs and other same-length substitutions); an indel falls back to the
  difference of the two windows' masked pseudo-log-likelihoods (inference.masked_log_probs);
- --reverse_complement: the mean of the score on both strands (the windows reverse-complemented).

Batches and ranks. ALTs are taken CHUNK at a time; each chunk's distinct windows (a REF window shared by several
ALTs is scored once) are put in batches of --batch_size in a fixed order (a masked model's batches hold windows of
one length only: padding would change its attention), the same at any world size; under the `deepspeed` launcher the
batches are dealt round-robin over ranks and the results gathered, so the scores equal one process's.

AUROC (--label_field, --positive): of -score for ALTs whose label is in --positive against every other labelled ALT
(unlabelled ones are left out), by the Mann-Whitney rank formula with ties at half; 95% interval from a stratified
bootstrap (positives and negatives resampled apart, --bootstrap times, numpy default_rng(--seed)), percentiles.

--supervised adds a second score, the out-of-fold probability of the positive class from a classifier on the model's
embeddings of the REF and ALT windows, cross-validated in position blocks (INFO --supervised_info_field, TSV columns
`supervised` and `fold`, its AUROC beside the zero-shot one); --subset_field, AUROCs within subsets: supervised_vep.py.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from megagenome.after_training import supervised_vep
from megagenome.after_training.auroc import auroc, bootstrap_interval
from megagenome.after_training.inference import (
    Loaded,
    World,
    batched,
    choose_window,
    interleave,
    load_model,
    log_probs,
    pad_batch,
    start_world,
)
from megagenome.after_training.variant_windows import CHUNK, ScoreError, skip_reason, variant_windows
from megagenome.data.fasta import FastaError, Genome
from megagenome.data.tokenizer import MASK_ID, TokenizerError, encode, reverse_complement
from megagenome.data.variants import VariantError
from megagenome.data.vcf_scores import Site, check_refs, labelled_alts, read_sites, write_scored, write_text, write_tsv
from megagenome.files.outputs import OutputError, check_outputs, staged
from megagenome.weights.consolidate import CheckpointError

PROG = "megagenome score-variants"
OUTPUT_SUFFIXES = (".vcf", ".vcf.gz", ".vcf.bgz", ".bcf")


@dataclass
class Options:
    """What `megagenome score-variants` is given (its flags, documented in cli/score_variants.py)."""

    run: str
    fasta: str
    vcf: str
    output: str
    step: int | None = None
    tsv: str | None = None
    window: int | None = None
    reverse_complement: bool = False
    batch_size: int = 16
    dtype: str = "fp32"
    label_field: str | None = None
    positive: list[str] = field(default_factory=list)
    bootstrap: int = 1000
    seed: int = 0
    info_field: str = "MG_SCORE"
    summary_json: str | None = None
    overwrite: bool = False
    progress: bool = True
    supervised: bool = False  # supervised_vep.py; None below: the default, given only with --supervised
    embed_layers: list[int] | None = None
    embed_window: int | None = None
    classifier: str | None = None
    cv_folds: int | None = None
    block_size: int | None = None
    supervised_info_field: str = "MG_SUPERVISED"
    subset_field: str | None = None
    subset_groups: list[str] = field(default_factory=list)


# ----- windows and what to compute for each ALT -------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """One forward computation: "sum" (the window's total log-likelihood: next-base for a causal model, masked
    pseudo-likelihood for a masked one) or "mask" (log-probabilities of every token at `positions`, masked)."""

    kind: str
    tokens: np.ndarray  # uint8 token ids
    positions: tuple[int, ...] = ()


class Plan:
    """The distinct queries of a chunk; `add` returns a query's index, the same one for a repeated query."""

    def __init__(self):
        self.queries: list[Query] = []
        self._index: dict[tuple, int] = {}

    def add(self, kind: str, tokens: np.ndarray, positions: tuple[int, ...] = ()) -> int:
        key = (kind, tokens.tobytes(), positions)
        if key not in self._index:
            self._index[key] = len(self.queries)
            self.queries.append(Query(kind, tokens, positions))
        return self._index[key]


Term = tuple[float, int, int, int]  # (weight, query, row of a "mask" query or -1, token or -1)


def method(causal: bool, ref: str, alt: str) -> str:
    if causal:
        return "llr"
    return "masked_marginal" if len(ref) == len(alt) else "pll"


def plan_alt(plan: Plan, causal: bool, windows: tuple[bytes, bytes, int], ref: str, alt: str, rc: bool) -> list[Term]:
    """The terms whose weighted sum is the ALT's score (see the module docstring), their queries added to `plan`;
    `windows` is variant_windows' result."""
    ref_window, alt_window, at = windows
    ref_len = len(ref)
    ref_tokens, alt_tokens = encode(ref_window)[0], encode(alt_window)[0]
    strands = [(ref_tokens, alt_tokens, at)]
    if rc:
        strands.append((reverse_complement(ref_tokens), reverse_complement(alt_tokens), len(ref_tokens) - at - ref_len))
    weight = 1.0 / len(strands)
    marginal = method(causal, ref, alt) == "masked_marginal"
    terms: list[Term] = []
    for ref_t, alt_t, start in strands:
        if not marginal:
            terms += [(weight, plan.add("sum", alt_t), -1, -1), (-weight, plan.add("sum", ref_t), -1, -1)]
            continue
        positions = tuple(range(start, start + ref_len))
        q = plan.add("mask", ref_t, positions)
        for row, p in enumerate(positions):
            terms += [(weight, q, row, int(alt_t[p])), (-weight, q, row, int(ref_t[p]))]
    return terms


def make_batches(queries: list[Query], batch_size: int, causal: bool) -> list[list[int]]:
    """Query indices in batches, in order of first appearance per group: one group for a causal model (right padding
    is harmless), one per (kind, length) for a masked one."""
    groups: dict[tuple, list[int]] = {}
    for i, q in enumerate(queries):
        groups.setdefault(("sum",) if causal else (q.kind, len(q.tokens)), []).append(i)
    return [b for group in groups.values() for b in batched(group, batch_size)]


@torch.no_grad()
def run_batch(loaded: Loaded, queries: list[Query]) -> list:
    """A float per "sum" query, a (positions, vocab) float64 array per "mask" query (one kind per batch)."""
    tokens, lengths = pad_batch([torch.from_numpy(q.tokens.astype(np.int64)) for q in queries], loaded.device)
    if queries[0].kind == "sum":
        logp = log_probs(loaded, tokens).double()  # (B, T)
        valid = torch.arange(tokens.size(1), device=tokens.device)[None] < lengths.to(tokens.device)[:, None]
        return (logp * valid).sum(1).cpu().tolist()
    masked = tokens.clone()
    for row, q in enumerate(queries):
        masked[row, list(q.positions)] = MASK_ID
    logp = loaded.model.log_probs(masked)  # (B, T, vocab), float32
    return [logp[row, list(q.positions)].double().cpu().numpy() for row, q in enumerate(queries)]


def compute(loaded: Loaded, queries: list[Query], batches: list[list[int]], world: World, tick) -> list:
    """Every query's result on every rank: this rank's share of the batches, gathered and put back in order."""
    mine = []
    for idx in world.mine(batches):
        mine.append(run_batch(loaded, [queries[i] for i in idx]))
        tick(len(mine))
    ordered = interleave(world.gather(mine))
    results: list = [None] * len(queries)
    for idx, values in zip(batches, ordered):
        for i, value in zip(idx, values):
            results[i] = value
    return results


def combine(terms: list[Term], results: list) -> float:
    return float(sum(w * (results[q] if row < 0 else results[q][row, tok]) for w, q, row, tok in terms))


# ----- scoring a VCF ------------------------------------------------------------------------------------------------


def score_sites(loaded: Loaded, genome: Genome, sites: list[Site], window: int, opts: Options, world: World) -> list:
    """Per record, per ALT: the score, or None for a skipped ALT. Collective under a launcher."""
    from tqdm import tqdm

    jobs = [(i, a) for i, s in enumerate(sites) for a in range(len(s.alts)) if not skip_reason(s, a, window)]
    scores: list[list[float | None]] = [[None] * len(s.alts) for s in sites]
    shown = opts.progress and world.main
    bar = tqdm(total=len(jobs), unit="variant", desc="score-variants", disable=not shown, file=sys.stderr)
    for first in range(0, len(jobs), CHUNK):
        chunk, plan = jobs[first : first + CHUNK], Plan()
        terms = []
        for i, a in chunk:
            s = sites[i]
            fetch = functools.partial(genome.fetch, s.chrom)
            windows = variant_windows(fetch, genome.lengths[s.chrom], s.pos, s.ref, s.alts[a], window)
            terms.append(plan_alt(plan, loaded.causal, windows, s.ref, s.alts[a], opts.reverse_complement))
        batches = make_batches(plan.queries, opts.batch_size, loaded.causal)
        tick = functools.partial(_advance, bar, first, len(chunk), len(batches) / world.size)
        results = compute(loaded, plan.queries, batches, world, tick)
        for (i, a), t in zip(chunk, terms):
            scores[i][a] = combine(t, results)
        bar.update(first + len(chunk) - bar.n)
    bar.close()
    return scores


def _advance(bar, done: int, n: int, batches_per_rank: float, ran: int) -> None:
    """Progress within a chunk of n ALTs: this rank's share of batches done stands for every rank's."""
    bar.update(done + min(n, int(n * ran / batches_per_rank)) - bar.n)


def evaluate_labels(sites, scores, opts: Options) -> dict:
    """The AUROC section of the summary: -score against the labels, over the scored, labelled ALTs."""
    rows = [(i, a, p) for i, a, p in labelled_alts(sites, opts.positive) if scores[i][a] is not None]
    predictor = np.array([-scores[i][a] for i, a, _ in rows])
    positive = np.array([p for _, _, p in rows], dtype=bool)
    out = {
        "label_field": opts.label_field,
        "positive": opts.positive,
        "n_positive": int(positive.sum()),
        "n_negative": int((~positive).sum()),
        "n_unlabelled": sum(lab is None for s in sites for lab in s.labels),
        "auroc": None,
        "ci95": None,
        "bootstrap": opts.bootstrap,
        "seed": opts.seed,
    }
    if out["n_positive"] and out["n_negative"]:
        out["auroc"] = auroc(predictor, positive)
        if opts.bootstrap > 0:
            out["ci95"] = list(bootstrap_interval(predictor, positive, opts.bootstrap, opts.seed))
    return out


# ----- the command -------------------------------------------------------------------------------------------------


def tsv_path(opts: Options) -> str:
    """--tsv, or --output with its suffix (.vcf, .vcf.gz, .vcf.bgz, .bcf) replaced by .tsv."""
    return opts.tsv or re.sub(r"(\.vcf(\.b?gz)?|\.bcf)$", "", opts.output) + ".tsv"


def check_options(opts: Options) -> None:
    """The checks that need no model: flags, and outputs that exist (refused without --overwrite)."""
    if not opts.output.endswith(OUTPUT_SUFFIXES):
        raise ScoreError(f"--output {opts.output}: must end in {', '.join(OUTPUT_SUFFIXES)}")
    if opts.batch_size < 1:
        raise ScoreError(f"--batch_size={opts.batch_size}: must be positive")
    if opts.bootstrap < 0:
        raise ScoreError(f"--bootstrap={opts.bootstrap}: must be 0 (no interval) or more")
    if bool(opts.label_field) != bool(opts.positive):
        raise ScoreError(
            "--label_field (the INFO field of the labels) and --positive (their positive values) go together"
        )
    supervised_vep.check_flags(opts)
    outputs = {"--output": opts.output, "--tsv": tsv_path(opts), "--summary_json": opts.summary_json}
    if os.path.abspath(opts.vcf) in [os.path.abspath(p) for p in outputs.values() if p]:
        raise ScoreError(f"the outputs ({', '.join(p for p in outputs.values() if p)}) and --vcf must all differ")
    try:
        check_outputs(list(outputs.items()), opts.overwrite)
    except OutputError as e:
        raise ScoreError(str(e)) from e


def check_labels(sites: list[Site], opts: Options) -> None:
    """--positive must match some labelled ALT, and some other labelled ALT must be negative."""
    if not opts.label_field:
        return
    rows = labelled_alts(sites, opts.positive)
    seen = sorted({lab for s in sites for lab in s.labels if lab is not None})
    if not any(p for *_, p in rows) or all(p for *_, p in rows):
        which = "no" if not any(p for *_, p in rows) else "every"
        raise ScoreError(
            f"--positive {','.join(opts.positive)} matches {which} labelled ALT of {opts.vcf} (INFO "
            f"{opts.label_field} values: {', '.join(seen[:20]) or 'none'}): AUROC needs positives and negatives"
        )


def run(opts: Options, world: World | None = None) -> dict:
    """Score the VCF and write the outputs (rank 0); the summary. Collective under a launcher; raises ScoreError,
    VariantError, FastaError, CheckpointError or TokenizerError on bad input before any output is written."""
    check_options(opts)
    world = world or start_world()
    with Genome(opts.fasta) as genome:
        sites = read_sites(opts.vcf, genome.lengths, opts.label_field, opts.subset_field)
        check_refs(genome, sites)
        check_labels(sites, opts)
        loaded = load_model(opts.run, opts.step, opts.dtype)
        window = choose_window(loaded, opts.window, ScoreError)
        plan = supervised_vep.prepare(opts, sites, window, loaded.model_cfg.n_layer) if opts.supervised else None
        started = time.perf_counter()
        scores = score_sites(loaded, genome, sites, window, opts, world)
        seconds = time.perf_counter() - started
        sup, sup_scores, folds = (None,) * 3
        if plan:
            sup, sup_scores, folds = supervised_vep.run(plan, loaded, genome, sites, window, scores, opts, world)
        lengths = {s.chrom: genome.lengths[s.chrom] for s in sites}
    missing = [(s, a) for s, row in zip(sites, scores) for a, v in enumerate(row) if v is None]
    skipped = [f"{s.where}: ALT {s.alts[a]}: {skip_reason(s, a, window)}" for s, a in missing]
    n_scored = sum(v is not None for row in scores for v in row)
    summary = {
        "model": loaded.source,
        "objective": loaded.model_cfg.objective,
        "parameters": loaded.model.num_parameters(),
        "context": loaded.context,
        "dtype": opts.dtype,
        "vcf": opts.vcf,
        "fasta": opts.fasta,
        "window": window,
        "reverse_complement": opts.reverse_complement,
        "records": len(sites),
        "variants": n_scored,
        "skipped": len(skipped),
        "first_skipped": skipped[0] if skipped else None,
        "ranks": world.size,
        "seconds": round(seconds, 3),
        "variants_per_s": round(n_scored / max(seconds, 1e-9), 2),
        "outputs": {"vcf": opts.output, "tsv": tsv_path(opts), "summary_json": opts.summary_json},
        "evaluation": evaluate_labels(sites, scores, opts) if opts.label_field else None,
        "supervised": sup,
        "subsets": None,
    }
    if opts.subset_field and world.main:  # the supervised scores are rank 0's
        summary["subsets"] = supervised_vep.evaluate_subsets(sites, scores, sup_scores, opts)
    if world.main:
        write_outputs(opts, sites, scores, loaded.causal, lengths, summary, (sup_scores, folds))
    return summary


def write_outputs(opts: Options, sites, scores, causal: bool, lengths: dict, summary: dict, supervised) -> None:
    """The scored VCF, the TSV and the JSON summary, published together (files/outputs.py staged: all three
    written to temporaries, then renamed; a failure leaves none and an earlier result intact); `supervised` is (the
    supervised score, the fold) per record per ALT, or Nones."""
    what = "log-likelihood ratio ALT vs REF" + (", mean of both strands" if opts.reverse_complement else "")
    description = f"{PROG}: {what}; {summary['window']} bp windows; model {summary['model']}"
    more, extra = supervised_vep.outputs(summary, opts, *supervised)
    paths = [opts.output, tsv_path(opts)] + ([opts.summary_json] if opts.summary_json else [])
    with staged(*paths) as temps:
        write_scored(opts.vcf, opts.output, scores, opts.info_field, description, lengths, more, target=temps[0])
        how = lambda s, a: method(causal, s.ref, s.alts[a])  # noqa: E731
        write_tsv(temps[1], sites, scores, how, bool(opts.label_field), extra)
        if opts.summary_json:
            write_text(temps[2], json.dumps(summary, indent=2) + "\n")


def report(summary: dict) -> str:
    """The printed summary: variants scored, variants/s, AUROC [95% interval]."""
    lines = [
        f"{PROG}: {summary['variants']:,} variants scored ({summary['skipped']:,} skipped) in "
        f"{summary['seconds']:.1f} s: {summary['variants_per_s']:,.1f} variants/s; window {summary['window']}, "
        f"{'both strands' if summary['reverse_complement'] else 'forward strand'}, {summary['ranks']} rank(s)"
    ]
    if summary["first_skipped"]:
        lines.append(f"first skipped: {summary['first_skipped']}")
    ev = summary["evaluation"]
    if ev:
        ci = " [{:.3f}, {:.3f}]".format(*ev["ci95"]) if ev["ci95"] else ""
        value = "not computed (a class has no scored variant)" if ev["auroc"] is None else f"{ev['auroc']:.3f}{ci}"
        lines.append(
            f"AUROC {value} ({ev['label_field']} in {','.join(ev['positive'])}: {ev['n_positive']:,} "
            f"positive vs {ev['n_negative']:,} negative; lower score = predicted damaging; {ev['n_unlabelled']:,} "
            f"unlabelled left out)"
        )
    lines += supervised_vep.report_lines(summary)
    out = summary["outputs"]
    lines.append("wrote " + ", ".join(p for p in out.values() if p))
    return "\n".join(lines)


def main(ns) -> int:
    """`megagenome score-variants` on its parsed flags: 0, or 2 with the error on bad input."""
    opts = Options(**{f.name: getattr(ns, f.name) for f in fields(Options)})
    if isinstance(opts.positive, str):  # --positive LOF or LOF,INT
        opts.positive = [p for p in opts.positive.split(",") if p]
    try:
        summary = run(opts)
    except (ScoreError, VariantError, FastaError, CheckpointError, TokenizerError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(report(summary))
    return 0
