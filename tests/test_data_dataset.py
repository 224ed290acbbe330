"""Tier 1: GenomeData batches for clm and mlm: shapes, shifts, reverse complement, soft-mask and N weights."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from megagenome.config import DataConfig, Region
from megagenome.data.dataset import build_genome_data
from megagenome.data.tokenizer import A_ID, MASK_ID, N_ID, PAD_ID, T_ID, encode, reverse_complement

PHIX = "phiX174_NC_001422.1.fna"
CHR17 = "hg19_chr17_1-40000_softmasked.fa"
CHR22 = "GRCh37_chr22_20000001-21000000.fa"
CHR22_CONTIG = "22:20000001-21000000"
N_BLOCK = (509_431, 609_431)


def data(path, objective="clm", **overrides):
    defaults = {"seq_len": 64, "eval_windows": 8, "seed": 5}
    return build_genome_data(DataConfig(fasta=path, **{**defaults, **overrides}), objective)


def full_window(batch, row):
    """The clm window (T + 1 tokens) a batch row was cut from."""
    return np.concatenate([batch["input_ids"][row].numpy(), batch["labels"][row, -1:].numpy()])


def test_clm_batch(genome_copy):
    path = genome_copy(PHIX)
    with data(path, val_ranges=["NC_001422.1:1-1000"], rc_prob=0.0) as d:
        assert d.window_len == 65
        assert d.split["val"] == [Region("NC_001422.1", 0, 1000)]
        indices = np.arange(10, 18)
        batch = d.train_batch(indices)
        assert set(batch) == {"input_ids", "labels", "loss_weight"}
        for key, dtype in [("input_ids", torch.int64), ("labels", torch.int64), ("loss_weight", torch.float32)]:
            assert batch[key].shape == (8, 64) and batch[key].dtype == dtype
        assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
        assert (batch["loss_weight"] == 1.0).all()  # phiX: no lowercase, no N
        for row, window in enumerate(d.train_sampler.windows(indices)):
            expected = encode(d.store.genome.fetch(window.contig, window.start, window.end))[0]
            assert np.array_equal(full_window(batch, row), expected)
            assert window.start >= 1000
        json.dumps(d.split_record())
        record = d.split_record()
        assert record["splits"]["train"]["bases"] == 5386 - 1000
        assert record["train_sampler"]["windows_per_epoch"] == d.train_sampler.num_windows == (5386 - 1000) // 65


def test_reverse_complement_reproducible(genome_copy):
    path = genome_copy(PHIX)
    with (
        data(path, val_ranges=["NC_001422.1:1-1000"], rc_prob=0.0) as plain,
        data(path, val_ranges=["NC_001422.1:1-1000"], rc_prob=1.0) as flipped,
        data(path, val_ranges=["NC_001422.1:1-1000"], rc_prob=0.5) as half,
    ):
        indices = np.arange(100, 140)
        a, b = plain.train_batch(indices), flipped.train_batch(indices)
        for row in range(len(indices)):
            assert np.array_equal(full_window(b, row), reverse_complement(full_window(a, row)))
        # rc_prob = 0.5: each sample is one or the other, decided by its index alone (not its batch).
        c = half.train_batch(indices)
        is_rc = [np.array_equal(c["input_ids"][r], b["input_ids"][r]) for r in range(len(indices))]
        is_plain = [np.array_equal(c["input_ids"][r], a["input_ids"][r]) for r in range(len(indices))]
        assert all(x != y for x, y in zip(is_rc, is_plain))
        assert 8 < sum(is_rc) < 32
        again = half.train_batch(indices[5:9])
        assert torch.equal(again["input_ids"], c["input_ids"][5:9])
        assert torch.equal(half.train_batch(indices)["labels"], c["labels"])


def test_softmask_weights_chr17(genome_copy):
    path = genome_copy(CHR17)
    with data(
        path, val_ranges=["chr17:30001-40000"], softmask_weight=0.25, eval_softmask_weight=0.0, rc_prob=0.5, seq_len=256
    ) as d:
        indices = np.arange(64)
        batch = d.train_batch(indices)
        labels, weight = batch["labels"].numpy(), batch["loss_weight"].numpy()
        lower = np.zeros_like(weight, dtype=bool)
        for row, window in enumerate(d.train_sampler.windows(indices)):
            soft = encode(d.store.genome.fetch(window.contig, window.start, window.end))[1]
            flipped = not np.array_equal(
                full_window(batch, row), encode(d.store.genome.fetch(window.contig, window.start, window.end))[0]
            )
            lower[row] = (soft[::-1] if flipped else soft)[1:]  # the soft-mask follows the reverse complement
        assert 0.2 < lower.mean() < 0.7  # this excerpt is 43.5% lowercase
        assert np.all(weight[lower & (labels != N_ID)] == 0.25)
        assert np.all(weight[~lower & (labels != N_ID)] == 1.0)
        ev = d.eval_batch(d.eval_regions)
        assert ev["input_ids"].shape == (8, 256)
        for row, region in enumerate(d.eval_regions):
            soft = encode(d.store.genome.fetch(region.contig, region.start, region.end))[1][1:]
            assert np.array_equal(ev["loss_weight"][row].numpy() == 0.0, soft)


def test_n_labels_weigh_nothing(genome_copy):
    path = genome_copy(CHR22)
    # A threshold above the block keeps it in the intervals, so windows may straddle its edge.
    for objective in ("clm", "mlm"):
        with data(path, objective, val_ranges=[f"{CHR22_CONTIG}:1-100000"], max_n_run=200_000) as d:
            edge = Region(CHR22_CONTIG, N_BLOCK[0] - 20, N_BLOCK[0] - 20 + d.window_len)
            batch = d.eval_batch([edge] * 4)
            labels, weight = batch["labels"].numpy(), batch["loss_weight"].numpy()
            assert (labels == N_ID).any() == (objective == "clm")  # mlm never selects an N
            assert np.all(weight[labels == N_ID] == 0.0)
            assert (weight > 0).any()
            if objective == "mlm":
                assert np.all(labels[:, 20:] == PAD_ID)


def test_mlm_masking_proportions(genome_copy):
    path = genome_copy(CHR22)
    with data(path, "mlm", val_ranges=[f"{CHR22_CONTIG}:1-100000"], seq_len=512, eval_windows=32) as d:
        assert d.window_len == 512
        indices = np.arange(256)
        batch = d.train_batch(indices)
        inputs, labels, weight = (batch[k].numpy() for k in ("input_ids", "labels", "loss_weight"))
        originals = np.stack(
            [encode(d.store.genome.fetch(w.contig, w.start, w.end))[0] for w in d.train_sampler.windows(indices)]
        )
        chosen = labels != PAD_ID
        rc = ~np.all(np.where(chosen, True, inputs == originals), axis=1)  # rows that were reverse-complemented
        originals[rc] = reverse_complement(originals[rc])
        assert np.array_equal(labels[chosen], originals[chosen])
        assert np.array_equal(inputs[~chosen], originals[~chosen])  # unselected positions are untouched
        assert np.all(weight[~chosen] == 0.0) and np.all(weight[chosen] == 1.0)
        assert 0.14 < chosen.mean() < 0.16
        masked = (inputs == MASK_ID)[chosen].mean()
        random = ((inputs != MASK_ID) & (inputs != labels))[chosen].mean()
        kept = (inputs == labels)[chosen].mean()
        # 10% get a random base, a quarter of which is the original base again.
        assert abs(masked - 0.8) < 0.02 and abs(random - 0.075) < 0.01 and abs(kept - 0.125) < 0.01
        assert inputs.min() >= PAD_ID and set(np.unique(inputs[chosen])) <= {MASK_ID, A_ID, 4, 5, T_ID}
        # Evaluation masks the same positions every time, also from a fresh instance.
        first = d.eval_batch(d.eval_regions)
        assert torch.equal(first["input_ids"], d.eval_batch(d.eval_regions)["input_ids"])
    with data(path, "mlm", val_ranges=[f"{CHR22_CONTIG}:1-100000"], seq_len=512, eval_windows=32) as again:
        assert again.eval_regions == d.eval_regions
        assert torch.equal(first["labels"], again.eval_batch(again.eval_regions)["labels"])


def test_mlm_at_least_one_target(genome_copy):
    path = genome_copy(PHIX)
    with data(path, "mlm", val_ranges=["NC_001422.1:1-1000"], mlm_probability=1e-6) as d:
        chosen = (d.train_batch(np.arange(32))["labels"] != PAD_ID).sum(dim=1)
        assert torch.equal(chosen, torch.ones(32, dtype=torch.int64))


def test_tokens_for_baselines(genome_copy):
    path = genome_copy(CHR22)
    with data(path, val_ranges=[f"{CHR22_CONTIG}:500001-650000"], test_ranges=[f"{CHR22_CONTIG}:1-10000"]) as d:
        val = d.heldout_tokens()
        assert [t.size for t, _ in val] == [N_BLOCK[0] - 500_000, 650_000 - N_BLOCK[1]]
        assert sum(t.size for t, _ in d.heldout_tokens("test")) == 10_000
        train = d.train_tokens()
        assert sum(t.size for t, _ in train) == 1_000_000 - 150_000 - 10_000
        assert not any((t == N_ID).any() for t, _ in train + val)
        with pytest.raises(ValueError):
            d.heldout_tokens("train")


def test_config_errors(genome_copy):
    path = genome_copy(CHR22)
    cfg = DataConfig(fasta=path, seq_len=64, val_ranges=[f"{CHR22_CONTIG}:509501-609000"])
    with pytest.raises(ValueError, match="held-out split"):
        build_genome_data(cfg, "clm")  # the held-out range is all N
    with pytest.raises(ValueError, match="--model.objective"):
        build_genome_data(dataclasses.replace(cfg, val_ranges=[f"{CHR22_CONTIG}:1-1000"]), "gpt")
    with pytest.raises(ValueError, match="--data.val_contigs"):
        build_genome_data(dataclasses.replace(cfg, val_ranges=[], val_contigs=["chr1"]), "clm")
