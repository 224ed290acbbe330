"""A run's weights on disk (layer L3): checkpoint.py the checkpoint directory's policy (tags, COMPLETE markers,
retention, resume lookup, layouts, conversion to the universal format) with integrity.py its manifests; consolidate.py
one dense state dict from a checkpoint of any layout; load.py weights from a run or export directory built into a
model, and loaded into a new run (--model.init_from); task_weights.py a fine-tuning run's task model and head.
Training (run/) and the commands after it (after_training/) both read weights through here."""
