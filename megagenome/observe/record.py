"""The run directory's self-describing records: config.yaml, ds_config.json, env.json (layer L1).

Only rank 0 writes. Each file is written to a temporary name and renamed, so an interrupted run never
leaves a half-written record.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
from importlib import metadata

import yaml


def atomic_write(path: str, text: str) -> None:
    """Write text to path through a temporary file (`<path>.tmp.<pid>`, fsynced) and a rename.

    On any failure (a full disk, which often shows only at fsync; a rename refused; an interrupt) the temporary
    file is removed and the error raised: `path` keeps its previous content and nothing else is left behind.
    """
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # never created, or already gone
            os.remove(tmp)
        raise


def write_yaml(path: str, data: dict) -> None:
    atomic_write(path, yaml.safe_dump(data, sort_keys=False))


def write_json(path: str, data) -> None:
    atomic_write(path, json.dumps(data, indent=2) + "\n")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The commit of the megagenome checkout, with '+dirty' when it has uncommitted changes."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def env_record(world_size: int, hosts: list[str], device: str) -> dict:
    """Versions, code commit, hosts and world size (env.json)."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "flash_attn": _version("flash-attn") or _version("flash_attn"),
        "numpy": _version("numpy"),
        "pyfaidx": _version("pyfaidx"),
        "jsonargparse": _version("jsonargparse"),
        "megagenome": _version("megagenome"),
        "cuda": torch.version.cuda,
        "device": device,
        "git_commit": git_commit(),
        "hosts": hosts,
        "world_size": world_size,
    }
