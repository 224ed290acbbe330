"""The experiments of benchmarks/loader.py (local re-implementations of train_batch, NOT the shipped path: E1 without
the unused mlm rng, E2 batch-vectorised, E3 E2 with a hashed reverse-complement coin), the check that they and the
FASTA path give the prepared path's batches, and where (A)'s time goes (its stages timed on their own, cProfile).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time
from collections.abc import Callable

import harness
import numpy as np
import torch

from megagenome.config import DataConfig
from megagenome.data import prepared
from megagenome.data.dataset import RNG_MASK, RNG_RC, GenomeData, _collate, build_genome_data, build_prepared_data
from megagenome.data.tokenizer import N_ID, SEP_ID, reverse_complement


def e1_batch(data: GenomeData, indices: np.ndarray) -> dict[str, torch.Tensor]:
    """E1: train_batch without seeding the per-sample mlm Generator that the clm objective never draws from."""
    cfg = data.cfg
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    samples = []
    for index, region in zip(indices.tolist(), data.train_sampler.windows(indices)):
        data.trained_contigs.add(region.contig)
        tokens, soft = data.store.tokens(region)
        if np.random.default_rng([cfg.seed, RNG_RC, index]).random() < cfg.rc_prob:
            tokens, soft = reverse_complement(tokens), soft[::-1]
        samples.append(data._sample(tokens, soft, cfg.softmask_weight, None))  # clm: the rng is unused
    return _collate(samples)


def rc_coins_rng(cfg: DataConfig, indices: list[int]) -> np.ndarray:
    """The shipped reverse-complement coin of each sample: one seeded numpy Generator per sample."""
    return np.array([np.random.default_rng([cfg.seed, RNG_RC, i]).random() < cfg.rc_prob for i in indices], bool)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function, vectorised over uint64 (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def rc_coins_hash(cfg: DataConfig, indices: list[int]) -> np.ndarray:
    """E3's coin: a counter-based hash of (seed, purpose, index), one vectorised call per batch."""
    key = _splitmix64(np.array([cfg.seed * 1_000_003 + RNG_RC], dtype=np.uint64))
    u = (_splitmix64(key ^ np.asarray(indices, dtype=np.uint64)) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return u < cfg.rc_prob


def _vectorised(data: GenomeData, indices: np.ndarray, coins: Callable) -> dict[str, torch.Tensor]:
    """E2/E3: the batch as one (B, W) byte array; unpack, reverse complement, weights, dtype casts once per batch."""
    cfg = data.cfg
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    regions = data.train_sampler.windows(indices)
    raw = np.empty((len(regions), data.window_len), dtype=np.uint8)
    where = data.store._where  # ShardStore internals: (memory map, offset) of every real contig
    for i, region in enumerate(regions):
        data.trained_contigs.add(region.contig)
        if region.contig in where:
            mm, offset = where[region.contig]
            raw[i] = mm[offset + region.start : offset + region.end]
        else:  # a packed virtual contig
            tokens, soft = data.store.tokens(region)
            raw[i] = prepared.pack_bytes(tokens, soft)
    rc = coins(cfg, indices.tolist())
    tokens, soft = prepared.unpack_bytes(raw)
    if rc.any():
        tokens[rc] = reverse_complement(tokens[rc])
        soft[rc] = soft[rc, ::-1]
    weight = np.where(soft[:, 1:], np.float32(cfg.softmask_weight), np.float32(1.0)).astype(np.float32)
    weight[(tokens[:, 1:] == N_ID) | (tokens[:, 1:] == SEP_ID)] = 0.0
    return {
        "input_ids": torch.from_numpy(tokens[:, :-1].astype(np.int64)),
        "labels": torch.from_numpy(tokens[:, 1:].astype(np.int64)),
        "loss_weight": torch.from_numpy(weight),
    }


def e2_batch(data: GenomeData, indices: np.ndarray) -> dict[str, torch.Tensor]:
    return _vectorised(data, indices, rc_coins_rng)


def e3_batch(data: GenomeData, indices: np.ndarray) -> dict[str, torch.Tensor]:
    return _vectorised(data, indices, rc_coins_hash)


EXPERIMENTS = {
    "E1 prepared, no unused mlm rng (experiment)": e1_batch,
    "E2 prepared, batch-vectorised (experiment)": e2_batch,
    "E3 prepared, batch-vectorised + hashed rc coin (experiment)": e3_batch,
}


def same_batches(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_batches(prepared_dir: str, fasta: str, seq_len: int, batch: int, val_contigs, n: int = 4) -> dict:
    """Whether (B) and E1/E2 give exactly (A)'s batches, and E3 the same windows, over n consecutive batches."""
    cfg_a = DataConfig(prepared=prepared_dir, seq_len=seq_len)
    cfg_b = DataConfig(fasta=fasta, seq_len=seq_len, val_contigs=list(val_contigs))
    with build_prepared_data(cfg_a, "clm") as a, build_genome_data(cfg_b, "clm") as b:
        out = {"fasta_equals_prepared": True, "E1_equals_prepared": True, "E2_equals_prepared": True}
        e3_same_coin, total = 0, 0
        for k in range(n):
            idx = np.arange(k * batch, (k + 1) * batch, dtype=np.int64)
            ref = a.train_batch(idx)
            out["fasta_equals_prepared"] &= same_batches(ref, b.train_batch(idx))
            out["E1_equals_prepared"] &= same_batches(ref, e1_batch(a, idx))
            out["E2_equals_prepared"] &= same_batches(ref, e2_batch(a, idx))
            e3_same_coin += int((rc_coins_rng(a.cfg, idx.tolist()) == rc_coins_hash(a.cfg, idx.tolist())).sum())
            total += batch
            assert {name: tuple(v.shape) for name, v in ref.items()} == {name: (batch, seq_len) for name in ref}
        hash_coins = rc_coins_hash(a.cfg, list(range(100_000)))
        out["E3_rc_fraction_of_100k"] = float(hash_coins.mean())
        out["E3_coin_agrees_with_shipped"] = e3_same_coin / total
    return out


def stage_breakdown(data: GenomeData, batch: int, n_batches: int, reps: int = 5) -> dict:
    """Microseconds per batch of each stage of train_batch (clm), each timed on its own over the same indices;
    per stage the fastest of `reps` passes over n_batches batches (the pass least disturbed by other processes)."""
    cfg = data.cfg
    batches = [np.arange(k * batch, (k + 1) * batch, dtype=np.int64) for k in range(n_batches)]
    regions = [data.train_sampler.windows(idx) for idx in batches]
    reads = [[data.store.tokens(r) for r in rs] for rs in regions]
    coins = [rc_coins_rng(cfg, idx.tolist()) for idx in batches]
    flipped = [
        [(reverse_complement(t), s[::-1]) if c else (t, s) for (t, s), c in zip(rd, cs)] for rd, cs in zip(reads, coins)
    ]
    samples = [[data._sample(t, s, cfg.softmask_weight, None) for t, s in fl] for fl in flipped]

    def timed(fn: Callable[[int], object]) -> float:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for k in range(n_batches):
                fn(k)
            best = min(best, time.perf_counter() - t0)
        return best / n_batches * 1e6

    def seed_both(k: int) -> None:  # what train_batch does per sample: the rc Generator and the (clm: unused) mlm one
        for i in batches[k].tolist():
            np.random.default_rng([cfg.seed, RNG_RC, i]).random()
            np.random.default_rng([cfg.seed, RNG_MASK, i])

    stages = {
        "sampler.windows (window of each index)": timed(lambda k: data.train_sampler.windows(batches[k])),
        "store.tokens (memmap slice + unpack)": timed(lambda k: [data.store.tokens(r) for r in regions[k]]),
        "per-sample rng seeding (rc coin + unused mlm rng)": timed(seed_both),
        "reverse complement (the flipped samples)": timed(
            lambda k: [(reverse_complement(t), s[::-1]) for (t, s), c in zip(reads[k], coins[k]) if c]
        ),
        "_sample (loss weights, shift)": timed(
            lambda k: [data._sample(t, s, cfg.softmask_weight, None) for t, s in flipped[k]]
        ),
        "_collate (stack, int64/float32, torch)": timed(lambda k: _collate(samples[k])),
    }
    total = timed(lambda k: data.train_batch(batches[k]))
    return {
        "reps": reps,
        "batches": n_batches,
        "us_per_batch": stages,
        "sum_of_stages_us": sum(stages.values()),
        "train_batch_us": total,
    }


def profile_train_batch(data: GenomeData, batch: int, n_batches: int, top: int = 15) -> dict:
    """cProfile of n_batches train_batch calls: the top functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for k in range(n_batches):
        data.train_batch(np.arange(k * batch, (k + 1) * batch, dtype=np.int64))
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt
    rows = []
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        mine = path.startswith(str(harness.REPO))
        where = f"{os.path.relpath(path, harness.REPO) if mine else os.path.basename(path)}:{line}"
        rows.append(
            {
                "function": f"{func} ({where})" if line else func,
                "calls_per_batch": ncalls / n_batches,
                "own_us_per_batch": tottime / n_batches * 1e6,
                "cum_us_per_batch": cumtime / n_batches * 1e6,
                "own_share": tottime / total,
            }
        )
    rows.sort(key=lambda r: -r["own_us_per_batch"])
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return {"batches": n_batches, "total_s": total, "top": rows[:top], "text": text.getvalue()}


# ----- report -----------------------------------------------------------------------------------------------------
