// Gated DeltaNet's recurrence for short pieces (decode tokens, verification blocks, short prompt chunks),
// and the rollback of a verified piece to its accepted prefix. Per token, with a = exp(g):
//     S <- a S;   delta = beta (v - S^T k);   S <- S + k delta^T;   o = S^T q
// (layers/gated_deltanet.py's `recurrent_delta_rule` in torch ops). torch runs each of these over the
// whole [heads, d_k, d_v] state (1 MiB at Qwen3.5's shapes), four passes from memory a token; here a unit
// of work is one piece, one head and a tile of up to 4 vectors of state columns ([d_k, 64] fp32 on AVX-512,
// 32 KiB), which takes all of the piece's tokens while it stays in the L1 cache: the state is read once and
// written once a forward, whatever the number of tokens.
//
// Exactness: a column's sums over d_k run in index order with one fused multiply-add a term, and every
// other step is elementwise, so a column's results do not depend on the vector width, the tile, the other
// pieces or the number of tokens that follow: the scalar, AVX2 and AVX-512 paths agree bitwise, and a
// verified token's output and state equal the same token decoded alone. The rollback replays the kept
// tokens' updates (S <- a S, then S <- S + k delta^T with the forward's delta) with the same operations,
// so the state it writes is bitwise the one the forward held after those tokens.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using namespace specserve_vec;

constexpr int kMaxVectors = 4;  // state columns of a unit: up to 4 vectors (accumulators in registers)

// One token's inputs and outputs for one head. Without `q` the step only updates the state with `delta`
// (the rollback's replay); with it, `delta` receives the token's delta and `out` its output.
struct Step {
  const float* k;  // [d_k]
  const float* q;  // [d_k] or null
  const float* v;  // [d_v] or null
  float decay, beta;
  float* out;    // [d_v]
  float* delta;  // [d_v]: written when q is set, read otherwise
};

template <int L>
SPECSERVE_INLINE void store(float* p, Vec<L> v) {
  std::memcpy(p, &v, sizeof v);
}

// Columns [c0, c0 + NV * L) of a [d_k, d_v] state (row stride d_v), one token.
template <int L, int NV>
SPECSERVE_INLINE void step_vectors(float* state, int64_t dk, int64_t dv, int64_t c0, const Step& s) {
  const Vec<L> decay = splat<L>(s.decay);
  Vec<L> delta[NV];
  if (s.q != nullptr) {
    Vec<L> predicted[NV] = {};
    for (int64_t i = 0; i < dk; ++i) {
      const Vec<L> k = splat<L>(s.k[i]);
      for (int c = 0; c < NV; ++c) {
        float* p = state + i * dv + c0 + c * L;
        const Vec<L> decayed = load<L>(p) * decay;
        store<L>(p, decayed);
        predicted[c] = fma(k, decayed, predicted[c]);
      }
    }
    for (int c = 0; c < NV; ++c) {
      delta[c] = (load<L>(s.v + c0 + c * L) - predicted[c]) * splat<L>(s.beta);
      store<L>(s.delta + c0 + c * L, delta[c]);
    }
  } else {
    for (int c = 0; c < NV; ++c) delta[c] = load<L>(s.delta + c0 + c * L);
  }
  Vec<L> out[NV] = {};
  for (int64_t i = 0; i < dk; ++i) {
    const Vec<L> k = splat<L>(s.k[i]);
    for (int c = 0; c < NV; ++c) {
      float* p = state + i * dv + c0 + c * L;
      const Vec<L> before = s.q != nullptr ? load<L>(p) : load<L>(p) * decay;
      const Vec<L> updated = fma(k, delta[c], before);
      store<L>(p, updated);
      if (s.q != nullptr) out[c] = fma(splat<L>(s.q[i]), updated, out[c]);
    }
  }
  if (s.q != nullptr)
    for (int c = 0; c < NV; ++c) store<L>(s.out + c0 + c * L, out[c]);
}

