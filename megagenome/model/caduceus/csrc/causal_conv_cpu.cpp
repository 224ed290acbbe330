// The depthwise causal convolution + SiLU of a Mamba direction on CPU, fused (scan_cpu.py builds and calls it).
//
// Of u (b, T, c) (float32, bfloat16, float16 or float64, contiguous), w (c, k) and bias (c) in the arithmetic's
// type (float32; float64 for float64 u), per channel:
//
//     p_t = bias + sum_j w_j v_{t-k+1+j}      x_t = silu(p_t) = p_t sigmoid(p_t)      (v before position 0 is 0)
//
// with v = u, or v = u read backwards (v_t = u_{T-1-t}) where reverse is set: the reverse direction's conv of the
// flipped sequence, x in the flipped order the reverse scan reads, without the flipped copy of u. x is in u's dtype,
// p is kept in float32 and never stored: the backward recomputes it (k multiply-adds per element).
//
// Backward, with g_t = dx_t sigmoid(p_t) (1 + p_t (1 - sigmoid(p_t))) (silu's derivative):
//
//     dv_s = sum_j w_j g_{s+k-1-j} (the positions s + k - 1 - j < T)      dw_j = sum_{b,t} g_t v_{t-k+1+j}
//     db = sum_{b,t} g_t
//
// A work item is WIDTH channels (one 64-byte cache line of float32 per position, the vector loop) of one batch row
// in the forward, of every batch row in the backward, which so sums dw and db over the batch in a fixed order: the
// gradients are the same bits at any thread count. The layout is the mixer's own (b, T, c): torch's conv1d wants
// (b, c, T), and the transposes, the padded copy and the separate SiLU cost more than the convolution (the profile in
// benchmarks/results/selective_scan_cpu.md).

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include "mamba_cpu.h"

