# shellcheck shell=bash disable=SC2154 # `prog` is the sourcing script's
# Shared by launch/slurm/pretrain_per_node.sbatch and pretrain_per_rank.sbatch (sourced, not run). The caller sets
# `prog` and `set -euo pipefail`, then calls mg_init "$@" and mg_run.
#
# Environment (every variable optional except a run config from MEGAGENOME_CONFIG or the script's arguments;
# sbatch exports the submitting shell's environment to the job, and a requeued job gets the same again):
#   MEGAGENOME_CONFIG        run config YAML, passed as --config (relative paths resolve from the job's working
#                            directory, the submit directory unless sbatch --chdir)
#   MEGAGENOME_ARGS          more `megagenome pretrain` flags, split on whitespace (arguments given after the script
#                            name on the sbatch command line come last and may contain spaces)
#   MEGAGENOME_PYTHON        the Python that has megagenome and deepspeed installed [python3]
#   MEGAGENOME_HOME          the megagenome checkout, put first on PYTHONPATH [the one holding this file]
#   MEGAGENOME_MODULES       environment modules to `module load` first (e.g. "cuda/12.4 nccl")
#   MEGAGENOME_SETUP         a shell file to source first (activate a venv, export NCCL_* ...)
#   MEGAGENOME_WRAPPER       a command every task runs under, e.g. "apptainer exec --nv megagenome.sif"
#   MEGAGENOME_LOG_DIR       where each job writes its logs, as <dir>/<job id>/ [$SLURM_SUBMIT_DIR/slurm-logs]
#   MEGAGENOME_SLOTS         ranks per node when Slurm allocated no GPUs (CPU runs) [1]
#   MEGAGENOME_SIGNAL        the checkpoint signal, as in the template's `#SBATCH --signal=B:USR1@...` [USR1]
#   MEGAGENOME_MASTER_ADDR   address of the rendezvous host [the allocation's first host]
#   MEGAGENOME_MASTER_PORT   rendezvous port [20000-59999, derived from the job id]
# Account, partition, QOS, time limit: sbatch's own options or SBATCH_ACCOUNT, SBATCH_PARTITION, SBATCH_QOS,
# SBATCH_TIMELIMIT in the environment.
#
# Checkpoint on signal and requeue. Slurm sends SIG$MEGAGENOME_SIGNAL to the batch shell (`--signal=B:...`, or
# `scancel --signal=USR1 --batch JOBID` by hand). mg_run's trap forwards it to srun, which delivers it to every process
# of the step: the training ranks (megagenome's loop finishes the step, all ranks agree, a checkpoint is saved, exit
# code 75) and, in the per-node mode, DeepSpeed's launchers, which therefore run with the signal ignored (its default
# action would kill them and end the step under the ranks while they save). Once srun returns, the batch shell runs
# `scontrol requeue`; the requeued job starts the same script again and `--checkpoint.resume auto` continues from the
# newest complete checkpoint.
#
# Stop without requeue. SIGTERM or SIGINT to the batch shell (`scancel --signal=TERM --batch JOBID`, an orchestrator)
# is forwarded the same way; when Slurm ends a job (scancel, the time limit, preemption) it sends SIGTERM to every
# process of every step itself, then SIGKILL after KillWait (30 s by default). Either way the ranks stop after the same
# step, save it if that fits in --checkpoint.grace_s (set it below KillWait), and the job exits with 143 (130).
# In the per-node mode DeepSpeed's launcher runs under `python -m megagenome.run.supervise`, which passes the signals it
# gets on to the ranks only.
#
# Restarts. With --train.max_restarts N, a step that fails (any exit code but 0, 2, 3, 4, 75, 130, 143, and no signal
# came) is run again with `--checkpoint.resume auto`, up to N times in the same allocation; each restart is logged
# on stderr and in <run dir>/restarts.jsonl.

MG_PREEMPTED_EXIT=75 # megagenome/train/loop.py PREEMPTED_EXIT: stopped by the checkpoint signal, checkpoint saved

mg_die() {
  echo "$prog: error: $*" >&2
  exit 2
}

