"""The DeepSpeed seam (layer L2): engine.py starts the process group and builds the engine; ds_config.py,
ds_schema.py and ds_final.py check, merge and complete the DeepSpeed JSON; optimizers.py and schedules.py the
optimizer and learning-rate schedule the run config names; pipeline.py DeepSpeed's PipelineModule of a model;
token_mean.py a step's loss as the mean over the whole global batch; universal.py and safe_load.py DeepSpeed's
universal checkpoints and restricted loading; memory.py what the engine holds per rank; watchdog.py a hung rank's
stacks and exit. Nothing above train/ (the loop, L3) needs DeepSpeed's API beyond what these give."""
