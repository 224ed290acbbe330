"""`megagenome embed` (layer L4): a trained model's hidden states at chosen layers for the windows of a FASTA, pooled
per window, written to a safetensors file with a TSV index of its rows.

Rows. Without --regions, --bed or --vcf, every record of the FASTA; with --regions (contig:start-end, 1-based
inclusive) or --bed (data/bed.py read_features: 0-based half-open, in the file's order, overlapping features
kept, each named by its 4th column or else its span), those stretches. A stretch longer
than the window is tiled into consecutive windows of `window` bases (the last one shorter), one row each. With --vcf,
two rows per ALT allele, REF then ALT: the windows score-variants scores (variant_scoring.variant_windows: `window`
bases, the variant at window // 2 where the contig allows, the ALT window sharing the left flank and filled on the
right to the same length); ALTs score-variants skips (symbolic, `*`, alleles too long for the window) are skipped.

Layers (--layers, model/stack.py BlockStack.layer_states): 0 the embedding output, i in 1..n_layer the output of
block i, -1 the final norm's output (what the LM head reads; the default). One forward pass gives them all.

Pooling (--pool), per layer, in float32: `mean` over the window's bases, (N, d_model); `centre` the hidden state at
one position, (N, d_model): the variant's first base for a VCF row, else index length // 2; `per_base` every
position, (N, window, d_model), zero past a row's length. (score-variants --supervised pools with SPAN: the mean over
a stretch of bases around the variant, embed_batch.)

Output. --output FILE.safetensors holds `layer_<i>` per layer i >= 0 and `final_norm` for -1, and `lengths` (N,)
int64 (each row's bases); its metadata (str -> str, each value but `format` JSON): format, model (the checkpoint or
export directory read), family, d_model, layers, tensors (their names), pool, window, dtype, input, fasta, rows. The
index (--index, default FILE.tsv) has a header and one line per row in tensor order: row, name, contig, start, end
(the reference bases the window stands for, 1-based inclusive), and for a VCF: id, pos (1-based), ref, alt, allele
(REF or ALT), variant_index (the variant's 0-based index in the window). Both are written by rank 0
through temporary files renamed when complete; bad input exits 2 before anything is written.

Batches and ranks. Rows are put in batches of --batch_size consecutive rows of one length (evaluate.make_batches: no
padding, which would change a masked model's attention), the same at any world size; under the `deepspeed` launcher
the batches are dealt round-robin over ranks and the pooled states gathered in batch order, so the tensors equal one
process's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from megagenome.after_training.evaluate import make_batches
from megagenome.after_training.inference import (
    Loaded,
    Stretch,
    World,
    choose_window,
    interleave,
    load_model,
    pad_batch,
    read_stretch,
    read_stretches,
    start_world,
)
from megagenome.after_training.variant_windows import skip_reason, variant_windows
from megagenome.data.bed import BedError, read_features
from megagenome.data.fasta import FastaError, Genome
from megagenome.data.tokenizer import N_ID, TokenizerError, encode
from megagenome.data.variants import VariantError
from megagenome.data.vcf_scores import Site, check_refs, read_sites
from megagenome.files.outputs import OutputError, check_outputs, staged
from megagenome.model.stack import FINAL_NORM, layers_problem
from megagenome.weights.consolidate import CheckpointError

PROG = "megagenome embed"
FORMAT = "megagenome-embeddings"
POOLS = ("mean", "centre", "per_base")
SPAN = "span"  # the mean over `span` bases around the centre: score-variants --supervised's pooling, not embed's
COLUMNS = ["row", "name", "contig", "start", "end"]
VARIANT_COLUMNS = ["id", "pos", "ref", "alt", "allele", "variant_index"]


class EmbedError(ValueError):
    """Bad input to `megagenome embed`; the message names the flag or the file and line."""


@dataclass
class Options:
    """What `megagenome embed` is given (its flags, documented in cli/embed.py)."""

    run: str
    fasta: str
    output: str
    step: int | None = None
    regions: list[str] = field(default_factory=list)
    bed: str | None = None
    vcf: str | None = None
    index: str | None = None
    layers: list[int] = field(default_factory=lambda: [FINAL_NORM])
    pool: str = "mean"
    window: int | None = None
    batch_size: int = 16
    dtype: str = "fp32"
    overwrite: bool = False
    progress: bool = True


@dataclass(frozen=True)
class Row:
    """One window to embed and its line of the index."""

    name: str  # the stretch's name, or chrom:pos:ref:alt for a VCF row
    contig: str
    start: int  # 0-based, half-open: the reference bases the window stands for
    end: int
    tokens: np.ndarray  # uint8 token ids, at most the window
    centre: int  # the index `centre` pooling takes
    variant: tuple | None = None  # (id, pos 1-based, ref, alt, "REF" or "ALT") for a VCF row


# ----- what to embed ----------------------------------------------------------------------------------------------


def read_inputs(genome: Genome, opts: Options) -> list[Stretch] | list[Site]:
    """The stretches to tile (records, --regions or --bed) or the VCF's sites (REFs checked against the FASTA)."""
    if opts.vcf:
        sites = read_sites(opts.vcf, genome.lengths)
        check_refs(genome, sites)
        return sites
    if opts.bed:
        features = read_features(opts.bed, genome.lengths)
        return [read_stretch(genome, f.name, f.contig, f.start, f.end, EmbedError) for f in features]
    return read_stretches(genome, opts.regions, EmbedError)


