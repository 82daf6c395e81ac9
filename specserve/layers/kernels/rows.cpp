// The row-wise steps between the linear layers, in fp32: RMSNorm (after the residual add), rotary
// position embedding applied in place with the write of K and V into the paged cache, the gated
// activation of the MLP, and Gated DeltaNet's steps from its conv to its delta rule (activation, L2 norms,
// gates). At decode sizes each is a few microseconds of arithmetic that torch spreads over
// 5-10 operators of ~2 us each; a layer runs five of them.
//
// Batch invariance: every row is computed on its own, with the same instructions whatever the number of
// rows; threads split rows, never a row. A row's last partial vector is copied into a zero-padded one and
// takes the vector code too. The rotary arithmetic is torch's (rotary.py: x * cos + roll(x) * sin, no fused
// multiply-add), so its results are bitwise those of the fallback; RMSNorm and the L2 norms sum in another
// order and the activations use their own exp, within a few ulp of torch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

using namespace specserve_vec;

// Rows per thread before a call splits its rows over threads (decode and verification run inline).
constexpr int64_t kGrainElements = 1 << 15;

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / row_elements); }

// Row i of a 2-D or 3-D tensor (unit stride in the last dimension).
struct Rows {
  float* data;
  int64_t count, inner, stride0, stride1;  // rows = count; row i = (i / inner, i % inner)

  explicit Rows(const at::Tensor& t)
      : data(t.data_ptr<float>()),
        count(t.numel() / t.size(-1)),
        inner(t.dim() == 3 ? t.size(1) : 1),
        stride0(t.stride(0)),
        stride1(t.dim() == 3 ? t.stride(1) : 0) {}

  float* row(int64_t i) const { return data + i / inner * stride0 + i % inner * stride1; }
};

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && (t.dim() == 2 || t.dim() == 3) && t.stride(-1) == 1,
              name, ": fp32 [rows, dim] or [rows, heads, dim], unit stride in dim");
}

// ------------------------------------------------------------------------------------------ RMSNorm

// Vector i of h = x (+ delta): the last, partial one from the zero-padded copies.
template <int L>
SPECSERVE_INLINE Vec<L> residual_sum(const float* x, const float* delta, const float (&last)[3][L], int64_t i,
                                     int64_t full) {
  const Vec<L> h = i < full ? load<L>(x + i) : load<L>(last[0]);
  return delta ? h + (i < full ? load<L>(delta + i) : load<L>(last[1])) : h;
}

// out = h / sqrt(mean(h^2) + eps) * scale, h = x (+ delta, also stored to `sum`); scale = weight + offset,
// or 1 without a weight. Four L-lane partial sums of squares, added lane by lane in order. (No lambdas in
// vector code: a lambda is a function of its own, without its caller's target attribute.)
template <int L>
SPECSERVE_INLINE void rms_norm_row(const float* x, const float* delta, float* sum, const float* weight,
                                   float offset, float eps, int64_t dim, float* out) {
  const int64_t full = dim / L * L, tail = dim - full;
  float last[3][L] = {};  // x, delta and weight of the partial vector, zero-padded
  if (tail) {
    std::memcpy(last[0], x + full, 4 * tail);
    if (delta) std::memcpy(last[1], delta + full, 4 * tail);
    if (weight) std::memcpy(last[2], weight + full, 4 * tail);
  }
  Vec<L> squares[4] = {};
  int64_t i = 0;
  for (; i + 4 * L <= dim; i += 4 * L)
    for (int c = 0; c < 4; ++c) {
      const Vec<L> h = residual_sum<L>(x, delta, last, i + c * L, full);
      squares[c] += h * h;
    }
  for (int c = 0; i < dim; i += L, ++c) {
    const Vec<L> h = residual_sum<L>(x, delta, last, i, full);
    squares[c] += h * h;
  }
  const Vec<L> total = (squares[0] + squares[1]) + (squares[2] + squares[3]);
  float sum_of_squares = 0.f;
  for (int j = 0; j < L; ++j) sum_of_squares += total[j];
  const Vec<L> inverse = splat<L>(1.f / std::sqrt(sum_of_squares / static_cast<float>(dim) + eps));
  for (i = 0; i < dim; i += L) {
    const Vec<L> h = residual_sum<L>(x, delta, last, i, full);
    Vec<L> y = h * inverse;
    if (weight) y = y * ((i < full ? load<L>(weight + i) : load<L>(last[2])) + splat<L>(offset));
    if (i < full) {  // a memcpy of a constant size is a store; of a variable one, a call
      std::memcpy(out + i, &y, sizeof y);
      if (sum) std::memcpy(sum + i, &h, sizeof h);
    } else {
      std::memcpy(out + i, &y, 4 * tail);
      if (sum) std::memcpy(sum + i, &h, 4 * tail);
    }
  }
}

