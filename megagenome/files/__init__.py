"""How commands write their files (layer L0, stdlib only, open to every layer): outputs.py checks an output before any
work and publishes it whole, several together, or not at all; run_files.py names every file of a run directory."""
