"""The attention kernel seam: which kernel runs scaled dot-product attention, chosen in one place.

Backends (`--model.attention`):

    math    SDPA restricted to its math backend (plain matmuls and softmax; what CPU runs with dropout)
    sdpa    torch.nn.functional.scaled_dot_product_attention, letting torch choose its backend
    cudnn   SDPA restricted to the cuDNN backend (SDPBackend.CUDNN_ATTENTION; the fastest on Hopper)
    flash   flash-attn 2 (`flash_attn.flash_attn_func`, the optional GPU extra `pip install -e '.[gpu]'`)
    fa3     FlashAttention-3 (`flash_attn_interface.flash_attn_func`, Hopper only, built from flash-attn's hopper/)
    auto    on CUDA in fp16/bf16: fa3 where it is importable on a 9.x GPU and there is no dropout, else cudnn on
            sm >= 8.0 where torch has it and there is no dropout, else flash when installed, else sdpa; sdpa
            everywhere else (CPU, fp32)

cuDNN attention is never auto-picked with dropout: torch only offers it without (its `can_use_cudnn_attention`
refuses dropout on most builds), and FA3 has no dropout at all. A backend asked for by name that cannot run raises a
RuntimeError naming the flag, never a silent fallback.

This is the only module in megagenome that imports flash_attn or flash_attn_interface, and it does so lazily: both
are optional, so importing the model, running the CPU tests or training without them must never fail. Every kernel
takes and returns the same layout, (B, n_head, T, head_dim); q, k and v may be strided views (the model passes views
of its packed qkv projection), the flash kernels get them back as (B, T, n_head, head_dim) views without a copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = ("auto", "sdpa", "math", "cudnn", "flash", "fa3")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# The SDPA backend each SDPA-restricted kernel pins (sdpa_kernel); "sdpa" pins none.
SDPA_BACKENDS = {"math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}


# Memoised probes (a plain dict, not functools.lru_cache, so torch.compile traces a lookup instead of breaking the
# graph): the flash-attn functions, or None where they cannot be imported, and cuDNN availability per device.
_PROBES: dict = {}


def _flash_attn_func():
    """flash_attn.flash_attn_func (flash-attn 2), or None when the package cannot be imported here."""
    if "flash" not in _PROBES:
        try:
            from flash_attn import flash_attn_func
        except (ImportError, OSError, RuntimeError):
            # A wheel built against another CUDA/torch fails with OSError or RuntimeError (undefined
            # symbols), not ImportError; either way flash is simply not usable on this machine.
            flash_attn_func = None
        _PROBES["flash"] = flash_attn_func
    return _PROBES["flash"]


def _fa3_func():
    """flash_attn_interface.flash_attn_func (FlashAttention-3), or None when it cannot be imported here."""
    if "fa3" not in _PROBES:
        try:
            from flash_attn_interface import flash_attn_func
        except (ImportError, OSError, RuntimeError):
            flash_attn_func = None
        _PROBES["fa3"] = flash_attn_func
    return _PROBES["fa3"]


def flash_available() -> bool:
    """True when flash_attn can be imported (it still needs CUDA tensors in fp16/bf16 to run)."""
    return _flash_attn_func() is not None


def fa3_available() -> bool:
    """True when FlashAttention-3 can be imported (it still needs a Hopper GPU and fp16/bf16 tensors)."""
    return _fa3_func() is not None


def _capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device, memoised per device index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if ("sm", index) not in _PROBES:
        _PROBES[("sm", index)] = torch.cuda.get_device_capability(index)
    return _PROBES[("sm", index)]


def cudnn_attention_available(device: torch.device) -> bool:
    """True when this torch has SDPA's cuDNN backend and `device` is a CUDA GPU of compute capability >= 8.0."""
    if device.type != "cuda" or not torch.backends.cudnn.is_available():
        return False
    return _capability(device) >= (8, 0) and torch.backends.cuda.cudnn_sdp_enabled()


def attention_backend(kernel: str, device: torch.device | str, dtype: torch.dtype, dropout_p: float = 0.0) -> str:
    """The backend `kernel` runs on `device` in `dtype` (auto resolved, module docstring), for the start-up log line.

    A backend named explicitly is returned as it is (attention() raises when it cannot run). dropout_p is the
    training dropout: auto never resolves to cudnn or fa3 with dropout.
    """
    if kernel not in KERNELS:
        raise ValueError(f"--model.attention={kernel!r}: must be one of {', '.join(KERNELS)}")
    if kernel != "auto":
        return kernel
    device = torch.device(device)
    if device.type != "cuda" or dtype not in FLASH_DTYPES:
        return "sdpa"
    key = ("auto", str(device), dtype, bool(dropout_p))
    if key not in _PROBES:
        if dropout_p == 0 and fa3_available() and _capability(device)[0] == 9:
            _PROBES[key] = "fa3"
        elif dropout_p == 0 and cudnn_attention_available(device):
            _PROBES[key] = "cudnn"
        else:
            _PROBES[key] = "flash" if flash_available() else "sdpa"
    return _PROBES[key]


