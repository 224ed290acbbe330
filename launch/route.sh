# Sourced by launch/local.sh and launch/common.sh (multinode.sh, no_ssh.sh).
# route_console PRETRAIN_ARGS...: the reader of a launch's stdout (`exec CMD > >(route_console ARGS)`): megagenome's
# lines, errors and the DeepSpeed warnings that matter on the console, DeepSpeed's other lines in <run dir>/logs/
# launcher.log (megagenome/observe/console.py). It ignores Ctrl-C, SIGTERM, SIGHUP and the checkpoint signals (the
# supervisor's to handle: the router must outlive the ranks) and ends when the launch's last process closes its output.
route_console() {
  trap '' INT TERM HUP USR1 USR2 QUIT
  local run_dir
  run_dir=$(python -m megagenome.observe.console run-dir "$@")
  exec python -m megagenome.observe.console route "$run_dir"
}
