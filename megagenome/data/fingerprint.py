"""What a run trained on, as data (layer L1): a fingerprint of --data.fasta or --data.prepared, and its differences.

A run records the fingerprint of its training data; a resume compares it with the data now at the same path, so a
different genome under the same name is not trained on silently. `differences` says what changed, one line each.

    --data.fasta     {"kind": "fasta", "path": absolute path, "size": bytes, "sha256": hex of the file's bytes}
    --data.prepared  {"kind": "prepared", "path": absolute path, "manifest_sha256": ..., "index_sha256": ...,
                      "shards": {"shards/<unit>.bin": {"size": bytes, "sha256": hex or None}}}

A FASTA is hashed here (about 1 GB/s: a human genome adds ~3 s). A prepared directory is not: its shards' sizes
and SHA-256 are those `megagenome prepare` recorded in index.json, and opening the directory for training
(prepared.read_index) checks the shards against them. manifest.json records the SHA-256 of every input and
output, so its own digest changes whenever the data was prepared from other inputs.
"""

from __future__ import annotations

import os

from megagenome.config import DataConfig
from megagenome.data import prepared
from megagenome.files.digest import sha256_file

PREFIX = 12  # hex digits of a SHA-256 shown in a difference


def data_fingerprint(data_cfg: DataConfig) -> dict:
    """The fingerprint of the run's training data (see the module docstring). Raises ValueError when neither
    --data.fasta nor --data.prepared is set, OSError for a FASTA that cannot be read and
    prepared.PreparedDataError for a prepared directory that cannot be opened."""
    if data_cfg.prepared:
        return _prepared(data_cfg.prepared)
    if data_cfg.fasta:
        path = os.path.abspath(data_cfg.fasta)
        return {"kind": "fasta", "path": path, "size": os.path.getsize(path), "sha256": sha256_file(path)}
    raise ValueError("no training data to fingerprint: set --data.fasta or --data.prepared")


def _prepared(directory: str) -> dict:
    path = os.path.abspath(directory)
    index = prepared.read_index(path, verify=False)  # sizes only: the digests are checked where data is opened
    manifest = os.path.join(path, prepared.MANIFEST)
    shards = {
        f"{prepared.SHARDS}/{unit['shard']}": {"size": unit["bytes"], "sha256": unit.get("sha256")}
        for unit in index["units"]
    }
    return {
        "kind": "prepared",
        "path": path,
        "manifest_sha256": sha256_file(manifest) if os.path.exists(manifest) else None,
        "index_sha256": sha256_file(os.path.join(path, prepared.INDEX)),
        "shards": shards,
    }


def _short(digest: str | None) -> str:
    return "none recorded" if not digest else f"{digest[:PREFIX]}..."


def _field(label: str, key: str, saved: dict, current: dict) -> list[str]:
    """One line when `key` differs; keys missing on either side (an older record) are not compared."""
    if key not in saved or key not in current or saved[key] == current[key]:
        return []
    before, after = saved[key], current[key]
    if key.endswith("sha256"):
        before, after = _short(before), _short(after)
    elif key == "size":
        before, after = f"{before} bytes", f"{after} bytes"
    return [f"{label} {key}: was {before}, now {after}"]


def differences(saved: dict, current: dict) -> list[str]:
    """What changed between a recorded fingerprint and the current one, one readable line each; [] when none."""
    kind = saved.get("kind")
    if kind != current.get("kind"):
        return [
            f"training data: was {kind} {saved.get('path')}, now {current.get('kind')} {current.get('path')}",
        ]
    flag = "--data.prepared" if kind == "prepared" else "--data.fasta"
    label = f"{flag}={current.get('path')}"
    lines = []
    for key in ("size", "sha256", "manifest_sha256", "index_sha256"):
        lines += _field(label, key, saved, current)
    if kind == "prepared":
        lines += _shard_differences(label, saved.get("shards") or {}, current.get("shards") or {})
    # The same bytes at another path (a moved or copied genome) are the same data; a path is named only beside
    # a change of content.
    return _field(flag, "path", saved, current) + lines if lines else []


def _shard_differences(label: str, saved: dict, current: dict) -> list[str]:
    lines = [f"{label}: shard {name} was trained on, now absent" for name in saved if name not in current]
    lines += [f"{label}: shard {name} is new" for name in current if name not in saved]
    for name in saved:
        if name in current:
            for key in ("size", "sha256"):
                lines += _field(f"{label}: shard {name}", key, saved[name], current[name])
    return lines
