#!/usr/bin/env bash
# Launch `megagenome pretrain` on every host of a DeepSpeed hostfile, from one node, through the real
# `deepspeed` launcher and pdsh (DeepSpeed's default multi-node backend).
#
#   bash launch/multinode.sh --hostfile hostfile [--include 'node01@node02:0,1' | --exclude node03]
#        [--master_addr ADDR] [--master_port PORT] [--launcher_args '...'] [--no_ssh_check]
#        [--] --config configs/dna_125m.yaml [--section.field value ...]
#
# Needs: pdsh on this node, passwordless ssh from here to every host, and this working directory, the
# virtualenv and megagenome at the same paths on every host (a shared filesystem): pdsh runs
# `cd $PWD; <this python> -m deepspeed.launcher.launch ...` on each host. Write the hostfile with
# `megagenome hostfile --nodelist 'node[01-04]' --slots 8 --output hostfile` (format: launch/hostfile.example);
# it is checked before launching.
#
# Flags (environment defaults in brackets):
#   --hostfile PATH      [MEGAGENOME_HOSTFILE] hosts and slots
#   --include/--exclude  DeepSpeed's host filters, NAME[:SLOT,SLOT][@NAME...]; one or the other
#   --master_addr ADDR   [MASTER_ADDR] address of the rank-0 host; unset: DeepSpeed asks the first host over
#                        ssh (`hostname -I`) and takes its first address
#   --master_port PORT   [MASTER_PORT, else 29500]
#   --launcher_args STR  extra pdsh arguments, passed through
#   --no_ssh_check       skip DeepSpeed's ssh probe of the first host
#
# The environment of the ranks: remote shells start from a login environment, so this script first writes
# ./.deepspeed_env (or $DS_ENV_FILE) with `megagenome deepspeed-env`: PYTHONPATH, TORCH_EXTENSIONS_DIR,
# OMP_NUM_THREADS, every NCCL_* and GLOO_* (CPU ranks on gloo need GLOO_SOCKET_IFNAME when the host name does
# not resolve to the interface the nodes share) and the names in MEGAGENOME_EXPORT="VAR1 VAR2". DeepSpeed reads
# that file from the working directory (after ~/.deepspeed_env, which it also reads) and exports every line on
# every host. The file is regenerated on each launch: keep extra variables in MEGAGENOME_EXPORT, not in hand
# edits. Names that look like secrets (TOKEN, SECRET, PASSWORD, KEY, CREDENTIAL) are refused; DeepSpeed itself
# also forwards PYTHON*, MLFLOW*, MV2* and UCX* variables.
#
# ssh: pdsh honours PDSH_SSH_ARGS_APPEND (e.g. "-F my_ssh_config"), but DeepSpeed's ssh probe and its lookup of
# the first host's address (`ssh HOST hostname -I`) run plain `ssh`: keep host aliases in ~/.ssh/config, or pass
# --no_ssh_check --master_addr ADDR. Interrupting the launcher makes DeepSpeed run `pkill -f "<python> -u -m
# deepspeed.launcher.launch"` on every host: on a shared node that stops other users' DeepSpeed launches too.
#
# Signals: DeepSpeed's runner runs under `python -m megagenome.run.supervise`. The ranks run on the hosts through ssh,
# not under this shell, so SIGTERM/SIGINT/SIGHUP here reach DeepSpeed's runner, whose multi-node handler stops
# pdsh and runs the pkill above; each host's launch.py then sends SIGTERM to its ranks, which stop after the same
# step with a checkpoint if it fits (launch.py SIGKILLs them 30 s later: keep --checkpoint.grace_s under that), and a
# rank whose launcher is gone stops by itself. --train.max_restarts N restarts a failed run up to N times from its
# newest complete checkpoint (<run dir>/restarts.jsonl). Exit codes: megagenome/train/stopping.py.
set -euo pipefail
prog=multinode.sh
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$here/common.sh"
parse_launch_flags "hostfile include exclude master_addr master_port launcher_args no_ssh_check" "$@"

python -m megagenome deepspeed-env || die "not launching: .deepspeed_env could not be written"

cmd=(deepspeed --hostfile "$hostfile" --master_port "$master_port")
[ -n "$master_addr" ] && cmd+=(--master_addr "$master_addr")
[ -n "$include" ] && cmd+=(--include "$include")
[ -n "$exclude" ] && cmd+=(--exclude "$exclude")
[ -n "$launcher_args" ] && cmd+=(--launcher_args "$launcher_args")
[ "$no_ssh_check" = 1 ] && cmd+=(--no_ssh_check)
cmd+=(--module megagenome pretrain "${pretrain_args[@]}")
echo "$prog: ${cmd[*]}" >&2
exec python -m megagenome.run.supervise -- "${cmd[@]}" > >(route_console "${pretrain_args[@]}")
