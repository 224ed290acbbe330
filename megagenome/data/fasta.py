"""FASTA access: a strict one-pass validator and `Genome`, random access by contig and 0-based coordinates.

This is the only module that imports pyfaidx (docs/architecture.md: one seam per heavy dependency). pyfaidx's own
errors are terse and some bad inputs (Windows line endings, stray characters) are not errors to it at all
but silently corrupt coordinates or tokens later, so `validate_fasta` reads the whole file once first and
fails with the file, line and column of the first problem.

Plain and BGZF-compressed files are accepted. Plain gzip is refused: pyfaidx needs to seek to arbitrary
offsets, which only BGZF's independent blocks allow.

Indexes never go beside the user's FASTA (its folder may be read-only or shared, and a run that fails validation
must leave nothing behind): a fresh .fai/.gzi already there (samtools faidx's) is read; otherwise one is built once,
atomically, in a per-user cache, $MEGAGENOME_CACHE, else $XDG_CACHE_HOME/megagenome, else ~/.cache/megagenome, with
its lock file. Entries are small (~100 bytes per contig, plus ~16 bytes per 64 KiB of BGZF) and may be deleted at
any time; they are rebuilt when needed.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import gzip
import hashlib
import os
import re
import socket
import tempfile
import zlib
from typing import IO

import pyfaidx

from megagenome.data.tokenizer import ALLOWED

_GZIP_MAGIC = b"\x1f\x8b"
_COMPRESSED_SUFFIXES = (".gz", ".bgz")
_ALLOWED_IN_LINE = ALLOWED + b"\n"
_BAD_CHAR = re.compile(b"[^" + re.escape(ALLOWED) + b"\n]")


class FastaError(ValueError):
    """A FASTA file that cannot be used; the message names the file and, where it applies, line and column."""


def _compression(path: str) -> str:
    """'bgzf', 'gzip' (plain, not seekable) or 'none', from the first gzip member's header.

    BGZF is gzip whose header carries an extra subfield with the id 'BC' (SAM/BAM spec, section 4.1).
    """
    with open(path, "rb") as fh:
        head = fh.read(18)
    if head[:2] != _GZIP_MAGIC:
        return "none"
    flags = head[3] if len(head) > 3 else 0
    has_extra = bool(flags & 0x04)
    if has_extra and len(head) >= 18 and head[12:14] == b"BC":
        return "bgzf"
    return "gzip"


def _open_text(path: str, compression: str) -> IO[bytes]:
    # BGZF is a series of gzip members, which the gzip module reads as one stream.
    return gzip.open(path, "rb") if compression == "bgzf" else open(path, "rb")


def file_problem(path: str) -> str | None:
    """What is wrong with the file at `path` before its content is read (existence, emptiness, plain gzip, a
    compression its name does not say), or None. validate_fasta and data/quick_checks.py both start here."""
    if not os.path.exists(path):
        return "FASTA file not found"
    if os.path.isdir(path):
        return "is a directory, not a FASTA file"
    if os.path.getsize(path) == 0:
        return "file is empty"
    compression = _compression(path)
    if compression == "gzip":
        return (
            "plain gzip cannot be read at random offsets; recompress with `bgzip` (htslib) or decompress with `gunzip`"
        )
    # pyfaidx picks its reader from the file name, not the content, so the two must agree.
    compressed_name = path.lower().endswith(_COMPRESSED_SUFFIXES)
    if compression == "bgzf" and not compressed_name:
        return "file is BGZF-compressed but its name does not end in .gz or .bgz; rename it"
    if compression == "none" and compressed_name:
        return "file name ends in .gz/.bgz but the file is not compressed; rename it"
    return None


def validate_fasta(path: str) -> None:
    """Raise FastaError for the first problem in the file; return None for a FASTA that pyfaidx reads correctly.

    Checked in one streaming pass: existence, emptiness, plain gzip, CRLF line endings, a header before any
    sequence, non-empty unique record names, no empty records, only IUPAC nucleotide characters, and the
    faidx layout (every line of a record but the last has the same length; at most one blank line, only at
    the end of a record).
    """
    problem = file_problem(path)
    if problem is not None:
        raise FastaError(f"{path}: {problem}")
    compression = _compression(path)
    try:
        with _open_text(path, compression) as fh:
            _scan(path, fh)
    except (OSError, EOFError, zlib.error) as e:  # truncated or corrupt compressed data, unreadable file
        raise FastaError(f"{path}: cannot read the file ({compression} compression): {e}") from e


def _scan(path: str, fh: IO[bytes]) -> None:
    """The validation pass proper; per line only C-level bytes methods run, so 5 Mb take ~0.1 s."""
    names: dict[bytes, int] = {}
    header_line = 0  # line of the current record's header; 0 before the first header
    orphan_line = 0  # first sequence line seen before any header
    width = 0  # length of the record's first sequence line (without the newline)
    short_line = 0  # a line shorter than `width`: legal only as the record's last sequence line
    blank_line = 0  # a blank line: legal only as the very last line of a record
    record_bases = 0
    seen_lf = 0
    number = 0
    for number, line in enumerate(fh, start=1):
        if line.endswith(b"\r\n"):
            _crlf(path, fh, number, seen_lf)
        if line.endswith(b"\n"):
            seen_lf = seen_lf or number
            body = line[:-1]
        else:
            body = line
        if body.startswith(b">"):
            if orphan_line:
                raise FastaError(f"{path}:{orphan_line}: sequence before the first header line ('>name')")
            if header_line and record_bases == 0:
                raise FastaError(f"{path}:{header_line}: record has no sequence")
            _header(path, body, number, names)
            header_line, width, short_line, blank_line, record_bases = number, 0, 0, 0, 0
            continue
        if not header_line:
            # pyfaidx (like samtools) skips blank and ';' comment lines before the first record.
            if body.strip() == b"" or body.startswith(b";"):
                continue
            orphan_line = orphan_line or number
            continue
        if not body:
            if blank_line:
                raise FastaError(f"{path}:{number}: second blank line in a record (faidx allows one, at its end)")
            blank_line = number
            continue
        if blank_line:
            raise FastaError(f"{path}:{blank_line}: blank line inside a record (faidx cannot index it)")
        if line.translate(None, _ALLOWED_IN_LINE):
            m = _BAD_CHAR.search(body)
            assert m is not None  # translate found a byte outside the set, so the search does too
            char = m.group().decode("latin-1")
            raise FastaError(
                f"{path}:{number}:{m.start() + 1}: character {char!r} is not a nucleotide "
                f"(allowed: ACGT, IUPAC codes RYSWKMBDHVN, either case)"
            )
        if short_line:
            raise FastaError(
                f"{path}:{short_line}: line is shorter than the record's first line ({width} bases) but is not "
                f"its last; faidx needs equal line lengths within a record (reformat, e.g. `seqkit seq -w 60`)"
            )
        n = len(body)
        if not width:
            width = n
        elif n > width:
            raise FastaError(
                f"{path}:{number}: line is longer ({n}) than the record's first line ({width}); faidx needs "
                f"equal line lengths within a record (reformat, e.g. `seqkit seq -w 60`)"
            )
        elif n < width:
            short_line = number
        record_bases += n
    if orphan_line:
        raise FastaError(f"{path}:{orphan_line}: no FASTA header ('>name') before this sequence line")
    if not header_line:
        raise FastaError(f"{path}: no FASTA header ('>name') in {number} line(s)")
    if record_bases == 0:
        raise FastaError(f"{path}:{header_line}: record has no sequence")


def _header(path: str, body: bytes, number: int, names: dict[bytes, int]) -> None:
    """Check a header line (without its newline) and record its name in `names` (name -> line)."""
    fields = body[1:].split(None, 1)
    if not fields or body[1:2].isspace():
        raise FastaError(
            f"{path}:{number}: header has an empty name (the name is the text right after '>' "
            f"up to the first whitespace)"
        )
    name = fields[0]
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FastaError(f"{path}:{number}:{e.start + 1}: header is not valid UTF-8") from e
    if name in names:
        raise FastaError(
            f"{path}:{number}: duplicate record name {name.decode()!r} (first defined at line "
            f"{names[name]}); names are the header text up to the first whitespace"
        )
    names[name] = number


def _crlf(path: str, fh: IO[bytes], number: int, seen_lf: int) -> None:
    """Raise for a CRLF line ending, saying whether the file mixes CRLF and LF (which needs a closer look)."""
    fix = "convert with `dos2unix` (or `sed -i 's/\\r$//'`)"
    if seen_lf:
        raise FastaError(f"{path}:{number}: mixed line endings: CRLF here, LF at line {seen_lf}; {fix}")
    # The file starts with CRLF: read on to tell a Windows file from a mixed one.
    for later, line in enumerate(fh, start=number + 1):
        if line.endswith(b"\n") and not line.endswith(b"\r\n"):
            raise FastaError(f"{path}:{number}: mixed line endings: CRLF here, LF at line {later}; {fix}")
    raise FastaError(f"{path}:{number}: Windows (CRLF) line endings; {fix}")


def cache_dir() -> str:
    """Where megagenome keeps what it derives from inputs (FASTA indexes): $MEGAGENOME_CACHE, else
    $XDG_CACHE_HOME/megagenome, else ~/.cache/megagenome."""
    if os.environ.get("MEGAGENOME_CACHE"):
        return os.environ["MEGAGENOME_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megagenome")


def _fresh(path: str, index: str) -> bool:
    """Whether `index` exists and is not older than `path` (pyfaidx's rule: it rebuilds older ones)."""
    return os.path.exists(index) and os.path.getmtime(index) >= os.path.getmtime(path)


def _complete(path: str, fai: str, gzi: str) -> bool:
    """Whether a fresh .fai (and, for BGZF, .gzi) is at these names."""
    return _fresh(path, fai) and (not path.lower().endswith(_COMPRESSED_SUFFIXES) or _fresh(path, gzi))


def _cache_entry(path: str) -> str:
    """The cache directory of this FASTA's index, keyed by its absolute path, size and mtime (an edited or replaced
    file gets a new entry), created if needed: under cache_dir(), else under the system temp directory."""
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    tried = []
    for root in (cache_dir(), os.path.join(tempfile.gettempdir(), f"megagenome-{os.getuid()}")):
        entry = os.path.join(root, "fai", key)
        try:
            os.makedirs(entry, exist_ok=True)
        except OSError as e:
            tried.append(f"{entry}: {e.strerror}")
            continue
        if os.access(entry, os.W_OK):
            return entry
        tried.append(f"{entry}: not writable")
    raise FastaError(f"{path}: no writable directory for its index ({'; '.join(tried)}); set MEGAGENOME_CACHE")


@contextlib.contextmanager
def _index_lock(fai: str):
    """Serialise index building across the processes of a node: every rank opens the same FASTA at start-up. The
    build is atomic anyway (a rename), so where the file system has no locks (NFS without lockd) it goes on without."""
    with open(fai + ".lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # ENOLCK: every process builds its own copy and renames it; the copies are identical
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _faidx(path: str, fai: str, gzi: str, build: bool) -> pyfaidx.Faidx:
    """pyfaidx over these index names; with build=False it reads them and never writes a file."""
    return pyfaidx.Faidx(
        path,
        indexname=fai,
        gzi_indexname=gzi,
        as_raw=True,
        sequence_always_upper=False,
        strict_bounds=True,
        one_based_attributes=False,
        build_index=build,
        rebuild=build,
    )


def _build_index(path: str, directory: str) -> tuple[str, str]:
    """The .fai (and .gzi) of `path` in `directory`, built under temporary names and renamed into place unless
    already there: a process killed while building leaves no index that looks complete."""
    base = os.path.join(directory, os.path.basename(path))
    fai, gzi = base + ".fai", base + ".gzi"
    with _index_lock(fai):
        if _complete(path, fai, gzi):
            return fai, gzi
        suffix = f".tmp.{socket.gethostname()}.{os.getpid()}"
        try:
            _faidx(path, fai + suffix, gzi + suffix, build=True).close()
            if os.path.exists(gzi + suffix):
                os.replace(gzi + suffix, gzi)
            os.replace(fai + suffix, fai)  # last: the .fai marks the index complete
        finally:
            for tmp in (fai + suffix, gzi + suffix):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
    return fai, gzi


def _open_index(path: str, index_dir: str | None) -> pyfaidx.Faidx:
    """pyfaidx over an index that nothing writes beside the FASTA: an existing fresh index beside it (samtools
    faidx's, say) is read as it is; otherwise the index is built in `index_dir`, or in the cache (cache_dir()).
    So a run that fails validation, or reads a FASTA in a read-only directory, leaves the FASTA's folder as it was."""
    if index_dir is None and _complete(path, path + ".fai", path + ".gzi"):
        with contextlib.suppress(OSError, ValueError, pyfaidx.FastaIndexingError):  # unreadable: build our own
            return _faidx(path, path + ".fai", path + ".gzi", build=False)
    if index_dir is not None:
        os.makedirs(index_dir, exist_ok=True)
    fai, gzi = _build_index(path, index_dir or _cache_entry(path))
    return _faidx(path, fai, gzi, build=False)


# A whole BGZF contig from this length on is read by zlib (Genome._read_bgzf); shorter ones through pyfaidx, which
# keeps its current block cached across the many small contigs of an assembly or a metagenome.
_ZLIB_READ_BASES = 1 << 20


class Genome:
    """A validated FASTA file with random access; coordinates are 0-based and half-open, case is kept.

    Its index (.fai, and .gzi for BGZF) is read from beside the file when a fresh one is there, else built once in
    `index_dir` or the per-user cache (cache_dir(), keyed by the file's path, size and mtime); the FASTA's own
    directory is never written. Not safe to share across fork(): open one Genome per process.
    """

    def __init__(self, path: str, index_dir: str | None = None):
        path = os.fspath(path)
        validate_fasta(path)
        self.path = path
        try:
            self._faidx = _open_index(path, index_dir)
        except ImportError as e:
            # pyfaidx reads BGZF through Biopython's bgzf module and imports it only then.
            raise FastaError(f"{path}: reading BGZF needs Biopython (`pip install biopython`): {e}") from e
        except FastaError:
            raise
        except (OSError, ValueError, pyfaidx.FastaIndexingError) as e:
            raise FastaError(f"{path}: pyfaidx could not index the file: {e}") from e
        self.lengths: dict[str, int] = {name: rec.rlen for name, rec in self._faidx.index.items()}
        self._block_starts: list[int] | None = None  # BGZF: each block's uncompressed start (_read_bgzf)

    def _check(self, contig: str, start: int, end: int) -> None:
        if contig not in self.lengths:
            known = ", ".join(list(self.lengths)[:10]) + (", ..." if len(self.lengths) > 10 else "")
            raise ValueError(f"{self.path}: no contig {contig!r} (known: {known})")
        if not 0 <= start <= end <= self.lengths[contig]:
            raise ValueError(
                f"{self.path}: interval [{start}, {end}) is outside {contig} (length {self.lengths[contig]})"
            )

    def fetch(self, contig: str, start: int, end: int) -> bytes:
        """Bases [start, end) of `contig` (0-based, half-open) as ASCII bytes with case preserved."""
        start, end = int(start), int(end)
        self._check(contig, start, end)
        if start == end:
            return b""
        try:
            return self._faidx.fetch(contig, start + 1, end).encode("ascii")
        except ValueError as e:
            # pyfaidx 0.9.2.2's BGZF reader computes a within-block offset of 65536 (not 0 in the next block) for a base
            # that starts a BGZF block, and refuses it; zlib reads it (_read_bgzf).
            if "within_block_offset" not in str(e):
                raise
            return self._read_bgzf(contig, start, end)

    def read_contig(self, contig: str) -> bytes:
        """The whole contig as ASCII bytes, case preserved."""
        self._check(contig, 0, 0)
        length = self.lengths[contig]
        if getattr(self._faidx, "_bgzf", False) and length >= _ZLIB_READ_BASES:
            return self._read_bgzf(contig, 0, length)
        return self.fetch(contig, 0, length)

    def _read_bgzf(self, contig: str, start: int, end: int) -> bytes:
        """Bases [start, end) of a BGZF file's contig, decompressed by zlib from the block that holds the first (.gzi).

        pyfaidx reads BGZF through Biopython's BgzfReader, whose read() grows its result block by block (quadratic:
        15 s for the 43.6 Mb chr17 record of the bundled BRCA1 genome, which every rank reads whole); the gzip module
        reads the same bytes in 0.16 s. It also reads the bases pyfaidx refuses (see fetch)."""
        rec = self._faidx.index[contig]
        newline = rec.lenb - rec.lenc  # 1 ("\n"), or 0 for a record on one line; validate_fasta refuses "\r\n"
        if newline not in (0, 1) or not rec.lenc:
            raise FastaError(f"{self.path}: {contig}: line layout the BGZF reader does not handle ({rec.lenb} bytes)")
        first, last = (rec.offset + (p // rec.lenc) * rec.lenb + p % rec.lenc for p in (start, end))
        if self._block_starts is None:  # (uncompressed start of each block, from 0 on, in order), once per Genome
            self._block_starts = [b.ustart for b in self._faidx.gzi_index]
        block = self._faidx.gzi_index[bisect.bisect_right(self._block_starts, first) - 1]
        with open(self.path, "rb") as raw:
            raw.seek(block.cstart)
            with gzip.GzipFile(fileobj=raw) as fh:  # BGZF blocks are gzip members: it reads on across them
                fh.seek(first - block.ustart)
                seq = fh.read(last - first).replace(b"\n", b"")
        if len(seq) != end - start:
            raise FastaError(f"{self.path}: {contig}: read {len(seq)} bases of [{start}, {end}) from the BGZF file")
        return seq

    def close(self) -> None:
        self._faidx.close()

    def __enter__(self) -> Genome:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Genome({self.path!r}, contigs={len(self.lengths)}, bases={sum(self.lengths.values())})"