namespace {

constexpr int64_t WIDTH = 16;  // channels per work item

struct Conv {
    int64_t b, T, c, k;
    bool reverse;
    int64_t blocks() const { return (c + WIDTH - 1) / WIDTH; }
    int64_t row(int64_t bi, int64_t t) const { return (bi * T + (reverse ? T - 1 - t : t)) * c; }  // v_t of row bi
};

inline float exp_of(float x) { return exp_fast(x); }
inline double exp_of(double x) { return std::exp(x); }

// Conversions to and from the arithmetic's type. bfloat16's are written out in integer operations the compiler
// vectorises (c10::BFloat16's own, called per element, are not: they made the bfloat16 kernel 2x slower than the
// float32 one): the upper 16 bits of the float, rounded to nearest even, NaN kept NaN.
template <typename scalar_t>
inline at::opmath_type<scalar_t> load(scalar_t v) {
    return static_cast<at::opmath_type<scalar_t>>(v);
}
template <>
inline float load(c10::BFloat16 v) {
    const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}
// dst[0, n) = src in dst's type.
template <typename scalar_t>
inline void store(const at::opmath_type<scalar_t>* src, scalar_t* dst, int64_t n) {
#pragma omp simd
    for (int64_t cc = 0; cc < n; ++cc) dst[cc] = static_cast<scalar_t>(src[cc]);
}
template <>
inline void store(const float* src, c10::BFloat16* dst, int64_t n) {
    uint16_t* out = reinterpret_cast<uint16_t*>(dst);  // c10::BFloat16 is its 16 bits
#pragma omp simd
    for (int64_t cc = 0; cc < n; ++cc) {
        uint32_t bits;
        std::memcpy(&bits, src + cc, sizeof(bits));
        const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        out[cc] = static_cast<uint16_t>(src[cc] != src[cc] ? 0x7FC0u : rounded);
    }
}

// The block's taps transposed to (k, WIDTH), so that the vector loop over channels reads them contiguously.
template <typename acc_t>
void taps(const Conv& s, const acc_t* w, int64_t c0, int64_t n, acc_t* wt) {
    for (int64_t j = 0; j < s.k; ++j)
        for (int64_t cc = 0; cc < n; ++cc) wt[j * WIDTH + cc] = w[(c0 + cc) * s.k + j];
}

// p (WIDTH) at output position t of batch row bi for the channels [c0, c0 + n).
template <typename scalar_t, typename acc_t>
inline void preactivation(const Conv& s, const scalar_t* u, const acc_t* wt, const acc_t* bias, int64_t bi,
                          int64_t t, int64_t c0, int64_t n, acc_t* p) {
    for (int64_t cc = 0; cc < n; ++cc) p[cc] = bias[c0 + cc];
    for (int64_t j = std::max<int64_t>(0, s.k - 1 - t); j < s.k; ++j) {
        const scalar_t* v = u + s.row(bi, t - s.k + 1 + j) + c0;
        const acc_t* wj = wt + j * WIDTH;
#pragma omp simd
        for (int64_t cc = 0; cc < n; ++cc) p[cc] += wj[cc] * load(v[cc]);
    }
}

template <typename scalar_t>
void forward_items(const Conv& s, const scalar_t* u, const at::opmath_type<scalar_t>* w,
                   const at::opmath_type<scalar_t>* bias, scalar_t* x, int64_t begin, int64_t end) {
    using acc_t = at::opmath_type<scalar_t>;
    std::vector<acc_t> wt(s.k * WIDTH);
    acc_t p[WIDTH];
    for (int64_t item = begin; item < end; ++item) {
        const int64_t bi = item / s.blocks(), c0 = (item % s.blocks()) * WIDTH, n = std::min(WIDTH, s.c - c0);
        taps(s, w, c0, n, wt.data());
        for (int64_t t = 0; t < s.T; ++t) {
            preactivation(s, u, wt.data(), bias, bi, t, c0, n, p);
#pragma omp simd
            for (int64_t cc = 0; cc < n; ++cc) p[cc] = p[cc] / (acc_t(1) + exp_of(-p[cc]));
            store(p, x + (bi * s.T + t) * s.c + c0, n);
        }
    }
}

template <typename scalar_t>
void backward_items(const Conv& s, const scalar_t* u, const at::opmath_type<scalar_t>* w,
                    const at::opmath_type<scalar_t>* bias, const scalar_t* dx, scalar_t* du,
                    at::opmath_type<scalar_t>* dw, at::opmath_type<scalar_t>* db, int64_t begin, int64_t end) {
    using acc_t = at::opmath_type<scalar_t>;
    std::vector<acc_t> wt(s.k * WIDTH), g(s.T * WIDTH), dw_block(s.k * WIDTH);
    acc_t p[WIDTH], db_block[WIDTH], dv[WIDTH];
    for (int64_t block = begin; block < end; ++block) {
        const int64_t c0 = block * WIDTH, n = std::min(WIDTH, s.c - c0);
        taps(s, w, c0, n, wt.data());
        std::fill(dw_block.begin(), dw_block.end(), acc_t(0));
        std::fill(db_block, db_block + WIDTH, acc_t(0));
        for (int64_t bi = 0; bi < s.b; ++bi) {
            for (int64_t t = 0; t < s.T; ++t) {  // g_t, and the sums dw and db
                preactivation(s, u, wt.data(), bias, bi, t, c0, n, p);
                const scalar_t* dxt = dx + (bi * s.T + t) * s.c + c0;
                acc_t* gt = g.data() + t * WIDTH;
#pragma omp simd
                for (int64_t cc = 0; cc < n; ++cc) {
                    const acc_t sig = acc_t(1) / (acc_t(1) + exp_of(-p[cc]));
                    gt[cc] = load(dxt[cc]) * sig * (acc_t(1) + p[cc] * (acc_t(1) - sig));
                    db_block[cc] += gt[cc];
                }
                for (int64_t j = std::max<int64_t>(0, s.k - 1 - t); j < s.k; ++j) {
                    const scalar_t* v = u + s.row(bi, t - s.k + 1 + j) + c0;
                    acc_t* dwj = dw_block.data() + j * WIDTH;
#pragma omp simd
                    for (int64_t cc = 0; cc < n; ++cc) dwj[cc] += gt[cc] * load(v[cc]);
                }
            }
            for (int64_t pos = 0; pos < s.T; ++pos) {  // dv_pos, written where v_pos was read from
                std::fill(dv, dv + WIDTH, acc_t(0));
                for (int64_t j = 0; j < s.k; ++j) {
                    const int64_t t = pos + s.k - 1 - j;
                    if (t >= s.T) continue;
                    const acc_t *gt = g.data() + t * WIDTH, *wj = wt.data() + j * WIDTH;
#pragma omp simd
                    for (int64_t cc = 0; cc < n; ++cc) dv[cc] += wj[cc] * gt[cc];
                }
                store(dv, du + s.row(bi, pos) + c0, n);
            }
        }
        for (int64_t cc = 0; cc < n; ++cc) {
            db[c0 + cc] = db_block[cc];
            for (int64_t j = 0; j < s.k; ++j) dw[(c0 + cc) * s.k + j] = dw_block[j * WIDTH + cc];
        }
    }
}

// The shapes and dtypes the kernel indexes by, each checked (a mismatch would read out of bounds, not fail).
Conv checked(const torch::Tensor& u, const torch::Tensor& w, const torch::Tensor& bias, bool reverse) {
    TORCH_CHECK(u.dim() == 3 && u.is_contiguous() && u.device().is_cpu(), "causal_conv_cpu: u must be (b, T, c), "
                "contiguous on CPU");
    const auto acc = u.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    for (const auto* x : {&w, &bias})
        TORCH_CHECK(x->scalar_type() == acc && x->is_contiguous(), "causal_conv_cpu: w and bias must be contiguous ",
                    acc, " for ", u.scalar_type(), " u");
    TORCH_CHECK(w.dim() == 2 && w.size(0) == u.size(2), "causal_conv_cpu: w must be (channels, k)");
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == u.size(2), "causal_conv_cpu: bias must be (channels,)");
    return {u.size(0), u.size(1), u.size(2), w.size(1), reverse};
}

