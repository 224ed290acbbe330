"""Test support: the harness the test modules share (no tests here; tests import it, never each other).

- helpers.py       paths, the CLI and the `deepspeed` launcher as a user runs them, small run configs, a world of one
- runs.py          scenario workers and their results: run many `pretrain` configs in one process group, read back
                   losses and final weights (any layout), compare two runs within tolerances
- worker.py        the scenario worker script runs.run_worker starts (under the launcher, or one plain process)
- tp_checks.py     tensor-parallel layer/model/engine checks the worker runs in its process group
- sp_checks.py     sequence-parallel attention checks the worker runs in its process group
- assembly_checks.py  assembly.from_run_dir on a finished run, run by the worker in its process group
- lose_checks.py   damage done between scenarios of test_lose_nothing.py (a truncated checkpoint file)
- stand_in.py      a stand-in DeepSpeed engine for the loop's own logic (where the real one cannot run on CPU)
- saved.py         bytes autograd saves for backward (activation-checkpointing and planner tests)
- hang_worker.py   a 2-rank pretrain in which one rank hangs (the watchdog test)
- netns_hosts.py   hosts in network namespaces, each with its own address and sshd (multi-host launch tests)
- slurm_cluster.py a real Slurm cluster started for the session (tests/conftest.py)
"""
