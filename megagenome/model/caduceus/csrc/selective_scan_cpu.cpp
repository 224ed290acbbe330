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
// One work item is LANES = 16 channels of one batch row (the backward's: a group of such blocks): the vector loop runs
// over the channels, each state one vector of them (N = 16, Mamba's default, is compiled with N fixed, as is a full
// block's width), so u, delta, dy and the outputs move a cache line at a time and the readout C_t . h_t adds vectors
// instead of reducing within one (an item per channel, with the vector over N, was 2-3x slower). The items run in
// parallel on torch's intra-op threads (at::parallel_for, OpenMP). Nothing of size (b, T, c, N) is ever written: the
// forward keeps the state at the start of every CHUNK-th position, and the backward recomputes one chunk's states
// and decays from that checkpoint into a small buffer, then runs the reverse recurrence over the chunk, as
// mamba_ssm's CUDA kernel does.
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

#include <type_traits>

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
int64_t channel_groups(int64_t b, int64_t blocks) {
    return std::max<int64_t>(1, std::min(blocks, (WORK_ITEMS + b - 1) / b));
}

// Items per thread at least: about at::internal::GRAIN_SIZE state updates each, so that a small scan (a test's, a
// short window's) runs on the calling thread instead of waking every OpenMP thread for microseconds of work, which
// costs more than the work itself where ranks share cores.
int64_t grain(const Shapes& s, int64_t channels_per_item) {
    const int64_t work = std::max<int64_t>(1, s.T * s.N * channels_per_item);
    return std::max<int64_t>(1, (at::internal::GRAIN_SIZE + work - 1) / work);
}

constexpr int64_t LANES = 16;  // channels per forward work item: one vector of float32

// The forward of the work items [begin, end), one item LANES channels of one batch row: the vector loop runs over the
// channels, each of the N states one vector (NS > 0: N known at compile time, the loops over it unrolled; NS = 0 any
// N), so the readout C_t . h_t adds vectors instead of reducing within one, and u, delta and y are read and written
// a cache line at a time.
template <int64_t NS>
void forward_blocks(const Shapes& s, const float* pu, const float* pdelta, const float* pA, const float* pB,
                    const float* pC, const float* pD, float* py, float* pck, int64_t begin, int64_t end) {
    const int64_t N = NS > 0 ? NS : s.N, T = s.T, c = s.c, blocks = (c + LANES - 1) / LANES;
    std::vector<float> h(N * LANES), a(N * LANES);  // [n][lane]
    float d_skip[LANES], du[LANES], y[LANES];
    for (int64_t item = begin; item < end; ++item) {
        const int64_t bi = item / blocks, c0 = (item % blocks) * LANES;
        // The block's width is known at compile time for a full block (the vector loops without remainders).
        auto block = [&](auto full) {
            const int64_t width = decltype(full)::value ? LANES : std::min(LANES, c - c0);
            for (int64_t n = 0; n < N; ++n)
                for (int64_t cc = 0; cc < width; ++cc) a[n * LANES + cc] = pA[(c0 + cc) * N + n];
            for (int64_t cc = 0; cc < width; ++cc) d_skip[cc] = pD[c0 + cc];
            std::fill(h.begin(), h.end(), 0.0f);
            for (int64_t t = 0; t < T; ++t) {
                if (t % CHUNK == 0)
                    for (int64_t cc = 0; cc < width; ++cc)
                        for (int64_t n = 0; n < N; ++n)
                            pck[((bi * c + c0 + cc) * s.chunks + t / CHUNK) * N + n] = h[n * LANES + cc];
                const int64_t row = (bi * T + t) * c + c0;
                const float *ut = pu + row, *dt = pdelta + row;
                const float *bt = pB + (bi * T + t) * N, *ct = pC + (bi * T + t) * N;
#pragma omp simd
                for (int64_t cc = 0; cc < width; ++cc) {
                    du[cc] = dt[cc] * ut[cc];
                    y[cc] = d_skip[cc] * ut[cc];
                }
                for (int64_t n = 0; n < N; ++n) {
                    const float bn = bt[n], cn = ct[n];
                    float* hn = &h[n * LANES];
                    const float* an = &a[n * LANES];
#pragma omp simd
                    for (int64_t cc = 0; cc < width; ++cc) {
                        hn[cc] = exp_fast(dt[cc] * an[cc]) * hn[cc] + du[cc] * bn;
                        y[cc] += cn * hn[cc];
                    }
                }
                std::copy(y, y + width, py + row);
            }
        };
        if (c - c0 >= LANES)
            block(std::true_type{});
        else
            block(std::false_type{});
    }
}

