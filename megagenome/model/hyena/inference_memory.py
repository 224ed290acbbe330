"""The Hyena families' memory at inference (layer L1, no torch): what one forward pass over a window holds at its
peak, without autograd (eval, score-variants, embed), the planner's inference estimate (planner/inference.py).

Counted from what the code keeps alive, per (batch, window) with E the bytes of one (B, T, d_model) activation in the
model's dtype, F the same in float32 and G one (B, T, d_ff):

- every block keeps its input x (E); the norm's output n (E) is alive while the mixer or MLP reads it. StripedHyena's
  norm (divide) goes through float32: x.float(), the division, the scale (3F) at once;
- a Hyena operator: the input projection z (3E), padded (3E) and convolved by the short filter (3E) at once; then z,
  x2's copy (E, a strided view reshaped), x1 * v (E) and the float32 result (F), plus the FFT blocks of
  operators.py (INFERENCE_BLOCK_ELEMENTS): the transforms of u and h, their product and the inverse, 8 bytes each
  per channel and position of the block (32 B Cb T, Cb the block's channels), u's block in float32 twice (for the
  FFT and for D), the block's filter (4 Cb T); an LI block's filter is itself made in blocks of
  MODAL_BLOCK_ELEMENTS (channels x poles x T) with ~6 float32 intermediates. A direct (SE) convolution runs whole in
  float32: u.float(), padded, convolved, u * D (4F);
- the MLP: w_gate's and w_up's outputs, the product, and the gate's activation (GELU in block 0 under gelu_first:
  4G; 3G without an activation);
- attention: qkv (3E), the rotated q and k (2E), the kernel's output (E), its (B, T, d) copy (E); SDPA's flash
  kernel on CPU keeps no T x T matrix;
- beside the blocks: the bf16 weights, every attention layer's rotary tables (max_seq_len x head_dim, cos and sin,
  in the model's dtype), the embedding output and the layer kept for embed (E each).

Loading comes first and can be the peak of a short window: the file's tensors, the model built in float32 (its
rotary tables in float32), the float32 copies loaded into it (weights/load.py build_model).
glibc may keep freed memory (a measurement sets MALLOC_MMAP_THRESHOLD_ low so that it does not); the CPU's FFT and
GEMM libraries' own workspaces are not counted.
"""

from __future__ import annotations

from megagenome.model.hyena.operators import INFERENCE_BLOCK_ELEMENTS, MODAL_BLOCK_ELEMENTS


def block_activation_bytes(shape, kind: str, seq: int, batch: int, act_bytes: int, divide_norm: bool,
                           gate: bool) -> int:  # fmt: skip
    """The peak bytes a block of `kind` holds beyond the model's weights (the module docstring); gate: its MLP has
    an activation on the gate (every block's but block 0's under --model.mlp_activation gelu_first)."""
    d, f = shape.d_model, shape.d_ff
    E, F, G = batch * seq * d * act_bytes, batch * seq * d * 4, batch * seq * f * act_bytes
    norm = 3 * F if divide_norm else 2 * F
    mlp = (4 if gate else 3) * G
    if kind == "A":
        mixer = 3 * E + 2 * E + E + E
    elif shape.by_fft(kind):
        channels = max(1, min(d, INFERENCE_BLOCK_ELEMENTS // (batch * 2 * seq)))
        fft = 32 * batch * channels * seq + 2 * 4 * batch * channels * seq + 4 * channels * seq
        filt = 0
        if kind == "LI":
            modal = max(1, min(channels, MODAL_BLOCK_ELEMENTS // (shape.state_size * seq)))
            filt = 6 * 4 * modal * shape.state_size * seq + 4 * channels * seq
        core = 3 * E + E + E + F + max(fft, filt)
        mixer = max(9 * E, core, 3 * E + E + E + F + E + E)
    else:  # a direct explicit filter (SE): the convolution in float32, whole
        mixer = max(9 * E, 3 * E + E + E + 4 * F)
    return E + E + max(norm, mixer, mlp)


def inference_bytes(shape, seq: int, batch: int, act_bytes: int, file_bytes: int, params: int, norm: str,
                    activation: str) -> dict[str, int]:  # fmt: skip
    """{weights, tables, activations, forward, load, peak} in bytes of one forward over (batch, seq) windows, for a
    model of `params` parameters held in act_bytes (its --dtype) and read from a file of file_bytes per parameter;
    norm and activation are --model.norm_form and --model.mlp_activation."""
    head_dim = shape.d_model // shape.n_head
    tables_at = lambda nbytes: shape.n_attention * shape.max_seq_len * head_dim * nbytes  # noqa: E731  cos + sin
    kinds = list(shape.kinds)
    blocks = [
        block_activation_bytes(shape, k, seq, batch, act_bytes, norm == "divide", activation != "gelu_first" or i == 0)
        for i, k in enumerate(kinds)
    ]
    E = batch * seq * shape.d_model * act_bytes
    activations = max(blocks, default=0) + 2 * E  # the embedding output and the kept layer
    weights, tables = params * act_bytes, tables_at(act_bytes)
    forward = weights + tables + activations
    load = params * (file_bytes + 4 + 4) + tables_at(4)
    return {"weights": weights, "tables": tables, "activations": activations, "forward": forward, "load": load,
            "peak": max(forward, load)}  # fmt: skip
