"""The report of benchmarks/loader.py: the target's arithmetic, the ratios at each sequence length, loader.md and the
suggestions for data/dataset.py that the experiments' measured effects support.
"""

from __future__ import annotations

import statistics

from loader_experiments import EXPERIMENTS

# The figure for the per-GPU token consumption of a 125M model on an H100, and its cross-check:
# H100 SXM dense BF16 peak x MFU / training flops per token, with flops per token = 6 N (weights, forward and
# backward) + 12 L d T (attention scores and values, forward and backward; PaLM, Chowdhery et al. 2022, App. B)
# for GPT-3 Small's shape (12 layers, d_model 768) at sequence length T.
TARGET_TOKENS_PER_S = 0.45e6
TARGET_MULTIPLE = 100
H100_BF16_FLOPS, MFU, PARAMS, N_LAYER, D_MODEL = 989e12, 0.45, 125e6, 12, 768


def consumption(seq_len: int) -> dict:
    """Tokens/s one H100 consumes training the 125M model at `seq_len`, from the flops arithmetic above."""
    per_token = 6 * PARAMS + 12 * N_LAYER * D_MODEL * seq_len
    return {
        "seq_len": seq_len,
        "flops_per_token": per_token,
        "tokens_per_s": H100_BF16_FLOPS * MFU / per_token,
        "arithmetic": f"989e12 * {MFU} / (6 * 125e6 + 12 * {N_LAYER} * {D_MODEL} * {seq_len}) = "
        f"{H100_BF16_FLOPS * MFU:.4g} / {per_token:.4g} = {H100_BF16_FLOPS * MFU / per_token:,.0f} tokens/s",
    }


def summarise(loaders: dict, seq_len: int) -> dict:
    """Ratios of (A) and (B) at one sequence length to (C) and (B) on the same file format, and the target; by
    wall-time medians (the headline) and by tokens per CPU second (what the core delivers when not shared)."""
    out = {}
    for key, suffix in (("tokens_per_s", ""), ("tokens_per_cpu_s", "_by_cpu_time")):
        a = loaders["A prepared (train_batch)"][key]
        fmt = {}
        for f in ("BGZF", "plain"):
            b = loaders[f"B fasta/pyfaidx, {f} (train_batch)"][key]
            c = loaders[f"C reference, {f}"][key]
            fmt[f] = {"A_over_B": a / b, "A_over_C": a / c, "B_over_C": b / c}
        out[f"A_{key}"] = a
        out[f"A_multiple_of_450k{suffix}"] = a / TARGET_TOKENS_PER_S
        out[f"target_met{suffix}"] = a >= TARGET_MULTIPLE * TARGET_TOKENS_PER_S
        out[f"ratios{suffix}"] = fmt
    a = out["A_tokens_per_s"]
    out["A_multiple_of_flops_consumption_at_this_seq_len"] = a / consumption(seq_len)["tokens_per_s"]
    out["A_share_of_ceiling"] = a / loaders["ceiling: memmap slice + unpack"]["tokens_per_s"]
    return out


def fmt_rate(x: float) -> str:
    return f"{x / 1e6:,.2f} M"


def markdown(r: dict) -> str:
    parts = (_head, _target, _loaders, _checks_and_prepare, _profiles, _suggestions)
    return "\n".join(line for part in parts for line in part(r))


