#!/usr/bin/env bash
# Launch `megagenome pretrain` on this machine through the real `deepspeed` launcher.
#   bash launch/local.sh --config configs/tiny.yaml [--section.field value ...]
# Uses every visible GPU; on a machine without one, NPROC CPU ranks (default 2) on the gloo backend. Runs from any
# directory: a file named relative to where you stand (--config my.yaml) is found there; the shipped configs' own
# paths are the checkout's. Needs the checkout's virtual environment on PATH (README command 1; refused otherwise).
# Environment: NPROC (CPU ranks), MASTER_PORT (default 29500 + a hash of the run's arguments).
#
# DeepSpeed's launcher runs under `python -m megagenome.run.supervise` (this script's pid becomes the supervisor's):
# SIGTERM, SIGINT (Ctrl-C) and SIGHUP to it stop every rank after the same step, with a checkpoint if it fits in
# --checkpoint.grace_s, exit code 143 (130 for Ctrl-C); the checkpoint signal (SIGUSR1) checkpoints and exits 75; no
# process of the launch outlives it; --train.max_restarts N restarts a failed run from its newest complete
# checkpoint up to N times (<run dir>/restarts.jsonl). Exit codes: megagenome/train/stopping.py.
#
# The console shows megagenome's lines, errors and the DeepSpeed warnings that matter; the launcher's other lines go
# to <run dir>/logs/launcher.log, each rank's DeepSpeed log and warnings to <run dir>/logs/rank<N>.log
# (megagenome/observe/console.py).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# A path the user gave relative to where they stand (--config my.yaml, --data.fasta=../g.fa) is made absolute before
# this script moves to the checkout, whose relative paths (ds_configs/, examples/) the shipped configs use.
args=()
for arg in "$@"; do
  value=${arg#--*=}
  if [ "$value" = "$arg" ] && [[ "$arg" != /* ]] && [ -e "$arg" ] && [ "$PWD" != "$here" ]; then
    arg="$PWD/$arg"
  elif [ "$value" != "$arg" ] && [[ "$value" != /* ]] && [ -e "$value" ] && [ "$PWD" != "$here" ]; then
    arg="${arg%%=*}=$PWD/$value"
  fi
  args+=("$arg")
done
set -- ${args[@]+"${args[@]}"}
cd "$here"
if ! command -v python >/dev/null 2>&1 || ! ngpu=$(python -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null); then
  echo "launch/local.sh: error: no python with torch on PATH: activate the checkout's virtual environment first" \
    "(README command 1 makes it): source $here/.venv/bin/activate" >&2
  exit 2
fi
if [ "$ngpu" -gt 0 ]; then
  nproc=$ngpu
else
  nproc=${NPROC:-2}
  export DS_ACCELERATOR=cpu # what DeepSpeed would pick, without its "unable to detect" warning in every process
fi
# stdout through the router (launch/route.sh): it ignores the signals the supervisor handles, ends with the launch
# shellcheck source=route.sh
source launch/route.sh
port=${MASTER_PORT:-$((29500 + $(printf '%s' "$*" | cksum | cut -d' ' -f1) % 1000))}
exec python -m megagenome.run.supervise -- \
  deepspeed --num_gpus "$nproc" --master_port "$port" --module megagenome pretrain "$@" > >(route_console "$@")
