"""A file's SHA-256 (layer L0, stdlib only): what checkpoint manifests, prepared shards, genomes in a task's manifest
and preflight's code hash record."""

from __future__ import annotations

import hashlib

CHUNK = 8 << 20  # bytes read at a time


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file's bytes, read CHUNK bytes at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()
