// The selective scan on CPU, fused (megagenome/model/caduceus/scan_cpu.py builds and calls it), and the bindings of
// the extension it is built into with causal_conv_cpu.cpp.
//
// Of u, delta (b, T, c), A (c, N) = -exp(A_log), B, C (b, T, N) and D (c), all float32 and contiguous:
//
//     h_t = exp(delta_t A) * h_{t-1} + delta_t u_t B_t    (N states per channel, h_{-1} = 0)
//     y_t = C_t . h_t + D u_t
//
// (delta_t = softplus(dt_t + dt_bias) is computed by torch before the call, element-wise and vectorised: inside, per
// position, it cost more than the recurrence.)
//
// One work item is one (batch row, channel): its N states stay in registers while it walks T (the N loop is the
// vector loop; N = 16, Mamba's default, is compiled with N fixed), and the items run in parallel on torch's intra-op
// threads (at::parallel_for, OpenMP). Nothing of size (b, T, c, N) is ever written: the forward keeps the state at
// the start of every CHUNK-th position, and the backward recomputes one chunk's states and decays from that
// checkpoint into a small buffer, then runs the reverse recurrence over the chunk, as mamba_ssm's CUDA kernel does.
//
// Backward, with g_t = dL/dh_t through every later position (g_t = dy_t C_t + exp(delta_{t+1} A) g_{t+1}) and
// s_t = g_t exp(delta_t A) h_{t-1} (dL/d(delta_t A), per state):
//
//     du_t     = delta_t (g_t . B_t) + D dy_t          dD += dy_t u_t
//     ddelta_t = u_t (g_t . B_t) + s_t . A              dA += delta_t s_t
//     dB_t    += delta_t u_t g_t                        dC_t += dy_t h_t     (summed over the channels)
//
// dB and dC are sums over channels, dA and dD over the batch: each work item adds into rows of its own (a group of
// channels of one batch row, below) and torch sums the rows afterwards, so no two threads ever write the same float
// and the result does not depend on the thread count.

#include <ATen/Parallel.h>

#include "mamba_cpu.h"

namespace {

constexpr int64_t CHUNK = 32;  // positions between the forward's state checkpoints

struct Shapes {
    int64_t b, T, c, N, chunks;
};

Shapes shapes_of(const torch::Tensor& u, const torch::Tensor& A) {
    const int64_t T = u.size(1);
    return {u.size(0), T, u.size(2), A.size(1), (T + CHUNK - 1) / CHUNK};
}

void check(const torch::Tensor& x, const char* name, int64_t dim) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "selective_scan_cpu: ", name, " must be float32");
    TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "selective_scan_cpu: ", name, " must be contiguous on CPU");
    TORCH_CHECK(x.dim() == dim, "selective_scan_cpu: ", name, " must have ", dim, " dimensions");
}

// The shapes the kernel indexes by, each checked (a mismatch would read out of bounds, not fail).
void check_shapes(const Shapes& s, const torch::Tensor& delta, const torch::Tensor& A, const torch::Tensor& B,
                  const torch::Tensor& C, const torch::Tensor& D) {
    TORCH_CHECK(delta.sizes() == torch::IntArrayRef({s.b, s.T, s.c}), "selective_scan_cpu: delta must be u's shape");
    TORCH_CHECK(A.size(0) == s.c, "selective_scan_cpu: A must be (channels, N)");
    for (const auto* x : {&B, &C})
        TORCH_CHECK(x->sizes() == torch::IntArrayRef({s.b, s.T, s.N}), "selective_scan_cpu: B and C must be (b, T, N)");
    TORCH_CHECK(D.size(0) == s.c, "selective_scan_cpu: D must be (channels,)");
}

// Channel groups per batch row in the backward: at least WORK_ITEMS work items (b x groups), enough for 16 threads,
// and few enough that the per-group dB and dC rows (b x groups x T x N floats each) stay small. A function of the
// shapes only, never of the thread count, so that the sums (and so the gradients) are the same bits on any machine.
constexpr int64_t WORK_ITEMS = 16;
int64_t channel_groups(int64_t b, int64_t c) { return std::max<int64_t>(1, std::min(c, (WORK_ITEMS + b - 1) / b)); }

// Items per thread at least: about at::internal::GRAIN_SIZE state updates each, so that a small scan (a test's, a
// short window's) runs on the calling thread instead of waking every OpenMP thread for microseconds of work, which
// costs more than the work itself where ranks share cores.
int64_t grain(const Shapes& s, int64_t channels_per_item) {
    const int64_t work = std::max<int64_t>(1, s.T * s.N * channels_per_item);
    return std::max<int64_t>(1, (at::internal::GRAIN_SIZE + work - 1) / work);
}

