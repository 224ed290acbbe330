"""The Hugging Face remote code of the Hyena families' exports (layer L1, never imported by megagenome).

model/hyena/hf.py copies configuration_megagenome_hyena.py and modeling_megagenome_hyena.py into an export directory
as they are, so that `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` builds the model from them:
they import torch and transformers only (a user without megagenome loads the export), and they live here, as Python
files, so that ruff checks them and tests/test_hyena_after_training.py holds their logits to megagenome's.
"""