// The vector code is compiled per ISA in these per-row functions: a lambda handed to at::parallel_for is
// a function of its own, which would not inherit a target attribute.
__attribute__((target("avx512f"))) void rms_norm_row_avx512(const float* x, const float* d, float* s,
                                                            const float* w, float o, float e, int64_t n,
                                                            float* out) {
  rms_norm_row<16>(x, d, s, w, o, e, n, out);
}

__attribute__((target("avx2,fma"))) void rms_norm_row_avx2(const float* x, const float* d, float* s,
                                                          const float* w, float o, float e, int64_t n,
                                                          float* out) {
  rms_norm_row<8>(x, d, s, w, o, e, n, out);
}

// x [rows, dim] or [rows, heads, dim] -> out, contiguous, the same shape; with `residual` (contiguous,
// x's shape), x + residual is normalised and also returned in `sum`: the layer's residual add.
void rms_norm_into(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps, double offset,
                   const at::Tensor* residual, at::Tensor* sum, at::Tensor& out) {
  check_rows(x, "x");
  const int64_t dim = x.size(-1);
  if (weight)
    TORCH_CHECK(weight->scalar_type() == at::kFloat && weight->dim() == 1 && weight->size(0) == dim &&
                    weight->is_contiguous(),
                "weight: contiguous fp32 [dim]");
  if (residual)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat &&
                    residual->is_contiguous(),
                "residual: contiguous fp32, x's shape");
  static const auto row_norm = has_avx512() ? rms_norm_row_avx512 : rms_norm_row_avx2;
  const Rows rows(x);
  const float* w = weight ? weight->data_ptr<float>() : nullptr;
  const float* d = residual ? residual->data_ptr<float>() : nullptr;
  float* s = sum ? sum->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const float off = static_cast<float>(offset), e = static_cast<float>(eps);
  at::parallel_for(0, rows.count, grain(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      row_norm(rows.row(r), d ? d + r * dim : nullptr, s ? s + r * dim : nullptr, w, off, e, dim, o + r * dim);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps, double offset) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm_into(x, weight, eps, offset, nullptr, nullptr, out);
  return out;
}

// (x + residual, rms_norm(x + residual))
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const c10::optional<at::Tensor>& weight, double eps,
                                                double offset) {
  at::Tensor sum = at::empty(x.sizes(), x.options()), out = at::empty(x.sizes(), x.options());
  rms_norm_into(x, weight, eps, offset, &residual, &sum, out);
  return {sum, out};
}

// ------------------------------------------------------------------------------- rotary + KV cache

// One head in place: the first `rot` channels rotate in halves (y_i = x_i cos_i + x_{i +- rot/2} sin_i,
// sin with its first half negated: rotary.py's table), the rest pass through.
template <int L>
SPECSERVE_INLINE void rotate_head(float* x, const float* cos, const float* sin, int64_t rot) {
  const int64_t half = rot / 2;
  if (half % L) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cos[i] + b * sin[i];
      x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
    return;
  }
  for (int64_t i = 0; i < half; i += L) {
    const Vec<L> a = load<L>(x + i), b = load<L>(x + i + half);
    const Vec<L> y0 = a * load<L>(cos + i) + b * load<L>(sin + i);
    const Vec<L> y1 = b * load<L>(cos + i + half) + a * load<L>(sin + i + half);
    std::memcpy(x + i, &y0, sizeof y0);
    std::memcpy(x + i + half, &y1, sizeof y1);
  }
}

struct Rotary {
  Rows q, k, v;
  int64_t heads_q, heads_k, dim, value_dim, rot;
  const float *cos, *sin;  // [N, rot]
  float *k_cache, *v_cache;
  const int64_t* slots;
};

