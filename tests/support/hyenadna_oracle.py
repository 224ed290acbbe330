"""HyenaDNA's own code as an oracle (tests/test_import_hyenadna.py): the standalone HyenaDNAModel that the `helical`
package ships (helical/models/hyena_dna/standalone_hyenadna.py, HyenaDNA's reference implementation from the
hyena-dna repository's colab), loaded by its file path.

helical's package __init__ files import its whole model zoo (datasets, anndata, scanpy ...), which the test command
installs with --no-deps and never needs: the two files the standalone model uses (itself and stochastic_depth.py)
are executed directly, the one it imports registered under its dotted name, so that no helical __init__ runs. The
model code itself runs as published (torch, einops, transformers).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

PACKAGE = "helical.models.hyena_dna"


def _load(name: str, path: pathlib.Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def standalone() -> ModuleType:
    """The standalone_hyenadna module (HyenaDNAModel, its blocks and filters)."""
    name = f"{PACKAGE}.standalone_hyenadna"
    if name not in sys.modules:
        root = pathlib.Path(importlib.util.find_spec("helical").submodule_search_locations[0]) / "models" / "hyena_dna"
        _load(f"{PACKAGE}.stochastic_depth", root / "stochastic_depth.py")
        _load(name, root / "standalone_hyenadna.py")
    return sys.modules[name]
