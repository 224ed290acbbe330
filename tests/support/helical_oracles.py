"""The authors' own code of HyenaDNA and Caduceus as oracles (tests/test_import_hyenadna.py, test_import_caduceus.py),
as the `helical` package ships it, loaded by file path.

helical's package __init__ files import its whole model zoo (datasets, anndata, scanpy ...), which the test command
installs with --no-deps and never needs: the files each model uses are executed directly under their dotted names
(_load), so that no helical __init__ runs. The model code itself runs as published.

HyenaDNA: the standalone HyenaDNAModel (helical/models/hyena_dna/standalone_hyenadna.py, HyenaDNA's reference
implementation from the hyena-dna repository's colab, and the stochastic_depth.py it imports); torch, einops and
transformers.

Caduceus: modeling_caduceus.py, modeling_rcps.py and pretrained_config.py (helical/models/caduceus/, taken from the
kuleshov-group/caduceus repository), with a CPU stand-in for the one thing they import that cannot run here.
Caduceus builds on mamba_ssm, whose Mamba runs CUDA kernels only (its selective scan and causal-conv1d extensions,
its Triton norms). The stand-in registers a `mamba_ssm` package in sys.modules with exactly the three names Caduceus
imports, each computing what mamba_ssm's does:

- modules.mamba_simple.Mamba: mambapy's MambaBlock (a pure-torch port of mamba_simple, the same parameter names and
  shapes: in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj), built from Mamba's keyword arguments;
- modules.block.Block: mamba_ssm 2's pre-norm block, residual = hidden + residual, hidden = mixer(norm(residual)),
  returning (hidden, residual) (its unfused path; no MLP, as Caduceus asks);
- ops.triton.layer_norm.RMSNorm: x * rsqrt(mean(x^2) + eps) * weight in float32; the fused functions
  (layer_norm_fn, rms_norm_fn) raise, and the oracle runs with fused_add_norm false, which for a model without RCPS
  computes the same function as the fused path (add, then norm).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

import torch
from mambapy.mamba import MambaBlock, MambaConfig
from torch import nn

CADUCEUS = "helical.models.caduceus"
HYENADNA = "helical.models.hyena_dna"


class Mamba(MambaBlock):
    """mamba_simple.Mamba's signature over mambapy's MambaBlock (the module docstring)."""

    def __init__(self, d_model, d_state=16, d_conv=4, expand=2, dt_rank="auto", dt_min=0.001, dt_max=0.1,
                 dt_init="random", dt_scale=1.0, dt_init_floor=1e-4, conv_bias=True, bias=False, use_fast_path=True,
                 layer_idx=None, device=None, dtype=None):  # fmt: skip
        config = MambaConfig(d_model, n_layers=1, dt_rank=dt_rank, d_state=d_state, expand_factor=expand, d_conv=d_conv,
                             dt_min=dt_min, dt_max=dt_max, dt_init=dt_init, dt_scale=dt_scale, bias=bias,
                             conv_bias=conv_bias, pscan=False)  # fmt: skip
        super().__init__(config)
        self.layer_idx = layer_idx

    def forward(self, hidden_states, inference_params=None):
        return super().forward(hidden_states)


class Block(nn.Module):
    """mamba_ssm 2's Block, unfused: (mixer(norm(hidden + residual)), hidden + residual)."""

    def __init__(self, dim, mixer_cls, mlp_cls, norm_cls=nn.LayerNorm, fused_add_norm=False, residual_in_fp32=False):
        super().__init__()
        assert not fused_add_norm and mlp_cls is nn.Identity, "the stand-in is mamba_ssm's unfused, MLP-free block"
        self.residual_in_fp32 = residual_in_fp32
        self.norm, self.mixer = norm_cls(dim), mixer_cls(dim)

    def forward(self, hidden_states, residual=None, inference_params=None, **mixer_kwargs):
        residual = hidden_states + residual if residual is not None else hidden_states
        hidden_states = self.norm(residual.to(dtype=self.norm.weight.dtype))
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        return self.mixer(hidden_states, inference_params=inference_params), residual


class RMSNorm(nn.Module):
    """mamba_ssm's RMSNorm (unfused): x * rsqrt(mean(x^2) + eps) * weight, in float32."""

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, device=None, dtype=None):
        super().__init__()
        self.eps, self.bias = eps, None
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def _fused(*args, **kwargs):
    raise NotImplementedError("the CPU stand-in has no fused add + norm: build the oracle with fused_add_norm false")


def _install_mamba_ssm() -> None:
    names = {
        "mamba_ssm": {},
        "mamba_ssm.modules": {},
        "mamba_ssm.modules.mamba_simple": {"Mamba": Mamba},
        "mamba_ssm.modules.block": {"Block": Block},
        "mamba_ssm.ops": {},
        "mamba_ssm.ops.triton": {},
        "mamba_ssm.ops.triton.layer_norm": {"RMSNorm": RMSNorm, "layer_norm_fn": _fused, "rms_norm_fn": _fused},
    }
    for name, attributes in names.items():
        module = ModuleType(name)
        module.__dict__.update(attributes)
        sys.modules.setdefault(name, module)


def _load(name: str, path: pathlib.Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _models() -> pathlib.Path:
    """helical/models, found without importing helical."""
    return pathlib.Path(importlib.util.find_spec("helical").submodule_search_locations[0]) / "models"


def hyenadna() -> ModuleType:
    """The standalone_hyenadna module (HyenaDNAModel, its blocks and filters)."""
    name = f"{HYENADNA}.standalone_hyenadna"
    if name not in sys.modules:
        _load(f"{HYENADNA}.stochastic_depth", _models() / "hyena_dna" / "stochastic_depth.py")
        _load(name, _models() / "hyena_dna" / "standalone_hyenadna.py")
    return sys.modules[name]


def caduceus() -> ModuleType:
    """The modeling_caduceus module (CaduceusModel, its backbone, BiMambaWrapper; its config class beside it)."""
    name = f"{CADUCEUS}.modeling_caduceus"
    if name not in sys.modules:
        _install_mamba_ssm()
        root = _models() / "caduceus"
        if CADUCEUS not in sys.modules:  # the parent the files' relative imports resolve against (its __init__ unrun)
            package = ModuleType(CADUCEUS)
            package.__path__ = [str(root)]
            sys.modules[CADUCEUS] = package
        for module in ("pretrained_config", "modeling_rcps", "modeling_caduceus"):
            _load(f"{CADUCEUS}.{module}", root / f"{module}.py")
    return sys.modules[name]