# mg_init ARGS...: everything that can fail before any task starts. Sets MG_* variables and the array pretrain_args.
mg_init() {
  local missing=() var
  for var in SLURM_JOB_ID SLURM_JOB_NODELIST SLURM_NNODES SLURM_SUBMIT_DIR; do
    [ -n "${!var:-}" ] || missing+=("$var")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    mg_die "not running inside a Slurm batch job (${missing[*]} not set): submit this script with sbatch, e.g." \
      "'MEGAGENOME_CONFIG=configs/tiny.yaml sbatch --nodes=2 launch/slurm/$prog'"
  fi
  for var in srun scontrol; do
    command -v "$var" >/dev/null || mg_die "'$var' is not on PATH inside the job; load Slurm's client commands"
  done
  MG_HOME=${MEGAGENOME_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
  [ -d "$MG_HOME/megagenome" ] || mg_die "MEGAGENOME_HOME=$MG_HOME has no megagenome/ package directory"
  if [ -n "${MEGAGENOME_MODULES:-}" ]; then
    command -v module >/dev/null || mg_die "MEGAGENOME_MODULES is set but there is no 'module' command"
    # shellcheck disable=SC2086 # a list of module names
    module load $MEGAGENOME_MODULES || mg_die "module load $MEGAGENOME_MODULES failed"
  fi
  if [ -n "${MEGAGENOME_SETUP:-}" ]; then
    [ -f "$MEGAGENOME_SETUP" ] || mg_die "MEGAGENOME_SETUP=$MEGAGENOME_SETUP: no such file"
    # shellcheck disable=SC1090
    source "$MEGAGENOME_SETUP"
  fi
  export PYTHONPATH="$MG_HOME${PYTHONPATH:+:$PYTHONPATH}"
  MG_PYTHON=${MEGAGENOME_PYTHON:-python3}
  MG_SIGNAL=${MEGAGENOME_SIGNAL:-USR1}
  MG_SIGNAL=${MG_SIGNAL#SIG}
  kill -l "$MG_SIGNAL" >/dev/null 2>&1 || mg_die "MEGAGENOME_SIGNAL=$MG_SIGNAL is not a signal name"

  pretrain_args=(--checkpoint.signal "SIG$MG_SIGNAL")
  if [ -n "${MEGAGENOME_CONFIG:-}" ]; then
    [ -f "$MEGAGENOME_CONFIG" ] || mg_die "MEGAGENOME_CONFIG=$MEGAGENOME_CONFIG: no such file (from $(pwd))"
    pretrain_args+=(--config "$MEGAGENOME_CONFIG")
  fi
  local extra=()
  read -r -a extra <<<"${MEGAGENOME_ARGS:-}"
  pretrain_args+=("${extra[@]}" "$@")
  if [ -z "${MEGAGENOME_CONFIG:-}" ] && [ $# -eq 0 ] && [ ${#extra[@]} -eq 0 ]; then
    mg_die "no run config: set MEGAGENOME_CONFIG=path/to/run.yaml (or pass megagenome pretrain flags after the script name)"
  fi

  MG_RUN=${SLURM_RESTART_COUNT:-0} # 0 for the first run of the job, +1 per requeue
  MG_LOG_DIR=${MEGAGENOME_LOG_DIR:-$SLURM_SUBMIT_DIR/slurm-logs}/$SLURM_JOB_ID
  mkdir -p "$MG_LOG_DIR/run$MG_RUN" || mg_die "cannot create the log directory $MG_LOG_DIR"
  MG_HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST") || mg_die "scontrol cannot expand SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
  MASTER_ADDR=${MEGAGENOME_MASTER_ADDR:-$(head -n 1 <<<"$MG_HOSTS")}
  # One port per job (and array task and requeue), so jobs sharing a node do not meet at the same rendezvous.
  local key=$((SLURM_JOB_ID + ${SLURM_ARRAY_TASK_ID:-0} * 7919 + MG_RUN * 104729))
  MASTER_PORT=${MEGAGENOME_MASTER_PORT:-$((20000 + key % 40000))}
  export MASTER_ADDR MASTER_PORT MG_HOME MG_PYTHON MG_SIGNAL MG_LOG_DIR MG_RUN
  export MEGAGENOME_WRAPPER="${MEGAGENOME_WRAPPER:-}"
  echo "$prog: job $SLURM_JOB_ID run $MG_RUN on $SLURM_NNODES node(s) ($SLURM_JOB_NODELIST); rendezvous" \
    "$MASTER_ADDR:$MASTER_PORT; logs in $MG_LOG_DIR/run$MG_RUN" >&2
}

# mg_write_hostfile PATH: DeepSpeed's hostfile for the allocation, one 'host slots=N' line per node in Slurm's node
# order (which is SLURM_NODEID order, so node rank R is line R+1), written and checked by `megagenome hostfile`
# (slots from SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE, else MEGAGENOME_SLOTS, else 1). Written once by the batch
# shell into the log directory, which every node must see (as it must see the run directory).
mg_write_hostfile() {
  local args=(--nodelist "$SLURM_JOB_NODELIST" --output "$1")
  if [ -z "${SLURM_GPUS_ON_NODE:-}${SLURM_GPUS_PER_NODE:-}" ]; then
    args+=(--slots "${MEGAGENOME_SLOTS:-1}")
  fi
  # shellcheck disable=SC2086 # MEGAGENOME_WRAPPER is a command with its arguments
  $MEGAGENOME_WRAPPER "$MG_PYTHON" -m megagenome hostfile "${args[@]}" >&2 || mg_die "could not write the hostfile $1"
}

# mg_tasks_on_node: the number of this step's tasks on this node, from SLURM_STEP_TASKS_PER_NODE ("4(x2),3").
mg_tasks_on_node() {
  local spec=${SLURM_STEP_TASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}} node=${SLURM_NODEID:-0} item count reps
  local IFS=,
  for item in $spec; do
    count=${item%%(*}
    reps=1
    if [[ $item == *"(x"* ]]; then
      reps=${item#*(x}
      reps=${reps%)}
    fi
    if [ "$node" -lt "$reps" ]; then
      echo "$count"
      return
    fi
    node=$((node - reps))
  done
  echo 1
}

# Task bodies, run by srun on the nodes: `bash -c 'source common.sh; mg_node_task "$@"'`.

# One per node: DeepSpeed's launcher without ssh starts this node's ranks (hostfile slots) and waits for them.
mg_node_task() {
  local hostfile=$1
  shift
  # Ignored here, the checkpoint signal reaches only the ranks, which install their handler (an ignored signal
  # stays ignored across exec, so the ranks also survive one that comes before the handler is up).
  trap '' "$MG_SIGNAL"
  local wrapper=()
  read -r -a wrapper <<<"${MEGAGENOME_WRAPPER:-}"
  # Under megagenome.run.supervise (no restarts of its own: mg_run restarts the whole step): SIGTERM/SIGINT and the
  # checkpoint signal that reach it go to the ranks only, so DeepSpeed's launch.py does not SIGKILL them 30 s later.
  exec "${wrapper[@]}" "$MG_PYTHON" -m megagenome.run.supervise --max_restarts 0 -- \
    "$MG_PYTHON" -u -m deepspeed.launcher.runner --no_ssh --node_rank "$SLURM_NODEID" \
    --hostfile "$hostfile" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    --enable_each_rank_log "$MG_LOG_DIR/run$MG_RUN" --module megagenome pretrain "$@"
}

# One per rank: the environment DeepSpeed's launcher would give the rank (launcher/launch.py), from srun's.
mg_rank_task() {
  trap '' "$MG_SIGNAL" # as above: until the loop's handler is installed, the signal is ignored, not fatal
  export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS
  LOCAL_SIZE=$(mg_tasks_on_node)
  export LOCAL_SIZE LOCAL_WORLD_SIZE=$LOCAL_SIZE CROSS_RANK=$SLURM_NODEID CROSS_SIZE=$SLURM_NNODES
  local wrapper=()
  read -r -a wrapper <<<"${MEGAGENOME_WRAPPER:-}"
  exec "${wrapper[@]}" "$MG_PYTHON" -u -m megagenome pretrain "$@"
}

# mg_run SRUN_OPTIONS... -- TASK_FUNCTION TASK_ARGS...: run the step, forward the checkpoint signal and SIGTERM /
# SIGINT to it, restart it after a failure (--train.max_restarts), and when the ranks stopped for the checkpoint
# signal, requeue the job. The pretrain arguments come last in TASK_ARGS. Exits with the step's exit code (75 after
# a requeue; train/stopping.py lists them).
mg_run() {
  local srun_opts=() rc attempt=0 max_restarts
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    srun_opts+=("$1")
    shift
  done
  shift
  mg_signalled=0
  mg_stopped=0
  mg_srun_pid=
  # shellcheck disable=SC2086 # MEGAGENOME_WRAPPER is a command with its arguments
  max_restarts=$($MEGAGENOME_WRAPPER "$MG_PYTHON" -m megagenome.run.supervise --print_max_restarts -- pretrain \
    "${pretrain_args[@]}") || max_restarts=0
  trap '_mg_forward "$MG_SIGNAL"' "$MG_SIGNAL"
  trap '_mg_forward TERM' TERM
  # srun takes one SIGINT as a request for the tasks' status, not as a signal to pass on: Ctrl-C goes on as SIGTERM.
  trap '_mg_forward TERM' INT
  local resumed=0 extra
  while true; do
    if [ "$attempt" -gt 0 ] && { [ "$mg_signalled" -eq 1 ] || [ "$mg_stopped" -eq 1 ]; }; then break; fi
    _mg_step "${srun_opts[@]}" -- "$@"
    rc=$mg_rc
    # Restart a failure (not a refused config, a stopped run, a divergence, a finished run or a stop asked for).
    if [ "$mg_signalled" -eq 1 ] || [ "$mg_stopped" -eq 1 ] || [ "$attempt" -ge "$max_restarts" ]; then break; fi
    case "$rc" in 0 | 2 | 3 | 4 | 75 | 130 | 143) break ;; esac  # megagenome/run/supervise.py NO_RESTART
    attempt=$((attempt + 1))
    # Logs the restart and prints what the restart appends: `--checkpoint.resume auto` once the run directory holds
    # a complete checkpoint (an explicit --checkpoint.resume of another run is kept until then).
    # shellcheck disable=SC2086
    extra=$($MEGAGENOME_WRAPPER "$MG_PYTHON" -m megagenome.run.supervise --log_restart "$attempt" "$rc" -- pretrain \
      "${pretrain_args[@]}") || extra=""
    if [ -n "$extra" ] && [ "$resumed" -eq 0 ]; then
      # shellcheck disable=SC2086 # two words: the flag and its value
      set -- "$@" $extra
      resumed=1
    fi
  done
  trap - "$MG_SIGNAL" TERM INT
  if [ "$rc" -eq 0 ]; then
    echo "$prog: job $SLURM_JOB_ID run $MG_RUN finished" >&2
    exit 0
  fi
  # 75: the ranks saved a checkpoint on the signal. Any other failure after the signal (a rank killed during
  # teardown, a signal that came before the handler was up) also resumes from the newest complete checkpoint.
  if [ "$rc" -eq "$MG_PREEMPTED_EXIT" ] || [ "$mg_signalled" -eq 1 ]; then
    echo "$prog: step exited with $rc after SIG$MG_SIGNAL; requeueing job $SLURM_JOB_ID to resume from its" \
      "newest complete checkpoint" >&2
    if scontrol requeue "$SLURM_JOB_ID"; then
      exit "$MG_PREEMPTED_EXIT"
    fi
    echo "$prog: scontrol requeue failed (submit with --requeue, or the cluster forbids it): resubmit the job to" \
      "resume" >&2
  fi
  exit "$rc"
}

# _mg_step SRUN_OPTIONS... -- TASK...: one srun of the step in the background, waited for across trapped signals;
# sets mg_rc.
_mg_step() {
  local srun_opts=()
  while [ "$1" != "--" ]; do
    srun_opts+=("$1")
    shift
  done
  shift
  # --kill-on-bad-exit: a rank that fails takes the others down instead of leaving them blocked in a collective.
  # shellcheck disable=SC2016 # expanded by the task's bash
  srun --kill-on-bad-exit=1 "${srun_opts[@]}" \
    bash -c 'source "$1"; shift; "$@"' mg "${BASH_SOURCE[0]}" "$@" &
  mg_srun_pid=$!
  while true; do
    mg_rc=0
    wait "$mg_srun_pid" || mg_rc=$?
    # A trapped signal interrupts `wait` (status > 128) while srun runs on: wait again.
    if [ "$mg_rc" -gt 128 ] && kill -0 "$mg_srun_pid" 2>/dev/null; then continue; fi
    break
  done
  mg_srun_pid=
}

# _mg_forward SIGNAL: the checkpoint signal (requeue afterwards) or SIGTERM/SIGINT (Slurm's TERM before KILL at
# the time limit or preemption, scancel, an orchestrator; no requeue, no restart), through srun to every process
# of the step. The ranks stop after the same step; after SIGTERM/SIGINT with a checkpoint if it fits in
# --checkpoint.grace_s (keep it below Slurm's KillWait, 30 s by default, after which Slurm sends SIGKILL).
_mg_forward() {
  if [ "$1" = "$MG_SIGNAL" ]; then
    mg_signalled=1
    echo "$prog: SIG$1: asking the ranks to finish their step, save a checkpoint and stop" >&2
  else
    mg_stopped=1
    echo "$prog: SIG$1: asking the ranks to stop after their step (checkpoint if it fits in the grace period)" >&2
  fi
  if [ -n "$mg_srun_pid" ]; then
    kill -s "$1" "$mg_srun_pid" 2>/dev/null || true # srun delivers it to every process of the step
  fi
}
