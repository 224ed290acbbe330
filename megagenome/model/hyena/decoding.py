"""Cached decoding of the Hyena operators (layer L1; model/decoding.py for the whole model): the prompt's prefill is
the operator's own forward, then each step costs what its filter needs, never a recompute of the prefix.

One HyenaCache per operator and generation holds:

    featurizer   the last short_filter_len - 1 projected inputs (B, 3 channels, k - 1): the depthwise short
                 convolution of the next position reads them (a FIR state)
    SE, MR       the last filter_len - 1 gated inputs u = x1 . v (B, channels, L - 1) and the taps: the next output
                 is their dot product with the filter (a FIR state; cost per step L, flat in the context)
    LI           the modal state s[c, p] = sum_{t' <= t} exp(lambda_p (t - t')) u[t'] (B, channels, state_size,
                 complex), computed from the prompt in one pass after the prefill and advanced by s <- exp(lambda) s +
                 u per step; the output is Re(sum_p R_p s_p), what the filter h[k] = Re(sum_p R_p exp(lambda_p k))
                 convolves to (Evo 2's vortex decodes its LI layers this way). Cost per step flat in the context.
    H            every gated input so far (B, channels, capacity) and the implicit filter's taps for the whole
                 capacity (its MLP run once): the next output is the dot product of the filter with the inputs
                 reversed, cost per step linear in the context (HyenaDNA's filter has no recurrent form)

All of it in float32, as the operator's long convolutions are (fft_conv, direct_conv).
"""

from __future__ import annotations

import torch

from megagenome.model.hyena.operators import direct_conv

STATE_BLOCK = 2048  # prompt positions per chunk of the LI state's one pass (channels x state_size x chunk complex)


class HyenaCache:
    """One Hyena operator's decoding state (module docstring) for `batch` sequences of up to `capacity` positions."""

    def __init__(self, op, batch: int, capacity: int, dtype: torch.dtype, device):
        channels3, k = op.short_filter.shape  # this operator's 3 x channels, featurizer taps
        channels = channels3 // 3
        self.kind = op.kind
        self.z_tail = torch.zeros(batch, channels3, k - 1, dtype=dtype, device=device)
        with torch.no_grad():
            if op.kind in ("SE", "MR"):
                self.h = op.filter(capacity)[:, :capacity].float()  # (channels, L)
                self.u_tail = torch.zeros(batch, channels, self.h.size(1) - 1, device=device)
            elif op.kind == "H":
                self.h = op.filter(capacity).float()  # (channels, capacity)
                self.u = torch.zeros(batch, channels, capacity, device=device)
            else:  # LI
                f = op.filter
                self.rate = torch.complex(-f.log_rate.float().exp(), f.theta.float())  # (channels, S): lambda
                self.step = self.rate.exp()  # exp(lambda): one position's decay and turn
                self.residues = torch.complex(*f.residues.float().unbind(-1))  # (channels, S)
                self.state = torch.zeros(batch, channels, self.rate.size(1), dtype=torch.complex64, device=device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        names = {"SE": ("z_tail", "h", "u_tail"), "MR": ("z_tail", "h", "u_tail"), "H": ("z_tail", "h", "u"),
                 "LI": ("z_tail", "state")}[self.kind]  # fmt: skip
        return tuple(getattr(self, n) for n in names)

    def fill(self, u: torch.Tensor) -> None:
        """The long filter's state after the prefill's gated inputs u (B, channels, P), float32."""
        P = u.size(-1)
        if self.kind in ("SE", "MR"):
            keep = self.u_tail.size(-1)
            if keep:
                tail = u[..., -keep:]
                self.u_tail[..., keep - tail.size(-1) :] = tail
        elif self.kind == "H":
            self.u[..., :P] = u
        else:  # the modal state at position P - 1: sum_t exp(lambda (P - 1 - t)) u[t], in chunks of positions
            for s in range(0, P, STATE_BLOCK):
                t = torch.arange(s, min(P, s + STATE_BLOCK), device=u.device)
                powers = torch.exp(self.rate[..., None] * (P - 1 - t).to(torch.float32))  # (channels, S, chunk)
                self.state += torch.einsum("bct,cst->bcs", u[..., t].to(torch.complex64), powers)

    def advance(self, u: torch.Tensor, position: int) -> torch.Tensor:
        """The long convolution's output (without D u) at `position` for its gated input u (B, channels, 1)."""
        if self.kind in ("SE", "MR"):
            ext = torch.cat([self.u_tail, u], dim=-1)  # (B, channels, L)
            if self.u_tail.size(-1):
                self.u_tail = ext[..., 1:]
            return direct_conv(ext, self.h)[..., -1:]  # (B, channels, 1)
        if self.kind == "H":
            self.u[..., position] = u[..., 0]
            past = self.u[..., : position + 1].flip(-1)  # (B, channels, position + 1): u[t], u[t - 1], ...
            return (past * self.h[:, : position + 1]).sum(-1, keepdim=True)  # (B, channels, 1)
        self.state = self.state * self.step + u.to(torch.complex64)  # (B, channels, S)
        return (self.state * self.residues).real.sum(-1, keepdim=True)  # (B, channels, 1)


def cached_forward(op, x: torch.Tensor, cache: HyenaCache, start: int) -> torch.Tensor:
    """The operator (operators.py HyenaOperator) on positions start..start+T-1 of x (B, T, d) with its cache: the
    prefill (start 0) computes as forward() does and fills the cache, a step (T = 1) reads and advances it."""
    B, T, _ = x.shape
    if start > 0 and T != 1:
        raise ValueError("a Hyena operator decodes one position per step after the prefill")
    z = op.in_proj(x)  # (B, T, 3 channels)
    z = (z if op.in_bias is None else z + op.in_bias.to(z.dtype)).transpose(1, 2)  # (B, 3 channels, T)
    k = op.short_filter.size(1)
    ext = torch.cat([cache.z_tail, z], dim=-1)  # (B, 3 channels, k - 1 + T): zeros before the first position
    if k > 1:
        cache.z_tail = ext[..., -(k - 1) :]
    z = direct_conv(ext, op.short_filter.float())[..., k - 1 :]  # (B, 3 channels, T): the featurizer
    if op.short_bias is not None:
        z = z + op.short_bias.to(z.dtype)[:, None]
    x2, x1, v = z.view(B, -1, 3, op.head_size, T).unbind(2)  # 3 x (B, heads, head_size, T)
    x2, u = x2.reshape(B, -1, T), (x1 * v).reshape(B, -1, T)  # 2 x (B, channels, T)
    if start == 0:
        conv = op._core_blocks(u, T) if op.fft else op._core(u, op.filter(T), op.D)  # (B, channels, T) float32
        cache.fill(u.float())
    else:
        conv = cache.advance(u.float(), start) + u.float() * op.D.float()[:, None]  # (B, channels, 1)
    out = op.out_proj((conv.to(x2.dtype) * x2).transpose(1, 2))  # (B, T, d)
    return out if op.out_bias is None else out + op.out_bias.to(out.dtype)
