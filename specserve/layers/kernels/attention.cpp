// Attention of short pieces' rows (decode tokens, verification blocks) straight from the paged KV cache.
//
// Each (query row, KV head) is one work item: the row's query heads that share the KV head are scored
// against exactly the keys the row sees, softmaxed in fp32 and applied to the values, reading K/V in place
// through the block table (no gather copy, no per-row SDPA call). An item's arithmetic is fixed by the row
// alone (its keys, in position order, the same vector lanes and summation tree whatever the batch or the
// thread that runs it), so a row's output is bitwise independent of the other rows of the call: the batch
// invariance greedy speculation needs. The vector code is written once with GCC vector types, for vectors
// of L floats, and compiled for AVX-512 (L = 16) and for AVX2 (L = 8); a process uses the best its CPU has
// (so the last bits of a result differ between the two kinds of CPU, never between the rows of a call).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using namespace specserve_vec;

// L vectors' lane sums at once, lane j = the sum of x[j]: the same tree for every vector (lane i takes
// lane i + L / 2, then i + L / 4, ..., i + 1), by halving levels that pack two vectors' partial sums into
// one (a's groups of lanes, then b's).
template <int L, int kWidth>  // lanes per vector's partial sums, before the level
SPECSERVE_INLINE Vec<L> fold_pair(Vec<L> a, Vec<L> b) {
  constexpr int half = kWidth / 2, groups = L / kWidth;
  IVec<L> lo{}, hi{};
  for (int i = 0; i < L; ++i) {
    const int group = i / half, source = group < groups ? 0 : L;
    lo[i] = source + (group % groups) * kWidth + i % half;
    hi[i] = lo[i] + half;
  }
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// x: kWidth vectors of kWidth-lane partial sums (overwritten) -> their lane sums.
template <int L, int kWidth = L>
SPECSERVE_INLINE Vec<L> sum_lanes(Vec<L>* x) {
  for (int i = 0; i < kWidth / 2; ++i) x[i] = fold_pair<L, kWidth>(x[2 * i], x[2 * i + 1]);
  if constexpr (kWidth == 2)
    return x[0];
  else
    return sum_lanes<L, kWidth / 2>(x);
}

SPECSERVE_INLINE void store(float* p, float x) { *p = x; }
SPECSERVE_INLINE void store(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }

struct Item {
  const int64_t* slots;  // flat cache slot of each key the row sees, in position order
  int64_t keys;
  int kv_head;
};

struct Shape {
  int64_t kv_heads, head_dim, value_dim, group;  // group: query heads per KV head
  float scale;
};

// One (row, KV head): q [group heads, head_dim] (heads `q_head_stride` apart) -> out [group, value_dim].
// Keys are taken L at a time (8 KiB at head_dim 128 and L = 16, in L1) for all the group's heads, so K and
// V are read from memory once per item, not once per query head. kChunks / kValueChunks: head_dim / L and
// value_dim / L when fixed at compile time (registers), else 0.
template <int L, int kChunks, int kValueChunks, typename T>
SPECSERVE_INLINE void attend_item(const Item& item, const Shape& s, const T* q, int64_t q_head_stride,
                                  const T* k_cache, const T* v_cache, T* out, std::vector<float>& scratch) {
  const int64_t keys = item.keys, padded = (keys + L - 1) / L * L;
  const int64_t chunks = kChunks ? kChunks : s.head_dim / L;
  const int64_t value_chunks = kValueChunks ? kValueChunks : s.value_dim / L;
  scratch.resize(s.group * (padded + s.value_dim));
  float* probs = scratch.data();                   // [group, padded]: scores, then exp(score - max)
  float* sums = scratch.data() + s.group * padded;  // [group, value_dim]: sum of p * v
  auto slot = [&](int64_t j) { return item.slots[j] * s.kv_heads + item.kv_head; };
  for (int64_t j0 = 0; j0 < padded; j0 += L) {
    // the lanes past the last key score a copy of it (finite, and never used)
    const int64_t valid = std::min<int64_t>(L, keys - j0);
    const T* k[L];
    for (int jj = 0; jj < L; ++jj) k[jj] = k_cache + slot(j0 + std::min<int64_t>(jj, valid - 1)) * s.head_dim;
    for (int64_t g = 0; g < s.group; ++g) {
      const T* qh = q + g * q_head_stride;
      // the L keys' dot products side by side: L independent chains, not one chain per key in turn
      Vec<L> dots[L];
      for (int jj = 0; jj < L; ++jj) dots[jj] = load<L>(qh) * load<L>(k[jj]);
      for (int64_t c = 1; c < chunks; ++c) {
        const Vec<L> qc = load<L>(qh + c * L);
        for (int jj = 0; jj < L; ++jj) dots[jj] += qc * load<L>(k[jj] + c * L);
      }
      const Vec<L> scores = sum_lanes<L>(dots) * splat<L>(s.scale);
      std::memcpy(probs + g * padded + j0, &scores, sizeof scores);
    }
  }
  std::vector<float> inverse_totals(s.group);
  for (int64_t g = 0; g < s.group; ++g) {
    float* p = probs + g * padded;
    float top = p[0];
    for (int64_t j = 1; j < keys; ++j) top = std::max(top, p[j]);
    for (int64_t j = 0; j < padded; j += L) {
      const Vec<L> e = exp_nonpositive<L>(load<L>(p + j) - splat<L>(top));
      std::memcpy(p + j, &e, sizeof e);
    }
    float total = 0.f;
    for (int64_t j = 0; j < keys; ++j) total += p[j];
    inverse_totals[g] = 1.f / total;
    std::fill(sums + g * s.value_dim, sums + (g + 1) * s.value_dim, 0.f);
  }
  for (int64_t j0 = 0; j0 < keys; j0 += L) {
    const int64_t j1 = std::min<int64_t>(keys, j0 + L);
    for (int64_t g = 0; g < s.group; ++g) {
      float* sum = sums + g * s.value_dim;
      Vec<L> acc[256 / L];
      for (int64_t c = 0; c < value_chunks; ++c) acc[c] = load<L>(sum + c * L);
      for (int64_t j = j0; j < j1; ++j) {
        const T* v = v_cache + slot(j) * s.value_dim;
        const Vec<L> p = splat<L>(probs[g * padded + j]);
        for (int64_t c = 0; c < value_chunks; ++c) acc[c] += p * load<L>(v + c * L);
      }
      for (int64_t c = 0; c < value_chunks; ++c) std::memcpy(sum + c * L, &acc[c], sizeof acc[c]);
    }
  }
  for (int64_t g = 0; g < s.group; ++g) {
    T* o = out + g * s.value_dim;
    const float* sum = sums + g * s.value_dim;
    for (int64_t i = 0; i < s.value_dim; ++i) store(o + i, sum[i] * inverse_totals[g]);
  }
}

// The common head sizes (64, 128, 256, keys and values alike) with their loops unrolled.
template <int L, typename T>
SPECSERVE_INLINE void attend_item_any(const Item& i, const Shape& s, const T* q, int64_t qs, const T* k,
                                      const T* v, T* o, std::vector<float>& p) {
  if (s.head_dim == s.value_dim && s.head_dim == 64)
    attend_item<L, 64 / L, 64 / L>(i, s, q, qs, k, v, o, p);
  else if (s.head_dim == s.value_dim && s.head_dim == 128)
    attend_item<L, 128 / L, 128 / L>(i, s, q, qs, k, v, o, p);
  else if (s.head_dim == s.value_dim && s.head_dim == 256)
    attend_item<L, 256 / L, 256 / L>(i, s, q, qs, k, v, o, p);
  else
    attend_item<L, 0, 0>(i, s, q, qs, k, v, o, p);
}

template <typename T>
__attribute__((target("avx512f"))) void attend_item_avx512(const Item& i, const Shape& s, const T* q,
                                                            int64_t qs, const T* k, const T* v, T* o,
                                                            std::vector<float>& p) {
  attend_item_any<16>(i, s, q, qs, k, v, o, p);
}

template <typename T>
__attribute__((target("avx2,fma"))) void attend_item_avx2(const Item& i, const Shape& s, const T* q,
                                                          int64_t qs, const T* k, const T* v, T* o,
                                                          std::vector<float>& p) {
  attend_item_any<8>(i, s, q, qs, k, v, o, p);
}

template <typename T>
void attend_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const std::vector<int64_t>& slots, const std::vector<int64_t>& key_start,
                 const int64_t* rows, const Shape& s, at::Tensor& out) {
  static const bool avx512 = has_avx512();
  const int64_t num_rows = out.size(0), heads = s.kv_heads * s.group;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, num_rows * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / s.kv_heads;
      const int kv_head = static_cast<int>(w % s.kv_heads);
      const Item item{slots.data() + key_start[r], key_start[r + 1] - key_start[r], kv_head};
      const T* qh = qp + rows[r] * q.stride(0) + kv_head * s.group * q.stride(1);
      T* o = op + (r * heads + kv_head * s.group) * s.value_dim;
      if (avx512)
        attend_item_avx512(item, s, qh, q.stride(1), kp, vp, o, probs);
      else
        attend_item_avx2(item, s, qh, q.stride(1), kp, vp, o, probs);
    }
  });
}

