"""The environment every rank needs on every node, written as DeepSpeed's `.deepspeed_env` (layer L1, stdlib only).

How DeepSpeed 0.19 uses the file (deepspeed/launcher/runner.py): only its multi-node launchers read it (pdsh,
the default, and openmpi/mpich/impi/mvapich/slurm), not a single-node or `--no_ssh` launch, whose ranks simply
inherit the launching shell's environment. The name is `.deepspeed_env`, or `$DS_ENV_FILE` when set (absolute
or relative to the working directory); it is read from the home directory and then from the working directory
of the `deepspeed` command, the later file winning for a name set in both. Each line is split at its first '='
into NAME and VALUE, the value stripped of surrounding whitespace and wrapped in double quotes when it holds
anything beyond `[\\w@%+=:,./-]`; pdsh then runs `export NAME=VALUE; ...` in a remote shell. Hence:

- every line must contain '=': a blank line or a '#' comment makes DeepSpeed fail to unpack the line (and a
  '#' would comment out the rest of the remote command), so the file carries no comments;
- values with '"', '$', '`' or '\\' would be re-interpreted by the remote shell, values with a newline cannot
  be written, and surrounding whitespace is lost: all are refused here with the variable's name.

What goes in: PYTHONPATH, TORCH_EXTENSIONS_DIR and OMP_NUM_THREADS when set, every NCCL_* and GLOO_* variable, and the
names listed in MEGAGENOME_EXPORT="VAR1 VAR2". Names that look like secrets (TOKEN, SECRET, PASSWORD, PASSWD,
KEY, CREDENTIAL) are never written: asked for by name they are refused, matched by a prefix (NCCL_*, GLOO_*) they are
skipped with a note. Secrets belong in each node's own environment (a profile, the scheduler), not in a file
in the working directory that pdsh also echoes into every remote command line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

ALWAYS = ("PYTHONPATH", "TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS")
PREFIXES = ("NCCL_", "GLOO_")  # NCCL on GPUs; gloo (CPU ranks) needs e.g. GLOO_SOCKET_IFNAME
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL")
EXPORT_VAR = "MEGAGENOME_EXPORT"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SHELL_ACTIVE = {'"': "a double quote", "$": "'$'", "`": "a backquote", "\\": "a backslash", "\n": "a newline"}


class ExportError(ValueError):
    """One or more variables that cannot be written to .deepspeed_env, each named."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def looks_secret(name: str) -> bool:
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def env_file_path(environ: Mapping[str, str]) -> str:
    """Where DeepSpeed looks in the working directory: $DS_ENV_FILE, else .deepspeed_env."""
    return environ.get("DS_ENV_FILE") or ".deepspeed_env"


def _requested(export: str) -> list[str]:
    return [n for n in re.split(r"[\s,]+", export.strip()) if n]


def collect(
    environ: Mapping[str, str], export: str | None = None, source: str = EXPORT_VAR
) -> tuple[dict[str, str], list[str]]:
    """(variables to write in order, notes about skipped names). ExportError lists every refused variable.

    `export` is the extra names (separated by spaces or commas); None reads MEGAGENOME_EXPORT from environ.
    `source` is how messages name where the list came from (the variable, or a flag).
    """
    if export is None:
        export = environ.get(EXPORT_VAR, "")
    chosen: dict[str, str] = {}
    notes: list[str] = []
    problems: list[str] = []
    for name in ALWAYS:
        if name in environ:
            chosen[name] = environ[name]
    for name in sorted(environ):
        if name.startswith(PREFIXES) and name not in chosen:
            if looks_secret(name):
                notes.append(f"{name} not written to .deepspeed_env: its name looks like a secret")
            else:
                chosen[name] = environ[name]
    for name in _requested(export):
        if not _NAME.match(name):
            problems.append(f"{source} names {name!r}, which is not a valid environment variable name")
        elif looks_secret(name):
            problems.append(
                f"{source} names {name}, which looks like a secret ({'/'.join(SECRET_WORDS)}): refusing to "
                "write it to .deepspeed_env; set it in each node's own environment instead"
            )
        elif name not in environ:
            problems.append(f"{source} names {name}, which is not set in this environment")
        else:
            chosen[name] = environ[name]
    for name, value in chosen.items():
        bad = [why for ch, why in _SHELL_ACTIVE.items() if ch in value]
        if bad:
            problems.append(
                f"{name}: its value holds {', '.join(bad)}, which DeepSpeed passes to the remote shell unescaped"
            )
        elif value != value.strip():
            problems.append(f"{name}: its value starts or ends with whitespace, which DeepSpeed strips")
    if problems:
        raise ExportError(problems)
    return chosen, notes


def render(variables: Mapping[str, str]) -> str:
    """The file's text: NAME=VALUE lines, no comments or blank lines (DeepSpeed cannot parse them)."""
    return "".join(f"{name}={value}\n" for name, value in variables.items())


def write(path: str, variables: Mapping[str, str]) -> None:
    """Write the file through a temporary name and a rename, so a launch never reads half of it."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(render(variables))
    os.replace(tmp, path)