def resolve_before_compile() -> None:
    """Resolve what auto picks on every visible GPU, in both 16-bit dtypes, with and without dropout, and probe the
    flash-attn imports, eagerly: a compiled block (--model.compile, fullgraph) then only looks the answers up, since
    dynamo cannot trace an import or a device query. DNATransformer.compile_blocks calls it on every rank."""
    _flash_attn_func()
    _fa3_func()
    if not torch.cuda.is_available():
        return
    for index in range(torch.cuda.device_count()):
        for dtype in FLASH_DTYPES:
            for dropout_p in (0.0, 0.1):
                attention_backend("auto", torch.device("cuda", index), dtype, dropout_p)


def attention_summary(kernel: str, device: torch.device | str, dtype: torch.dtype, dropout_p: float = 0.0) -> str:
    """The start-up log line naming the attention backend: 'attention: cudnn (auto)', 'attention: flash'."""
    backend = attention_backend(kernel, device, dtype, dropout_p)
    return f"attention: {backend}" + (" (auto)" if kernel == "auto" else "")


def _refuse(kernel: str, q: torch.Tensor, dropout_p: float) -> None:
    """Raise a RuntimeError naming --model.attention where the named GPU kernel cannot run these tensors."""
    if kernel == "flash" and not flash_available():
        raise RuntimeError(
            "attention kernel 'flash' requested (--model.attention=flash) but flash_attn is not installed or "
            "cannot be imported; install the gpu extra (pip install -e '.[gpu]') or use --model.attention=auto"
        )
    if kernel == "fa3" and not fa3_available():
        raise RuntimeError(
            "attention kernel 'fa3' requested (--model.attention=fa3) but flash_attn_interface (FlashAttention-3) "
            "is not installed or cannot be imported; build it from flash-attn's hopper/ or use --model.attention=auto"
        )
    if not q.is_cuda:
        raise RuntimeError(
            f"attention kernel {kernel!r} (--model.attention={kernel}) needs CUDA tensors, got device {q.device}; "
            "use --model.attention=auto or sdpa on CPU"
        )
    if q.dtype not in FLASH_DTYPES:
        raise RuntimeError(
            f"attention kernel {kernel!r} (--model.attention={kernel}) needs float16 or bfloat16 tensors, got "
            f"{q.dtype}; enable bf16/fp16 in the DeepSpeed JSON or use --model.attention=auto"
        )
    if kernel == "fa3" and dropout_p:
        raise RuntimeError("attention kernel 'fa3' (--model.attention=fa3) has no dropout; set --model.dropout 0")
    if kernel == "cudnn" and not cudnn_attention_available(q.device):
        raise RuntimeError(
            "attention kernel 'cudnn' (--model.attention=cudnn) needs SDPA's cuDNN backend on a GPU of compute "
            "capability >= 8.0; use --model.attention=auto"
        )


def _flash(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, **kw) -> torch.Tensor:
    """A flash-attn function on (B, n_head, T, head_dim) tensors, which it takes as (B, T, n_head, head_dim)."""
    # The transposes are views (head_dim stays contiguous): no copy in either direction.
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, **kw)
    if isinstance(out, tuple):  # FlashAttention-3 releases before 3.0.0b2 also return the log-sum-exp
        out = out[0]
    return out.transpose(1, 2)  # (B, n_head, T, head_dim)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, dropout_p: float = 0.0, kernel: str = "auto"
) -> torch.Tensor:
    """Scaled dot-product attention of q, k, v, each (B, n_head, T, head_dim); returns the same shape.

    kernel: one of KERNELS (module docstring); a named GPU kernel that cannot run here raises a RuntimeError naming
    --model.attention. dropout_p applies to the attention weights; pass 0.0 in eval mode.
    """
    if kernel not in KERNELS:
        raise ValueError(f"--model.attention={kernel!r}: must be one of {', '.join(KERNELS)}")
    backends = None  # the SDPA backends allowed, in priority order; None: torch's own choice
    if kernel == "auto":
        kernel = attention_backend(kernel, q.device, q.dtype, dropout_p)
        if kernel == "cudnn":
            # Chosen, not asked for: cuDNN first, and torch's other backends behind it for a shape it refuses.
            backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
            backends.append(SDPBackend.MATH)
    elif kernel in ("flash", "fa3", "cudnn"):
        _refuse(kernel, q, dropout_p)
    if kernel == "flash":
        return _flash(_flash_attn_func(), q, k, v, causal, dropout_p=dropout_p)
    if kernel == "fa3":
        return _flash(_fa3_func(), q, k, v, causal)
    if backends is None and kernel in SDPA_BACKENDS:
        backends = [SDPA_BACKENDS[kernel]]
    if backends is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)  # (B, n_head, T, hd)
    with sdpa_kernel(backends, set_priority=len(backends) > 1):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)  # (B, n_head, T, hd)
