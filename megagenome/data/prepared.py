"""Prepared data (layer L1): the on-disk layout `megagenome prepare` writes, and reading it at memory speed.

    <dir>/manifest.json           the manifest as given, with the SHA-256 of every input and output file
    <dir>/index.json              every unit (a source, or one haplotype of a source with a VCF): its shard, group,
                                  species, weight, contigs with their offsets and lengths, and per contig the
                                  train/val/test regions (N-free, cut to the BED intervals when the source has one)
    <dir>/shards/<unit>.bin       the unit's contigs, concatenated: one uint8 per base, the token id (tokenizer.py)
                                  in bits 0-6 and the soft-mask flag (a lowercase base) in bit 7
    <dir>/shards/<unit>.json      the unit's index entry, written after its shard: its presence marks the shard
                                  complete (an interrupted prepare resumes from it)

Each unit's entry records its shard's size ("bytes") and SHA-256 ("sha256"). Opening a directory for training
(`read_index`) checks every shard against them: the size always, the SHA-256 where recorded (directories written
before digests were recorded still open). Hashing runs at about 1 GB/s, so a 100 GB directory adds ~100 s to the
start of every rank that opens it; a check that takes longer than CHECK_REPORT_S says so on stderr.

A base's token and soft-mask flag share one byte so that a window is one slice of a memory map: reading a window
is a memcpy plus two vectorised operations. Region contig names are qualified by the unit, "<unit>/<contig>", so
the regions of all units live in one namespace (the sampler, the split record and evaluation need nothing else).
A source with `pack: true` exposes per split one virtual contig "<unit>/<packed-SPLIT>": its regions laid end to
end with one SEP token between neighbours, which is what the sampler tiles into windows.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable

import numpy as np

from megagenome.config import Region
from megagenome.data.tokenizer import SEP_ID
from megagenome.files.digest import sha256_file

INDEX = "index.json"
MANIFEST = "manifest.json"
SHARDS = "shards"
INDEX_VERSION = 1
SOFTMASK_BIT = np.uint8(0x80)
TOKEN_BITS = np.uint8(0x7F)
SPLITS = ("train", "val", "test")
CHECK_REPORT_S = 5.0  # a shard check slower than this is reported on stderr


class PreparedDataError(ValueError):
    """A prepared-data directory that is missing, incomplete or of another version."""


def pack_bytes(tokens: np.ndarray, soft: np.ndarray) -> np.ndarray:
    """Token ids (uint8) and soft-mask flags (bool) of the same length as shard bytes."""
    return (tokens.astype(np.uint8) | (soft.astype(np.uint8) << 7)).astype(np.uint8)


def unpack_bytes(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Shard bytes -> (token ids uint8, soft-mask flags bool), as tokenizer.encode returns them."""
    return raw & TOKEN_BITS, (raw & SOFTMASK_BIT).astype(bool)


def qualified(unit: str, contig: str) -> str:
    return f"{unit}/{contig}"


def packed_name(unit: str, split: str) -> str:
    return qualified(unit, f"<packed-{split}>")


def read_index(directory: str, verify: bool = True) -> dict:
    """index.json of a prepared directory, checked for its version and its shards: present, of the recorded size,
    and (with `verify`, where the index records one) of the recorded SHA-256. Raises PreparedDataError naming the
    directory or the file and what to do."""
    path = os.path.join(directory, INDEX)
    if not os.path.isdir(directory):
        what = "a file, not a directory" if os.path.exists(directory) else "no such directory"
        raise PreparedDataError(f"--data.prepared={directory}: {what} (write one with `megagenome prepare`)")
    if not os.path.exists(path):
        raise PreparedDataError(
            f"--data.prepared={directory}: no {INDEX}: `megagenome prepare` did not finish there; rerun it (finished "
            "shards are kept)"
        )
    with open(path, encoding="utf-8") as fh:
        index = json.load(fh)
    if index.get("version") != INDEX_VERSION:
        raise PreparedDataError(
            f"{path}: version {index.get('version')} of the prepared layout; this megagenome reads version "
            f"{INDEX_VERSION}: prepare the data again"
        )
    check_shards(directory, index, verify)
    return index