// Items per thread at least: about at::internal::GRAIN_SIZE multiply-adds each (small convolutions stay on the
// calling thread).
int64_t grain(const Conv& s, int64_t rows) {
    const int64_t work = std::max<int64_t>(1, rows * s.T * s.k * WIDTH);
    return std::max<int64_t>(1, (at::internal::GRAIN_SIZE + work - 1) / work);
}

}  // namespace

torch::Tensor conv_silu_forward(torch::Tensor u, torch::Tensor w, torch::Tensor bias, bool reverse) {
    const Conv s = checked(u, w, bias, reverse);
    auto x = torch::empty_like(u);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, u.scalar_type(), "conv_silu_forward", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* pu = u.data_ptr<scalar_t>();
        const acc_t *pw = w.data_ptr<acc_t>(), *pb = bias.data_ptr<acc_t>();
        scalar_t* px = x.data_ptr<scalar_t>();
        at::parallel_for(0, s.b * s.blocks(), grain(s, 1), [&](int64_t begin, int64_t end) {
            forward_items<scalar_t>(s, pu, pw, pb, px, begin, end);
        });
    });
    return x;
}

std::vector<torch::Tensor> conv_silu_backward(torch::Tensor u, torch::Tensor w, torch::Tensor bias, torch::Tensor dx,
                                              bool reverse) {
    const Conv s = checked(u, w, bias, reverse);
    TORCH_CHECK(dx.sizes() == u.sizes() && dx.scalar_type() == u.scalar_type() && dx.is_contiguous(),
                "causal_conv_cpu: dx must be contiguous, of u's shape and dtype");
    auto du = torch::empty_like(u), dw = torch::empty_like(w), db = torch::empty_like(bias);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, u.scalar_type(), "conv_silu_backward", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t *pu = u.data_ptr<scalar_t>(), *pdx = dx.data_ptr<scalar_t>();
        const acc_t *pw = w.data_ptr<acc_t>(), *pb = bias.data_ptr<acc_t>();
        scalar_t* pdu = du.data_ptr<scalar_t>();
        acc_t *pdw = dw.data_ptr<acc_t>(), *pdb = db.data_ptr<acc_t>();
        at::parallel_for(0, s.blocks(), grain(s, s.b), [&](int64_t begin, int64_t end) {
            backward_items<scalar_t>(s, pu, pw, pb, pdx, pdu, pdw, pdb, begin, end);
        });
    });
    return {du, dw, db};
}
