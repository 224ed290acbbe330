"""Slurm node lists and DeepSpeed hostfiles (layer L1, standard library only).

- expand_nodelist: `node[01-04],gpu[1-2]` -> host names, exactly as `scontrol show hostnames` lists them.
- parse_hostfile: read a DeepSpeed hostfile, reporting every problem at once as `path:line: ...`.
- write_hostfile: the text of a hostfile for hosts and slots (one `host slots=N` line each).
- slots_from_env: slots per host from --slots or the Slurm GPU variables.

DeepSpeed's own parser (deepspeed/launcher/runner.py, _parse_hostfile) strips each line, skips blank lines
and lines starting with '#', and otherwise wants the line to *start* with `^(\\S+)\\s+slots=(\\d+)`; the rest
of the line is ignored. We accept every hostfile it accepts and means the same thing by, and refuse, with the
reason, what it would accept but misread: trailing text that is not a '#' comment (`slots=4abc` is 4 to
DeepSpeed, `max_slots=8` is silently dropped), zero slots, and host names that break its --include/--exclude
syntax (`@`, `:`) or pdsh's host list (`,`, brackets).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

# The most hosts one bracket expression may produce (Slurm's own cap, MAX_RANGE, is 64Ki per range).
MAX_HOSTS = 65536

# Characters a host name cannot hold in a DeepSpeed hostfile (one message per group), and why.
_BAD_HOST_CHARS = {
    "@": "DeepSpeed's --include/--exclude use '@' to separate hosts",
    ":": "DeepSpeed's --include/--exclude use ':' to separate a host from its slots",
    ",": "pdsh (-w a,b) and DeepSpeed's slot lists use ',' as a separator",
    "[]": "brackets are Slurm node-list syntax; expand the list first (megagenome hostfile --nodelist ...)",
    "=": "'=' belongs in 'slots=N', not in a host name",
}
_INT = re.compile(r"^[0-9]+$")


class NodelistError(ValueError):
    """A Slurm node list that cannot be expanded; the message names the offending piece."""


class HostfileError(ValueError):
    """One or more hostfile problems, each `path:line: message`."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class SlotsError(ValueError):
    """No usable slot count: names the flag and the environment variables it looked at."""


# ---------------------------------------------------------------------------------------------------------------
# Slurm node lists


