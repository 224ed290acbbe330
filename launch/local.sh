#!/usr/bin/env bash
# Launch `megagenome pretrain` on this machine through the real `deepspeed` launcher.
#   bash launch/local.sh --config configs/tiny.yaml [--section.field value ...]
# Uses every visible GPU; on a machine without one, NPROC CPU ranks (default 2) on the gloo backend.
# Environment: NPROC (CPU ranks), MASTER_PORT (default 29500 + a hash of the run's arguments).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"
ngpu=$(python -c 'import torch; print(torch.cuda.device_count())')
if [ "$ngpu" -gt 0 ]; then
  nproc=$ngpu
else
  nproc=${NPROC:-2}
fi
port=${MASTER_PORT:-$((29500 + $(printf '%s' "$*" | cksum | cut -d' ' -f1) % 1000))}
exec deepspeed --num_gpus "$nproc" --master_port "$port" --module megagenome pretrain "$@"
