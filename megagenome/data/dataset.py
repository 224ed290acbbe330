"""GenomeData: the split, samplers and batches for the clm and mlm objectives, over one FASTA or prepared shards.

`build_genome_data` opens the FASTA, finds the N-free stretches of every contig (one pass), builds the
train/val/test split inside them, and sets up the training sampler and the fixed evaluation windows.
`build_prepared_data` memory-maps the shards `megagenome prepare` wrote (their split was cut at prepare time) and
samples across its units by weight (blend.BlendSampler), or gives each data-parallel rank whole groups
(blend.GroupSampler). Both serve batches through the same code: a store's tokens(region) and the sampler's
windows(indices).
Batches are computed from global sample indices alone: the randomness of each sample (reverse complement,
masking) is drawn from np.random.default_rng([seed, purpose, index]), so a sample is the same on any rank,
in any process and after any resume.

Sequence-length warmup (data/curriculum.py): train_batch(indices, seq_len) builds a batch of windows of a warmup
stage's length from a sampler of that length, built when first asked for and kept (sampler_at); evaluation always
scores windows of cfg.seq_len.

Batch dict (T = cfg.seq_len, or the warmup stage's length):
    input_ids    (B, T) int64    token ids fed to the model
    labels       (B, T) int64    target token per position (clm: the next base; mlm: the original base)
    loss_weight  (B, T) float32  per-position loss weight: 0 for N (and packing SEP) targets and unselected mlm
                                 positions, the soft-mask weight for lowercase targets, 1 otherwise
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from megagenome.config import DataConfig, Region
from megagenome.data import prepared
from megagenome.data.blend import BlendSampler, GroupSampler, Unit
from megagenome.data.fasta import Genome
from megagenome.data.intervals import build_split, n_free_intervals, restrict, split_record, total_bases
from megagenome.data.masking import mask_window
from megagenome.data.sampler import WindowSampler, eval_windows
from megagenome.data.tokenizer import N_ID, SEP_ID, encode, reverse_complement

OBJECTIVES = ("clm", "mlm")
# Second word of every per-sample rng seed (see sampler.RNG_WINDOWS, which is 0).
RNG_RC, RNG_MASK, RNG_EVAL_MASK = 1, 2, 3


class FastaTokens:
    """A Genome (pyfaidx) as the token store GenomeData reads from: tokens(region) -> (token ids, soft-mask)."""

    def __init__(self, genome: Genome):
        self.genome, self.path, self.lengths = genome, genome.path, genome.lengths

    def tokens(self, region: Region) -> tuple[np.ndarray, np.ndarray]:
        return encode(self.genome.fetch(region.contig, region.start, region.end))

    def close(self) -> None:
        self.genome.close()


def window_length(cfg: DataConfig, objective: str, seq_len: int | None = None) -> int:
    """Bases per sample of seq_len tokens (default cfg.seq_len): clm predicts base t+1 from bases <= t, so a window
    of T inputs needs T + 1 bases."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r} (--model.objective)")
    seq_len = cfg.seq_len if seq_len is None else seq_len
    return seq_len + 1 if objective == "clm" else seq_len


