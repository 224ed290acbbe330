"""Checkpoint integrity (layer L3, standard library only): the manifest of sizes and SHA-256 digests that a
COMPLETE marker holds and its verification; the disk-space check before a save and the one clear error
(SaveError) when a save fails, a full disk recognised as such; the warnings of a resume that skipped damaged
checkpoints, and the ranks' agreement on the checkpoint to resume from.

A COMPLETE marker is JSON, {"step": N, "files": {relative path: {"size": bytes, "sha256": hex}}}, listing every
file of the tag directory except the marker itself. Markers written by earlier versions hold just "N\\n": the
checkpoint is complete, but there is no manifest to verify it against. weights/checkpoint.py writes and reads
markers through this module, which imports nothing of megagenome.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import traceback

from megagenome.files.digest import sha256_file

MARKER = "COMPLETE"
LEVELS = ("digest", "size")  # --checkpoint.verify: SHA-256 and size of every file, or sizes only
NEARLY_FULL = 16 << 20  # free bytes under which torch's errno-less write errors are taken for a full disk
_DISK_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
_TORCH_WRITE_ERRORS = ("unexpected pos", "iostream error")  # what torch.save raises on a full disk, without errno


def human(n: float) -> str:
    """Bytes in binary units: '1.5 GiB'."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def list_files(tag_dir: str) -> list[str]:
    """Every file under tag_dir as a sorted relative path (POSIX separators), the marker and its temporary
    excluded."""
    out = []
    for dirpath, _, names in os.walk(tag_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), tag_dir).replace(os.sep, "/")
            if rel not in (MARKER, MARKER + ".tmp"):
                out.append(rel)
    return sorted(out)


def hash_files(tag_dir: str, rels: list[str], strict: bool = True) -> dict[str, dict]:
    """{relative path: {"size", "sha256"}} of the files `rels` of tag_dir. strict=False leaves out a file that
    cannot be read rather than raising (a rank's share during a save: rank 0 hashes what is missing, strictly)."""
    out = {}
    for rel in rels:
        path = os.path.join(tag_dir, rel)
        try:
            out[rel] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
        except OSError:
            if strict:
                raise
    return out


def write_marker(tag_dir: str, step: int, files: dict[str, dict]) -> None:
    """Write tag_dir's COMPLETE marker with its manifest: first as COMPLETE.tmp, then renamed, so that a marker
    exists only when it is whole."""
    tmp = os.path.join(tag_dir, MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"step": step, "files": files}, fh, indent=1, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(tag_dir, MARKER))


def read_marker(tag_dir: str) -> dict:
    """{"step": int, "files": manifest or None} of tag_dir's marker; "files" is None for an old "N\\n" marker.
    Raises ValueError naming the marker when it is neither."""
    path = os.path.join(tag_dir, MARKER)
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    if text.strip().isdigit():
        return {"step": int(text), "files": None}
    try:
        marker = json.loads(text)
        if isinstance(marker, dict) and isinstance(marker.get("files"), dict):
            return {"step": marker.get("step"), "files": marker["files"]}
    except ValueError:
        pass
    raise ValueError(f"{path} is neither a step number nor a JSON manifest (it is damaged)")


def has_manifest(tag_dir: str) -> bool:
    """Whether tag_dir's marker lists its files (False for an old "N\\n" marker or an unreadable one)."""
    try:
        return read_marker(tag_dir)["files"] is not None
    except (OSError, ValueError):
        return False


def verify(path: str, level: str = "digest") -> list[str]:
    """What is wrong with the checkpoint in the tag directory `path` against its marker's manifest, one line per
    bad file (missing; size X, expected Y; SHA-256 differs); level "size" compares sizes only. Files the manifest
    does not list are ignored. Empty when it verifies, and for an old marker without a manifest (unverifiable:
    accepted as is; see has_manifest)."""
    if level not in LEVELS:
        raise ValueError(f"verification level {level!r}: choose one of {', '.join(LEVELS)}")
    try:
        files = read_marker(path)["files"]
    except (OSError, ValueError) as e:
        return [f"{os.path.join(path, MARKER)}: {e}"]
    problems = []
    for rel, want in sorted((files or {}).items()):
        full = os.path.join(path, rel)
        try:
            size = os.path.getsize(full)
        except FileNotFoundError:
            problems.append(f"{full}: missing")
            continue
        if size != want["size"]:
            problems.append(f"{full}: size {size}, expected {want['size']}")
        elif level == "digest" and sha256_file(full) != want["sha256"]:
            problems.append(f"{full}: SHA-256 differs from the manifest's (same size: the contents changed)")
    return problems


