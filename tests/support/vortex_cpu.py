"""Evo 2's own code (vtx 1.1.0, Arc Institute's vortex) on a CPU, as the oracle of tests/test_import_evo2.py.

vortex is written for CUDA; its model code runs on a CPU in float32 with two stand-ins, the only mocks of these
tests, and each is where the real thing cannot run here:

- its rotary embedding imports a Triton kernel (vortex/model/rotary.py imports vortex.ops.embedding.rotary, whose
  package imports flash_attn_2_cuda): the module is registered beforehand with `apply_rotary` in plain torch, the
  rotate-half rotation the kernel computes (GPT-NeoX style, cos and sin of the positions, no interleave);
- it enters `torch.cuda.device(x.device)` around every Hyena block, which raises for a CPU device: a CPU device gets
  a null context instead (a CUDA device the real one).

Everything else is theirs as published: the config keys of their YAMLs, with the kernels a CPU has not (fp8 input
projections, flash attention, flashfft) switched off by their own flags, and float32 for every block.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
import types

import torch


def _apply_rotary(x, cos, sin, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None, interleaved=False, inplace=False,
                  conjugate=False):  # fmt: skip
    """vortex.ops.embedding.rotary.apply_rotary for (B, T, H, head_dim) x, non-interleaved, in plain torch."""
    assert cu_seqlens is None and isinstance(seqlen_offsets, int) and not interleaved
    T, rd = x.shape[1], cos.shape[-1] * 2
    c = cos[seqlen_offsets : seqlen_offsets + T].to(x.dtype)[None, :, None, :]
    s = sin[seqlen_offsets : seqlen_offsets + T].to(x.dtype)[None, :, None, :]
    s = -s if conjugate else s
    x1, x2 = x[..., : rd // 2], x[..., rd // 2 : rd]
    out = x if inplace else x.clone()
    out[..., :rd] = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return out


def install() -> None:
    """Register the two stand-ins (idempotent); import vortex after this."""
    if "vortex.ops.embedding.rotary" not in sys.modules:
        module = types.ModuleType("vortex.ops.embedding.rotary")
        module.apply_rotary = _apply_rotary
        sys.modules["vortex.ops.embedding.rotary"] = module
    if not getattr(torch.cuda.device, "_cpu_stand_in", False):
        cuda_device = torch.cuda.device

        def device(dev):
            d = torch.device(dev) if isinstance(dev, str) else dev
            return contextlib.nullcontext() if isinstance(d, torch.device) and d.type != "cuda" else cuda_device(dev)

        device._cpu_stand_in = True
        torch.cuda.device = device


# The flags of a CPU run (the published YAMLs ask for Transformer Engine's fp8 projections and flash attention).
CPU_FLAGS = dict(
    use_fp8_input_projections=False, use_flash_attn=False, use_flashfft=False, use_flash_depthwise=False,
    use_flash_rmsnorm=False, use_hcs_kernel=False, use_hcm_kernel=False, use_hcl_kernel=False,
    hyena_block_dtype=torch.float32, attn_block_dtype=torch.float32, mlp_dtype=torch.float32,
    params_dtype=torch.float32, max_batch_size=1, prefill_style="fft",
)  # fmt: skip


def _import_vortex_logging() -> None:
    """vortex.logging opens activations_debug.log in the working directory when imported: import it from a temporary
    one, so that the suite leaves nothing in the checkout (the handler's file goes with the directory)."""
    if "vortex.logging" in sys.modules:
        return
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            importlib.import_module("vortex.logging")
        finally:
            os.chdir(here)


def build(config: dict):
    """vortex's StripedHyena of a config (the YAML's keys), float32 on CPU, in eval mode."""
    install()
    _import_vortex_logging()
    import logging

    from vortex.model.model import StripedHyena
    from vortex.model.utils import dotdict

    logging.getLogger("vortex").setLevel(logging.WARNING)
    return StripedHyena(dotdict({**config, **CPU_FLAGS})).float().eval()