// Row n: its query and key heads rotated, then v and k written to the caches.
template <int L>
SPECSERVE_INLINE void rotate_and_cache_row(const Rotary& a, int64_t n) {
  const float *c = a.cos + n * a.rot, *s = a.sin + n * a.rot;
  for (int64_t h = 0; h < a.heads_q; ++h) rotate_head<L>(a.q.row(n * a.heads_q + h), c, s, a.rot);
  for (int64_t h = 0; h < a.heads_k; ++h) {  // v first: it may be k itself, unrotated (Gemma 4)
    std::memcpy(a.v_cache + (a.slots[n] * a.heads_k + h) * a.value_dim, a.v.row(n * a.heads_k + h),
                4 * a.value_dim);
    float* k = a.k.row(n * a.heads_k + h);
    rotate_head<L>(k, c, s, a.rot);
    std::memcpy(a.k_cache + (a.slots[n] * a.heads_k + h) * a.dim, k, 4 * a.dim);
  }
}

__attribute__((target("avx512f"))) void rotate_and_cache_row_avx512(const Rotary& a, int64_t n) {
  rotate_and_cache_row<16>(a, n);
}

__attribute__((target("avx2,fma"))) void rotate_and_cache_row_avx2(const Rotary& a, int64_t n) {
  rotate_and_cache_row<8>(a, n);
}

// q [N, heads, dim] and k [N, kv_heads, dim] rotated in place (cos, sin [N, rot]); k and v [N, kv_heads,
// value_dim] then written to the caches [blocks, block_size, kv_heads, dim] at the flat slots [N].
void rotate_and_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& slots) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    check_rows(*t, name);
    TORCH_CHECK(t->dim() == 3 && t->size(0) == q.size(0), name, ": [N, heads, dim]");
  }
  const int64_t n = q.size(0), dim = q.size(2), rot = cos.size(-1);
  TORCH_CHECK(k.size(2) == dim && v.size(1) == k.size(1), "q, k, v: q and k of one head dim, k and v heads");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == n && rot % 2 == 0 &&
                  rot <= dim && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos, sin: contiguous fp32 [N, rot], rot even and <= head dim");
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->dim() == 4 && c->is_contiguous() &&
                    c->size(2) == k.size(1) && c->size(0) == k_cache.size(0) && c->size(1) == k_cache.size(1),
                "caches: contiguous fp32 [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(k_cache.size(3) == dim && v_cache.size(3) == v.size(2), "caches: k's and v's head dims");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n,
              "slots: contiguous int64 [N]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "slot ", slot[i], " is not in the cache");
  const Rotary a{Rows(q), Rows(k), Rows(v), q.size(1), k.size(1), dim, v.size(2), rot,
                 cos.data_ptr<float>(), sin.data_ptr<float>(), k_cache.data_ptr<float>(),
                 v_cache.data_ptr<float>(), slot};
  static const auto row = has_avx512() ? rotate_and_cache_row_avx512 : rotate_and_cache_row_avx2;
  at::parallel_for(0, n, grain((a.heads_q + a.heads_k) * dim), [&](int64_t n0, int64_t n1) {
    for (int64_t i = n0; i < n1; ++i) row(a, i);
  });
}

// ------------------------------------------------------------------------------ gated activations

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// x * sigmoid(z) through exp of a non-positive argument (no overflow, no cancellation): x / (1 + e^-z),
// or x e^z / (1 + e^z) for z < 0. silu(x) = x sigmoid(x); gelu's tanh form 0.5 x (1 + tanh(u)) is
// x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3).
template <int L, int64_t kAct>
SPECSERVE_INLINE Vec<L> activate(Vec<L> x) {
  const Vec<L> zero{};
  const Vec<L> z = kAct == kSilu ? x : splat<L>(1.5957691216f) * (x + splat<L>(0.044715f) * x * x * x);
  const Vec<L> e = exp_nonpositive<L>(z < zero ? z : -z);
  return (z < zero ? x * e : x) / (splat<L>(1.f) + e);
}

template <int L, int64_t kAct>
SPECSERVE_INLINE void gated_row(const float* g, const float* u, int64_t dim, float* o) {
  const int64_t full = dim / L * L;
  for (int64_t i = 0; i < full; i += L) {
    const Vec<L> y = activate<L, kAct>(load<L>(g + i)) * load<L>(u + i);
    std::memcpy(o + i, &y, sizeof y);
  }
  if (full < dim) {  // the partial last vector, zero-padded
    float gl[L] = {}, ul[L] = {};
    std::memcpy(gl, g + full, 4 * (dim - full));
    std::memcpy(ul, u + full, 4 * (dim - full));
    const Vec<L> y = activate<L, kAct>(load<L>(gl)) * load<L>(ul);
    std::memcpy(o + full, &y, 4 * (dim - full));
  }
}

