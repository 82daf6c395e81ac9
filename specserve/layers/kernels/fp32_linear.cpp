// fp32 linear layers with few outputs (MoE routers, Gated DeltaNet's per-head gates): out = x W^T (+ b).
// oneDNN's packed call, the other fp32 linears' kernel (layers/linear.py), costs 70-190 us at M = 1 for
// such shapes, where reading the weight takes 10-40 us: this reads it once a call at memory speed.
//
// Batch invariance: each output element is one dot product with one L-lane accumulator over K in order
// (the last partial vector from zero-padded copies), its lanes then added in order, whatever M, the
// element's row or the thread split: threads split output columns, never K.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

using namespace specserve_vec;

constexpr int kCols = 4;  // output columns (weight rows) of a unit
// Input rows R taken together within a unit, kCols x R independent accumulators: 4 on AVX-512 (32
// registers), 2 on AVX2 (16). Each element's arithmetic is the same whatever R.

// out[r][c] = x_r . w_c for R rows at x (row stride k) and kCols weight rows at w (row stride k), for
// `rows` <= R and `cols` <= kCols; the last, partial vector of every row from zero-padded copies.
template <int L, int R>
SPECSERVE_INLINE void dots(const float* x, int64_t rows, const float* w, int64_t cols, int64_t k,
                           const float* bias, float* out, int64_t out_stride) {
  const int64_t full = k / L * L, tail = k - full;
  float x_last[R][L] = {}, w_last[kCols][L] = {};
  for (int64_t r = 0; r < rows && tail; ++r) std::memcpy(x_last[r], x + r * k + full, 4 * tail);
  for (int64_t c = 0; c < cols && tail; ++c) std::memcpy(w_last[c], w + c * k + full, 4 * tail);
  Vec<L> acc[R][kCols] = {};
  for (int64_t i = 0; i < full; i += L) {
    Vec<L> wv[kCols];
    for (int c = 0; c < kCols; ++c) wv[c] = c < cols ? load<L>(w + c * k + i) : Vec<L>{};
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      const Vec<L> xv = load<L>(x + r * k + i);
      for (int c = 0; c < kCols; ++c) acc[r][c] = fma(xv, wv[c], acc[r][c]);
    }
  }
  if (tail)
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < kCols; ++c) acc[r][c] = fma(load<L>(x_last[r]), load<L>(w_last[c]), acc[r][c]);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float sum = 0.f;
      for (int j = 0; j < L; ++j) sum += acc[r][c][j];
      out[r * out_stride + c] = bias ? sum + bias[c] : sum;
    }
}

// All m rows against weight rows [c0, c0 + cols), R rows at a time.
template <int L, int R>
SPECSERVE_INLINE void columns(const float* x, int64_t m, const float* w, int64_t c0, int64_t cols, int64_t k,
                              const float* bias, float* out, int64_t n) {
  for (int64_t r = 0; r < m; r += R)
    dots<L, R>(x + r * k, std::min<int64_t>(R, m - r), w + c0 * k, cols, k, bias ? bias + c0 : nullptr,
            out + r * n + c0, n);
}

__attribute__((target("avx512f"), flatten)) void columns_avx512(const float* x, int64_t m, const float* w,
                                                                 int64_t c0, int64_t cols, int64_t k,
                                                                 const float* b, float* out, int64_t n) {
  columns<16, 4>(x, m, w, c0, cols, k, b, out, n);
}

__attribute__((target("avx2,fma"), flatten)) void columns_avx2(const float* x, int64_t m, const float* w,
                                                                int64_t c0, int64_t cols, int64_t k,
                                                                const float* b, float* out, int64_t n) {
  columns<8, 2>(x, m, w, c0, cols, k, b, out, n);
}

// x [M, K], weight [N, K], bias [N] or none, all contiguous fp32 -> [M, N]. isa: -1 the best here, 1 AVX2,
// 2 AVX-512 (the two sum in different lanes: each is batch invariant, they are not bitwise equal).
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       int64_t isa) {
  const auto fp32 = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu();
  };
  TORCH_CHECK(fp32(x) && x.dim() == 2, "x: contiguous fp32 [M, K] on the CPU");
  TORCH_CHECK(fp32(weight) && weight.dim() == 2 && weight.size(1) == x.size(1),
              "weight: contiguous fp32 [N, K] on the CPU, K = x's");
  const int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  if (bias) TORCH_CHECK(fp32(*bias) && bias->dim() == 1 && bias->size(0) == n, "bias: contiguous fp32 [N]");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const bool avx512 = has_avx512();
  TORCH_CHECK(isa == -1 || isa == 1 || (isa == 2 && avx512), "fp32_linear: path ", isa,
              " is not supported by this CPU");
  const auto run = (isa == -1 ? avx512 : isa == 2) ? columns_avx512 : columns_avx2;
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t units = (n + kCols - 1) / kCols;
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / (kCols * k));  // ~128 KiB of weights a task
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t c0 = u * kCols;
      run(xp, m, wp, c0, std::min<int64_t>(kCols, n - c0), k, bp, op, n);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("fp32_linear(Tensor x, Tensor weight, Tensor? bias=None, int isa=-1) -> Tensor", &fp32_linear);
}
