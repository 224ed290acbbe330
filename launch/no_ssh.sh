#!/usr/bin/env bash
# Start one node's share of a multi-node `megagenome pretrain` without ssh or pdsh: run this once on every
# host of the hostfile, at about the same time, each with its own --node_rank (by hand, from a container
# orchestrator, or from any per-node scheduler). The ranks of all nodes meet at --master_addr:--master_port
# and form one world.
#
#   bash launch/no_ssh.sh --hostfile hostfile --node_rank R --master_addr ADDR [--master_port PORT]
#        [--include ... | --exclude ...] [--] --config configs/dna_125m.yaml [--section.field value ...]
#
# Flags (environment defaults in brackets):
#   --hostfile PATH      [MEGAGENOME_HOSTFILE] the same hostfile on every node: host order gives node ranks,
#                        slots give the processes started here (format: launch/hostfile.example)
#   --node_rank R        [NODE_RANK] this node's index among the hostfile's (active) hosts, from 0
#   --master_addr ADDR   [MASTER_ADDR] an address of node rank 0 that every node can reach (required: without
#                        ssh, DeepSpeed cannot look it up)
#   --master_port PORT   [MASTER_PORT, else 29500] the same on every node
#   --include/--exclude  DeepSpeed's host filters; node ranks then index the hosts that remain
#
# Environment: with --no_ssh DeepSpeed does not read .deepspeed_env; the ranks inherit this shell's
# environment, so set NCCL_*, PYTHONPATH, OMP_NUM_THREADS ... where this script is started on each node.
# The working directory is the run's: relative paths in the config resolve from it on every node.
#
# Signals: DeepSpeed's launcher runs under `python -m megagenome.run.supervise`: SIGTERM, SIGINT and SIGHUP to this
# script's pid reach this node's ranks, which stop (with the other nodes' ranks) after the same step, with a
# checkpoint if it fits in --checkpoint.grace_s, exit 143 (130 for SIGINT); nothing outlives the script.
# --train.max_restarts N restarts this node's share after a failure; the other nodes' ranks fail with it (their
# peer is gone) and restart too, and all meet again at the rendezvous. Exit codes: megagenome/train/stopping.py.
set -euo pipefail
prog=no_ssh.sh
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/common.sh
source "$here/common.sh"
parse_launch_flags "hostfile include exclude master_addr master_port node_rank" "$@"

[ -n "$master_addr" ] || die "no master address: give --master_addr ADDR (or set MASTER_ADDR), an address of node rank 0"
case "$node_rank" in
  '') die "no node rank: give --node_rank R (or set NODE_RANK), this node's index in the hostfile from 0" ;;
  *[!0-9]*) die "--node_rank=$node_rank (or NODE_RANK): not a non-negative integer" ;;
esac
if [ -z "$include$exclude" ]; then
  nhosts=$(hostfile_hosts)
  [ "$node_rank" -lt "$nhosts" ] || die "--node_rank=$node_rank: $hostfile has $nhosts host(s), so ranks 0..$((nhosts - 1))"
fi

cmd=(deepspeed --no_ssh --node_rank "$node_rank" --hostfile "$hostfile"
  --master_addr "$master_addr" --master_port "$master_port")
[ -n "$include" ] && cmd+=(--include "$include")
[ -n "$exclude" ] && cmd+=(--exclude "$exclude")
cmd+=(--module megagenome pretrain "${pretrain_args[@]}")
echo "$prog: ${cmd[*]}" >&2
exec python -m megagenome.run.supervise -- "${cmd[@]}" > >(route_console "${pretrain_args[@]}")