// The same arithmetic one column at a time: the scalar path, and the columns past the last whole vector.
inline void step_columns(float* state, int64_t dk, int64_t dv, int64_t c0, int64_t c1, const Step& s) {
  for (int64_t c = c0; c < c1; ++c) {
    float delta;
    if (s.q != nullptr) {
      float predicted = 0.f;
      for (int64_t i = 0; i < dk; ++i) {
        float& x = state[i * dv + c];
        x = x * s.decay;
        predicted = std::fma(s.k[i], x, predicted);
      }
      delta = (s.v[c] - predicted) * s.beta;
      s.delta[c] = delta;
    } else {
      delta = s.delta[c];
    }
    float out = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      float& x = state[i * dv + c];
      x = std::fma(s.k[i], delta, s.q != nullptr ? x : x * s.decay);
      if (s.q != nullptr) out = std::fma(s.q[i], x, out);
    }
    if (s.q != nullptr) s.out[c] = out;
  }
}

// One unit: columns [c0, c0 + width) of one head's state through `steps`. Per ISA, so that the vector code
// is compiled for it (a lambda would not inherit the target attribute).
template <int L>
SPECSERVE_INLINE void run_unit(float* state, int64_t dk, int64_t dv, int64_t c0, int64_t width,
                               const Step* steps, int64_t count) {
  const int64_t vectors = width / L;
  for (int64_t t = 0; t < count; ++t) {
    switch (vectors) {
      case 4: step_vectors<L, 4>(state, dk, dv, c0, steps[t]); break;
      case 3: step_vectors<L, 3>(state, dk, dv, c0, steps[t]); break;
      case 2: step_vectors<L, 2>(state, dk, dv, c0, steps[t]); break;
      case 1: step_vectors<L, 1>(state, dk, dv, c0, steps[t]); break;
      default: break;
    }
    step_columns(state, dk, dv, c0 + vectors * L, c0 + width, steps[t]);
  }
}

__attribute__((target("avx512f"), flatten)) void unit_avx512(float* state, int64_t dk, int64_t dv, int64_t c0,
                                                              int64_t width, const Step* steps, int64_t n) {
  run_unit<16>(state, dk, dv, c0, width, steps, n);
}

__attribute__((target("avx2,fma"), flatten)) void unit_avx2(float* state, int64_t dk, int64_t dv, int64_t c0,
                                                             int64_t width, const Step* steps, int64_t n) {
  run_unit<8>(state, dk, dv, c0, width, steps, n);
}

void unit_scalar(float* state, int64_t dk, int64_t dv, int64_t c0, int64_t width, const Step* steps, int64_t n) {
  for (int64_t t = 0; t < n; ++t) step_columns(state, dk, dv, c0, c0 + width, steps[t]);
}

using Unit = void (*)(float*, int64_t, int64_t, int64_t, int64_t, const Step*, int64_t);

// isa: -1 the best this CPU has, 0 scalar, 1 AVX2, 2 or more AVX-512 (qlinear's numbering). Returns the
// unit function and its columns per unit.
std::pair<Unit, int64_t> unit_for(int64_t isa) {
  const bool avx512 = has_avx512(), avx2 = has_avx2();
  if (isa < 0) isa = avx512 ? 2 : avx2 ? 1 : 0;
  TORCH_CHECK(isa == 0 || (isa == 1 && avx2) || (isa >= 2 && avx512), "delta rule: path ", isa,
              " is not supported by this CPU");
  if (isa >= 2) return {unit_avx512, kMaxVectors * 16};
  if (isa == 1) return {unit_avx2, kMaxVectors * 8};
  return {unit_scalar, kMaxVectors * 8};
}

void check_fp32(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dim && t.device().is_cpu(),
              name, ": a contiguous fp32 CPU tensor of ", dim, " dimensions");
}

// Split (pieces x heads x column tiles) over threads; `unit(p, h, c0, width)` runs one.
template <typename F>
void for_each_unit(int64_t pieces, int64_t heads, int64_t dv, int64_t tile, const F& unit) {
  const int64_t tiles = (dv + tile - 1) / tile;
  at::parallel_for(0, pieces * heads * tiles, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t c0 = u % tiles * tile;
      unit(u / tiles / heads, u / tiles % heads, c0, std::min(tile, dv - c0));
    }
  });
}