struct Grads {
    float *du, *ddelta, *dA, *dD, *dB, *dC;  // dA (b, c, N), dD (b, c), dB and dC (b, groups, T, N): summed later
};

// out[n] += sum over lanes of rows[n][0, LANES), for N = LANES = 16 rows: the 16 horizontal sums of a block done
// as one transposing fold (45 vector operations, where 16 separate reductions take about 130). gcc's vector
// extensions (any target: AVX-512 makes each shuffle one instruction); other compilers reduce row by row.
inline void add_row_sums(const float* rows, float* out) {
#if defined(__GNUC__) && !defined(__clang__)
    typedef float v16 __attribute__((vector_size(64)));
    typedef int i16 __attribute__((vector_size(64)));
    v16 v[16];
    std::memcpy(v, rows, sizeof(v));
    const i16 halves_lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16 halves_hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i16 quarters_lo = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const i16 quarters_hi = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const i16 pairs_lo = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const i16 pairs_hi = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const i16 singles_lo = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const i16 singles_hi = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    for (int i = 0; i < 8; ++i)  // v[i]: row i's 8 partial sums, then row i + 8's
        v[i] = __builtin_shuffle(v[i], v[i + 8], halves_lo) + __builtin_shuffle(v[i], v[i + 8], halves_hi);
    for (int i = 0; i < 4; ++i)  // v[i]: 4 partial sums each of rows i, i + 4, i + 8, i + 12
        v[i] = __builtin_shuffle(v[i], v[i + 4], quarters_lo) + __builtin_shuffle(v[i], v[i + 4], quarters_hi);
    for (int i = 0; i < 2; ++i)  // v[i]: 2 partial sums each of rows i, i + 2, ..., i + 14
        v[i] = __builtin_shuffle(v[i], v[i + 2], pairs_lo) + __builtin_shuffle(v[i], v[i + 2], pairs_hi);
    const v16 sums = __builtin_shuffle(v[0], v[1], singles_lo) + __builtin_shuffle(v[0], v[1], singles_hi);
    float sum[16];
    std::memcpy(sum, &sums, sizeof(sum));
    for (int n = 0; n < 16; ++n) out[n] += sum[n];
#else
    for (int n = 0; n < 16; ++n) {
        float sum = 0.0f;
        for (int lane = 0; lane < 16; ++lane) sum += rows[n * 16 + lane];
        out[n] += sum;
    }
#endif
}

