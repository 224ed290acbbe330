"""`megagenome generate` (layer L4): DNA sampled from a trained causal model, one base at a time.

    megagenome generate RUN_OR_EXPORT --output samples.fa [--prompt ACGT... | --prompt_fasta FILE] [--length N]
        [--num_samples K] [--temperature T] [--top_k K] [--top_p P] [--seed S] [--scores samples.tsv] [--slide S]

Each sample continues the prompt (an empty prompt starts after <sep>, the boundary a sequence starts from) by
--length bases drawn from the model's next-base distribution over A, C, G and T (N and the special tokens are never
drawn): the logits divided by --temperature (0: the most likely base, greedy), cut to the --top_k most likely and to
the smallest set whose probability reaches --top_p, renormalised. Sample i draws from its own generator, seeded
from --seed and i, so a sample is the same whatever the batching and the number of ranks.

The model reads at most its --model.max_seq_len positions: a longer sequence is read through a window that slides
by --slide bases (default a quarter of the window) when full, the bases kept read again as a new prompt.

Decoding is cached (model/decoding.py: attention layers keep their keys and values, Hyena operators their filters'
states; the prompt runs once, as the training forward runs it, then one step per base); a model with a block that
cannot cache would recompute the whole sequence so far at every step. The cache's memory is printed before the
generation starts.

Output: a FASTA record per sample (the prompt and the generated bases), its header naming the sample, the prompt,
the settings and the model; with --scores a TSV of each generated base's log-probability (natural log, normalised
over the model's whole token table). Both are written through temporary files, and only when every sample is done;
an existing output is refused unless --overwrite. Under the `deepspeed` launcher the samples are dealt over the
ranks and rank 0 writes them all.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megagenome.after_training.inference import World, load_model, start_world
from megagenome.data.fasta import FastaError, Genome
from megagenome.data.tokenizer import A_ID, SEP_ID, TokenizerError, encode
from megagenome.files.outputs import OutputError, check_outputs, write_texts
from megagenome.weights.consolidate import CheckpointError

PROG = "megagenome generate"
BASES = "ACGT"  # what is drawn: A_ID .. A_ID + 3


class GenerateError(ValueError):
    """Bad flags or input for `megagenome generate` (the message names the flag or file)."""


@dataclass
class Options:
    run: str
    output: str
    step: int | None = None
    prompt: str = ""
    prompt_fasta: str | None = None
    length: int = 1000
    num_samples: int = 1
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    scores: str | None = None
    batch_size: int = 8
    dtype: str = "fp32"
    slide: int | None = None
    overwrite: bool = False
    progress: bool = True


@dataclass
class Prompt:
    name: str
    bases: str


def check_options(opts: Options) -> None:
    """The checks that need no model."""
    if opts.length < 1:
        raise GenerateError(f"--length={opts.length}: must be positive")
    if opts.num_samples < 1 or opts.batch_size < 1:
        raise GenerateError(f"--num_samples={opts.num_samples}, --batch_size={opts.batch_size}: must be positive")
    if opts.temperature < 0:
        raise GenerateError(f"--temperature={opts.temperature}: must be 0 (greedy) or positive")
    if opts.top_k is not None and not 1 <= opts.top_k <= len(BASES):
        raise GenerateError(f"--top_k={opts.top_k}: must be within 1..{len(BASES)} (the bases drawn from)")
    if opts.top_p is not None and not 0 < opts.top_p <= 1:
        raise GenerateError(f"--top_p={opts.top_p}: must be within (0, 1]")
    if opts.prompt and opts.prompt_fasta:
        raise GenerateError("--prompt and --prompt_fasta: give one of them (or neither: an empty prompt)")
    try:
        check_outputs([("--output", opts.output), ("--scores", opts.scores)], opts.overwrite)
    except OutputError as e:
        raise GenerateError(str(e)) from e


def read_prompts(opts: Options) -> list[Prompt]:
    """The prompts: --prompt, every record of --prompt_fasta, or one empty prompt."""
    if opts.prompt_fasta:
        with Genome(opts.prompt_fasta) as genome:
            return [Prompt(name, genome.fetch(name, 0, n).decode()) for name, n in genome.lengths.items()]
    return [Prompt("prompt" if opts.prompt else "empty", opts.prompt)]


def prompt_ids(prompt: Prompt, flag: str) -> torch.Tensor:
    """The prompt's token ids, <sep> first when empty (the model needs a position to predict from)."""
    if not prompt.bases:
        return torch.tensor([SEP_ID])
    try:
        return torch.from_numpy(encode(prompt.bases)[0].astype("int64"))
    except TokenizerError as e:
        raise GenerateError(f"{flag} ({prompt.name}): {e}") from e