class GenomeData:
    """Split, samplers and batch construction over a token store; see the module docstring.

    store: FastaTokens (one FASTA) or prepared.ShardStore (prepared shards); split: the N-free regions of each
    split; declared_split: the split as declared, before N runs were cut; sampler: the training sampler (a
    WindowSampler, or blend.BlendSampler / blend.GroupSampler over prepared units); record: more split.json facts;
    sampler_at(seq_len): the same kind of sampler for windows of a warmup stage's length (data/curriculum.py).
    """

    def __init__(
        self,
        cfg: DataConfig,
        objective: str,
        store,
        split: dict[str, list[Region]],
        declared_split: dict[str, list[Region]],
        sampler,
        record: dict | None = None,
        sampler_at: Callable[[int], object] | None = None,
    ):
        self.cfg = cfg
        self.objective = objective
        self.store = store
        self.window_len = window_length(cfg, objective)
        self.declared_split = declared_split
        self.split = split
        self.train_sampler = sampler
        self._samplers = {cfg.seq_len: sampler}  # window length in tokens -> training sampler
        self._sampler_at = sampler_at
        self.record = record or {}
        self.eval_regions = eval_windows(self.split["val"], self.window_len, cfg.eval_windows)
        if declared_split["val"] and not self.eval_regions:
            raise ValueError(
                f"the held-out split ({total_bases(self.split['val'])} N-free bases) has no stretch of "
                f"{self.window_len} bases without a run of more than the allowed N run (--data.max_n_run, or the "
                "manifest's max_n_run); hold out more or lower --data.seq_len"
            )
        self._contig_index = {name: i for i, name in enumerate(store.lengths)}
        self.trained_contigs: set[str] = set()  # contigs of every training window this process built

    # ----- records and raw tokens -------------------------------------------------------------------------

    def split_record(self) -> dict:
        """JSON-able split.json content: N-free regions per split, the declared split and sampling facts."""
        record = split_record(
            self.split,
            fasta=self.store.path,
            contig_lengths=dict(self.store.lengths),
            max_n_run=self.record.get("max_n_run", self.cfg.max_n_run),
            window_len=self.window_len,
            declared_bases={name: total_bases(regions) for name, regions in self.declared_split.items()},
        )
        s = self.train_sampler
        record["train_sampler"] = {
            "windows_per_epoch": s.num_windows,
            "dropped_regions": s.dropped_regions,
            "dropped_bases": s.dropped_bases,
            "slack_bases_per_epoch": s.slack_bases,
        }
        record["eval_windows"] = len(self.eval_regions)
        record.update({k: v for k, v in self.record.items() if k != "max_n_run"})
        return record

    def _tokens(self, region: Region) -> tuple[np.ndarray, np.ndarray]:
        return self.store.tokens(region)

    def train_tokens(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(tokens, soft-mask) of every N-free training region, e.g. to fit Markov baselines."""
        return [self._tokens(r) for r in self.split["train"]]

    def heldout_tokens(self, split: str = "val") -> list[tuple[np.ndarray, np.ndarray]]:
        """(tokens, soft-mask) of every N-free region of a held-out split ("val" or "test")."""
        if split not in ("val", "test"):
            raise ValueError(f"held-out split must be 'val' or 'test', got {split!r}")
        return [self._tokens(r) for r in self.split[split]]

    # ----- batches --------------------------------------------------------------------------------------------

    def sampler(self, seq_len: int | None = None):
        """The training sampler of windows of seq_len tokens (default cfg.seq_len); a warmup stage's is built the first
        time it is asked for and kept, so its windows tile the training intervals at that length."""
        seq_len = self.cfg.seq_len if seq_len is None else int(seq_len)
        if seq_len not in self._samplers:
            if self._sampler_at is None:
                raise ValueError(f"this data serves windows of {self.cfg.seq_len} tokens only, not {seq_len}")
            self._samplers[seq_len] = self._sampler_at(seq_len)
        return self._samplers[seq_len]

    def train_batch(self, indices: np.ndarray, seq_len: int | None = None) -> dict[str, torch.Tensor]:
        """Training batch of the given global sample indices of the sampler of windows of seq_len tokens (default
        cfg.seq_len; data/curriculum.py gives a warmup stage's): reverse complement with prob rc_prob.

        Built as one (B, W) array: reverse complement, loss weights and the clm shift run once per batch, and a
        per-sample generator is seeded only where it is drawn from (the reverse-complement coin when 0 < rc_prob
        < 1, the masking stream for mlm); the batches are the same as sample by sample (benchmarks/loader.py).
        """
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size == 0:
            raise ValueError("a batch needs at least one sample")
        regions = self.sampler(seq_len).windows(indices)
        width = window_length(self.cfg, self.objective, seq_len)
        tokens = np.empty((indices.size, width), dtype=np.uint8)  # (B, W)
        soft = np.empty((indices.size, width), dtype=bool)  # (B, W)
        for row, region in enumerate(regions):
            self.trained_contigs.add(region.contig)
            tokens[row], soft[row] = self._tokens(region)
        p = self.cfg.rc_prob
        if 0.0 < p < 1.0:
            flip = np.array([np.random.default_rng([self.cfg.seed, RNG_RC, i]).random() < p for i in indices.tolist()])
        else:  # the coin's outcome is certain: no generator to seed
            flip = np.full(indices.size, p >= 1.0)
        if flip.any():
            tokens[flip] = reverse_complement(tokens[flip])
            soft[flip] = soft[flip][:, ::-1]
        if self.objective == "clm":
            weight = np.where(soft, np.float32(self.cfg.softmask_weight), np.float32(1.0)).astype(np.float32)
            weight[(tokens == N_ID) | (tokens == SEP_ID)] = 0.0  # (B, W)
            return {
                "input_ids": torch.from_numpy(tokens[:, :-1].astype(np.int64)),  # (B, T)
                "labels": torch.from_numpy(tokens[:, 1:].astype(np.int64)),  # (B, T)
                "loss_weight": torch.from_numpy(np.ascontiguousarray(weight[:, 1:])),  # (B, T)
            }
        samples = [
            self._sample(t, s, self.cfg.softmask_weight, np.random.default_rng([self.cfg.seed, RNG_MASK, i]))
            for t, s, i in zip(tokens, soft, indices.tolist())
        ]
        return _collate(samples)

    def eval_batch(self, regions: Sequence[Region]) -> dict[str, torch.Tensor]:
        """Evaluation batch of held-out windows (e.g. a slice of `eval_regions`): no reverse complement, and
        mlm masking seeded by the window's position so that every evaluation scores the same positions."""
        samples = []
        for region in regions:
            if region.end - region.start != self.window_len:
                raise ValueError(f"eval window {region} is not {self.window_len} bases long")
            tokens, soft = self._tokens(region)
            seed = [self.cfg.seed, RNG_EVAL_MASK, self._contig_index[region.contig], region.start]
            samples.append(self._sample(tokens, soft, self.cfg.eval_softmask_weight, np.random.default_rng(seed)))
        return _collate(samples)

    def _sample(
        self, tokens: np.ndarray, soft: np.ndarray, softmask_weight: float, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, labels, loss_weight) of one window of `window_len` tokens."""
        weight = np.where(soft, np.float32(softmask_weight), np.float32(1.0)).astype(np.float32)  # (W,)
        weight[(tokens == N_ID) | (tokens == SEP_ID)] = 0.0  # N (and packing separators) carry nothing to learn
        if self.objective == "clm":
            return tokens[:-1], tokens[1:], weight[1:]  # (T,) each: predict base t+1 from bases <= t
        return mask_window(tokens, weight, self.cfg.mlm_probability, rng)

    def groups_trained(self) -> list[str]:
        """With prepared data: the groups of the units whose windows this process trained on, sorted."""
        group_of = {u["unit"]: u["group"] for u in self.record.get("units", [])}
        return sorted({group_of[c.split("/", 1)[0]] for c in self.trained_contigs if c.split("/", 1)[0] in group_of})

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> GenomeData:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _collate(samples: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
    if not samples:
        raise ValueError("a batch needs at least one sample")
    inputs, labels, weights = zip(*samples)
    return {
        "input_ids": torch.from_numpy(np.stack(inputs).astype(np.int64)),  # (B, T)
        "labels": torch.from_numpy(np.stack(labels).astype(np.int64)),  # (B, T)
        "loss_weight": torch.from_numpy(np.stack(weights).astype(np.float32)),  # (B, T)
    }


def build_genome_data(cfg: DataConfig, objective: str) -> GenomeData:
    """Open cfg.fasta, find N-free intervals (each contig read once), and build the split and samplers."""
    genome = Genome(cfg.fasta)
    try:
        n_free = {}
        for contig in genome.lengths:
            tokens, _ = encode(genome.read_contig(contig))
            n_free[contig] = n_free_intervals(tokens, cfg.max_n_run)
        declared = build_split(genome.lengths, cfg.val_contigs, cfg.val_ranges, cfg.test_contigs, cfg.test_ranges)
        split = {name: restrict(regions, n_free) for name, regions in declared.items()}

        def sampler_at(seq_len: int) -> WindowSampler:
            return WindowSampler(split["train"], window_length(cfg, objective, seq_len), cfg.seed)

        sampler = sampler_at(cfg.seq_len)
        return GenomeData(cfg, objective, FastaTokens(genome), split, declared, sampler, sampler_at=sampler_at)
    except BaseException:
        genome.close()
        raise


def build_prepared_data(cfg: DataConfig, objective: str, dp_size: int = 1, micro_batch: int = 1) -> GenomeData:
    """Memory-map the shards of cfg.prepared (written by `megagenome prepare`) and build the split and the blended
    sampler over its units (group-aware over dp_size ranks with cfg.group_aware). A unit without training regions
    (a source held out whole) only serves evaluation."""
    index = prepared.read_index(cfg.prepared)
    store = prepared.ShardStore(cfg.prepared, index)
    try:
        split: dict[str, list[Region]] = {name: [] for name in prepared.SPLITS}
        units, record_units = [], []
        for entry in index["units"]:
            regions = prepared.unit_regions(entry)
            if entry["pack"]:  # one virtual contig per split: the regions end to end, separated by SEP
                for name in prepared.SPLITS:
                    if regions[name]:
                        regions[name] = [store.add_packed(prepared.packed_name(entry["name"], name), regions[name])]
            for name in prepared.SPLITS:
                split[name] += regions[name]
            train_bases = prepared.total(regions["train"])
            weight = entry["weight"] if entry["weight"] is not None else float(train_bases)
            record_units.append(
                {"unit": entry["name"], "group": entry["group"], "weight": weight, "train_bases": train_bases}
            )
            if train_bases:
                units.append(Unit(entry["name"], entry["group"], weight, regions["train"]))
        if not units:
            raise ValueError(f"--data.prepared={cfg.prepared}: no unit has training regions (all held out?)")
        period = cfg.blend_period or max(1000, len(units))

        def sampler_at(seq_len: int) -> BlendSampler | GroupSampler:
            # Group-aware: a warmup stage's micro batch holds k windows per slot (data/curriculum.py), so blocks of
            # micro_batch x k of its indices are the slots of one rank, which keeps its own groups at every length.
            width, k = window_length(cfg, objective, seq_len), 1
            if cfg.seq_warmup_mode == "tokens" and seq_len != cfg.seq_len:
                k = cfg.seq_len // seq_len
            if cfg.group_aware:
                return GroupSampler(units, width, cfg.seed, dp_size, micro_batch * k, period)
            return BlendSampler(units, width, cfg.seed, period)

        sampler = sampler_at(cfg.seq_len)
        record = {"prepared": cfg.prepared, "max_n_run": index["max_n_run"], "units": record_units}
        record["sampler"] = sampler.record()  # blend shares per unit; with group_aware, the groups of every rank
        return GenomeData(cfg, objective, store, split, split, sampler, record, sampler_at)
    except BaseException:
        store.close()
        raise
