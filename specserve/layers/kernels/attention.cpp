// Attention of short pieces' rows (decode tokens, verification blocks) straight from the paged KV cache.
//
// A work item is a KV head and a group of a piece's rows whose key ranges overlap (one row of a decode
// step, the rows of a verification block): each row's query heads that share the KV head are scored
// against exactly the keys the row sees, softmaxed in fp32 and applied to the values, reading K/V in place
// through the block table (no gather copy, no per-row SDPA call), each block of keys once for the whole
// group. A row's arithmetic is fixed by the row alone (its keys, in position order, the same vector lanes
// and summation tree whatever its group, the batch or the thread that runs it), so a row's output is
// bitwise independent of the other rows of the call: the batch invariance greedy speculation needs. The
// vector code is written once with GCC vector types, for vectors of L floats, and compiled for AVX-512
// (L = 16) and for AVX2 (L = 8); a process uses the best its CPU has (so the last bits of a result differ
// between the two kinds of CPU, never between the rows of a call).
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

// The largest of x[0..n), n >= 1 (exact in any order).
template <int L>
SPECSERVE_INLINE float max_of(const float* x, int64_t n) {
  Vec<L> top = splat<L>(x[0]);
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    const Vec<L> v = load<L>(x + j);
    top = v > top ? v : top;
  }
  float m = x[0];
  for (int l = 0; l < L; ++l) m = std::max(m, top[l]);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// The sum of x[0..n) in a fixed order, lane l taking x[l], x[l + L], ..., then the lanes in turn: a
// function of the values alone (as a row's softmax total must be), and L chains instead of one.
template <int L>
SPECSERVE_INLINE float sum_of(const float* x, int64_t n) {
  Vec<L> lanes{};
  int64_t j = 0;
  for (; j + L <= n; j += L) lanes += load<L>(x + j);
  Vec<L> tail{};
  for (int l = 0; j + l < n; ++l) tail[l] = x[j + l];
  lanes += tail;
  float total = 0.f;
  for (int l = 0; l < L; ++l) total += lanes[l];
  return total;
}

SPECSERVE_INLINE void store(float* p, float x) { *p = x; }
SPECSERVE_INLINE void store(c10::BFloat16* p, float x) { *p = c10::BFloat16(x); }

struct Shape {
  int64_t kv_heads, head_dim, value_dim, group;  // group: query heads per KV head
  float scale;
};

// Rows of one piece whose key ranges overlap (a verification block, a draft block), attended together
// for one KV head: each block of L keys is read once for all of them, not once per row.
struct Item {
  const int64_t* slots;  // flat cache slot of each key in the rows' ranges together, in position order
  int64_t keys;
  const int64_t* first;  // [rows]: row i sees keys [first[i], end[i]) of those
  const int64_t* end;
  const int64_t* q_rows;  // [rows]: row i's query row in q
  int64_t out_row0, rows;  // its output rows: out_row0 + i
  int kv_head;
};

template <typename T>
struct Operands {
  const T* q;  // [N, heads, head_dim]
  int64_t q_row_stride, q_head_stride;
  const T* k_cache;  // [slots, kv_heads, head_dim]
  const T* v_cache;  // [slots, kv_heads, value_dim]
  T* out;            // [R, heads, value_dim]
};