def choose(logits: torch.Tensor, opts: Options, generators: list[torch.Generator]) -> torch.Tensor:
    """The next base of each row: ids (B,) drawn from logits (B, vocab) over A C G T (module docstring)."""
    scores = logits[:, A_ID : A_ID + len(BASES)].float()  # (B, 4)
    if opts.temperature == 0:
        return A_ID + scores.argmax(-1)
    scores = scores / opts.temperature
    if opts.top_k is not None:
        kth = scores.topk(opts.top_k, dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = F.softmax(scores, dim=-1)  # (B, 4)
    if opts.top_p is not None:
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # the probability of the bases more likely than each
        cut = torch.zeros_like(probs).scatter(-1, order, (before >= opts.top_p).to(probs.dtype))
        probs = probs.masked_fill(cut.bool(), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    probs = probs.cpu()  # each row drawn by its sample's own (CPU) generator
    picked = [torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators, strict=True)]
    return A_ID + torch.cat(picked).to(logits.device)


def token_log_probs(model, table: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of megagenome's tokens (B, vocab), normalised over the whole token table (B, rows)."""
    logp = F.log_softmax(table.float(), dim=-1)
    return logp if model.token_rows is None else logp[:, model.token_rows]


@torch.no_grad()
def generate_batch(model, ids: torch.Tensor, length: int, opts: Options, generators, on_step=None, window=None,
                   cache: bool = True):  # fmt: skip
    """(generated ids (B, length), their log-probabilities (B, length)) continuing the prompt ids (P,) for B =
    len(generators) samples.

    The model reads at most `window` positions (default: its max_seq_len): when the sequence outgrows the window, it
    slides, dropping the oldest opts.slide bases (default: a quarter of the window), and the bases kept are read
    again as a new prompt (the caches are refilled). cache=False recomputes the window's forward at every step
    instead of decoding (what a model that cannot cache does): the same logits, the reference in the tests."""
    B, P = len(generators), ids.numel()
    device = next(model.parameters()).device
    window = window or model.cfg.max_seq_len
    keep = window - slide_of(opts, window)
    seq = torch.empty(B, P + length, dtype=torch.long, device=device)  # the prompt, then each base as drawn
    seq[:, :P] = ids.to(device)
    cached = cache and model.can_cache()
    start, state = max(0, P - window), None  # the window is seq[:, start:end]

    def read(end: int):  # the window's last logits, its caches filled afresh
        nonlocal state
        if not cached:
            return model.table_logits(seq[:, start:end])[:, -1]
        state = model.decode_state(B, min(window, P + length - start))  # what this window can still hold
        return model.decode(seq[:, start:end], state)[:, -1]

    table = read(P)
    scores = torch.empty(B, length)
    for t in range(length):
        logp = token_log_probs(model, table)  # (B, vocab)
        nxt = choose(logp, opts, generators).to(device)  # (B,): log-probabilities rank as the logits
        end = P + t + 1
        seq[:, end - 1] = nxt
        scores[:, t] = logp.gather(-1, nxt[:, None])[:, 0].float().cpu()
        if end - start > window:
            start = end - keep
            table = read(end)
        elif cached:
            table = model.decode(nxt[:, None], state)[:, -1]
        else:
            table = read(end)
        if on_step is not None:
            on_step(B)
    return seq[:, P:].cpu(), scores


def slide_of(opts: Options, window: int) -> int:
    """Bases the window drops when the sequence outgrows it: --slide, or a quarter of the window."""
    return opts.slide if opts.slide is not None else max(1, window // 4)


def cache_bytes(model, batch: int, capacity: int) -> int:
    """The decoding cache's bytes for a batch (0 where the model recomputes instead)."""
    if not model.can_cache():
        return 0
    return model.decode_state(batch, capacity).nbytes()


def header(i: int, prompt: Prompt, opts: Options, source: str, window: int) -> str:
    """A sample's FASTA header: its name, then what made it (the window and slide when the sequence outgrew it)."""
    settings = [f"prompt={prompt.name}:{len(prompt.bases)}", f"length={opts.length}", f"temperature={opts.temperature}"]
    if len(prompt.bases) + opts.length > window:
        settings += [f"window={window}", f"slide={slide_of(opts, window)}"]
    settings += [f"top_k={opts.top_k}"] if opts.top_k is not None else []
    settings += [f"top_p={opts.top_p}"] if opts.top_p is not None else []
    return f">{prompt.name}_sample{i} " + " ".join([*settings, f"seed={opts.seed}", f"model={source}"])


def sample_generators(opts: Options, prompt_index: int, samples: list[int]) -> list[torch.Generator]:
    """Sample i's own generator: seeded from --seed, the prompt and i (the same whatever batch or rank draws it)."""
    seeds = [(opts.seed * 1_000_003 + prompt_index) * 1_000_033 + i for i in samples]
    return [torch.Generator().manual_seed(seed % 2**63) for seed in seeds]


def run(opts: Options, world: World | None = None) -> dict:
    """Generate every prompt's samples (this rank's share of each) and write them (rank 0); the summary."""
    check_options(opts)
    prompts = read_prompts(opts)
    tokens = [prompt_ids(p, "--prompt_fasta" if opts.prompt_fasta else "--prompt") for p in prompts]
    world = world or start_world()
    loaded = load_model(opts.run, opts.step, opts.dtype)
    model = loaded.model
    if not loaded.causal:
        family = loaded.model_cfg.family
        raise GenerateError(f"{opts.run}: a masked-LM model ({family}, --model.objective mlm) predicts a hidden base "
                            "from both sides; generation needs a causal (clm) model")  # fmt: skip
    window = loaded.model_cfg.max_seq_len
    if opts.slide is not None and not 1 <= opts.slide < window:
        raise GenerateError(f"--slide={opts.slide}: must be within 1..{window - 1} (the model reads {window} "
                            "positions)")  # fmt: skip
    longest = max(len(t) for t in tokens) + opts.length
    batch = min(opts.batch_size, opts.num_samples)
    memory = cache_bytes(model, batch, min(longest, window))
    if world.main:
        how = f"cached decoding, cache {memory / 2**20:.2f} MiB per batch of {batch}" if memory else "full recompute"
        print(f"{PROG}: {len(prompts)} prompt(s) x {opts.num_samples} sample(s) x {opts.length:,} bases; {how}",
              file=sys.stderr)  # fmt: skip
        if longest > window:
            print(f"{PROG}: {longest:,} positions outgrow the model's {window:,} (--model.max_seq_len): it reads a "
                  f"sliding window, the last {window - slide_of(opts, window):,} to {window:,} bases (--slide "
                  f"{slide_of(opts, window)})", file=sys.stderr)  # fmt: skip
    from tqdm import tqdm

    total = len(prompts) * len(world.mine(range(opts.num_samples))) * opts.length
    bar = tqdm(total=total, unit="base", desc=PROG, disable=not (opts.progress and world.main), file=sys.stderr)
    started = time.perf_counter()
    mine: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (prompt, sample, bases, log-probabilities)
    for p, ids in enumerate(tokens):
        samples = world.mine(range(opts.num_samples))
        for k in range(0, len(samples), batch):
            chunk = samples[k : k + batch]
            gens = sample_generators(opts, p, chunk)
            out, scores = generate_batch(model, ids, opts.length, opts, gens, bar.update, window)
            mine += [(p, i, out[j], scores[j]) for j, i in enumerate(chunk)]
    bar.close()
    seconds = time.perf_counter() - started
    gathered = world.gather_to_main(mine)
    samples = len(prompts) * opts.num_samples
    summary = {"samples": samples, "bases": samples * opts.length, "seconds": round(seconds, 3),
               "cache_bytes": memory, "ranks": world.size, "model": loaded.source}  # fmt: skip
    summary["bases_per_s"] = round(summary["bases"] / max(seconds, 1e-9), 1)
    if world.main:
        rows = sorted((r for part in gathered for r in part), key=lambda r: (r[0], r[1]))
        write_outputs(opts, prompts, rows, loaded.source, window)
    return summary


def write_outputs(opts: Options, prompts: list[Prompt], rows: list, source: str, window: int) -> None:
    """The FASTA of every sample, and the scores TSV when asked, published together (files/outputs.py)."""
    fasta, tsv = [], ["sample\tposition\tbase\tlog_prob"]
    for p, i, out, scores in rows:
        bases = "".join(BASES[t - A_ID] for t in out.tolist())
        sequence = prompts[p].bases + bases
        fasta.append(header(i, prompts[p], opts, source, window))
        fasta += [sequence[j : j + 80] for j in range(0, len(sequence), 80)]
        name = f"{prompts[p].name}_sample{i}"
        offset = len(prompts[p].bases)
        tsv += [f"{name}\t{offset + j + 1}\t{b}\t{s:.6f}" for j, (b, s) in enumerate(zip(bases, scores.tolist()))]
    contents = {opts.output: "\n".join(fasta) + "\n"}
    if opts.scores:
        contents[opts.scores] = "\n".join(tsv) + "\n"
    write_texts(contents)  # published together, or neither


def report(summary: dict, opts: Options) -> str:
    written = opts.output + (f", {opts.scores}" if opts.scores else "")
    return (f"{PROG}: {summary['samples']} sample(s), {summary['bases']:,} bases in {summary['seconds']:.1f} s: "
            f"{summary['bases_per_s']:,.1f} bases/s on {summary['ranks']} rank(s); wrote {written}")  # fmt: skip


def main(ns) -> int:
    """`megagenome generate` on its parsed flags: 0, or 2 with the error on bad input."""
    opts = Options(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(Options)})
    try:
        summary = run(opts)
    except (GenerateError, FastaError, CheckpointError, TokenizerError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(report(summary, opts))
    return 0