// Pieces g = 0..G-1 (rows starts[g] .. starts[g] + lengths[g] of the flat batch) from state0[index[g]]:
// out[rows] = their outputs, deltas[rows] (if given) the tokens' deltas, pool[slots[g]] the state after
// the piece (state0 may be pool, index slots: each piece then updates its slot in place). q, k [N, key heads, d_k] (value head h reads key head h / (heads / key heads)); v, out,
// deltas [N, heads, d_v]; decay, beta [N, heads]; state0 [P, heads, d_k, d_v], pool [S, heads, d_k, d_v].
void delta_rule_recurrent(const at::Tensor& state0, at::Tensor& pool, const at::Tensor& index,
                          const at::Tensor& slots, at::IntArrayRef starts, at::IntArrayRef lengths,
                          const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& decay,
                          const at::Tensor& beta, at::Tensor& out, const c10::optional<at::Tensor>& deltas,
                          int64_t isa) {
  check_fp32(state0, "state0", 4);
  check_fp32(pool, "pool", 4);
  check_fp32(q, "q", 3);
  check_fp32(k, "k", 3);
  check_fp32(v, "v", 3);
  check_fp32(decay, "decay", 2);
  check_fp32(beta, "beta", 2);
  check_fp32(out, "out", 3);
  const int64_t n = v.size(0), heads = v.size(1), dv = v.size(2), key_heads = k.size(1), dk = k.size(2);
  TORCH_CHECK(q.sizes() == k.sizes() && k.size(0) == n && heads % key_heads == 0, "q, k: [N, key heads, d_k]");
  TORCH_CHECK(state0.size(1) == heads && state0.size(2) == dk && state0.size(3) == dv &&
                  pool.sizes().slice(1) == state0.sizes().slice(1),
              "state0, pool: [*, heads, d_k, d_v]");
  TORCH_CHECK(out.sizes() == v.sizes() && decay.size(0) == n && decay.size(1) == heads &&
                  beta.sizes() == decay.sizes(),
              "out: v's shape; decay, beta: [N, heads]");
  if (deltas) {
    check_fp32(*deltas, "deltas", 3);
    TORCH_CHECK(deltas->sizes() == v.sizes(), "deltas: v's shape");
  }
  const int64_t pieces = index.numel();
  TORCH_CHECK(slots.numel() == pieces && static_cast<int64_t>(starts.size()) == pieces &&
                  static_cast<int64_t>(lengths.size()) == pieces,
              "index, slots, starts, lengths: one per piece");
  const at::Tensor index64 = index.to(at::kLong).contiguous(), slots64 = slots.to(at::kLong).contiguous();
  const int64_t *src = index64.data_ptr<int64_t>(), *dst = slots64.data_ptr<int64_t>();
  for (int64_t g = 0; g < pieces; ++g) {
    TORCH_CHECK(0 <= src[g] && src[g] < state0.size(0) && 0 <= dst[g] && dst[g] < pool.size(0),
                "piece ", g, ": index or slot out of range");
    TORCH_CHECK(lengths[g] >= 1 && starts[g] >= 0 && starts[g] + lengths[g] <= n, "piece ", g,
                ": rows out of range");
  }
  const auto [unit, tile] = unit_for(isa);
  const int64_t head_size = dk * dv, group = heads / key_heads;
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* deltas_p = deltas ? deltas->data_ptr<float>() : nullptr;
  const float* s0 = state0.data_ptr<float>();
  float* sp = pool.data_ptr<float>();
  for_each_unit(pieces, heads, dv, tile, [&](int64_t g, int64_t h, int64_t c0, int64_t width) {
    const float* from = s0 + (src[g] * heads + h) * head_size;
    float* state = sp + (dst[g] * heads + h) * head_size;
    if (from != state) {  // else updated in place: its own slot (each unit reads and writes its columns)
      for (int64_t i = 0; i < dk; ++i) std::memcpy(state + i * dv + c0, from + i * dv + c0, 4 * width);
    }
    std::vector<float> scratch(deltas_p ? 0 : lengths[g] * dv);  // deltas nobody keeps
    std::vector<Step> steps(lengths[g]);
    for (int64_t t = 0; t < lengths[g]; ++t) {
      const int64_t r = starts[g] + t, kh = h / group;
      steps[t] = Step{kp + (r * key_heads + kh) * dk,
                      qp + (r * key_heads + kh) * dk,
                      vp + (r * heads + h) * dv,
                      dp[r * heads + h],
                      bp[r * heads + h],
                      op + (r * heads + h) * dv,
                      deltas_p ? deltas_p + (r * heads + h) * dv : scratch.data() + t * dv};
    }
    unit(state, dk, dv, c0, width, steps.data(), lengths[g]);
  });
}

