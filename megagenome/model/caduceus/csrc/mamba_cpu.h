// The fused CPU kernels of the Mamba mixer, built by megagenome/model/caduceus/scan_cpu.py into one extension:
// the selective scan (selective_scan_cpu.cpp, which also holds the module's bindings) and the depthwise causal
// convolution + SiLU (causal_conv_cpu.cpp). What the two files share: the conv's entry points and exp_fast.

#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// x (b, T, c) in u's dtype = silu(depthwise causal conv of u with w (c, k) and bias (c)), u read backwards if reverse
torch::Tensor conv_silu_forward(torch::Tensor u, torch::Tensor w, torch::Tensor bias, bool reverse);

// du (b, T, c), dw (c, k), db (c) of the forward's inputs and dx
std::vector<torch::Tensor> conv_silu_backward(torch::Tensor u, torch::Tensor w, torch::Tensor bias, torch::Tensor dx,
                                              bool reverse);

// exp(x) for the scan's decays (x = delta A <= 0) and the conv's SiLU, in arithmetic the compiler vectorises:
// x = k ln2 + r with |r| <= ln2/2, e^r by its Taylor polynomial to r^7 (relative error under 2e-8 before rounding),
// 2^k by the exponent bits. Below -87 (where float's normal range ends) it gives 0, as expf underflows; above 88,
// exp(88).
inline float exp_fast(float x) {
    const float below = x < -87.0f ? 0.0f : 1.0f;
    x = std::max(x, -87.0f);
    x = std::min(x, 88.0f);
    const float k = std::nearbyint(x * 1.44269504088896341f);
    const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187045e-06f;
    float p = 1.98412698e-4f;  // 1/5040
    p = p * r + 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    return p * scale * below;
}
