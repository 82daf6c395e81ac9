// A mixture-of-experts layer's routing bookkeeping (layers/moe.py), each half in one call: `moe_dispatch`
// sorts a step's (token, expert) pairs by expert and gathers the tokens' rows in that order; `moe_combine`
// adds each token's weighted expert outputs back in the order of its experts' ids. torch spends ~15
// operators of a few microseconds each on this (three sorts, a bincount, gathers, k additions): at decode
// sizes more than a layer's attention arithmetic.
//
// Both are bitwise the torch fallback: the sort is stable (a counting sort over experts, pairs in token
// order within an expert), and each term is rounded as a product before it is added, from zero, in id
// order (the file is built without contracted multiply-adds). Every token is computed on its own.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

// Tokens a thread takes before a call splits its tokens over threads (decode and verification run inline).
constexpr int64_t kGrainElements = 1 << 16;

void check_routing(const at::Tensor& ids, int64_t tokens, const char* op) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.is_contiguous() && ids.size(0) == tokens,
              op, ": ids must be int64 [tokens, top_k], contiguous");
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(-1) == 1, name,
              ": fp32 [rows, dim] with unit stride in dim");
}

// (rows [N * k, H]: the tokens' rows sorted by expert, stably; counts [E]: rows of each expert;
//  slots [N, k]: where the pair (token, j) sits in rows).
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_dispatch(const at::Tensor& x, const at::Tensor& ids,
                                                           int64_t num_experts) {
  check_rows(x, "moe_dispatch: x");
  const int64_t tokens = x.size(0), dim = x.size(1);
  check_routing(ids, tokens, "moe_dispatch");
  TORCH_CHECK(num_experts > 0, "moe_dispatch: num_experts must be positive");
  const int64_t pairs = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  auto counts = at::zeros({num_experts}, ids.options());
  int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_experts, "moe_dispatch: expert id ", id[i], " outside [0, ",
                num_experts, ")");
    ++count[id[i]];
  }
  std::vector<int64_t> next(num_experts);  // the next free row of each expert
  for (int64_t e = 0, start = 0; e < num_experts; start += count[e++]) next[e] = start;
  auto slots = at::empty_like(ids);
  int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs; ++i) slot[i] = next[id[i]]++;

  auto rows = at::empty({pairs, dim}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = rows.data_ptr<float>();
  const int64_t top_k = ids.size(1), stride = x.stride(0);
  at::parallel_for(0, pairs, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(dim, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i)
                       std::memcpy(dst + slot[i] * dim, src + i / top_k * stride, dim * sizeof(float));
                   });
  return {rows, counts, slots};
}

// out [N, H]: token t's sum over its k experts, in the order of their ids, of y[slots[t, j]] * weights[t, j].
at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& ids,
                       const at::Tensor& slots) {
  check_rows(y, "moe_combine: y");
  const int64_t tokens = ids.size(0), top_k = ids.dim() == 2 ? ids.size(1) : 0, dim = y.size(1);
  check_routing(ids, tokens, "moe_combine");
  TORCH_CHECK(slots.sizes() == ids.sizes() && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "moe_combine: slots must be int64 shaped as ids, contiguous");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "moe_combine: weights must be fp32 shaped as ids, contiguous");
  TORCH_CHECK(y.size(0) == tokens * top_k, "moe_combine: y must have tokens * top_k rows");
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* weight = weights.data_ptr<float>();
  const float* terms = y.data_ptr<float>();
  const int64_t stride = y.stride(0), rows = y.size(0);
  for (int64_t i = 0; i < tokens * top_k; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < rows, "moe_combine: slot ", slot[i], " outside y's rows");
  auto out = at::empty({tokens, dim}, y.options());
  float* result = out.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(dim * top_k, 1)),
                   [&](int64_t begin, int64_t end) {
                     std::vector<int64_t> by_id(top_k);
                     for (int64_t t = begin; t < end; ++t) {
                       const int64_t* token_ids = id + t * top_k;
                       for (int64_t j = 0; j < top_k; ++j) by_id[j] = j;
                       std::stable_sort(by_id.begin(), by_id.end(),
                                        [&](int64_t a, int64_t b) { return token_ids[a] < token_ids[b]; });
                       float* o = result + t * dim;
                       std::fill(o, o + dim, 0.0f);
                       for (const int64_t j : by_id) {
                         const float w = weight[t * top_k + j];
                         const float* term = terms + slot[t * top_k + j] * stride;
                         for (int64_t d = 0; d < dim; ++d) o[d] += term[d] * w;
                       }
                     }
                   });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("moe_dispatch(Tensor x, Tensor ids, int num_experts) -> (Tensor, Tensor, Tensor)", &moe_dispatch);
  m.def("moe_combine(Tensor y, Tensor weights, Tensor ids, Tensor slots) -> Tensor", &moe_combine);
}