template <int L>
SPECSERVE_INLINE void gated_row_any(int64_t act, const float* g, const float* u, int64_t dim, float* o) {
  if (act == kSilu)
    gated_row<L, kSilu>(g, u, dim, o);
  else
    gated_row<L, kGeluTanh>(g, u, dim, o);
}

__attribute__((target("avx512f"))) void gated_row_avx512(int64_t act, const float* g, const float* u,
                                                         int64_t dim, float* o) {
  gated_row_any<16>(act, g, u, dim, o);
}

__attribute__((target("avx2,fma"))) void gated_row_avx2(int64_t act, const float* g, const float* u,
                                                       int64_t dim, float* o) {
  gated_row_any<8>(act, g, u, dim, o);
}

// act(gate) * up for gate, up [rows, dim] (a fused projection's halves: any row stride); act 0 = silu,
// 1 = gelu with the tanh approximation.
at::Tensor gated_activation(const at::Tensor& gate, const at::Tensor& up, int64_t act) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes(), "gate, up: one shape, [rows, dim]");
  TORCH_CHECK(act == kSilu || act == kGeluTanh, "activation: 0 (silu) or 1 (gelu, tanh)");
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  static const auto row = has_avx512() ? gated_row_avx512 : gated_row_avx2;
  const Rows g(gate), u(up);
  const int64_t dim = gate.size(1);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, g.count, grain(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(act, g.row(r), u.row(r), dim, o + r * dim);
  });
  return out;
}

// --------------------------------------------------------------- Gated DeltaNet's delta-rule inputs

// silu(x[0:n]) into out[0:n]; the last partial vector from a zero-padded copy.
template <int L>
SPECSERVE_INLINE void silu_into(const float* x, int64_t n, float* out) {
  const int64_t full = n / L * L;
  for (int64_t i = 0; i < full; i += L) {
    const Vec<L> y = activate<L, kSilu>(load<L>(x + i));
    std::memcpy(out + i, &y, sizeof y);
  }
  if (full < n) {
    float last[L] = {};
    std::memcpy(last, x + full, 4 * (n - full));
    const Vec<L> y = activate<L, kSilu>(load<L>(last));
    std::memcpy(out + full, &y, 4 * (n - full));
  }
}

// x[0:n] /= sqrt(sum(x^2) + eps), then *= scale unless it is 1 (two roundings, as torch's l2norm and then
// its scaling).
template <int L>
SPECSERVE_INLINE void l2_normalise(float* x, int64_t n, float eps, float scale) {
  Vec<L> squares[2] = {};
  const int64_t full = n / L * L;
  int64_t i = 0;
  for (int c = 0; i < full; i += L, c ^= 1) squares[c] += load<L>(x + i) * load<L>(x + i);
  const Vec<L> total = squares[0] + squares[1];
  float sum = 0.f;
  for (int j = 0; j < L; ++j) sum += total[j];
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inverse = 1.f / std::sqrt(sum + eps);
  for (i = 0; i < n; ++i) x[i] = scale == 1.f ? x[i] * inverse : x[i] * inverse * scale;
}

struct DeltaRuleInputs {
  Rows conv, a, b;               // [N, 2 key_dim + value_dim] before the activation, [N, heads] twice
  const float *a_log, *dt_bias;  // [heads]
  int64_t key_heads, dk, heads, dv;
  float eps, q_scale;
  float *q, *k, *v, *g, *decay, *beta;  // [N, key heads, dk] twice, [N, heads, dv], [N, heads] thrice
};