def check_shards(directory: str, index: dict, verify: bool = True) -> None:
    """Raise PreparedDataError for the first shard that is missing, not of its recorded size or (with `verify`)
    not of its recorded SHA-256: a shard altered after `megagenome prepare` must not be trained on."""
    path = os.path.join(directory, INDEX)
    rerun = "rerun `megagenome prepare` with the same manifest and --out (it rewrites only what changed)"
    started, hashed = time.monotonic(), 0
    for unit in index["units"]:
        shard = os.path.join(directory, SHARDS, unit["shard"])
        if not os.path.exists(shard):
            raise PreparedDataError(f"{shard}: missing, but {path} lists it; {rerun}")
        size = os.path.getsize(shard)
        if size != unit["bytes"]:
            raise PreparedDataError(
                f"{shard}: {size} bytes, but {path} records {unit['bytes']}: the shard changed after "
                f"`megagenome prepare`; {rerun}"
            )
        recorded = unit.get("sha256")
        if verify and recorded:
            actual = sha256_file(shard)
            hashed += size
            if actual != recorded:
                raise PreparedDataError(
                    f"{shard}: SHA-256 {actual[:12]}..., but {path} records {recorded[:12]}...: the shard changed "
                    f"after `megagenome prepare`; {rerun}"
                )
    elapsed = time.monotonic() - started
    if elapsed > CHECK_REPORT_S:
        print(
            f"--data.prepared={directory}: checked the SHA-256 of {len(index['units'])} shards "
            f"({hashed / 1e9:.1f} GB) in {elapsed:.0f} s",
            file=sys.stderr,
            flush=True,
        )


class _Packed:
    """A virtual contig: regions of real contigs end to end, one SEP token between neighbours."""

    def __init__(self, regions: list[Region]):
        self.regions = regions
        lengths = np.array([r.end - r.start for r in regions], dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(lengths + 1)[:-1]))  # virtual start of each region
        self.length = int(lengths.sum() + max(len(regions) - 1, 0))


class ShardStore:
    """Token access over the memory-mapped shards of a prepared directory; regions use qualified contig names."""

    def __init__(self, directory: str, index: dict):
        self.path = directory
        self.lengths: dict[str, int] = {}
        self._where: dict[str, tuple[np.memmap, int]] = {}  # qualified contig -> (shard map, offset)
        self._packed: dict[str, _Packed] = {}
        self._maps = []
        for unit in index["units"]:
            data = np.memmap(os.path.join(directory, SHARDS, unit["shard"]), dtype=np.uint8, mode="r")
            self._maps.append(data)
            for contig in unit["contigs"]:
                name = qualified(unit["name"], contig["name"])
                self.lengths[name] = contig["length"]
                self._where[name] = (data, contig["offset"])

    def add_packed(self, name: str, regions: list[Region]) -> Region:
        """Register a virtual contig packing `regions`; returns the one region that covers it."""
        packed = _Packed(regions)
        self._packed[name] = packed
        self.lengths[name] = packed.length
        return Region(name, 0, packed.length)

    def tokens(self, region: Region) -> tuple[np.ndarray, np.ndarray]:
        """(token ids uint8, soft-mask bool) of a region, copied out of the shard."""
        if not 0 <= region.start <= region.end <= self.lengths[region.contig]:
            raise ValueError(f"{region} is outside {region.contig} (length {self.lengths[region.contig]})")
        packed = self._packed.get(region.contig)
        if packed is not None:
            return self._packed_tokens(packed, region.start, region.end)
        data, offset = self._where[region.contig]
        return unpack_bytes(np.array(data[offset + region.start : offset + region.end]))

    def _packed_tokens(self, packed: _Packed, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.full(end - start, SEP_ID, dtype=np.uint8)  # positions between regions stay SEP
        soft = np.zeros(end - start, dtype=bool)
        first = int(np.searchsorted(packed.starts, start, side="right")) - 1
        for i in range(max(first, 0), len(packed.regions)):
            v0 = int(packed.starts[i])
            if v0 >= end:
                break
            r = packed.regions[i]
            lo, hi = max(start, v0), min(end, v0 + r.end - r.start)
            if lo < hi:
                t, s = self.tokens(Region(r.contig, r.start + lo - v0, r.start + hi - v0))
                tokens[lo - start : hi - start], soft[lo - start : hi - start] = t, s
        return tokens, soft

    def close(self) -> None:
        for data in self._maps:
            mm = getattr(data, "_mmap", None)
            if mm is not None:
                mm.close()
        self._maps.clear()
        self._where.clear()


def unit_regions(unit: dict) -> dict[str, list[Region]]:
    """The unit's regions per split (qualified contig names), from its index entry."""
    out: dict[str, list[Region]] = {split: [] for split in SPLITS}
    for contig in unit["contigs"]:
        name = qualified(unit["name"], contig["name"])
        for split in SPLITS:
            out[split] += [Region(name, int(s), int(e)) for s, e in contig["split"][split]]
    return out


def total(regions: Iterable[Region]) -> int:
    return sum(r.end - r.start for r in regions)