// The rollback: pool[slots[i]] = state0[i] advanced by its first kept[i] tokens' updates, with the keys,
// decays and deltas the forward kept: k [C, T, key heads, d_k], decay [C, T, heads], deltas [C, T, heads,
// d_v], state0 [C, heads, d_k, d_v]; pieces i in `which` only.
void delta_rule_replay(at::Tensor& pool, const at::Tensor& slots, const at::Tensor& state0, const at::Tensor& k,
                       const at::Tensor& decay, const at::Tensor& deltas, at::IntArrayRef which,
                       at::IntArrayRef kept, int64_t isa) {
  check_fp32(pool, "pool", 4);
  check_fp32(state0, "state0", 4);
  check_fp32(k, "k", 4);
  check_fp32(decay, "decay", 3);
  check_fp32(deltas, "deltas", 4);
  const int64_t c = state0.size(0), heads = state0.size(1), dk = state0.size(2), dv = state0.size(3);
  const int64_t t_max = k.size(1), key_heads = k.size(2);
  TORCH_CHECK(pool.sizes().slice(1) == state0.sizes().slice(1), "pool, state0: [*, heads, d_k, d_v]");
  TORCH_CHECK(k.size(0) == c && k.size(3) == dk && heads % key_heads == 0, "k: [C, T, key heads, d_k]");
  TORCH_CHECK(decay.size(0) == c && decay.size(1) == t_max && decay.size(2) == heads, "decay: [C, T, heads]");
  TORCH_CHECK(deltas.size(0) == c && deltas.size(1) == t_max && deltas.size(2) == heads && deltas.size(3) == dv,
              "deltas: [C, T, heads, d_v]");
  TORCH_CHECK(which.size() == kept.size(), "which, kept: one per rolled-back piece");
  const at::Tensor slots64 = slots.to(at::kLong).contiguous();
  TORCH_CHECK(slots64.numel() == c, "slots: one per kept piece");
  const int64_t* dst = slots64.data_ptr<int64_t>();
  for (size_t j = 0; j < which.size(); ++j) {
    TORCH_CHECK(0 <= which[j] && which[j] < c && 0 <= kept[j] && kept[j] <= t_max, "rollback ", j,
                ": piece or kept count out of range");
    TORCH_CHECK(0 <= dst[which[j]] && dst[which[j]] < pool.size(0), "rollback ", j, ": slot out of range");
  }
  const auto [unit, tile] = unit_for(isa);
  const int64_t head_size = dk * dv, group = heads / key_heads;
  const float *kp = k.data_ptr<float>(), *dp = decay.data_ptr<float>(), *s0 = state0.data_ptr<float>();
  float* deltas_p = deltas.data_ptr<float>();
  float* sp = pool.data_ptr<float>();
  for_each_unit(which.size(), heads, dv, tile, [&](int64_t j, int64_t h, int64_t c0, int64_t width) {
    const int64_t i = which[j];
    const float* from = s0 + (i * heads + h) * head_size;
    float* state = sp + (dst[i] * heads + h) * head_size;
    for (int64_t r = 0; r < dk; ++r) std::memcpy(state + r * dv + c0, from + r * dv + c0, 4 * width);
    std::vector<Step> steps(kept[j]);
    for (int64_t t = 0; t < kept[j]; ++t) {
      const int64_t r = i * t_max + t;
      steps[t] = Step{kp + (r * key_heads + h / group) * dk, nullptr, nullptr, dp[r * heads + h], 0.f, nullptr,
                      deltas_p + (r * heads + h) * dv};
    }
    unit(state, dk, dv, c0, width, steps.data(), kept[j]);
  });
}

