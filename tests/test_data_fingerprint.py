"""Tier 1: the fingerprint of a run's training data (megagenome/data/fingerprint.py) and what `differences` says.

Real files throughout: a FASTA edited in place at the same size, another genome copied over the same path; a
prepared directory (prepared in-process from phiX174) whose fingerprint uses the digests prepare recorded, and the
same directory prepared again from another genome.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import yaml
from support.helpers import DATA

from megagenome.config import DataConfig
from megagenome.config.load import load_manifest
from megagenome.data.fingerprint import data_fingerprint, differences
from megagenome.run import prepare

PHIX, MITO = "phiX174_NC_001422.1.fna", "chrM_rCRS_16569bp.fa"


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()  # noqa: SIM115 (small test files)


def prepare_dir(tmp_path, fasta: str, out) -> str:
    """`megagenome prepare` of one source named "genome" (in-process); returns the output directory."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(DATA / fasta, tmp_path / fasta)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({"sources": [{"name": "genome", "fasta": fasta}]}))
    resolved = prepare.resolve(load_manifest(str(manifest)), str(tmp_path))
    prepare.run(resolved, str(manifest), str(out), progress=False)
    return str(out)


def test_fasta_fingerprint_and_an_edit_at_the_same_size(tmp_path, monkeypatch):
    path = tmp_path / PHIX
    shutil.copy(DATA / PHIX, path)
    monkeypatch.chdir(tmp_path)
    saved = data_fingerprint(DataConfig(fasta=PHIX))  # a relative path is recorded absolute
    assert saved == {"kind": "fasta", "path": str(path), "size": path.stat().st_size, "sha256": sha256(path)}
    assert differences(saved, data_fingerprint(DataConfig(fasta=str(path)))) == []

    text = path.read_bytes()
    at = text.index(b"\n") + 10
    path.write_bytes(text[:at] + (b"A" if text[at : at + 1] != b"A" else b"C") + text[at + 1 :])
    edited = data_fingerprint(DataConfig(fasta=str(path)))
    assert differences(saved, edited) == [
        f"--data.fasta={path} sha256: was {saved['sha256'][:12]}..., now {edited['sha256'][:12]}..."
    ]


def test_another_genome_at_the_same_path(tmp_path):
    path = tmp_path / "genome.fa"
    shutil.copy(DATA / PHIX, path)
    saved = data_fingerprint(DataConfig(fasta=str(path)))
    shutil.copy(DATA / MITO, path)
    lines = differences(saved, data_fingerprint(DataConfig(fasta=str(path))))
    assert len(lines) == 2, lines
    assert lines[0] == f"--data.fasta={path} size: was {saved['size']} bytes, now {os.path.getsize(path)} bytes"
    assert lines[1].startswith(f"--data.fasta={path} sha256: was {saved['sha256'][:12]}..., now ")
    moved = dict(saved, path=str(tmp_path / "elsewhere.fa"))
    assert differences(moved, saved) == [], "the same bytes at another path are the same data"
    changed = data_fingerprint(DataConfig(fasta=str(path)))
    assert differences(moved, changed)[0] == f"--data.fasta path: was {tmp_path / 'elsewhere.fa'}, now {path}"


def test_prepared_fingerprint_uses_the_recorded_digests(tmp_path):
    out = prepare_dir(tmp_path, PHIX, tmp_path / "prepared")
    saved = data_fingerprint(DataConfig(prepared=out))
    shard = os.path.join(out, "shards", "genome.bin")
    assert saved["kind"] == "prepared" and saved["path"] == out
    assert saved["manifest_sha256"] == sha256(os.path.join(out, "manifest.json"))
    assert saved["index_sha256"] == sha256(os.path.join(out, "index.json"))
    assert saved["shards"] == {"shards/genome.bin": {"size": 5386, "sha256": sha256(shard)}}

    # Not re-hashed here: a shard altered at the same size keeps its recorded digest (read_index catches it).
    data = bytearray(open(shard, "rb").read())  # noqa: SIM115
    data[100] ^= 1
    open(shard, "wb").write(bytes(data))  # noqa: SIM115
    assert data_fingerprint(DataConfig(prepared=out)) == saved


def test_prepared_again_from_another_genome(tmp_path):
    out = tmp_path / "prepared"
    saved = data_fingerprint(DataConfig(prepared=prepare_dir(tmp_path / "a", PHIX, out)))
    current = data_fingerprint(DataConfig(prepared=prepare_dir(tmp_path / "b", MITO, out)))
    lines = differences(saved, current)
    label = f"--data.prepared={out}"
    assert lines[0].startswith(f"{label} manifest_sha256: was {saved['manifest_sha256'][:12]}..., now ")
    assert lines[1].startswith(f"{label} index_sha256: was ")
    assert lines[2] == f"{label}: shard shards/genome.bin size: was 5386 bytes, now 16569 bytes"
    assert lines[3].startswith(f"{label}: shard shards/genome.bin sha256: was ")
    assert len(lines) == 4, lines
    gone = dict(current, shards={"shards/other.bin": current["shards"]["shards/genome.bin"]})
    assert differences(saved, gone)[2:] == [
        f"{label}: shard shards/genome.bin was trained on, now absent",
        f"{label}: shard shards/other.bin is new",
    ]


def test_kind_changed_and_nothing_to_fingerprint(tmp_path):
    fasta = {"kind": "fasta", "path": "/a.fa", "size": 1, "sha256": "0" * 64}
    prep = {"kind": "prepared", "path": "/p", "shards": {}}
    assert differences(fasta, prep) == ["training data: was fasta /a.fa, now prepared /p"]
    with pytest.raises(ValueError, match="set --data.fasta or --data.prepared"):
        data_fingerprint(DataConfig())