// q [N, heads, head_dim]; caches [blocks, block_size, kv_heads, dim] (fp32 or bf16, q's dtype); row r of
// the output is query row rows[r], of the sequence with block table tables[pieces[r]], seeing its keys at
// positions [max(0, positions[r] + 1 - window) if window > 0 else 0, key_ends[r]).
at::Tensor paged_attention_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& rows, const at::Tensor& tables, const at::Tensor& pieces,
                                const at::Tensor& positions, const at::Tensor& key_ends, int64_t window,
                                double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: [N, heads, head_dim], unit stride in head_dim");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches: contiguous [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q and the caches: one dtype, fp32 or bf16");
  const int64_t blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(v_cache.size(0) == blocks && v_cache.size(1) == block_size && v_cache.size(2) == kv_heads,
              "k and v caches differ in shape");
  const int64_t heads = q.size(1), head_dim = q.size(2), value_dim = v_cache.size(3);
  TORCH_CHECK(k_cache.size(3) == head_dim, "q and k differ in head_dim");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of the KV heads");
  TORCH_CHECK(head_dim % 16 == 0 && value_dim % 16 == 0 && head_dim <= 256 && value_dim <= 256,
              "head dims: multiples of 16 up to 256");
  for (const at::Tensor* t : {&rows, &tables, &pieces, &positions, &key_ends})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "indices: contiguous int64");
  const int64_t num_rows = rows.numel(), width = tables.size(1);
  TORCH_CHECK(tables.dim() == 2 && pieces.numel() == num_rows && positions.numel() == num_rows &&
                  key_ends.numel() == num_rows,
              "one piece, position and key end per row");
  const int64_t *row_p = rows.data_ptr<int64_t>(), *table_p = tables.data_ptr<int64_t>();
  const int64_t *piece_p = pieces.data_ptr<int64_t>(), *pos_p = positions.data_ptr<int64_t>();
  const int64_t* end_p = key_ends.data_ptr<int64_t>();
  // every key's flat slot, row after row (checked here, so the parallel part reads only valid memory)
  std::vector<int64_t> slots, key_start{0};
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(row_p[r] >= 0 && row_p[r] < q.size(0), "row ", row_p[r], " is not a row of q");
    TORCH_CHECK(piece_p[r] >= 0 && piece_p[r] < tables.size(0), "row ", r, ": no block table ", piece_p[r]);
    const int64_t first = window > 0 ? std::max<int64_t>(0, pos_p[r] + 1 - window) : 0, last = end_p[r];
    TORCH_CHECK(first < last && last <= width * block_size, "row ", r, ": keys [", first, ", ", last,
                ") outside its block table");
    const int64_t* table = table_p + piece_p[r] * width;
    for (int64_t pos = first; pos < last; ++pos) {
      const int64_t block = table[pos / block_size];
      TORCH_CHECK(block >= 0 && block < blocks, "block ", block, " is not in the cache");
      slots.push_back(block * block_size + pos % block_size);
    }
    key_start.push_back(static_cast<int64_t>(slots.size()));
  }
  at::Tensor out = at::empty({num_rows, heads, value_dim}, q.options());
  const Shape shape{kv_heads, head_dim, value_dim, heads / kv_heads, static_cast<float>(scale)};
  if (q.scalar_type() == at::kFloat)
    attend_rows<float>(q, k_cache, v_cache, slots, key_start, row_p, shape, out);
  else
    attend_rows<c10::BFloat16>(q, k_cache, v_cache, slots, key_start, row_p, shape, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def(
      "paged_attention_rows(Tensor q, Tensor k_cache, Tensor v_cache, Tensor rows, Tensor tables, "
      "Tensor pieces, Tensor positions, Tensor key_ends, int window, float scale) -> Tensor",
      &paged_attention_rows);
}