def checkpoint_bytes(tag_dir: str) -> int:
    """The size of the checkpoint in tag_dir: the manifest's total, or its files' sizes summed."""
    try:
        files = read_marker(tag_dir)["files"]
    except (OSError, ValueError):
        files = None
    if files is not None:
        return sum(entry["size"] for entry in files.values())
    return sum(os.path.getsize(os.path.join(tag_dir, rel)) for rel in list_files(tag_dir))


def free_bytes(path: str) -> int:
    """Free bytes (for this user) on the filesystem of `path`, or of its nearest existing parent."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def disk_full_reason(exc: BaseException, free: int) -> str | None:
    """'no space left on device' (or 'disk quota exceeded') when `exc` is a full disk: ENOSPC/EDQUOT anywhere in
    its chain, or torch's errno-less write errors ('unexpected pos ...', 'basic_ios::clear: iostream error') while
    fewer than NEARLY_FULL bytes are free; else None."""
    seen: set[int] = set()
    chain: BaseException | None = exc
    torch_write_error = False
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if getattr(chain, "errno", None) in _DISK_FULL:
            return _DISK_FULL[chain.errno]
        torch_write_error |= any(s in str(chain) for s in _TORCH_WRITE_ERRORS)
        chain = chain.__cause__ or chain.__context__
    return _DISK_FULL[errno.ENOSPC] if torch_write_error and free < NEARLY_FULL else None


# ----- resuming ----------------------------------------------------------------------------------------------


def resume_warnings(damaged: list[tuple[str, list[str]]], chosen: str) -> list[str]:
    """The warnings of a resume from `chosen`: each damaged checkpoint skipped (path, verify's problems), and
    that `chosen` could not be verified when its marker has no manifest."""
    out = [
        f"checkpoint {bad} is damaged ({'; '.join(problems)}); skipping it, falling back to {chosen}"
        for bad, problems in damaged
    ]
    if not has_manifest(chosen):
        out.append(
            f"checkpoint {chosen} is unverifiable (no manifest: its {MARKER} marker was written by an earlier "
            "megagenome); resuming from it unverified"
        )
    return out


def agree_on_resume(chosen: str | None, gather) -> str | None:
    """The checkpoint every rank resumes from, the same on all: each rank passes its own choice (resolve_verified
    on its view of the filesystem) through `gather` (all_gather_object-style); where they differ, the oldest
    choice by step, which the ranks that chose newer ones skipped past. ValueError (on every rank) when some ranks
    found a checkpoint and others none: they do not see the same checkpoint directory."""
    choices = gather(chosen)
    if len(set(choices)) == 1:
        return choices[0]
    if None in choices:
        raise ValueError(
            f"the ranks disagree on the checkpoint to resume from ({dict(enumerate(choices))}): some see none at "
            "all. Every rank must see the same checkpoint directory: put the run directory on a filesystem that "
            "all nodes share"
        )
    return min(choices, key=_step_of)


def _step_of(path: str) -> int:
    """The step of the checkpoint in `path`: from its step_XXXXXXXX name, else from its marker."""
    m = re.match(r"^step_(\d+)$", os.path.basename(path.rstrip("/")))
    return int(m.group(1)) if m else int(read_marker(path)["step"])


def load_failure(path: str, exc: BaseException) -> str:
    """Why the checkpoint in `path` did not load (`exc`), with what verifying it against its manifest finds."""
    error = " ".join(f"{type(exc).__name__}: {exc}".split())
    if not has_manifest(path):
        found = f"it has no manifest to check its files against (its {MARKER} marker predates manifests)"
    elif problems := verify(path):
        found = (
            f"damaged files: {'; '.join(problems)}. Resume from an earlier checkpoint (--checkpoint.resume auto "
            "skips damaged ones) or restore these files"
        )
    else:
        found = (
            "its files match their manifest: the checkpoint is intact on disk, and this run's model, layout or "
            "DeepSpeed config does not fit it"
        )
    return f"could not load checkpoint {path} ({error}); {found}"


# ----- failed saves ------------------------------------------------------------------------------------------

SPACE_MARGIN = 1.1  # a new checkpoint is assumed up to 10% larger than the last complete one


class SaveError(RuntimeError):
    """A checkpoint could not be saved; the message names the path, the cause and the complete checkpoint that
    remains. Raised on every rank alike; the run should exit with exit_code."""

    exit_code = 3


def space_shortfall(target: str, last: str | None) -> str | None:
    """Why the checkpoint `target` (a tag directory to be written) will not fit beside `last`, the newest complete
    checkpoint (SPACE_MARGIN times its size must be free); None when it fits or there is nothing to compare."""
    if last is None:
        return None
    size = checkpoint_bytes(last)
    need, free = int(size * SPACE_MARGIN), free_bytes(target)
    if free >= need:
        return None
    root = os.path.dirname(target)
    return (
        f"not saving checkpoint {target}: {human(free)} free on the filesystem of {root}, about {human(need)} "
        f"needed (the last complete checkpoint, {last}, is {human(size)}). Nothing was written; {last} is intact. "
        f"Free space there (`df -h {root}`) or move the run directory to a larger filesystem, then resume with "
        "--checkpoint.resume auto"
    )


def write_failure(rank: int, exc: BaseException, root: str) -> dict:
    """What one rank reports of a failed write: {"rank", "reason" (a full disk, or None), "error"}. The free space
    is measured now, before anything is removed, so a full disk is still full."""
    reason = disk_full_reason(exc, free_bytes(root))
    return {"rank": rank, "reason": reason, "error": " ".join(f"{type(exc).__name__}: {exc}".split())}


def failure_message(path: str, failures: list[dict], remaining: str | None) -> str:
    """The one message for a save of `path` that failed on some ranks (write_failure's records), the partial
    directory removed; `remaining` is the newest complete checkpoint left."""
    reason = next((f["reason"] for f in failures if f["reason"]), None)
    errors = "; ".join(f"rank {f['rank']}: {f['error']}" for f in failures)
    kept = (
        f"the last complete checkpoint, {remaining}, is intact (the run resumes from it with --checkpoint.resume auto)"
        if remaining
        else "there is no earlier complete checkpoint"
    )
    how = f" Free space on that filesystem (`df -h {os.path.dirname(path)}`) and resume." if reason else ""
    what = reason or "writing failed"
    return f"could not save checkpoint {path}: {what} ({errors}). The partial {path} was removed; {kept}.{how}"


def release(errors: list[BaseException]) -> None:
    """Forget the exceptions of failed writes, and the frames their tracebacks hold: those frames keep torch's
    file writers, and so the partial files, open, and a removed file that is still open keeps its space."""
    for exc in errors:
        chain: BaseException | None = exc
        while chain is not None:
            traceback.clear_frames(chain.__traceback__)
            chain = chain.__cause__ or chain.__context__
    errors.clear()


@contextlib.contextmanager
def deferred_write_errors(engine, errors: list[BaseException]):
    """While DeepSpeed's save_checkpoint runs: a failed file write is appended to `errors` instead of raised (and
    this rank writes nothing more), so that the rank still joins the collectives DeepSpeed runs after its writes
    (its closing barrier) and all ranks then agree on the failure together; an exception out of the middle of the
    save would leave the other ranks waiting in that barrier. Every file DeepSpeed writes goes through
    engine.checkpoint_engine.save; an engine without one is left alone."""
    writer = getattr(engine, "checkpoint_engine", None)
    original = getattr(writer, "save", None)
    if original is None:
        yield
        return

    def save(state_dict, path, *args, **kwargs):
        if errors:
            return None  # the checkpoint is abandoned: write no more of it
        try:
            return original(state_dict, path, *args, **kwargs)
        except Exception as e:
            errors.append(e)
            return None

    own = vars(writer).get("save")  # normally None: save is the class's method
    writer.save = save
    try:
        yield
    finally:
        if own is None:
            del writer.save
        else:
            writer.save = own
