"""The cluster commands (layer L1): `megagenome hostfile` (write a DeepSpeed hostfile from a Slurm node list, or
check one) and `megagenome deepspeed-env` (write .deepspeed_env). The CLI (cli/hostfile.py, cli/deepspeed_env.py) parses
their flags; the work is cluster/hostfile.py's and cluster/deepspeed_env.py's. Errors go to stderr with exit status 2.
"""

from __future__ import annotations

import os
import sys

from megagenome.cluster import deepspeed_env as dsenv
from megagenome.cluster import hostfile as hf
from megagenome.observe.record import atomic_write


def _write_output(output: str, text: str) -> None:
    if output == "-":
        sys.stdout.write(text)
    else:
        atomic_write(output, text)


def hostfile(ns) -> int:
    prog = "megagenome hostfile"
    if ns.check is not None:
        given = [f for f, v in [("--nodelist", ns.nodelist), ("--slots", ns.slots)] if v is not None]
        given += ["--output"] if ns.output != "-" else []
        if given:
            print(f"{prog}: error: --check validates a hostfile; it takes no {', '.join(given)}", file=sys.stderr)
            return 2
        try:
            hosts = hf.parse_hostfile(ns.check)
        except hf.HostfileError as e:
            for problem in e.problems:
                print(f"{prog}: error: {problem}", file=sys.stderr)
            return 2
        print(f"{ns.check}: ok: {len(hosts)} host(s), {sum(hosts.values())} slot(s)")
        return 0
    nodelist, source = ns.nodelist, "--nodelist"
    for var in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if nodelist is None and os.environ.get(var):
            nodelist, source = os.environ[var], var
    if nodelist is None:
        print(
            f"{prog}: error: no node list: give --nodelist (e.g. 'node[01-04]') or run inside a Slurm allocation "
            "($SLURM_JOB_NODELIST / $SLURM_NODELIST)",
            file=sys.stderr,
        )
        return 2
    try:
        hosts = hf.expand_nodelist(nodelist)
        slots = hf.slots_from_env(os.environ, len(hosts), ns.slots)
        comment = f"DeepSpeed hostfile written by `megagenome hostfile` from {source}={nodelist}"
        text = hf.write_hostfile(hosts, slots, comment=comment)
    except hf.HostfileError as e:
        for problem in e.problems:
            print(f"{prog}: error: {source}={nodelist!r}: {problem}", file=sys.stderr)
        return 2
    except ValueError as e:
        where = f"{source}={nodelist!r}: " if isinstance(e, hf.NodelistError) else ""
        print(f"{prog}: error: {where}{e}", file=sys.stderr)
        return 2
    try:
        _write_output(ns.output, text)
    except OSError as e:
        print(f"{prog}: error: --output={ns.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    if ns.output != "-":
        print(f"megagenome: wrote {ns.output}: {len(hosts)} host(s), {sum(slots)} slot(s)", file=sys.stderr)
    return 0


def deepspeed_env(ns) -> int:
    prog = "megagenome deepspeed-env"
    source = "--export" if ns.export is not None else dsenv.EXPORT_VAR
    try:
        variables, notes = dsenv.collect(os.environ, ns.export, source)
    except dsenv.ExportError as e:
        for problem in e.problems:
            print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    output = ns.output or dsenv.env_file_path(os.environ)
    home_file = os.path.join(os.path.expanduser("~"), dsenv.env_file_path(os.environ))
    if output != "-" and os.path.isfile(home_file) and os.path.abspath(output) != os.path.abspath(home_file):
        notes.append(f"DeepSpeed also reads {home_file}, first: for a name set in both, {output} wins")
    for note in notes:
        print(f"{prog}: note: {note}", file=sys.stderr)
    try:
        if output == "-":
            sys.stdout.write(dsenv.render(variables))
        else:
            dsenv.write(output, variables)
    except OSError as e:
        print(f"{prog}: error: --output={output}: {e.strerror or e}", file=sys.stderr)
        return 2
    if output != "-":
        names = " ".join(variables) or "(nothing)"
        print(f"megagenome: wrote {output} for DeepSpeed's multi-node launcher: {names}", file=sys.stderr)
    return 0