// The forward of the items [begin, end), with NS > 0 the state size known at compile time (the loops over it
// unrolled and the state kept in registers), NS = 0 any N.
template <int64_t NS>
void forward_items(const Shapes& s, const float* pu, const float* pdelta, const float* pA, const float* pB,
                   const float* pC, const float* pD, float* py, float* pck, int64_t begin, int64_t end) {
    const int64_t N = NS > 0 ? NS : s.N, T = s.T, c = s.c;
    std::vector<float> heap(NS > 0 ? 0 : N);
    float local[NS > 0 ? NS : 1];
    float* h = NS > 0 ? local : heap.data();
    for (int64_t item = begin; item < end; ++item) {
        const int64_t bi = item / c, ch = item % c;
        const float* a = pA + ch * N;
        const float d_skip = pD[ch];
        std::fill(h, h + N, 0.0f);
        for (int64_t t = 0; t < T; ++t) {
            if (t % CHUNK == 0) std::copy(h, h + N, pck + ((item * s.chunks) + t / CHUNK) * N);
            const int64_t at_t = (bi * T + t) * c + ch;
            const float ut = pu[at_t], delta = pdelta[at_t], du = delta * ut;
            const float *bt = pB + (bi * T + t) * N, *ct = pC + (bi * T + t) * N;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t n = 0; n < N; ++n) {
                h[n] = exp_fast(delta * a[n]) * h[n] + du * bt[n];
                acc += ct[n] * h[n];
            }
            py[at_t] = acc + d_skip * ut;
        }
    }
}

struct Grads {
    float *du, *ddelta, *dA, *dD, *dB, *dC;  // dA (b, c, N), dD (b, c), dB and dC (b, groups, T, N): summed later
};

// The backward of the work items [begin, end) (one item: a group of channels of one batch row), NS as above.
template <int64_t NS>
void backward_items(const Shapes& s, int64_t groups, const float* pu, const float* pdelta, const float* pA,
                    const float* pB, const float* pC, const float* pD, const float* pck, const float* pdy,
                    const Grads& out, int64_t begin, int64_t end) {
    const int64_t N = NS > 0 ? NS : s.N, T = s.T, c = s.c, per_group = (c + groups - 1) / groups;
    // states[i] = h entering position t0 + i of the chunk (states[0] the checkpoint), decays[i] its decays
    std::vector<float> states((CHUNK + 1) * N), decays(CHUNK * N), heap(NS > 0 ? 0 : N);
    float local[NS > 0 ? NS : 1];
    float* g_next = NS > 0 ? local : heap.data();  // exp(delta_{t+1} A) g_{t+1}
    for (int64_t item = begin; item < end; ++item) {
        const int64_t bi = item / groups, group = item % groups;
        float *dB_row = out.dB + item * T * N, *dC_row = out.dC + item * T * N;
        for (int64_t ch = group * per_group; ch < std::min(c, (group + 1) * per_group); ++ch) {
            const float* a = pA + ch * N;
            const float d_skip = pD[ch];
            float* dA = out.dA + (bi * c + ch) * N;
            float dD = 0.0f;
            std::fill(g_next, g_next + N, 0.0f);
            for (int64_t chunk = s.chunks - 1; chunk >= 0; --chunk) {
                const int64_t t0 = chunk * CHUNK, len = std::min(CHUNK, T - t0);
                const float* start = pck + ((bi * c + ch) * s.chunks + chunk) * N;
                std::copy(start, start + N, states.begin());
                for (int64_t i = 0; i < len; ++i) {  // the chunk's states again, from its checkpoint
                    const int64_t at_t = (bi * T + t0 + i) * c + ch;
                    const float delta = pdelta[at_t], dut = delta * pu[at_t];
                    const float* bt = pB + (bi * T + t0 + i) * N;
                    const float* h_prev = &states[i * N];
                    float *h = &states[(i + 1) * N], *dec = &decays[i * N];
#pragma omp simd
                    for (int64_t n = 0; n < N; ++n) {
                        dec[n] = exp_fast(delta * a[n]);
                        h[n] = dec[n] * h_prev[n] + dut * bt[n];
                    }
                }
                for (int64_t i = len - 1; i >= 0; --i) {  // the reverse recurrence over the chunk
                    const int64_t t = t0 + i, at_t = (bi * T + t) * c + ch;
                    const float ut = pu[at_t], delta = pdelta[at_t], dyt = pdy[at_t], dut = delta * ut;
                    const float *bt = pB + (bi * T + t) * N, *ct = pC + (bi * T + t) * N;
                    const float *h_prev = &states[i * N], *h = &states[(i + 1) * N], *dec = &decays[i * N];
                    float *dBt = dB_row + t * N, *dCt = dC_row + t * N;
                    float gB = 0.0f, sA = 0.0f;
#pragma omp simd reduction(+ : gB, sA)
                    for (int64_t n = 0; n < N; ++n) {
                        const float g = dyt * ct[n] + g_next[n];
                        const float sn = g * dec[n] * h_prev[n];
                        dCt[n] += dyt * h[n];
                        dBt[n] += dut * g;
                        dA[n] += delta * sn;
                        gB += g * bt[n];
                        sA += sn * a[n];
                        g_next[n] = g * dec[n];
                    }
                    out.du[at_t] = delta * gB + d_skip * dyt;
                    out.ddelta[at_t] = ut * gB + sA;
                    dD += dyt * ut;
                }
            }
            out.dD[bi * c + ch] = dD;
        }
    }
}

}  // namespace

