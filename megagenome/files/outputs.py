"""A command's output files (layer L0, stdlib only): checked before any work, written whole or not at all, several
published together.

What every command that writes files holds to (docs/when-things-go-wrong.md):

- check_outputs, before any work: each output's directory (or the nearest part of it that exists) is a writable
  directory, the output itself is not a directory, and it does not exist unless the command's --overwrite allows
  it. OutputError names the flag and the path.
- staged: every file is written under a temporary name beside its output (`.<name>.partial-<pid>-<random>`) and
  renamed over it only when all of a command's outputs are complete, so several outputs appear together or not at
  all, and an earlier result is replaced only by a complete one. A failure, a full disk or an interrupt (the CLI
  turns SIGTERM into an exception, cli/__init__.py) removes the temporaries. Missing parent directories are created
  then, not before.
- A process killed outright (SIGKILL, a power cut) cannot clean up: the next command writing into that directory
  removes the temporaries whose process is gone (sweep_stale: named by pid and host, so that a process of another
  node sharing the file system is never taken for a dead one).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator, Sequence

# .<name>.partial-<pid>-<host>-<random>: the host, so that on a shared file system a temporary of a process running on
# another node is never taken for a dead one's; .<name>.partial-<pid>: an export's, before the host was recorded.
_STALE = re.compile(r"^\.(?P<name>.+)\.partial-(?P<pid>\d+)(?:-(?P<host>[A-Za-z0-9_]+)-[^-]*)?$")


class OutputError(ValueError):
    """An output that cannot be written where it was asked for (the message names the flag and the path)."""


def check_outputs(outputs: Sequence[tuple[str, str | None]], overwrite: bool = False, directory: bool = False) -> None:
    """Refuse, before any work, outputs (flag, path; None: not asked for) that cannot be written (module
    docstring). directory: the outputs are directories, which are never replaced."""
    seen = {}
    for flag, path in outputs:
        if path is None:
            continue
        full = os.path.abspath(path)
        if full in seen:
            raise OutputError(f"{flag} {path}: the same file as {seen[full]}")
        seen[full] = flag
        if os.path.isdir(full) and not directory:
            raise OutputError(f"{flag} {path}: is a directory (give a file name)")
        if os.path.lexists(full) and (directory or not overwrite):
            again = "choose a new directory" if directory else "give --overwrite to replace it"
            raise OutputError(f"{flag} {path}: already exists ({again}); nothing was written")
        parent = os.path.dirname(full)
        while not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise OutputError(f"{flag} {path}: {parent} is a file, not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OutputError(f"{flag} {path}: {parent} is not writable (permission denied)")


def umask() -> int:
    """This process's umask: read from /proc where Linux says it (setting it to read it back would briefly leave
    other threads creating files with none), else by setting and restoring it."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sweep_stale(folder: str) -> list[str]:
    """Remove the temporaries in `folder` left by a process that no longer runs; the paths removed."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        m = _STALE.match(name)
        if m is None or m.group("host") not in (None, _host()) or _alive(int(m.group("pid"))):
            continue
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
        removed.append(path)
    return removed


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def temporary_beside(path: str, directory: bool = False) -> str:
    """A new temporary file (or directory) in `path`'s directory, named for `path` and this process, mode as the
    umask gives a new file (mkstemp's 0600 would leak into the output)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    sweep_stale(folder)
    prefix = f".{os.path.basename(path)}.partial-{os.getpid()}-{_host()}-"
    if directory:
        tmp = tempfile.mkdtemp(prefix=prefix, dir=folder)
        os.chmod(tmp, 0o777 & ~umask())
        return tmp
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=folder)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~umask())
    return tmp


@contextlib.contextmanager
def staged(*paths: str) -> Iterator[list[str]]:
    """Temporary paths for `paths` (files), each beside its output; when the block ends without error, each is
    renamed over its output (all of them, after the block has written them all); otherwise they are removed."""
    temps = []
    try:
        for path in paths:
            temps.append(temporary_beside(path))
        yield list(temps)
        for tmp, path in zip(temps, paths):
            os.chmod(tmp, 0o666 & ~umask())  # a writer that recreated the file (safetensors does) set its own mode
            os.replace(tmp, path)
    except OSError as e:  # named by the output it was for (a write's error names no file, a temporary's is hidden)
        if e.filename is None or e.filename in temps:
            named = paths[temps.index(e.filename)] if e.filename in temps else " and ".join(paths)
            raise OSError(e.errno, e.strerror, named) from e
        raise
    finally:
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def write_text(path: str, text: str | bytes) -> None:
    """`text` (UTF-8; bytes as they are) written whole to `path` (staged) or not at all."""
    with staged(os.fspath(path)) as (tmp,), open(tmp, "wb") as fh:
        fh.write(text.encode("utf-8") if isinstance(text, str) else text)


def write_texts(contents: dict[str, str | bytes]) -> None:
    """Several files published together: all written, then all renamed, or none."""
    paths = [os.fspath(p) for p in contents]
    with staged(*paths) as temps:
        for tmp, text in zip(temps, contents.values()):
            with open(tmp, "wb") as fh:
                fh.write(text.encode("utf-8") if isinstance(text, str) else text)


def describe_os_error(e: OSError) -> str:
    """An OSError as one line: the path(s), what went wrong, and what to do for the usual ones."""
    where = ", ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    hint = {
        errno.ENOSPC: "free space there or write elsewhere",
        errno.EDQUOT: "over the disk quota: free space or write elsewhere",
        errno.EACCES: "permission denied: choose a path you may write to",
        errno.EROFS: "the file system is read-only: write elsewhere",
        errno.ENOTDIR: "a part of the path is a file, not a directory",
    }.get(e.errno)
    what = e.strerror or str(e)
    return f"{where + ': ' if where else ''}{what}{f' ({hint})' if hint else ''}"
