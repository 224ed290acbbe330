"""The Hugging Face remote code of the gpn family's exports (layer L1, never imported by megagenome).

model/gpn/hf.py copies configuration_megagenome_gpn.py and modeling_megagenome_gpn.py into an export directory as
they are, so that `AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)` builds the model from them:
they import torch and transformers only (a user without megagenome loads the export), and they live here, as Python
files, so that ruff checks them and tests/test_mlm_hf.py holds their logits to megagenome's.
"""