def _head(r: dict) -> list[str]:
    """The run: machine, command, input and method; the target and its arithmetic."""
    target = TARGET_MULTIPLE * TARGET_TOKENS_PER_S
    lines = [
        f"# Data loading on one core: prepared shards vs the FASTA path vs a reference loader ({r['date']})",
        "",
        f"Hardware: {r['hardware']}. Pinned to CPU {r['cpu_affinity']} (one core), torch threads "
        f"{r['torch_threads']}; load average at start {r['load_average_at_start']} (the machine is shared, so the "
        "`cpu share` column, CPU time / wall time of the process, shows how much of the core it got).",
        f"Software: {r['software']}.",
        f"Command: `{r['command']}`",
        f"Input: `{r['input']}` ({r['prepare']['bases']:,} bases in {r['prepare']['records']} records; copied, with "
        f"a decompressed plain copy for the `plain` rows); held out: {', '.join(r['val_contigs']) or 'nothing'}.",
        f"Method: micro batch {r['batch']}, clm, tokens = B x T per batch; {r['rounds']} rounds of all loaders in "
        f"rotation, {r['seconds']} s each after a warm-up batch; median (min-max) over rounds. `cpu share` below 1 "
        "means another process ran on the same core during the round; `tokens/CPU-s` (tokens over the process's "
        "CPU time, median over rounds) estimates what the core delivers alone. A slot (or prepare run) with a cpu "
        f"share below {r['min_cpu_share']} was measured again, up to {r['retries']} times, keeping the attempt with "
        f"the highest share ({sum(v['repeated_slots'] for ls in r['loaders'].values() for v in ls.values())} slots "
        f"and {r['prepare']['repeated_runs']} prepare runs were repeated; every kept attempt is in loader.json). "
        "`set-up s` is the loader's "
        "construction, once (the FASTA path reads every contig to find its N runs). What each loader does: "
        "the docstring of benchmarks/loader.py.",
        "",
        f"## Target: (A) >= {TARGET_MULTIPLE} x 0.45M = {target / 1e6:.0f} M tokens/s from one core",
        "",
        "0.45M tokens/s per GPU is the issue's figure for a 125M model on an H100. Cross-check: H100 SXM dense BF16 "
        "peak x MFU / training flops per token, with 6 N + 12 L d T flops per token (PaLM, App. B) for GPT-3 "
        "Small's shape (L = 12, d = 768):",
        "",
    ]
    for c in r["consumption"]:
        lines.append(f"- T = {c['seq_len']}: {c['arithmetic']}")
    return lines