// y (b, T, c) and the state checkpoints (b, c, chunks, N): the state entering positions 0, CHUNK, 2 CHUNK, ...
std::vector<torch::Tensor> forward(torch::Tensor u, torch::Tensor delta, torch::Tensor A, torch::Tensor B,
                                   torch::Tensor C, torch::Tensor D) {
    check(u, "u", 3), check(delta, "delta", 3), check(A, "A", 2), check(B, "B", 3), check(C, "C", 3);
    check(D, "D", 1);
    const Shapes s = shapes_of(u, A);
    check_shapes(s, delta, A, B, C, D);
    auto y = torch::empty_like(u);
    auto ckpt = torch::empty({s.b, s.c, s.chunks, s.N}, u.options());
    const float *pu = u.data_ptr<float>(), *pdelta = delta.data_ptr<float>(), *pA = A.data_ptr<float>();
    const float *pB = B.data_ptr<float>(), *pC = C.data_ptr<float>(), *pD = D.data_ptr<float>();
    float *py = y.data_ptr<float>(), *pck = ckpt.data_ptr<float>();
    at::parallel_for(0, s.b * s.c, grain(s, 1), [&](int64_t begin, int64_t end) {
        if (s.N == 16)
            forward_items<16>(s, pu, pdelta, pA, pB, pC, pD, py, pck, begin, end);
        else
            forward_items<0>(s, pu, pdelta, pA, pB, pC, pD, py, pck, begin, end);
    });
    return {y, ckpt};
}

// du, ddelta (b, T, c), dA (c, N), dB, dC (b, T, N), dD (c), of the forward's inputs, its checkpoints and dy
std::vector<torch::Tensor> backward(torch::Tensor u, torch::Tensor delta, torch::Tensor A, torch::Tensor B,
                                    torch::Tensor C, torch::Tensor D, torch::Tensor ckpt, torch::Tensor dy) {
    check(dy, "dy", 3), check(ckpt, "ckpt", 4);
    const Shapes s = shapes_of(u, A);
    check_shapes(s, delta, A, B, C, D);
    TORCH_CHECK(dy.sizes() == u.sizes(), "selective_scan_cpu: dy must be u's shape");
    TORCH_CHECK(ckpt.sizes() == torch::IntArrayRef({s.b, s.c, s.chunks, s.N}), "selective_scan_cpu: ckpt's shape");
    const int64_t groups = channel_groups(s.b, s.c);
    auto du = torch::empty_like(u), ddelta = torch::empty_like(delta);
    auto dA_rows = torch::zeros({s.b, s.c, s.N}, u.options()), dD_rows = torch::zeros({s.b, s.c}, u.options());
    auto dB_rows = torch::zeros({s.b, groups, s.T, s.N}, u.options());
    auto dC_rows = torch::zeros({s.b, groups, s.T, s.N}, u.options());
    const float *pu = u.data_ptr<float>(), *pdelta = delta.data_ptr<float>(), *pA = A.data_ptr<float>();
    const float *pB = B.data_ptr<float>(), *pC = C.data_ptr<float>(), *pD = D.data_ptr<float>();
    const float *pck = ckpt.data_ptr<float>(), *pdy = dy.data_ptr<float>();
    const Grads out{du.data_ptr<float>(),      ddelta.data_ptr<float>(),  dA_rows.data_ptr<float>(),
                    dD_rows.data_ptr<float>(), dB_rows.data_ptr<float>(), dC_rows.data_ptr<float>()};
    at::parallel_for(0, s.b * groups, grain(s, (s.c + groups - 1) / groups), [&](int64_t begin, int64_t end) {
        if (s.N == 16)
            backward_items<16>(s, groups, pu, pdelta, pA, pB, pC, pD, pck, pdy, out, begin, end);
        else
            backward_items<0>(s, groups, pu, pdelta, pA, pB, pC, pD, pck, pdy, out, begin, end);
    });
    return {du, ddelta, dA_rows.sum(0), dB_rows.sum(1), dC_rows.sum(1), dD_rows.sum(0)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("forward", &forward, "the fused selective scan: y and the state checkpoints");
    m.def("backward", &backward, "its gradients, recomputing each chunk's states from the checkpoints");
    m.attr("CHUNK") = CHUNK;
    m.def("conv_silu_forward", &conv_silu_forward, "the depthwise causal conv + SiLU (causal_conv_cpu.cpp)");
    m.def("conv_silu_backward", &conv_silu_backward, "its gradients, recomputing the pre-activation");
}