def _split_tokens(s: str) -> list[str]:
    """Split at ',' and whitespace outside brackets (Slurm's separators), checking bracket balance."""
    tokens, cur, depth = [], [], 0
    pieces: list[list[str]] = [[]]  # comma-separated pieces, each a list of whitespace-separated tokens

    def flush():
        if cur:
            pieces[-1].append("".join(cur))
            cur.clear()

    for ch in s:
        if ch == "[":
            if depth:
                raise NodelistError(f"'[' inside a bracket group in {s!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise NodelistError(f"']' without a matching '[' in {s!r}")
            depth = 0
        elif depth and ch.isspace():
            raise NodelistError(f"whitespace inside a bracket group in {s!r}")
        if not depth and ch == ",":
            flush()
            pieces.append([])
            continue
        if not depth and ch.isspace():
            flush()
            continue
        cur.append(ch)
    if depth:
        raise NodelistError(f"unclosed '[' in {s!r}")
    flush()
    for i, piece in enumerate(pieces):
        if not piece:
            where = "at the start" if i == 0 else "at the end" if i == len(pieces) - 1 else "between two commas"
            raise NodelistError(f"empty host name {where} of {s!r}")
        tokens.extend(piece)
    return tokens


def _expand_ranges(body: str, token: str) -> list[str]:
    """`01-03,7` -> ['01', '02', '03', '7']: zero padding to the width of each range's lower bound, as Slurm."""
    if not body:
        raise NodelistError(f"empty bracket group '[]' in {token!r}")
    out: list[str] = []
    for item in body.split(","):
        lo, dash, hi = item.partition("-")
        if not item:
            raise NodelistError(f"empty item between commas in the bracket group of {token!r}")
        if not _INT.match(lo) or (dash and not _INT.match(hi)):
            raise NodelistError(f"bad range {item!r} in {token!r}: expected N or LO-HI with digits only")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise NodelistError(f"descending range {item!r} in {token!r}: write {hi}-{lo}")
        if last - first + 1 + len(out) > MAX_HOSTS:
            raise NodelistError(f"{token!r} expands to more than {MAX_HOSTS} hosts")
        out.extend(f"{n:0{len(lo)}d}" for n in range(first, last + 1))
    return out


def _segments(token: str) -> list:
    """`rack[1-2]-node[01-02]` -> ['rack', ['1', '2'], '-node', ['01', '02']]: literals and expanded groups."""
    if "[" not in token:
        return [token]
    segs: list = []
    rest = token
    while "[" in rest:
        literal, _, rest = rest.partition("[")
        body, _, rest = rest.partition("]")  # balance was checked while splitting
        segs.append(literal)
        segs.append(_expand_ranges(body, token))
    if rest:
        raise NodelistError(
            f"{rest!r} after the last ']' in {token!r}: a Slurm node list ends with its last bracket group "
            "(scontrol rejects this too)"
        )
    return segs


def _push(segs: list, last: list[str], out: list[str]) -> None:
    """Push prefix `segs` + each of `last` in Slurm's order (hostlist.c, _push_range_list): the last group varies
    fastest; the groups before it are expanded from the right, each value of the rightmost one wrapping the
    expansion of those to its left. So the group before the last is the outermost loop: two groups give the
    plain nested order (rack1-node01, rack1-node02, rack2-node01, ...), three give Slurm's own
    (r[1-2]-n[1-2]-g[1-2]: r1-n1-g1, r1-n1-g2, r2-n1-g1, r2-n1-g2, r1-n2-g1, ...)."""
    groups = [i for i, s in enumerate(segs) if isinstance(s, list)]
    if not groups:
        prefix = "".join(segs)
        out.extend(prefix + v for v in last)
        return
    i = groups[-1]
    for value in segs[i]:
        _push(segs[:i] + [value] + segs[i + 1 :], last, out)
        if len(out) > MAX_HOSTS:
            raise NodelistError(f"node list expands to more than {MAX_HOSTS} hosts")


def expand_nodelist(s: str) -> list[str]:
    """Expand a Slurm node list (SLURM_JOB_NODELIST) into host names, in `scontrol show hostnames` order.

    Accepts comma- or whitespace-separated items, each a plain host name or a prefix with one or more bracket
    groups of numbers and ranges (`gpu[1-2],cpu[01-02]`, `n[1-3,7,10-11]`, `rack[1-2]-node[01-02]`). Zero
    padding follows the lower bound of each range, as in Slurm (`n[08-10]` -> n08 n09 n10). Repeated hosts
    are kept, as scontrol keeps them. Raises NodelistError naming the piece for an empty list, unbalanced or
    nested brackets, an empty or descending range, non-digits in a range, or text after the last bracket.
    Stricter than scontrol, which turns some of these into odd host names (`n[1-3` -> `n]`) instead.
    """
    if not s or not s.strip():
        raise NodelistError("empty node list")
    hosts: list[str] = []
    for token in _split_tokens(s.strip()):
        segs = _segments(token)
        groups = [i for i, g in enumerate(segs) if isinstance(g, list)]
        if not groups:
            hosts.append(token)
            continue
        last = segs[groups[-1]]
        _push(segs[: groups[-1]], last, hosts)
        if len(hosts) > MAX_HOSTS:
            raise NodelistError(f"node list {s!r} expands to more than {MAX_HOSTS} hosts")
    return hosts


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed hostfiles


def host_problems(host: str) -> list[str]:
    """Why `host` cannot be a hostfile entry (empty when it can)."""
    problems = []
    for chars, why in _BAD_HOST_CHARS.items():
        found = "".join(c for c in chars if c in host)
        if found:
            problems.append(f"host {host!r} contains {found!r}: {why}")
    return problems


def _check_line(line: str) -> tuple[str | None, int | None, list[str]]:
    """(host, slots, problems) of one stripped, non-comment line."""
    tokens = line.split()
    for i, tok in enumerate(tokens):
        if tok.startswith("#"):  # a trailing comment; DeepSpeed ignores everything after slots=N anyway
            tokens = tokens[:i]
            break
    host = tokens[0]
    if host.startswith("slots="):
        return None, None, [f"{line!r}: no host name before {host!r} (expected 'HOST slots=N')"]
    problems = host_problems(host)
    if len(tokens) == 1:
        return host, None, problems + [f"host {host!r} has no slot count (expected '{host} slots=N', e.g. slots=8)"]
    key, eq, value = tokens[1].partition("=")
    slots = None
    if key != "slots" or not eq:
        problems.append(f"expected 'slots=N' after host {host!r}, got {tokens[1]!r} (lowercase, no spaces around '=')")
    elif not _INT.match(value):
        problems.append(f"{tokens[1]!r} for host {host!r}: the slot count must be a positive integer")
    elif int(value) == 0:
        problems.append(f"{tokens[1]!r} for host {host!r}: a host needs at least 1 slot (leave it out instead)")
    else:
        slots = int(value)
    if len(tokens) > 2:
        extra = " ".join(tokens[2:])
        problems.append(
            f"unexpected {extra!r} after {tokens[1]!r} (DeepSpeed ignores it silently; start a comment with '#')"
        )
    return host, slots, problems


def parse_hostfile_text(text: str, path: str = "<hostfile>") -> dict[str, int]:
    """Hosts and slots of a hostfile's text, in file order; HostfileError lists every problem."""
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    problems: list[str] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        host, slots, line_problems = _check_line(line)
        problems.extend(f"{path}:{lineno}: {p}" for p in line_problems)
        if host is None:
            continue
        if host in first_line:
            problems.append(
                f"{path}:{lineno}: host {host!r} repeated (first on line {first_line[host]}); DeepSpeed refuses "
                "repeated hosts: give one line with the total slots"
            )
            continue
        first_line[host] = lineno
        if slots is not None:
            hosts[host] = slots
    if not first_line and not problems:
        problems.append(f"{path}: no hosts (expected lines like 'node01 slots=8'; '#' starts a comment)")
    if problems:
        raise HostfileError(problems)
    return hosts


def parse_hostfile(path: str | os.PathLike) -> dict[str, int]:
    """Hosts and slots of the hostfile at `path`, in file order; HostfileError lists every problem."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError as e:
        raise HostfileError([f"{path}: not UTF-8 text ({e.reason} at byte {e.start})"]) from None
    except OSError as e:
        raise HostfileError([f"{path}: cannot read the hostfile: {e.strerror or e}"]) from None
    return parse_hostfile_text(text, path)


def write_hostfile(hosts: Sequence[str], slots: int | Sequence[int], comment: str | None = None) -> str:
    """The text of a DeepSpeed hostfile: one `host slots=N` line per host, in order.

    `slots` is one count for every host or one per host. `comment` becomes '#' lines at the top (provenance).
    Raises HostfileError for repeated hosts, host names DeepSpeed or pdsh cannot take, or bad slot counts.
    """
    hosts = list(hosts)
    per_host = [slots] * len(hosts) if isinstance(slots, int) else list(slots)
    problems = []
    if not hosts:
        problems.append("no hosts to write")
    if len(per_host) != len(hosts):
        problems.append(f"{len(per_host)} slot counts for {len(hosts)} hosts")
    seen: dict[str, int] = {}
    for i, host in enumerate(hosts):
        if not host or any(c.isspace() for c in host) or host.startswith("#"):
            problems.append(f"host #{i + 1} {host!r} is not a host name")
        problems.extend(host_problems(host))
        if host in seen:
            problems.append(f"host {host!r} repeated (hosts #{seen[host] + 1} and #{i + 1})")
        seen.setdefault(host, i)
    problems.extend(f"slots={n} for host {h!r}: must be a positive integer" for h, n in zip(hosts, per_host) if n < 1)
    if problems:
        raise HostfileError(problems)
    lines = [f"# {c}".rstrip() for c in comment.splitlines()] if comment else []
    lines += [f"{h} slots={n}" for h, n in zip(hosts, per_host)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Slots


_GPUS_ITEM = re.compile(r"^(?:(?P<type>[^:()]+(?::[^:()]+)?):)?(?P<n>[0-9]+)(?:\(x(?P<rep>[0-9]+)\))?$")


def _parse_gpus_per_node(value: str, n_hosts: int) -> list[int]:
    """SLURM_GPUS_PER_NODE -> slots per host.

    Forms: `4`, `gpu:4`, `a100:4` (one count for every node); `a100:2,v100:2` (several GPU types on each
    node: their sum); `4(x2)` or `4(x2),2` (counts per group of nodes, as in SLURM_TASKS_PER_NODE).
    """
    items = [m for m in (_GPUS_ITEM.match(part.strip()) for part in value.split(","))]
    if not value.strip() or not all(items):
        raise SlotsError(
            f"SLURM_GPUS_PER_NODE={value!r}: expected N, TYPE:N, N(xK) or a comma list of those; give --slots N instead"
        )
    typed = [m for m in items if m["type"]]
    repeated = [m for m in items if m["rep"]]
    if len(items) > 1 and len(typed) == len(items) and not repeated:
        return [sum(int(m["n"]) for m in items)] * n_hosts
    if len(items) == 1 and not repeated:
        return [int(items[0]["n"])] * n_hosts
    if typed and repeated:
        raise SlotsError(f"SLURM_GPUS_PER_NODE={value!r}: cannot mix GPU types with (xK) node counts; give --slots N")
    counts = [int(m["n"]) for m in items for _ in range(int(m["rep"] or 1))]
    if len(counts) != n_hosts:
        raise SlotsError(
            f"SLURM_GPUS_PER_NODE={value!r} describes {len(counts)} nodes but the node list has {n_hosts}; "
            "give --slots N"
        )
    return counts


def slots_from_env(environ: Mapping[str, str], n_hosts: int, flag: int | None = None) -> list[int]:
    """Slots for each of n_hosts hosts: --slots when given, else SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE.

    The explicit flag wins over the environment (e.g. CPU ranks inside a GPU allocation). SLURM_GPUS_ON_NODE
    counts the GPUs of the node this runs on and is applied to every node (Slurm allocations are usually
    homogeneous; use SLURM_GPUS_PER_NODE's N(xK) form or --slots otherwise).
    """
    if flag is not None:
        if flag < 1:
            raise SlotsError(f"--slots={flag}: must be a positive integer")
        return [flag] * n_hosts
    on_node = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if on_node:
        if not _INT.match(on_node) or int(on_node) == 0:
            raise SlotsError(f"SLURM_GPUS_ON_NODE={on_node!r}: not a positive GPU count; give --slots N")
        return [int(on_node)] * n_hosts
    per_node = environ.get("SLURM_GPUS_PER_NODE", "").strip()
    if per_node:
        counts = _parse_gpus_per_node(per_node, n_hosts)
        if min(counts) < 1:
            raise SlotsError(f"SLURM_GPUS_PER_NODE={per_node!r}: a node with 0 GPUs; give --slots N")
        return counts
    raise SlotsError(
        "no slot count: give --slots N (processes per host), or run inside a Slurm allocation with GPUs "
        "(SLURM_GPUS_ON_NODE or SLURM_GPUS_PER_NODE, set by --gpus-per-node / --gres=gpu:N)"
    )