// One item: the rows' query heads of the KV head -> their outputs. Keys are taken L at a time (8 KiB at
// head_dim 128 and L = 16, in L1) for all the rows' heads. A row's arithmetic is its own whatever the
// item: each score is its key's own lane tree, its softmax and its sum of values run over its keys in
// position order. kChunks / kValueChunks: head_dim / L and value_dim / L when fixed at compile time
// (registers), else 0.
template <int L, int kChunks, int kValueChunks, typename T>
SPECSERVE_INLINE void attend_item(const Item& item, const Shape& s, const Operands<T>& t,
                                  std::vector<float>& scratch) {
  const int64_t keys = item.keys, padded = (keys + L - 1) / L * L, heads = item.rows * s.group;
  const int64_t chunks = kChunks ? kChunks : s.head_dim / L;
  const int64_t value_chunks = kValueChunks ? kValueChunks : s.value_dim / L;
  scratch.resize(heads * (padded + s.value_dim + 1));
  float* probs = scratch.data();                  // [rows, group, padded]: scores, then exp(score - max)
  float* sums = probs + heads * padded;           // [rows, group, value_dim]: sum of p * v
  float* inverse_totals = sums + heads * s.value_dim;  // [rows, group]
  auto slot = [&](int64_t j) { return item.slots[j] * s.kv_heads + item.kv_head; };
  const T *k_cache = t.k_cache, *v_cache = t.v_cache;
  for (int64_t j0 = 0; j0 < padded; j0 += L) {
    // the lanes past the last key score a copy of it (finite, and never used)
    const int64_t valid = std::min<int64_t>(L, keys - j0);
    const T* k[L];
    for (int jj = 0; jj < L; ++jj) k[jj] = k_cache + slot(j0 + std::min<int64_t>(jj, valid - 1)) * s.head_dim;
    for (int64_t i = 0; i < item.rows; ++i) {
      if (j0 + L <= item.first[i] || j0 >= item.end[i]) continue;
      for (int64_t g = 0; g < s.group; ++g) {
        const T* qh = t.q + item.q_rows[i] * t.q_row_stride + (item.kv_head * s.group + g) * t.q_head_stride;
        // the L keys' dot products side by side: L independent chains, not one chain per key in turn
        Vec<L> dots[L];
        for (int jj = 0; jj < L; ++jj) dots[jj] = load<L>(qh) * load<L>(k[jj]);
        for (int64_t c = 1; c < chunks; ++c) {
          const Vec<L> qc = load<L>(qh + c * L);
          for (int jj = 0; jj < L; ++jj) dots[jj] = fma(qc, load<L>(k[jj] + c * L), dots[jj]);
        }
        const Vec<L> scores = sum_lanes<L>(dots) * splat<L>(s.scale);
        std::memcpy(probs + (i * s.group + g) * padded + j0, &scores, sizeof scores);
      }
    }
  }
  for (int64_t i = 0; i < item.rows; ++i) {
    // exp over the L-key blocks that hold the row's keys (lane by lane: the blocks' bounds change nothing)
    const int64_t first = item.first[i], end = item.end[i], from = first / L * L;
    for (int64_t g = 0; g < s.group; ++g) {
      float* p = probs + (i * s.group + g) * padded;
      const float top = max_of<L>(p + first, end - first);
      for (int64_t j = from; j < end; j += L) {
        const Vec<L> e = exp_nonpositive<L>(load<L>(p + j) - splat<L>(top));
        std::memcpy(p + j, &e, sizeof e);
      }
      inverse_totals[i * s.group + g] = 1.f / sum_of<L>(p + first, end - first);
    }
  }
  std::fill(sums, sums + heads * s.value_dim, 0.f);
  for (int64_t j0 = 0; j0 < keys; j0 += L) {
    const int64_t j1 = std::min<int64_t>(keys, j0 + L);
    for (int64_t i = 0; i < item.rows; ++i) {
      const int64_t from = std::max(j0, item.first[i]), to = std::min(j1, item.end[i]);
      for (int64_t g = 0; g < s.group && from < to; ++g) {
        float* sum = sums + (i * s.group + g) * s.value_dim;
        const float* p = probs + (i * s.group + g) * padded;
        Vec<L> acc[256 / L];
        for (int64_t c = 0; c < value_chunks; ++c) acc[c] = load<L>(sum + c * L);
        for (int64_t j = from; j < to; ++j) {
          const T* v = v_cache + slot(j) * s.value_dim;
          const Vec<L> pj = splat<L>(p[j]);
          for (int64_t c = 0; c < value_chunks; ++c) acc[c] = fma(pj, load<L>(v + c * L), acc[c]);
        }
        for (int64_t c = 0; c < value_chunks; ++c) std::memcpy(sum + c * L, &acc[c], sizeof acc[c]);
      }
    }
  }
  for (int64_t i = 0; i < item.rows; ++i)
    for (int64_t g = 0; g < s.group; ++g) {
      T* o = t.out + ((item.out_row0 + i) * s.kv_heads * s.group + item.kv_head * s.group + g) * s.value_dim;
      const float* sum = sums + (i * s.group + g) * s.value_dim;
      const float inverse_total = inverse_totals[i * s.group + g];
      for (int64_t d = 0; d < s.value_dim; ++d) store(o + d, sum[d] * inverse_total);
    }
}

// The common head sizes (64, 128, 256, keys and values alike) with their loops unrolled.
template <int L, typename T>
SPECSERVE_INLINE void attend_item_any(const Item& i, const Shape& s, const Operands<T>& t,
                                      std::vector<float>& p) {
  if (s.head_dim == s.value_dim && s.head_dim == 64)
    attend_item<L, 64 / L, 64 / L>(i, s, t, p);
  else if (s.head_dim == s.value_dim && s.head_dim == 128)
    attend_item<L, 128 / L, 128 / L>(i, s, t, p);
  else if (s.head_dim == s.value_dim && s.head_dim == 256)
    attend_item<L, 256 / L, 256 / L>(i, s, t, p);
  else
    attend_item<L, 0, 0>(i, s, t, p);
}

template <typename T>
__attribute__((target("avx512f"), flatten)) void attend_item_avx512(const Item& i, const Shape& s, const Operands<T>& t,
                                                            std::vector<float>& p) {
  attend_item_any<16>(i, s, t, p);
}

