"""A training run's machinery (layer L4): the assembly every command shares, the stages of `megagenome pretrain`,
resume checks, the run directory's lock, the closing summary, preflight, training trials, the supervisor and the
planner's command (plan.py: a run config's predicted memory and step time, from planner/'s arithmetic)."""
