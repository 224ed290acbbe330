"""Quick checks of the data files a run config names (layer L1): what can be told of them in milliseconds, without
reading a genome through. A FASTA: present, a file, not empty, not plain gzip, compressed as its name says, a header
('>name') first; a prepared directory: its index.json and the shards it lists (present, of their recorded sizes).

The launch scripts' supervisor runs these before it starts DeepSpeed's launcher (supervise.py pretrain_problems), and
assembly.validate runs them when the config's own data problems keep the data stage from running, so that a bad
file is reported with the config's problems, not on the next try. data/fasta.py validate_fasta and
data/prepared.py read_index check the same files in full when the data stage runs.
"""

from __future__ import annotations

import zlib

from megagenome.config import DataConfig
from megagenome.data.fasta import _compression, _open_text, file_problem
from megagenome.data.prepared import read_index

_HEAD_BYTES = 1 << 16


def data_problems(d: DataConfig) -> list[str]:
    """The problems quick checks find in --data.fasta and --data.prepared, each naming its flag."""
    problems = [f"--data.fasta={d.fasta}: {p}" for p in fasta_problems(d.fasta)] if d.fasta else []
    if d.prepared:
        try:
            read_index(d.prepared, verify=False)
        except (ValueError, OSError) as e:  # PreparedDataError, an unreadable index.json
            message = str(e)
            problems.append(message if message.startswith("--data.prepared") else f"--data.prepared: {message}")
    return problems


def fasta_problems(path: str) -> list[str]:
    """What is wrong with the FASTA at `path` that its first 64 KiB tell (module docstring); [] when nothing."""
    problem = file_problem(path)
    if problem is not None:
        return [problem]
    compression = _compression(path)
    try:
        with _open_text(path, compression) as fh:
            head = fh.read(_HEAD_BYTES)
    except (OSError, EOFError, zlib.error) as e:
        return [f"cannot read the file ({compression} compression): {e}"]
    for number, line in enumerate(head.split(b"\n")[:-1] or [head], start=1):
        text = line.rstrip(b"\r")
        if text.strip() == b"" or text.startswith(b";"):  # skipped before the first record, as pyfaidx does
            continue
        if not text.startswith(b">"):
            return [f"line {number}: sequence before the first header line ('>name'): is this a FASTA file?"]
        if not text[1:].strip():
            return [f"line {number}: a header line without a name"]
        break
    return []