def _target(r: dict) -> list[str]:
    """(A) against the target at each sequence length, and its share of a step."""
    lines: list[str] = []
    lines += [
        "",
        "| seq len | (A) tokens/s (wall, median) | x 0.45M | target met | (A) tokens/CPU-s | x 0.45M | target met "
        "(CPU time) | x flops consumption at this T | share of ceiling |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t, s in r["summary"].items():
        lines.append(
            f"| {t} | {fmt_rate(s['A_tokens_per_s'])} | {s['A_multiple_of_450k']:.0f} x | "
            f"{'yes' if s['target_met'] else '**no**'} | {fmt_rate(s['A_tokens_per_cpu_s'])} | "
            f"{s['A_multiple_of_450k_by_cpu_time']:.0f} x | {'yes' if s['target_met_by_cpu_time'] else '**no**'} | "
            f"{s['A_multiple_of_flops_consumption_at_this_seq_len']:.0f} x | {s['A_share_of_ceiling']:.1%} |"
        )
    lines += [
        "",
        "Training calls train_batch on the training process itself (pretrain.py, no loader workers), so at the "
        "flops consumption above (A) costs at most "
        + ", ".join(
            f"{consumption(t)['tokens_per_s'] / s['A_tokens_per_s']:.2%} of the step time at T = {t}"
            for t, s in r["summary"].items()
        )
        + " (less where it overlaps the GPU's queued work).",
        "",
        "## Loaders (tokens/s)",
        "",
    ]
    return lines


def _loaders(r: dict) -> list[str]:
    """Every loader's tokens/s at each sequence length, with the ratios of the formats."""
    lines: list[str] = []
    for t, loaders in r["loaders"].items():
        s = r["summary"][t]
        lines += [
            f"### seq len {t}, micro batch {r['batch']}",
            "",
            "| loader | tokens/s median | min-max | cpu share | tokens/CPU-s | x (C) same format | x (B) same format "
            "| set-up s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, v in loaders.items():
            f = "plain" if "plain" in name else "BGZF"
            b = loaders[f"B fasta/pyfaidx, {f} (train_batch)"]["tokens_per_s"]
            c = loaders[f"C reference, {f}"]["tokens_per_s"]
            lines.append(
                f"| {name} | {fmt_rate(v['tokens_per_s'])} | {fmt_rate(v['min_tokens_per_s'])}-"
                f"{fmt_rate(v['max_tokens_per_s'])} | {v['cpu_share']:.2f} | {fmt_rate(v['tokens_per_cpu_s'])} | "
                f"{v['tokens_per_s'] / c:,.1f} | "
                f"{v['tokens_per_s'] / b:,.2f} | {v.get('setup_s', float('nan')):.2f} |"
            )
        lines += [
            "",
            "Ceiling, A, E1-E3 read the prepared shard; for them `same format` means the BGZF rows. By wall-time "
            "medians: "
            + "; ".join(
                f"{f}: A/B {v['A_over_B']:.1f} x, A/C {v['A_over_C']:.1f} x, B/C {v['B_over_C']:.1f} x"
                for f, v in s["ratios"].items()
            )
            + ". By tokens per CPU second: "
            + "; ".join(
                f"{f}: A/B {v['A_over_B']:.1f} x, A/C {v['A_over_C']:.1f} x, B/C {v['B_over_C']:.1f} x"
                for f, v in s["ratios_by_cpu_time"].items()
            )
            + ".",
            "",
        ]
    return lines


def _checks_and_prepare(r: dict) -> list[str]:
    """The batch checks, and `megagenome prepare`'s bases/s."""
    lines: list[str] = []
    c = r["checks"]
    lines += [
        "Checks: (B)'s batches equal (A)'s for the same indices: "
        f"{c['fasta_equals_prepared']}; E1 equals (A): {c['E1_equals_prepared']}; E2 equals (A): "
        f"{c['E2_equals_prepared']}; E3 reverse-complements {c['E3_rc_fraction_of_100k']:.4f} of 100k samples and "
        f"agrees with the shipped coin on {c['E3_coin_agrees_with_shipped']:.0%} of the checked samples (a different, "
        "equally deterministic coin).",
        "",
        "## prepare",
        "",
        "`megagenome prepare` (Python API, 1 worker) of the yeast genome into a fresh directory, "
        f"{r['prepare']['runs']} runs: median {r['prepare']['median_wall_s']:.3f} s for "
        f"{r['prepare']['bases']:,} bases = "
        f"**{r['prepare']['bases_per_s'] / 1e6:.1f} M bases/s** (runs: "
        + ", ".join(f"{w:.3f} s" for w in r["prepare"]["wall_s"])
        + f"); by CPU time (median {statistics.median(r['prepare']['cpu_s']):.3f} s) "
        f"{r['prepare']['bases_per_cpu_s'] / 1e6:.1f} M bases/s, the rest of the wall time is waiting for the disk "
        "(fsync) or for the core. The input is in the page cache (copied just before).",
        "",
    ]
    return lines


def _profiles(r: dict) -> list[str]:
    """Where (A)'s time goes at the sequence lengths that miss the target (all, when none misses: the first)."""
    lines: list[str] = []
    if r["profiles"]:
        lines += [
            "## Where (A)'s time goes",
            "",
            "The stage table times the per-sample steps of a batch one by one (the decomposition of the first "
            "train_batch, which E1-E3 improve on). The shipped train_batch now builds the batch as one (B, W) "
            "array and seeds a generator only where it draws from one (E1 + E2's approach, same batches: checked "
            "above), so these stages overstate its seeding, _sample and _collate costs; the cProfile table below "
            "profiles the shipped train_batch as it is.",
            "",
        ]
    for t, p in r["profiles"].items():
        br = p["stages"]
        lines += [
            f"### seq len {t} ({'misses' if not r['summary'][t]['target_met'] else 'meets'} the target)",
            "",
            f"Stages of one batch of {r['batch']} timed on their own, each the fastest of {br['reps']} passes over "
            f"{br['batches']} batches ({br['train_batch_us']:.0f} us per train_batch call timed the same way; the "
            f"stages sum to {br['sum_of_stages_us']:.0f} us; the rest is train_batch's own loop and bookkeeping, "
            "and noise):",
            "",
            "| stage | us per batch | share of train_batch |",
            "|---|---|---|",
        ]
        for name, us in br["us_per_batch"].items():
            lines.append(f"| {name} | {us:.0f} | {us / br['train_batch_us']:.0%} |")
        lines += [
            "",
            f"cProfile of {p['cprofile']['batches']} train_batch calls, top functions by own time. numpy's "
            "Generator seeding is Cython, invisible to cProfile: it lands in train_batch's own time, except `inner` "
            "(numpy/_core/_ufunc_config.py), the np.errstate wrapper that each seeding enters once (16 calls per "
            "batch of 8 = the two Generators per sample):",
            "",
            "| function | calls/batch | own us/batch | cum us/batch | own share |",
            "|---|---|---|---|---|",
        ]
        for row in p["cprofile"]["top"][:10]:
            lines.append(
                f"| `{row['function']}` | {row['calls_per_batch']:.1f} | {row['own_us_per_batch']:.1f} | "
                f"{row['cum_us_per_batch']:.1f} | {row['own_share']:.0%} |"
            )
        lines.append("")
    return lines


def _suggestions(r: dict) -> list[str]:
    """The suggestions, when a sequence length misses the target."""
    lines: list[str] = []
    if r["suggestions"]:
        lines += ["## Suggestions (for data/dataset.py; not applied here)", ""]
        lines += [f"- {s}" for s in r["suggestions"]]
        lines.append("")
    return lines


def suggestions(r: dict) -> list[str]:
    """Concrete changes with the experiments' measured effect, at every sequence length."""
    out = []
    names = list(EXPERIMENTS)
    seeding = [
        p["stages"]["us_per_batch"]["per-sample rng seeding (rc coin + unused mlm rng)"] / (2 * r["batch"])
        for p in r["profiles"].values()
    ]
    per_generator = f"{statistics.median(seeding):.0f} us" if seeding else "about 10 us"
    sampler = [
        (p["stages"]["us_per_batch"]["sampler.windows (window of each index)"], p["stages"]["train_batch_us"], t)
        for t, p in r["profiles"].items()
    ]
    sampler_us = "; ".join(f"{us:.0f} us of {total:.0f} us per batch at T = {t}" for us, total, t in sampler)
    for t, loaders in r["loaders"].items():
        a = loaders["A prepared (train_batch)"]["tokens_per_s"]
        e = [loaders[n]["tokens_per_s"] for n in names]
        out.append(
            f"T = {t}: A {fmt_rate(a)} ({a / TARGET_TOKENS_PER_S:.0f} x 0.45M); "
            + ", ".join(
                f"E{i + 1} {fmt_rate(x)} ({x / a:.2f} x A, {x / TARGET_TOKENS_PER_S:.0f} x 0.45M)"
                for i, x in enumerate(e)
            )
            + f" tokens/s; the target is {TARGET_MULTIPLE} x 0.45M."
        )
    out += [
        "E1 (bit-identical batches): in GenomeData.train_batch create `rng = np.random.default_rng([seed, RNG_MASK, "
        "index])` only when objective == 'mlm'; the clm path never draws from it, and seeding a Generator from a "
        f"list (SeedSequence + PCG64 + an np.errstate context) costs {per_generator} each here, two per sample.",
        "E2 (bit-identical batches): assemble the batch as one (B, W) uint8 array of shard bytes (one memmap slice "
        "per window, for ShardStore a `raw(region)` accessor next to `tokens(region)`), then unpack, reverse "
        "complement the flipped rows, build loss weights and cast to int64/float32 once per batch instead of once "
        "per sample and again in _collate.",
        "E3 (changes which samples are reverse-complemented, so a new data-stream version for resumes): draw the "
        "reverse-complement coin of all samples of a batch in one vectorised call of a counter-based hash of (seed, "
        "purpose, index) (SplitMix64 here; numpy's Philox with the index as counter would do too) instead of one "
        "seeded Generator per sample. Samples stay a pure function of (seed, index). The mlm masking rng could "
        "follow the same way, but is once per sample over W positions, so it matters less.",
        f"Smaller: BlendSampler.windows ({sampler_us}) goes through _Composite.locate (np.unique, boolean "
        "selections) even for a single unit; a one-part fast path would trim it.",
    ]
    return out