// The backward of the work items [begin, end), one item a group of channel blocks (LANES channels each) of one batch
// row, vectorised over the channels as the forward is; NS as there. dB_t and dC_t sum over the block's channels
// (add_row_sums), added into the group's rows in a fixed order.
template <int64_t NS>
void backward_blocks(const Shapes& s, int64_t groups, const float* pu, const float* pdelta, const float* pA,
                     const float* pB, const float* pC, const float* pD, const float* pck, const float* pdy,
                     const Grads& out, int64_t begin, int64_t end) {
    const int64_t N = NS > 0 ? NS : s.N, T = s.T, c = s.c, blocks = (c + LANES - 1) / LANES;
    const int64_t per_group = (blocks + groups - 1) / groups, NL = N * LANES;
    // states[i] = h entering position t0 + i of the chunk (states[0] the checkpoint), decays[i] its decays: [n][lane]
    std::vector<float> a(NL), states((CHUNK + 1) * NL), decays(CHUNK * NL), g_next(NL), dA(NL);
    std::vector<float> terms_b(NL), terms_c(NL);  // [n][lane]: the channels' terms of dB_t and dC_t
    float d_skip[LANES], dD[LANES], gB[LANES], sA[LANES];
    for (int64_t item = begin; item < end; ++item) {
        const int64_t bi = item / groups, group = item % groups;
        float *dB_row = out.dB + item * T * N, *dC_row = out.dC + item * T * N;
        for (int64_t blk = group * per_group; blk < std::min(blocks, (group + 1) * per_group); ++blk) {
            const int64_t c0 = blk * LANES;
            auto block = [&](auto full) {  // as in forward_blocks
                const int64_t width = decltype(full)::value ? LANES : std::min(LANES, c - c0);
                for (int64_t n = 0; n < N; ++n)
                    for (int64_t cc = 0; cc < width; ++cc) a[n * LANES + cc] = pA[(c0 + cc) * N + n];
                for (int64_t cc = 0; cc < width; ++cc) d_skip[cc] = pD[c0 + cc];
                std::fill(dA.begin(), dA.end(), 0.0f);
                std::fill(g_next.begin(), g_next.end(), 0.0f);
                std::fill(dD, dD + LANES, 0.0f);
                for (int64_t chunk = s.chunks - 1; chunk >= 0; --chunk) {
                    const int64_t t0 = chunk * CHUNK, len = std::min(CHUNK, T - t0);
                    for (int64_t cc = 0; cc < width; ++cc)
                        for (int64_t n = 0; n < N; ++n)
                            states[n * LANES + cc] = pck[((bi * c + c0 + cc) * s.chunks + chunk) * N + n];
                    for (int64_t i = 0; i < len; ++i) {  // the chunk's states again, from its checkpoint
                        const int64_t row = (bi * T + t0 + i) * c + c0;
                        const float *ut = pu + row, *dt = pdelta + row, *bt = pB + (bi * T + t0 + i) * N;
                        const float* h_prev = &states[i * NL];
                        float *h = &states[(i + 1) * NL], *dec = &decays[i * NL];
                        for (int64_t n = 0; n < N; ++n) {
                            const float bn = bt[n];
                            const int64_t at = n * LANES;
#pragma omp simd
                            for (int64_t cc = 0; cc < width; ++cc) {
                                dec[at + cc] = exp_fast(dt[cc] * a[at + cc]);
                                h[at + cc] = dec[at + cc] * h_prev[at + cc] + dt[cc] * ut[cc] * bn;
                            }
                        }
                    }
                    for (int64_t i = len - 1; i >= 0; --i) {  // the reverse recurrence over the chunk
                        const int64_t t = t0 + i, row = (bi * T + t) * c + c0;
                        const float *ut = pu + row, *dt = pdelta + row, *dyt = pdy + row;
                        const float *bt = pB + (bi * T + t) * N, *ct = pC + (bi * T + t) * N;
                        const float *h_prev = &states[i * NL], *h = &states[(i + 1) * NL], *dec = &decays[i * NL];
                        float *dBt = dB_row + t * N, *dCt = dC_row + t * N;
                        std::fill(gB, gB + LANES, 0.0f);
                        std::fill(sA, sA + LANES, 0.0f);
                        for (int64_t n = 0; n < N; ++n) {
                            const float bn = bt[n], cn = ct[n];
                            const int64_t at = n * LANES;
#pragma omp simd
                            for (int64_t cc = 0; cc < width; ++cc) {
                                const float g = dyt[cc] * cn + g_next[at + cc];
                                const float sn = g * dec[at + cc] * h_prev[at + cc];
                                terms_c[at + cc] = dyt[cc] * h[at + cc];
                                terms_b[at + cc] = dt[cc] * ut[cc] * g;
                                dA[at + cc] += dt[cc] * sn;
                                gB[cc] += g * bn;
                                sA[cc] += sn * a[at + cc];
                                g_next[at + cc] = g * dec[at + cc];
                            }
                        }
                        if (NS == LANES && decltype(full)::value) {  // dB_t and dC_t: sums over the block's channels
                            add_row_sums(terms_c.data(), dCt);
                            add_row_sums(terms_b.data(), dBt);
                        } else {
                            for (int64_t n = 0; n < N; ++n)
                                for (int64_t cc = 0; cc < width; ++cc) {
                                    dCt[n] += terms_c[n * LANES + cc];
                                    dBt[n] += terms_b[n * LANES + cc];
                                }
                        }
#pragma omp simd
                        for (int64_t cc = 0; cc < width; ++cc) {
                            out.du[row + cc] = dt[cc] * gB[cc] + d_skip[cc] * dyt[cc];
                            out.ddelta[row + cc] = ut[cc] * gB[cc] + sA[cc];
                            dD[cc] += dyt[cc] * ut[cc];
                        }
                    }
                }
                for (int64_t cc = 0; cc < width; ++cc) {
                    for (int64_t n = 0; n < N; ++n) out.dA[(bi * c + c0 + cc) * N + n] = dA[n * LANES + cc];
                    out.dD[bi * c + c0 + cc] = dD[cc];
                }
            };
            if (c - c0 >= LANES)
                block(std::true_type{});
            else
                block(std::false_type{});
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
    at::parallel_for(0, s.b * ((s.c + LANES - 1) / LANES), grain(s, LANES), [&](int64_t begin, int64_t end) {
        if (s.N == 16)
            forward_blocks<16>(s, pu, pdelta, pA, pB, pC, pD, py, pck, begin, end);
        else
            forward_blocks<0>(s, pu, pdelta, pA, pB, pC, pD, py, pck, begin, end);
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
    const int64_t groups = channel_groups(s.b, (s.c + LANES - 1) / LANES);
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
            backward_blocks<16>(s, groups, pu, pdelta, pA, pB, pC, pD, pck, pdy, out, begin, end);
        else
            backward_blocks<0>(s, groups, pu, pdelta, pA, pB, pC, pD, pck, pdy, out, begin, end);
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