def tiles(stretch: Stretch, window: int) -> list[Row]:
    """The stretch in consecutive windows of `window` bases (the last one shorter)."""
    out = []
    for first in range(0, len(stretch.tokens), window):
        tokens = stretch.tokens[first : first + window]
        start = stretch.start + first
        out.append(Row(stretch.name, stretch.contig, start, start + len(tokens), tokens, len(tokens) // 2))
    return out


def variant_rows(genome: Genome, sites: list[Site], window: int) -> tuple[list[Row], list[str]]:
    """(a REF and an ALT row per ALT allele that fits the window, why each other ALT was skipped)."""
    rows, skipped = [], []
    for s in sites:
        fetch = functools.partial(genome.fetch, s.chrom)
        for a, alt in enumerate(s.alts):
            reason = skip_reason(s, a, window)
            if reason:
                skipped.append(f"{s.where}: ALT {alt}: {reason}")
                continue
            ref_window, alt_window, at = variant_windows(fetch, genome.lengths[s.chrom], s.pos, s.ref, alt, window)
            start, name = s.pos - at, f"{s.chrom}:{s.pos + 1}:{s.ref}:{alt}"
            # ALT replaces REF: the ALT window stands for as many reference bases as it holds, less ALT plus REF.
            alt_end = start + len(alt_window) - len(alt) + len(s.ref)
            for allele, bases, end in (("REF", ref_window, start + len(ref_window)), ("ALT", alt_window, alt_end)):
                variant = (s.id, s.pos + 1, s.ref, alt, allele)
                rows.append(Row(name, s.chrom, start, end, encode(bases)[0], at, variant))
    return rows, skipped


def make_rows(genome: Genome, inputs: list, window: int) -> tuple[list[Row], list[str]]:
    """The rows of read_inputs' result, in order, and the skipped ALTs of a VCF."""
    if inputs and isinstance(inputs[0], Site):
        return variant_rows(genome, inputs, window)
    return [row for stretch in inputs for row in tiles(stretch, window)], []


# ----- embedding --------------------------------------------------------------------------------------------------


@torch.no_grad()
def embed_batch(
    loaded: Loaded, rows: list[Row], layers: list[int], pool: str, window: int, span: int | None = None
) -> dict[int, torch.Tensor]:
    """{layer: pooled float32 states on CPU} of one batch: (B, d_model), or (B, window, d_model) for per_base.
    `pool` is one of POOLS, or SPAN: the mean over the `span` bases starting span // 2 before each row's centre,
    clipped to the row (score-variants --supervised's features)."""
    tokens, lengths = pad_batch([torch.from_numpy(r.tokens.astype(np.int64)) for r in rows], loaded.device)
    lengths = lengths.to(tokens.device)
    positions = torch.arange(tokens.size(1), device=tokens.device)[None]  # (1, T)
    valid = (positions < lengths[:, None])[..., None]  # (B, T, 1)
    centres = torch.tensor([r.centre for r in rows], device=tokens.device)  # (B,)
    if pool == SPAN:
        first = centres[:, None] - span // 2  # (B, 1)
        valid = valid & ((positions >= first) & (positions < first + span))[..., None]
    out = {}
    for layer, x in loaded.model.layer_states(tokens, layers).items():
        x = x.float() * valid  # (B, T, d_model), zero past each row's length (or outside its span)
        if pool == "mean":
            pooled = x.sum(1) / lengths[:, None]  # (B, d_model)
        elif pool == SPAN:
            pooled = x.sum(1) / valid.sum(1)  # (B, d_model): over the span's bases inside the row
        elif pool == "centre":
            pooled = x[torch.arange(len(rows), device=x.device), centres]  # (B, d_model)
        else:
            pooled = F.pad(x, (0, 0, 0, window - x.size(1)))  # (B, window, d_model)
        out[layer] = pooled.cpu()
    return out


def embed_rows(
    loaded: Loaded,
    rows: list[Row],
    layers: list[int],
    pool: str,
    window: int,
    world: World,
    batch_size: int = 16,
    progress: bool = True,
    span: int | None = None,
    desc: str = "embed",
) -> dict[int, torch.Tensor] | None:
    """{layer: (N, d_model) or (N, window, d_model)} of every row on rank 0 (None on the others, which hold only their
    share): this rank's share of the batches (embed_batch), gathered to rank 0 and put back in batch order.
    Collective under a launcher."""
    from tqdm import tqdm

    batches = make_batches(rows, batch_size)
    shown = progress and world.main
    mine = []
    for idx in tqdm(world.mine(batches), desc=desc, unit="batch", disable=not shown, file=sys.stderr):
        mine.append(embed_batch(loaded, [rows[i] for i in idx], layers, pool, window, span))
    gathered = world.gather_to_main(mine)
    if gathered is None:
        return None
    ordered = interleave(gathered)
    return {layer: torch.cat([batch[layer] for batch in ordered]) for layer in layers}


def tensor_name(layer: int) -> str:
    """The safetensors name of a layer's embeddings: layer_<i>, or final_norm for -1."""
    return "final_norm" if layer == FINAL_NORM else f"layer_{layer}"


# ----- the command -------------------------------------------------------------------------------------------------


def index_path(opts: Options) -> str:
    """--index, or --output with .safetensors replaced by .tsv."""
    return opts.index or re.sub(r"\.safetensors$", "", opts.output) + ".tsv"


def check_options(opts: Options) -> None:
    """The checks that need no model: flags, and outputs that exist (refused without --overwrite)."""
    given = [flag for flag, value in (("--regions", opts.regions), ("--bed", opts.bed), ("--vcf", opts.vcf)) if value]
    if len(given) > 1:
        raise EmbedError(f"{' and '.join(given)}: give one of --regions, --bed and --vcf (or none: every record)")
    if not opts.output.endswith(".safetensors"):
        raise EmbedError(f"--output {opts.output}: must end in .safetensors")
    if opts.pool not in POOLS:
        raise EmbedError(f"--pool {opts.pool}: must be one of {', '.join(POOLS)}")
    if opts.batch_size < 1:
        raise EmbedError(f"--batch_size={opts.batch_size}: must be positive")
    outputs = {"--output": opts.output, "--index": index_path(opts)}
    inputs = [p for p in (opts.fasta, opts.bed, opts.vcf) if p]
    paths = {os.path.abspath(p) for p in outputs.values()}
    if len(paths) < 2 or paths & {os.path.abspath(p) for p in inputs}:
        raise EmbedError(f"--output {opts.output} and --index {index_path(opts)}: must differ, and from the inputs")
    try:
        check_outputs(list(outputs.items()), opts.overwrite)
    except OutputError as e:
        raise EmbedError(str(e)) from e


def run(opts: Options, world: World | None = None) -> dict:
    """Embed the rows and write the outputs (rank 0); the summary. Collective under a launcher; raises EmbedError,
    VariantError, BedError, FastaError, CheckpointError or TokenizerError on bad input before any output is
    written."""
    check_options(opts)
    opts = dataclasses.replace(opts, layers=list(dict.fromkeys(opts.layers)))  # each once, in the order given
    world = world or start_world()
    with Genome(opts.fasta) as genome:
        inputs = read_inputs(genome, opts)
        loaded = load_model(opts.run, opts.step, opts.dtype)
        problem = layers_problem(opts.layers, loaded.model_cfg.n_layer)
        if problem:
            raise EmbedError(f"--layers {problem}")
        window = choose_window(loaded, opts.window, EmbedError)
        rows, skipped = make_rows(genome, inputs, window)
    if not rows:
        raise EmbedError(f"nothing to embed: {skipped[0] if skipped else 'no rows'} ({len(skipped)} ALTs skipped)")
    blank = [r.name for r in rows if not (np.asarray(r.tokens) != N_ID).any()]
    if blank and world.main:  # embedded all the same, in their place: the index keeps its rows in input order
        print(f"{PROG}: warning: {len(blank)} of {len(rows)} rows are all N, their embeddings carry no sequence: "
              f"{', '.join(blank[:5])}{', ...' if len(blank) > 5 else ''}", file=sys.stderr)  # fmt: skip
    started = time.perf_counter()
    states = embed_rows(loaded, rows, opts.layers, opts.pool, window, world, opts.batch_size, opts.progress)
    seconds = time.perf_counter() - started
    summary = {
        "model": loaded.source,
        "family": loaded.model_cfg.family,
        "d_model": loaded.model_cfg.d_model,
        "layers": opts.layers,
        "tensors": [tensor_name(layer) for layer in opts.layers],
        "pool": opts.pool,
        "window": window,
        "dtype": opts.dtype,
        "input": "vcf" if opts.vcf else "bed" if opts.bed else "regions" if opts.regions else "fasta",
        "fasta": opts.fasta,
        "rows": len(rows),
        "skipped": len(skipped),
        "first_skipped": skipped[0] if skipped else None,
        "ranks": world.size,
        "seconds": round(seconds, 3),
        "rows_per_s": round(len(rows) / max(seconds, 1e-9), 2),
        "outputs": {"embeddings": opts.output, "index": index_path(opts)},
    }
    if world.main:
        write_outputs(opts, rows, states, summary)
    return summary


def write_outputs(opts: Options, rows: list[Row], states: dict[int, torch.Tensor], summary: dict) -> None:
    """The safetensors file (the tensors, `lengths`, the metadata) and the TSV index, published together
    (files/outputs.py staged: both written to temporaries, then renamed; a failure leaves neither)."""
    from safetensors.torch import save_file

    tensors = {tensor_name(layer): states[layer].contiguous() for layer in opts.layers}
    tensors["lengths"] = torch.tensor([len(r.tokens) for r in rows], dtype=torch.int64)
    keys = ("model", "family", "d_model", "layers", "tensors", "pool", "window", "dtype", "input", "fasta", "rows")
    metadata = {"format": FORMAT, **{k: json.dumps(summary[k]) for k in keys}}
    columns = COLUMNS + (VARIANT_COLUMNS if opts.vcf else [])
    lines = ["\t".join(columns)]
    for i, r in enumerate(rows):
        cells = [i, r.name, r.contig, r.start + 1, r.end]
        if r.variant is not None:
            cells += [*r.variant, r.centre]
        lines.append("\t".join(map(str, cells)))
    with staged(opts.output, index_path(opts)) as (tensors_tmp, index_tmp):
        save_file(tensors, tensors_tmp, metadata=metadata)  # straight from the tensors, no copy in memory
        with open(index_tmp, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")


def report(summary: dict) -> str:
    """The printed summary: rows, layers, pooling, rows/s, the outputs."""
    lines = [
        f"{PROG}: {summary['rows']:,} rows ({summary['input']}) x layers {', '.join(summary['tensors'])} "
        f"({summary['pool']}, d_model {summary['d_model']}) in {summary['seconds']:.1f} s: "
        f"{summary['rows_per_s']:,.1f} rows/s; window {summary['window']}, {summary['ranks']} rank(s)"
    ]
    if summary["skipped"]:
        lines.append(f"{summary['skipped']:,} ALTs skipped; first: {summary['first_skipped']}")
    lines.append("wrote " + ", ".join(summary["outputs"].values()))
    return "\n".join(lines)


def main(ns) -> int:
    """`megagenome embed` on its parsed flags: 0, or 2 with the error on bad input."""
    opts = Options(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(Options)})
    try:
        summary = run(opts)
    except (EmbedError, VariantError, BedError, FastaError, CheckpointError, TokenizerError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(report(summary))
    return 0
