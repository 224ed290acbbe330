"""The attention kernel seam: flash-attn on a GPU when it is installed, PyTorch SDPA everywhere else.

This is the only module in megagenome that imports flash_attn, and it does so lazily: the package
is an optional GPU extra (`pip install megagenome[gpu]`), so importing the model, running the CPU
tests or training on a machine without it must never fail. Every kernel takes and returns the
same layout, (B, n_head, T, head_dim), so callers never see which one ran.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

KERNELS = ("auto", "sdpa", "flash")
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _flash_attn_func():
    """flash_attn.flash_attn_func, or None when the package cannot be imported here."""
    try:
        from flash_attn import flash_attn_func
    except (ImportError, OSError, RuntimeError):
        # A wheel built against another CUDA/torch fails with OSError or RuntimeError (undefined
        # symbols), not ImportError; either way flash is simply not usable on this machine.
        return None
    return flash_attn_func


def flash_available() -> bool:
    """True when flash_attn can be imported (it still needs CUDA tensors in fp16/bf16 to run)."""
    return _flash_attn_func() is not None


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout_p: float) -> torch.Tensor:
    """flash_attn_func on (B, n_head, T, head_dim) tensors; raises RuntimeError where it cannot run."""
    fn = _flash_attn_func()
    if fn is None:
        raise RuntimeError(
            "attention kernel 'flash' requested (--model.attention=flash) but flash_attn is not installed or "
            "cannot be imported; install megagenome[gpu] or use --model.attention=auto"
        )
    if not q.is_cuda:
        raise RuntimeError(
            f"attention kernel 'flash' needs CUDA tensors, got device {q.device}; "
            "use --model.attention=auto or sdpa on CPU"
        )
    if q.dtype not in FLASH_DTYPES:
        raise RuntimeError(
            f"attention kernel 'flash' needs float16 or bfloat16 tensors, got {q.dtype}; "
            "enable bf16/fp16 in the DeepSpeed JSON or use --model.attention=auto"
        )
    # flash_attn wants (B, T, n_head, head_dim); the transposes are views (head_dim stays contiguous).
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p, causal=causal)
    return out.transpose(1, 2)  # (B, n_head, T, head_dim)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout_p: float = 0.0, kernel: str = "auto"
) -> torch.Tensor:
    """Scaled dot-product attention of q, k, v, each (B, n_head, T, head_dim); returns the same shape.

    kernel: "sdpa" (torch.nn.functional.scaled_dot_product_attention), "flash" (flash-attn; a clear
    RuntimeError when it cannot run) or "auto" (flash when installed and the tensors are CUDA fp16/bf16,
    else SDPA). dropout_p applies to the attention weights; pass 0.0 in eval mode.
    """
    if kernel not in KERNELS:
        raise ValueError(f"--model.attention={kernel!r}: must be one of {', '.join(KERNELS)}")
    use_flash = kernel == "flash" or (kernel == "auto" and q.is_cuda and q.dtype in FLASH_DTYPES and flash_available())
    if use_flash:
        return _flash(q, k, v, causal, dropout_p)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)  # (B, n_head, T, head_dim)