template <typename T>
__attribute__((target("avx2,fma"), flatten)) void attend_item_avx2(const Item& i, const Shape& s, const Operands<T>& t,
                                                          std::vector<float>& p) {
  attend_item_any<8>(i, s, t, p);
}

constexpr int64_t kMaxGroupRows = 16;

// The call's rows in groups (one item per group and KV head).
struct Groups {
  std::vector<int64_t> slots, key_start{0};  // each group's keys' flat slots: slots[key_start[g]:key_start[g + 1]]
  std::vector<int64_t> first, end;           // each row's keys among its group's
  std::vector<int64_t> row_start{0};         // group g: rows row_start[g] .. row_start[g + 1] - 1
};

template <typename T>
void attend_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const Groups& groups,
                 const int64_t* rows, const Shape& s, at::Tensor& out) {
  static const bool avx512 = has_avx512();
  const Operands<T> t{q.data_ptr<T>(), q.stride(0), q.stride(1), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                      out.data_ptr<T>()};
  const int64_t num_groups = static_cast<int64_t>(groups.row_start.size()) - 1;
  at::parallel_for(0, num_groups * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t g = w / s.kv_heads, row0 = groups.row_start[g];
      const Item item{groups.slots.data() + groups.key_start[g],
                      groups.key_start[g + 1] - groups.key_start[g],
                      groups.first.data() + row0,
                      groups.end.data() + row0,
                      rows + row0,
                      row0,
                      groups.row_start[g + 1] - row0,
                      static_cast<int>(w % s.kv_heads)};
      if (avx512)
        attend_item_avx512(item, s, t, scratch);
      else
        attend_item_avx2(item, s, t, scratch);
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
  // Consecutive rows of one piece whose key ranges overlap or touch form a group, up to rows_per_group
  // rows: as large as keeps every thread busy (one item per group and KV head). Each key of a group's
  // range is some row's, checked here, so the parallel part reads only valid memory.
  const int64_t threads = at::get_num_threads();
  const int64_t rows_per_group = std::clamp<int64_t>(num_rows * kv_heads / threads, 1, kMaxGroupRows);
  Groups groups;
  int64_t group_first = 0, group_end = 0, group_piece = -1;  // the open group's key positions and piece
  std::vector<int64_t> firsts(num_rows), ends(num_rows);
  auto close_group = [&](int64_t next_row) {
    const int64_t* table = table_p + group_piece * width;
    for (int64_t pos = group_first; pos < group_end; ++pos) {
      const int64_t block = table[pos / block_size];
      TORCH_CHECK(block >= 0 && block < blocks, "block ", block, " is not in the cache");
      groups.slots.push_back(block * block_size + pos % block_size);
    }
    groups.key_start.push_back(static_cast<int64_t>(groups.slots.size()));
    for (int64_t r = groups.row_start.back(); r < next_row; ++r) {
      groups.first.push_back(firsts[r] - group_first);
      groups.end.push_back(ends[r] - group_first);
    }
    groups.row_start.push_back(next_row);
  };
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(row_p[r] >= 0 && row_p[r] < q.size(0), "row ", row_p[r], " is not a row of q");
    TORCH_CHECK(piece_p[r] >= 0 && piece_p[r] < tables.size(0), "row ", r, ": no block table ", piece_p[r]);
    const int64_t first = window > 0 ? std::max<int64_t>(0, pos_p[r] + 1 - window) : 0, last = end_p[r];
    TORCH_CHECK(first < last && last <= width * block_size, "row ", r, ": keys [", first, ", ", last,
                ") outside its block table");
    firsts[r] = first;
    ends[r] = last;
    const bool joins = r > 0 && piece_p[r] == group_piece && first <= group_end && last >= group_first &&
                       r - groups.row_start.back() < rows_per_group;
    if (joins) {
      group_first = std::min(group_first, first);
      group_end = std::max(group_end, last);
      continue;
    }
    if (r > 0) close_group(r);
    group_first = first;
    group_end = last;
    group_piece = piece_p[r];
  }
  if (num_rows > 0) close_group(num_rows);
  at::Tensor out = at::empty({num_rows, heads, value_dim}, q.options());
  const Shape shape{kv_heads, head_dim, value_dim, heads / kv_heads, static_cast<float>(scale)};
  if (q.scalar_type() == at::kFloat)
    attend_rows<float>(q, k_cache, v_cache, groups, row_p, shape, out);
  else
    attend_rows<c10::BFloat16>(q, k_cache, v_cache, groups, row_p, shape, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def(
      "paged_attention_rows(Tensor q, Tensor k_cache, Tensor v_cache, Tensor rows, Tensor tables, "
      "Tensor pieces, Tensor positions, Tensor key_ends, int window, float scale) -> Tensor",
      &paged_attention_rows);
}