// The causal depthwise conv before the recurrence, for pieces all short: piece g's tokens are rows
// starts[g] .. starts[g] + lengths[g] - 1 of x [N, C], its state pool[slots[g]] [C, W] the W = K - 1 inputs
// before them. out[r, c] = the sum over taps j of window[t + j] * weight[c, j], where the window is the
// state's W inputs then the piece's tokens: a product per tap, added in tap order, each rounded (no fused
// multiply-add), as GatedDeltaNet._conv's torch ops do, so bitwise theirs (the activation is the
// caller's). The slot then holds the window's last W inputs: the state is updated in place, with no copy
// of it or buffer of the window in torch ops (those small ops cost more than the conv at decode).
void causal_conv_short(at::Tensor& pool, const at::Tensor& slots, at::IntArrayRef starts,
                       at::IntArrayRef lengths, const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  check_fp32(pool, "pool", 3);
  check_fp32(x, "x", 2);
  check_fp32(weight, "weight", 2);
  check_fp32(out, "out", 2);
  const int64_t n = x.size(0), channels = x.size(1), w = pool.size(2), taps = weight.size(1);
  TORCH_CHECK(pool.size(1) == channels && weight.size(0) == channels && taps == w + 1,
              "pool [slots, C, K-1], weight [C, K] for x [N, C]");
  TORCH_CHECK(out.sizes() == x.sizes(), "out: x's shape");
  const int64_t pieces = slots.numel();
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == pieces && static_cast<int64_t>(lengths.size()) == pieces,
              "slots, starts, lengths: one per piece");
  const at::Tensor slots64 = slots.to(at::kLong).contiguous();
  const int64_t* dst = slots64.data_ptr<int64_t>();
  for (int64_t g = 0; g < pieces; ++g) {
    TORCH_CHECK(0 <= dst[g] && dst[g] < pool.size(0), "piece ", g, ": slot out of range");
    TORCH_CHECK(lengths[g] >= 1 && starts[g] >= 0 && starts[g] + lengths[g] <= n, "piece ", g,
                ": rows out of range");
  }
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = pool.data_ptr<float>(), *op = out.data_ptr<float>();
  constexpr int64_t kChannels = 256;  // a unit of work: one piece, this many channels
  const int64_t blocks = (channels + kChannels - 1) / kChannels;
  at::parallel_for(0, pieces * blocks, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> window;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / blocks, c0 = u % blocks * kChannels, c1 = std::min(channels, c0 + kChannels);
      const int64_t len = lengths[g];
      window.resize(w + len);
      for (int64_t c = c0; c < c1; ++c) {
        float* state = sp + (dst[g] * channels + c) * w;
        const float* tap = wp + c * taps;
        std::memcpy(window.data(), state, 4 * w);
        for (int64_t t = 0; t < len; ++t) window[w + t] = xp[(starts[g] + t) * channels + c];
        for (int64_t t = 0; t < len; ++t) {
          float acc = window[t] * tap[0];
          for (int64_t j = 1; j < taps; ++j) acc = acc + window[t + j] * tap[j];
          op[(starts[g] + t) * channels + c] = acc;
        }
        std::memcpy(state, window.data() + len, 4 * w);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def(
      "delta_rule_recurrent(Tensor state0, Tensor(a!) pool, Tensor index, Tensor slots, int[] starts, "
      "int[] lengths, Tensor q, Tensor k, Tensor v, Tensor decay, Tensor beta, Tensor(b!) out, "
      "Tensor(c!)? deltas=None, int isa=-1) -> ()",
      &delta_rule_recurrent);
  m.def(
      "delta_rule_replay(Tensor(a!) pool, Tensor slots, Tensor state0, Tensor k, Tensor decay, Tensor deltas, "
      "int[] which, int[] kept, int isa=-1) -> ()",
      &delta_rule_replay);
  m.def(
      "causal_conv_short(Tensor(a!) pool, Tensor slots, int[] starts, int[] lengths, Tensor x, Tensor weight, "
      "Tensor(b!) out) -> ()",
      &causal_conv_short);
}