// Row n: silu over the conv output, q and k L2-normalised per key head (q then scaled), v; per value head
// g = -exp(A_log) softplus(a + dt_bias), exp(g) and sigmoid(b), in double as the torch path computes them
// (gated_deltanet.py's docstring says why), each rounded to fp32 once.
template <int L>
SPECSERVE_INLINE void delta_rule_inputs_row(const DeltaRuleInputs& p, int64_t n) {
  const int64_t key_dim = p.key_heads * p.dk, value_dim = p.heads * p.dv;
  const float* x = p.conv.row(n);
  float *q = p.q + n * key_dim, *k = p.k + n * key_dim;
  silu_into<L>(x, key_dim, q);
  silu_into<L>(x + key_dim, key_dim, k);
  silu_into<L>(x + 2 * key_dim, value_dim, p.v + n * value_dim);
  for (int64_t h = 0; h < p.key_heads; ++h) {
    l2_normalise<L>(q + h * p.dk, p.dk, p.eps, p.q_scale);
    l2_normalise<L>(k + h * p.dk, p.dk, p.eps, 1.f);
  }
  const float *a = p.a.row(n), *b = p.b.row(n);
  for (int64_t h = 0; h < p.heads; ++h) {
    const double shifted = static_cast<double>(a[h]) + static_cast<double>(p.dt_bias[h]);
    const double softplus = shifted > 20.0 ? shifted : std::log1p(std::exp(shifted));  // torch's threshold
    const double g = -std::exp(static_cast<double>(p.a_log[h])) * softplus;
    p.g[n * p.heads + h] = static_cast<float>(g);
    p.decay[n * p.heads + h] = static_cast<float>(std::exp(g));
    p.beta[n * p.heads + h] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(b[h]))));
  }
}

__attribute__((target("avx512f"))) void delta_rule_inputs_row_avx512(const DeltaRuleInputs& p, int64_t n) {
  delta_rule_inputs_row<16>(p, n);
}

__attribute__((target("avx2,fma"))) void delta_rule_inputs_row_avx2(const DeltaRuleInputs& p, int64_t n) {
  delta_rule_inputs_row<8>(p, n);
}

// Gated DeltaNet's steps between its causal conv and its delta rule, every row in one call (torch spreads
// them over ~25 operators a layer): conv [N, 2 key_heads dk + heads dv] (before the activation), a, b
// [N, heads], A_log, dt_bias [heads] -> q, k [N, key_heads, dk], v [N, heads, dv], g, exp(g), beta
// [N, heads].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gdn_delta_rule_inputs(
    const at::Tensor& conv, const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
    const at::Tensor& dt_bias, int64_t key_heads, int64_t dk, double eps) {
  check_rows(conv, "conv");
  check_rows(a, "a");
  check_rows(b, "b");
  const int64_t n = conv.size(0), heads = a.size(-1), value_dim = conv.size(-1) - 2 * key_heads * dk;
  TORCH_CHECK(conv.dim() == 2 && a.dim() == 2 && a.sizes() == b.sizes() && a.size(0) == n,
              "conv [N, channels], a and b [N, heads]");
  TORCH_CHECK(key_heads > 0 && dk > 0 && value_dim > 0 && value_dim % heads == 0,
              "conv's channels: 2 key_heads dk + heads dv");
  for (const at::Tensor* t : {&a_log, &dt_bias})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == heads && t->is_contiguous(),
                "A_log, dt_bias: contiguous fp32 [heads]");
  const auto options = conv.options();
  at::Tensor q = at::empty({n, key_heads, dk}, options), k = at::empty({n, key_heads, dk}, options);
  at::Tensor v = at::empty({n, heads, value_dim / heads}, options);
  at::Tensor g = at::empty({n, heads}, options), decay = at::empty({n, heads}, options);
  at::Tensor beta = at::empty({n, heads}, options);
  const DeltaRuleInputs p{Rows(conv), Rows(a), Rows(b), a_log.data_ptr<float>(), dt_bias.data_ptr<float>(),
                          key_heads, dk, heads, value_dim / heads, static_cast<float>(eps),
                          static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk))),
                          q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                          decay.data_ptr<float>(), beta.data_ptr<float>()};
  static const auto row = has_avx512() ? delta_rule_inputs_row_avx512 : delta_rule_inputs_row_avx2;
  at::parallel_for(0, n, grain(conv.size(-1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(p, r);
  });
  return {q, k, v, g, decay, beta};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps, float offset) -> Tensor", &rms_norm);
  m.def(
      "add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps, float offset) -> (Tensor, Tensor)",
      &add_rms_norm);
  m.def(
      "rotate_and_cache(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, Tensor(c!) k_cache, "
      "Tensor(d!) v_cache, Tensor slots) -> ()",
      &rotate_and_cache);
  m.def("gated_activation(Tensor gate, Tensor up, int act) -> Tensor", &gated_activation);
  m.def(
      "gdn_delta_rule_inputs(Tensor conv, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, int key_heads, "
      "int dk, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
      &gdn_delta_rule_inputs);
}
