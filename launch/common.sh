# shellcheck shell=bash disable=SC2034,SC2154  # sets variables for, and reads `prog` from, the sourcing script
# Shared by launch/multinode.sh and launch/no_ssh.sh (sourced, not run): launcher-flag parsing and the checks
# both make before starting anything. The caller sets `prog` and `set -euo pipefail` first.
#
# This checkout goes first on PYTHONPATH, so `python -m megagenome` and the ranks' `--module megagenome` run the
# code next to these scripts from any working directory (remote nodes get PYTHONPATH through DeepSpeed).
#
# Flags come first, then an optional `--`, then the `megagenome pretrain` arguments (the first argument that
# is not a launcher flag starts those). Every flag also takes the --flag=value form.

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

die() {
  echo "$prog: error: $*" >&2
  exit 2
}

# parse_launch_flags "ACCEPTED FLAG NAMES" "$@" sets: hostfile include exclude master_addr master_port node_rank
# launcher_args no_ssh_check, and the array pretrain_args. Defaults come from the environment:
# MEGAGENOME_HOSTFILE, MASTER_ADDR, MASTER_PORT (else DeepSpeed's 29500), NODE_RANK.
parse_launch_flags() {
  local accepted=" $1 " flag value names
  read -ra names <<<"$1"
  shift
  hostfile=${MEGAGENOME_HOSTFILE:-}
  include=""
  exclude=""
  master_addr=${MASTER_ADDR:-}
  master_port=${MASTER_PORT:-29500}
  node_rank=${NODE_RANK:-}
  launcher_args=""
  no_ssh_check=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --)
        shift
        break
        ;;
      --no_ssh_check)
        flag=no_ssh_check
        value=1
        shift
        ;;
      --hostfile=* | --include=* | --exclude=* | --master_addr=* | --master_port=* | --node_rank=* | --launcher_args=*)
        flag=${1%%=*}
        flag=${flag#--}
        value=${1#*=}
        shift
        ;;
      --hostfile | --include | --exclude | --master_addr | --master_port | --node_rank | --launcher_args)
        [ $# -ge 2 ] || die "$1 needs a value"
        flag=${1#--}
        value=$2
        shift 2
        ;;
      *) break ;;
    esac
    case "$accepted" in
      *" $flag "*) ;;
      *) die "--$flag is not a flag of $prog (it takes:$(printf ' --%s' "${names[@]}"))" ;;
    esac
    printf -v "$flag" '%s' "$value"
  done
  pretrain_args=("$@")
  [ -n "$hostfile" ] || die "no hostfile: give --hostfile PATH (or set MEGAGENOME_HOSTFILE); write one with 'megagenome hostfile --nodelist ... --slots N' (see launch/hostfile.example)"
  if [ -n "$include" ] && [ -n "$exclude" ]; then
    die "--include and --exclude cannot be combined (DeepSpeed takes one or the other)"
  fi
  case "$master_port" in
    '' | *[!0-9]*) die "--master_port=$master_port (or MASTER_PORT): not a port number" ;;
  esac
  # Every problem in the hostfile, with its line, before DeepSpeed half-reads it (it ignores text after slots=N).
  python -m megagenome hostfile --check "$hostfile" >/dev/null || die "--hostfile=$hostfile: not launching (see above)"
}

# route_console: launch/route.sh
# shellcheck source=route.sh
source "$(dirname "${BASH_SOURCE[0]}")/route.sh"

# The number of hosts in the (already checked) hostfile: its lines that are not blank or a comment.
hostfile_hosts() {
  grep -cvE '^[[:space:]]*(#|$)' "$hostfile"
}
