// Weight-only int4 / int8 linear layers for x86 CPUs: y = x W^T (+ bias), fp32 in and out.
//
// Activations are quantized to int8 per block of 32 inputs (scale = max|x| / 127, as llama.cpp's Q8_0),
// weights stay 4- or 8-bit codes with a scale (and, for int4, a minimum) per group of G >= 32 inputs; each
// block's dot product is exact integer arithmetic (AVX2 maddubs / madd, AVX-512 VNNI dpbusd or AMX tile
// multiplies), and one block at a time is folded into an fp32 accumulator per output element:
//     acc = fma(float(dot_b), w_scale * x_scale_b, acc);  acc = fma(w_min, x_scale_b * sum_b(x_q), acc)
// in the order b = 0, 1, ..., whatever the number of rows M: a row's output is bitwise independent of the
// other rows of the call and of M (rows only share the unpacking of a weight tile). The integer dot
// products are exact on every path, and the float steps are the same instructions lane by lane, so the
// scalar, AVX2, AVX-512 and AMX paths give bitwise the same results (the tests compare them); so a call
// may pick its path by M (AMX from a few rows on) without a row's result depending on the others.
//
// Layouts (built by specserve/layers/quant.py), for N outputs in tiles of 16 and K inputs:
//   int4 codes  uint8 [N/16, K/8, 64]: line l holds two quads of inputs, 8l..8l+3 in the low nibbles and
//               8l+4..8l+7 in the high ones, byte 4c + j = output 16t + c, input (quad) + j
//   int8 codes  int8 [N/16, K/4, 64]: line l holds inputs 4l..4l+3, byte 4c + j as above
//   int8 scales fp16 [N/16, K/G, 16]
//   int4 scales two levels, as GGUF's Q4_K: group g's scale and minimum are d * s_g and dmin * m_g, with
//               8-bit s_g (unsigned) and m_g (signed) per group, uint8 [N/16, K/G, 32] (16 s, then 16 m),
//               and fp16 d, dmin per 8 groups, [N/16, ceil(K/G / 8), 32] (16 d, then 16 dmin): 4.625 bits
//               a weight at G = 32 instead of 5 with fp16 scales and minimums per group. The products are
//               exact in fp32 (11-bit by 8-bit mantissas), so every path computes the same w_scale, w_min.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t kBlock = 32;  // inputs per activation block, the smallest weight group
constexpr int64_t kTile = 16;   // output columns per weight tile
// Rows sharing one pass over a weight tile on AVX-512 (registers: 8 rows' accumulators and two dot
// products each fit the 32 zmm). One pass streams the tile from memory under all their arithmetic: 8
// rows in one pass rather than two of 4 took the int4 1.5B's T(8) from ~63 to ~58 ms (Zen 4).
constexpr int kRows = 8;
constexpr int kAmxRows = 16;    // rows of one AMX tile multiply
// From this many rows on AMX beats VNNI (measured on Sapphire Rapids at the 1.5B's shapes, when VNNI took
// rows 4 a pass): below, VNNI reads the weights at memory speed, while AMX pays a fixed cost a block (int4
// unpacking, tile stores); from 5 rows VNNI made a second pass over each tile.
constexpr int kAmxMinRows = 5;

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

// AMX needs the CPU's tile and int8 units (CPUID 7.0 EDX bits 24, 25) and the kernel's leave to use the
// tile registers (Linux >= 5.16 grants it per process on request).
bool amx_usable() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25)))
    return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

int64_t detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    return amx_usable() ? kAmx : kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kAvx2;
  return kScalar;
}

// Detected once: the engine asks before every forward, and the AMX check is a system call.
int64_t best_isa() {
  static const int64_t detected = detect_isa();
  return std::min(detected, specserve_vec::isa_cap().load());
}

void cap_isa(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= kAmx, "cap_isa: path ", isa, " is not one of 0 .. 3");
  specserve_vec::isa_cap() = isa;
}

// One call's activations: row r's codes of block b at q + (r * nb + b) * 32, its scale and sum at
// [r * nb + b], or block-major at [b * m + r] on the AMX path: a block's rows side by side, at fixed
// offsets from one pointer (row-major, gcc spent a register chain through the stack on the rows' indices).
struct Acts {
  const int8_t* q;
  const float* scale;  // max|x| / 127
  const float* sum;    // scale * sum of the block's codes (for the int4 minimum)
  int64_t nb, m;
};

constexpr int64_t kGroupsPerSuper = 8;  // int4 groups that share one d, dmin

struct Weights {
  const uint8_t* codes;    // this tile's
  const uint16_t* scales;  // int8: fp16 per group
  const uint8_t* groups;   // int4: s, m per group
  const uint16_t* supers;  // int4: d, dmin per 8 groups
  int gshift;              // log2(G / 32): block b uses group b >> gshift

  // int4: column c's sub-scale and sub-minimum bytes, and d, dmin (fp16 bits) of block b
  const uint8_t* group_of(int64_t b) const { return groups + (b >> gshift) * 2 * kTile; }
  const uint16_t* super_of(int64_t b) const { return supers + ((b >> gshift) / kGroupsPerSuper) * 2 * kTile; }
};

// --------------------------------------------------------------------------------- activations

// Per block: scale = max|x| / 127, codes = round-half-even(x * (127 / max|x|)). Exact operations only
// (max, one rounded multiply, integer sums), so the vector version below gives the same bits.
void quantize_block_scalar(const float* x, int8_t* q, float* scale, float* sum) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0;
  for (int i = 0; i < kBlock; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
    total += q[i];
  }
  *scale = amax / 127.f;
  *sum = *scale * static_cast<float>(total);
}

__attribute__((target("avx2,fma"))) void quantize_block_avx2(const float* x, int8_t* q, float* scale,
                                                             float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i n[4];
  for (int i = 0; i < 4; ++i)
    n[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT));
  // int32 -> int8 (packs interleave 128-bit lanes; the permute puts the 32 codes back in order)
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m256i t = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  *scale = amax / 127.f;
  *sum = *scale * static_cast<float>(_mm_cvtsi128_si32(s));
}

// ------------------------------------------------------------------------------------------ scalar
// The reference path (and the one for CPUs without AVX2): the same arithmetic, element by element.

float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

template <bool kInt4>
void tile_scalar(const Weights& w, const Acts& a, int64_t r0, int rows, const float* bias, float* out,
                 int64_t ldo) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < kTile; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < a.nb; ++b) {
        const int8_t* xq = a.q + ((r0 + r) * a.nb + b) * kBlock;
        int32_t dot = 0;
        for (int i = 0; i < kBlock; ++i) {
          const int64_t quad = b * 8 + i / 4;
          int32_t code;
          if (kInt4)
            code = (w.codes[(quad / 2) * 64 + 4 * c + i % 4] >> (4 * (quad % 2))) & 15;
          else
            code = reinterpret_cast<const int8_t*>(w.codes)[quad * 64 + 4 * c + i % 4];
          dot += code * xq[i];
        }
        const int64_t i = (r0 + r) * a.nb + b;
        if (kInt4) {
          const uint8_t* sm = w.group_of(b);
          const uint16_t* dd = w.super_of(b);
          const float ws = half_to_float(dd[c]) * static_cast<float>(sm[c]);
          const float mn = half_to_float(dd[kTile + c]) * static_cast<float>(static_cast<int8_t>(sm[kTile + c]));
          acc = std::fma(static_cast<float>(dot), ws * a.scale[i], acc);
          acc = std::fma(mn, a.sum[i], acc);
        } else {
          const float ws = half_to_float(w.scales[(b >> w.gshift) * kTile + c]);
          acc = std::fma(static_cast<float>(dot), ws * a.scale[i], acc);
        }
      }
      out[r * ldo + c] = bias ? acc + bias[c] : acc;
    }
  }
}

// int4 codes are prefetched this far ahead of their use: the L2 streamer alone keeps too few lines in
// flight for one core to read at memory speed (Sapphire Rapids, int4 1.5B: a batch-1 step 51 -> 48 ms,
// a forward over 8 rows 86 -> 78 ms; 2-4 KiB ahead measured best; int8, twice the bytes a block, got
// slower. Zen 3, AVX2: the 1.5B's MLP weights read 8-20% faster at 1 to 8 rows). Prefetches never
// fault, so reading past the end of the codes is harmless.
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_lines(const uint8_t* p, int lines) {
  for (int l = 0; l < lines; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * l), _MM_HINT_T0);
}

// -------------------------------------------------------------------------------------------- AVX2
// Up to kAvx2Rows rows in one pass over a weight tile: per block, one 8-column half of the tile at a time
// is unpacked into 8 registers and stays there while the rows stream past, each row's broadcast
// activations against it and its fp32 accumulators in L1 (16 registers hold no more: with both halves and
// 4 rows in registers, as before, gcc spilled the dot products, and 8 or 16 rows took 2 or 4 passes, each
// unpacking the tile again: int4 at the 1.5B's shapes, 16 rows, a forward's linears 358 -> 297 ms on one
// Xeon core). A row's float steps are the same whatever the rows beside it.
constexpr int kAvx2Rows = 16;

template <bool kInt4>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const Weights& w, const Acts& a, int64_t r0,
                                                        int rows, const float* bias, float* out,
                                                        int64_t ldo) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  alignas(32) float acc[kAvx2Rows][kTile];
  std::memset(acc, 0, rows * sizeof acc[0]);
  const int64_t stride = a.nb * kBlock;
  for (int64_t b = 0; b < a.nb; ++b) {
    const int8_t* x0 = a.q + (r0 * a.nb + b) * kBlock;
    const float *scale0 = a.scale + r0 * a.nb + b, *sum0 = a.sum + r0 * a.nb + b;
    if (kInt4) prefetch_lines(w.codes + 4 * b * 64 + kPrefetchBytes, 4);
#pragma GCC unroll 1
    for (int h = 0; h < 2; ++h) {
      // int4: quads 2p (low nibbles) and 2p + 1 (high) of line p; int8: |codes| of line l (maddubs wants
      // one unsigned side, so the rows' inputs take the codes' signs)
      __m256i wv[8];
      const uint8_t* lines = w.codes + (kInt4 ? 4 : 8) * b * 64 + 32 * h;
      __m256 ws, mn = _mm256_setzero_ps();
      if (kInt4) {
        for (int p = 0; p < 4; ++p) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + 64 * p));
          wv[2 * p] = _mm256_and_si256(v, nibble);
          wv[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        }
        const uint8_t* sm = w.group_of(b) + 8 * h;
        const uint16_t* dd = w.super_of(b) + 8 * h;
        ws = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dd))),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                               reinterpret_cast<const __m128i*>(sm)))));
        mn = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dd + kTile))),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                               reinterpret_cast<const __m128i*>(sm + kTile)))));
      } else {
        for (int l = 0; l < 8; ++l) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + 64 * l));
          wv[l] = _mm256_sign_epi8(v, v);
        }
        ws = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales + (b >> w.gshift) * kTile + 8 * h)));
      }
#pragma GCC unroll 1
      for (int r = 0; r < rows; ++r) {
        const int8_t* xq = x0 + r * stride;
        __m256i d;
        if (kInt4) {
          // 16 products of <= 15 * 127 per int16 lane: at most 30480, no saturation, so sum in int16
          __m256i p[8];
          for (int q = 0; q < 8; ++q) {
            int32_t xi;
            std::memcpy(&xi, xq + 4 * q, 4);
            p[q] = _mm256_maddubs_epi16(wv[q], _mm256_set1_epi32(xi));
          }
          for (int q = 0; q < 4; ++q) p[q] = _mm256_add_epi16(p[q], p[q + 4]);
          d = _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])), ones);
        } else {
          // <= 2 * 128 * 127 per int16 lane: to int32 after each multiply
          __m256i p[8];
          for (int l = 0; l < 8; ++l) {
            int32_t xi;
            std::memcpy(&xi, xq + 4 * l, 4);
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + 64 * l));
            p[l] = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[l], _mm256_sign_epi8(_mm256_set1_epi32(xi), v)),
                                     ones);
          }
          for (int l = 0; l < 4; ++l) p[l] = _mm256_add_epi32(p[l], p[l + 4]);
          d = _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3]));
        }
        const __m256 s = _mm256_mul_ps(ws, _mm256_set1_ps(scale0[r * a.nb]));
        __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, _mm256_load_ps(acc[r] + 8 * h));
        if (kInt4) y = _mm256_fmadd_ps(mn, _mm256_set1_ps(sum0[r * a.nb]), y);
        _mm256_store_ps(acc[r] + 8 * h, y);
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h) {
      __m256 y = _mm256_load_ps(acc[r] + 8 * h);
      if (bias) y = _mm256_add_ps(y, _mm256_loadu_ps(bias + 8 * h));
      _mm256_storeu_ps(out + r * ldo + 8 * h, y);
    }
}

// ----------------------------------------------------------------------------------- AVX-512 VNNI
// The tile's 16 columns a vector, up to kRows rows a pass (registers), and dpbusd for AVX2's maddubs +
// madd + add (exact integers alike).

// Block b's exact int32 dot products (R rows x 16 outputs) into the fp32 accumulators: the float steps
// of both 512-bit paths, instruction for instruction.
// kBlockMajor: the activations' scales and sums are block-major (AMX).
template <int R, bool kInt4, bool kBlockMajor = false>
__attribute__((target("avx512f,avx512bw"))) inline void fold_block_avx512(__m512* acc, const __m512i* dot,
                                                                         const Weights& w, const Acts& a,
                                                                         int64_t r0, int64_t b) {
  __m512 ws, mn = _mm512_setzero_ps();
  if (kInt4) {
    const uint8_t* sm = w.group_of(b);
    const uint16_t* dd = w.super_of(b);
    ws = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd))),
                       _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                           reinterpret_cast<const __m128i*>(sm)))));
    mn = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dd + kTile))),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                           reinterpret_cast<const __m128i*>(sm + kTile)))));
  } else {
    ws = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + (b >> w.gshift) * kTile)));
  }
  // the same steps either way; only where a row's scale and sum are read from differs
  if constexpr (kBlockMajor) {
    const float *scale = a.scale + b * a.m + r0, *sum = a.sum + b * a.m + r0;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(scale[r]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), s, acc[r]);
      if (kInt4) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sum[r]), acc[r]);
    }
    return;
  }
  for (int r = 0; r < R; ++r) {
    const int64_t i = (r0 + r) * a.nb + b;
    const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(a.scale[i]));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), s, acc[r]);
    if (kInt4) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.sum[i]), acc[r]);
  }
}

template <int R>
__attribute__((target("avx512f"))) inline void store_rows_avx512(const __m512* acc, const float* bias,
                                                                float* out, int64_t ldo) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    __m512 y = acc[r];
    if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(out + r * ldo, y);
  }
}

template <int R, bool kInt4>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_avx512(const Weights& w, const Acts& a,
                                                                        int64_t r0, const float* bias,
                                                                        float* out, int64_t ldo) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const int8_t* xq[R];
    for (int r = 0; r < R; ++r) xq[r] = a.q + ((r0 + r) * a.nb + b) * kBlock;
    // Two sums a row (low and high nibbles, or even and odd lines), added at the end: each chain of
    // dependent dpbusd is half as long (their latency, not their throughput, bounded a block), and integer
    // sums are exact in any order.
    __m512i dot[R], dot2[R];
    for (int r = 0; r < R; ++r) dot[r] = dot2[r] = zero;
    if (kInt4) {
      prefetch_lines(w.codes + 4 * b * 64 + kPrefetchBytes, 4);
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(w.codes + (4 * b + p) * 64);
        const __m512i lo = _mm512_and_si512(v, nibble),
                      hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; ++r) {
          int32_t x0, x1;
          std::memcpy(&x0, xq[r] + 8 * p, 4);
          std::memcpy(&x1, xq[r] + 8 * p + 4, 4);
          dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(x0));
          dot2[r] = _mm512_dpbusd_epi32(dot2[r], hi, _mm512_set1_epi32(x1));
        }
      }
    } else {
      for (int l = 0; l < 8; ++l) {
        const __m512i v = _mm512_loadu_si512(w.codes + (8 * b + l) * 64);
        const __m512i av = _mm512_abs_epi8(v);
        const __mmask64 negative = _mm512_movepi8_mask(v);
        for (int r = 0; r < R; ++r) {
          int32_t x;
          std::memcpy(&x, xq[r] + 4 * l, 4);
          const __m512i xb = _mm512_set1_epi32(x);
          __m512i& sum = l % 2 ? dot2[r] : dot[r];
          sum = _mm512_dpbusd_epi32(sum, av, _mm512_mask_sub_epi8(xb, negative, zero, xb));
        }
      }
    }
    for (int r = 0; r < R; ++r) dot[r] = _mm512_add_epi32(dot[r], dot2[r]);
    fold_block_avx512<R, kInt4>(acc, dot, w, a, r0, b);
  }
  store_rows_avx512<R>(acc, bias, out, ldo);
}

// --------------------------------------------------------------------------------------------- AMX
// Intel AMX (Sapphire Rapids on): one tile multiply gives a block's exact int32 dot products for up to 16
// rows x 16 columns (VNNI needs 8 instructions per row); the dot products go through memory to the AVX-512
// path's float steps (fold_block_avx512), so the bits are the same. Two sets of tiles take alternate
// blocks, so one block's multiply can overlap the next one's loads: tile s = a block's activations
// [rows, 32] int8 (set s), 2 and 3 = blocks of weights [8, 64] (4 inputs of 16 columns a line: the codes'
// own layout, int4 unpacked to bytes), 4 to 7 = dot products [rows, 16] int32. Up to 8 rows, a call
// may take two weight tiles (32 columns) at once, each block's activations loaded once for both: a down
// projection's (8 x 8960 int8) do not fit in L1, and its 8-row calls took 495 -> 414 us on Sapphire Rapids;
// where they fit (8 x 1536) one tile a call was a few % faster.

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void amx_configure(int rows) {
  TileConfig c;
  for (int t = 0; t < 2; ++t) c.rows[t] = rows, c.colsb[t] = kBlock;  // activations
  for (int t = 2; t < 4; ++t) c.rows[t] = kBlock / 4, c.colsb[t] = 64;  // weights
  for (int t = 4; t < 8; ++t) c.rows[t] = rows, c.colsb[t] = kTile * 4;  // dot products
  // not _tile_loadconfig: gcc 12 does not see that it reads the struct and drops the stores above
  asm volatile("ldtilecfg %0" : : "m"(c));
}

__attribute__((target("amx-tile"))) void amx_release() { _tile_release(); }

// A block's dot products into `dots` on tiles X (activations, loaded), W (weights), D (dot products).
// gcc 12's tile intrinsics paste their tile numbers into the assembly text (literals only), hence a macro.
#define SPECSERVE_AMX_DOT(X, W, D, weights, dots)                       \
  do {                                                                  \
    _tile_zero(D);                                                      \
    _tile_loadd(W, weights, 64);                                        \
    if (kInt4)                                                          \
      _tile_dpbsud(D, X, W); /* signed activations x unsigned codes */ \
    else                                                                \
      _tile_dpbssd(D, X, W);                                            \
    _tile_stored(D, dots, kTile * 4);                                   \
  } while (0)

// The blocks go through a software pipeline: in step i block i is unpacked, block i - kAmxLag multiplied
// and block i - 2 kAmxLag folded, so the weights stream in (and the tile unit works) while the vector units
// fold, instead of in turns; tile results are read back kAmxLag steps after their store.
constexpr int64_t kAmxLag = 2, kAmxRing = 4;  // ring slots > lag

// The configured tile rows (>= R) of activations are read from row r0 on (the caller pads past M with
// zero rows); R of them are finished, for kCols weight tiles side by side (w[0], w[1]: outputs
// out, out + 16).
template <int R, bool kInt4, int kCols>
__attribute__((target("avx512f,avx512bw,amx-tile,amx-int8"))) void tile_amx(const Weights* w,
                                                                          const Acts& a, int64_t r0,
                                                                          const float* bias, float* out,
                                                                          int64_t ldo) {
  alignas(64) uint8_t unpacked[kAmxRing][kCols][kBlock * kTile];
  alignas(64) int32_t dots[kAmxRing][kCols][kAmxRows * kTile];
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // in registers only if gcc unrolls the loops before it places them: hence the pragmas
  __m512 acc[kCols][R];
#pragma GCC unroll 2
  for (int c = 0; c < kCols; ++c)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
  const int64_t stride = a.nb * kBlock;
  const int8_t* x = a.q + r0 * stride;
  for (int64_t i = 0; i < a.nb + 2 * kAmxLag; ++i) {
    if (kInt4 && i < a.nb) {  // line l -> quads 2l (low nibbles), 2l + 1 (high)
#pragma GCC unroll 2
      for (int c = 0; c < kCols; ++c) {
        uint8_t* to = unpacked[i % kAmxRing][c];
        const uint8_t* line = w[c].codes + 4 * i * 64;
        prefetch_lines(line + kPrefetchBytes, 4);
        for (int l = 0; l < 4; ++l) {
          const __m512i v = _mm512_loadu_si512(line + 64 * l);
          _mm512_store_si512(to + 128 * l, _mm512_and_si512(v, nibble));
          _mm512_store_si512(to + 128 * l + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
        }
      }
    }
    const int64_t b = i - kAmxLag;
    if (b >= 0 && b < a.nb) {
      const int64_t slot = b % kAmxRing;
      auto weights = [&](int c) { return kInt4 ? unpacked[slot][c] : w[c].codes + b * kBlock * kTile; };
      if (b & 1) {
        _tile_loadd(1, x + b * kBlock, stride);
        SPECSERVE_AMX_DOT(1, 3, 5, weights(0), dots[slot][0]);
        if (kCols == 2) SPECSERVE_AMX_DOT(1, 2, 7, weights(1), dots[slot][1]);
      } else {
        _tile_loadd(0, x + b * kBlock, stride);
        SPECSERVE_AMX_DOT(0, 2, 4, weights(0), dots[slot][0]);
        if (kCols == 2) SPECSERVE_AMX_DOT(0, 3, 6, weights(1), dots[slot][1]);
      }
    }
    const int64_t f = i - 2 * kAmxLag;
    if (f >= 0) {
#pragma GCC unroll 2
      for (int c = 0; c < kCols; ++c) {
        __m512i dot[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) dot[r] = _mm512_load_si512(dots[f % kAmxRing][c] + r * kTile);
        fold_block_avx512<R, kInt4, true>(acc[c], dot, w[c], a, r0, f);
      }
    }
  }
#pragma GCC unroll 2
  for (int c = 0; c < kCols; ++c)
    store_rows_avx512<R>(acc[c], bias ? bias + c * kTile : nullptr, out + c * kTile, ldo);
}

constexpr int kAmxPairRows = 8;           // up to this many rows, two weight tiles a call (registers)
constexpr int64_t kPairFromBytes = 16384;  // of int8 activations a call: L1 holds them up to ~this

// `tiles` (1 or 2) weight tiles side by side, for all rows.
template <bool kInt4>
void rows_of_tiles_amx(const Weights* w, int tiles, const Acts& a, int64_t rows, const float* bias,
                       float* out, int64_t ldo) {
  for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
    const int n = static_cast<int>(std::min<int64_t>(kAmxRows, rows - r0));
    const bool pair = tiles == 2 && n <= kAmxPairRows;
    for (int c = 0; c < tiles; c += pair ? 2 : 1) {
      const float* b = bias ? bias + c * kTile : nullptr;
      float* o = out + r0 * ldo + c * kTile;
      switch (n) {
#define SPECSERVE_TILE(R)                                  \
  case R:                                                  \
    if constexpr (R <= kAmxPairRows)                       \
      if (pair) {                                          \
        tile_amx<R, kInt4, 2>(w, a, r0, b, o, ldo);        \
        break;                                             \
      }                                                    \
    tile_amx<R, kInt4, 1>(w + c, a, r0, b, o, ldo);        \
    break;
        SPECSERVE_TILE(1)
        SPECSERVE_TILE(2)
        SPECSERVE_TILE(3)
        SPECSERVE_TILE(4)
        SPECSERVE_TILE(5)
        SPECSERVE_TILE(6)
        SPECSERVE_TILE(7)
        SPECSERVE_TILE(8)
        SPECSERVE_TILE(9)
        SPECSERVE_TILE(10)
        SPECSERVE_TILE(11)
        SPECSERVE_TILE(12)
        SPECSERVE_TILE(13)
        SPECSERVE_TILE(14)
        SPECSERVE_TILE(15)
        SPECSERVE_TILE(16)
#undef SPECSERVE_TILE
      }
    }
  }
}

// ------------------------------------------------------------------------------------------ driver

template <bool kInt4>
void rows_of_tile(int64_t isa, const Weights& w, const Acts& a, int64_t rows, const float* bias, float* out,
                  int64_t ldo) {
  if (isa == kAvx2) {
    for (int64_t r0 = 0; r0 < rows; r0 += kAvx2Rows)
      tile_avx2<kInt4>(w, a, r0, static_cast<int>(std::min<int64_t>(kAvx2Rows, rows - r0)), bias,
                       out + r0 * ldo, ldo);
    return;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int n = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
    float* o = out + r0 * ldo;
    if (isa == kScalar) {
      tile_scalar<kInt4>(w, a, r0, n, bias, o, ldo);
      continue;
    }
#define SPECSERVE_TILE(R)                          \
  case R:                                          \
    tile_avx512<R, kInt4>(w, a, r0, bias, o, ldo); \
    break;
    switch (n) {
      SPECSERVE_TILE(1)
      SPECSERVE_TILE(2)
      SPECSERVE_TILE(3)
      SPECSERVE_TILE(4)
      SPECSERVE_TILE(5)
      SPECSERVE_TILE(6)
      SPECSERVE_TILE(7)
      SPECSERVE_TILE(8)
    }
#undef SPECSERVE_TILE
  }
}

int64_t resolve_isa(int64_t isa) {
  const int64_t best = best_isa();
  TORCH_CHECK(isa <= best, "specserve qlinear: path ", isa, " is not supported by this CPU (best ", best,
              ")");
  return isa < 0 ? best : isa;
}

constexpr int64_t kQuantizeGrain = 512;  // activation blocks a thread quantizes at least

// The codes get `rows` >= M rows, zeros past M (AMX reads whole tiles of rows); scales and sums M, laid
// out block-major if asked (Acts; returned as [M, nb] views either way).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_padded(const at::Tensor& x, int64_t isa,
                                                                   int64_t rows, bool block_major) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x: contiguous fp32 [M, K]");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of ", kBlock);
  isa = resolve_isa(isa);
  const int64_t m = x.size(0), nb = x.size(1) / kBlock;
  at::Tensor q = at::empty({rows, nb * kBlock}, x.options().dtype(at::kChar));
  if (rows > m) q.narrow(0, m, rows - m).zero_();
  const auto shape = block_major ? std::vector<int64_t>{nb, m} : std::vector<int64_t>{m, nb};
  at::Tensor scale = at::empty(shape, x.options()), sum = at::empty(shape, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float *sp = scale.data_ptr<float>(), *up = sum.data_ptr<float>();
  // blocks are independent: threads share a large call (a verification block's down projection: 8 x 8960
  // inputs took 24 us on one thread), a small one stays on the caller's. Each thread writes a range of
  // the scales and sums (threads writing neighbouring floats of one cache line cost more than they saved)
  at::parallel_for(0, m * nb, kQuantizeGrain, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t i = block_major ? j % m * nb + j / m : j;  // block i % nb of row i / nb
      if (isa == kScalar)
        quantize_block_scalar(xp + i * kBlock, qp + i * kBlock, sp + j, up + j);
      else
        quantize_block_avx2(xp + i * kBlock, qp + i * kBlock, sp + j, up + j);
    }
  });
  if (block_major) return {q, scale.t(), sum.t()};
  return {q, scale, sum};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, int64_t isa) {
  return quantize_rows_padded(x, isa, x.size(0), false);
}

// One weight's layout, checked against K: where a call finds each output tile's codes and scales.
// int4: `scales` is the groups' bytes (uint8 [N/16, K/G, 32]) and `supers` d, dmin (fp16 [N/16, S, 32]);
// int8: `scales` fp16 [N/16, K/G, 16].
struct Layout {
  bool int4;
  int64_t tiles, groups, super_groups, tile_bytes;
  int gshift;
  const uint8_t* codes;
  const uint8_t* scales;
  const uint16_t* supers;

  Layout(bool int4, int64_t k, const at::Tensor& codes, const at::Tensor& scales,
         const c10::optional<at::Tensor>& supers)
      : int4(int4) {
    TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 64 && codes.is_contiguous(),
                "codes: packed [N/16, _, 64]");
    const int64_t width = int4 ? 2 * kTile : kTile;
    TORCH_CHECK(scales.dim() == 3 && scales.size(2) == width &&
                    scales.scalar_type() == (int4 ? at::kByte : at::kHalf) && scales.is_contiguous(),
                int4 ? "scales: uint8 [N/16, K/G, 32]" : "scales: fp16 [N/16, K/G, 16]");
    tiles = codes.size(0);
    TORCH_CHECK(codes.size(1) * (int4 ? 8 : 4) == k, "codes do not match K = ", k);
    groups = scales.size(1);
    TORCH_CHECK(scales.size(0) == tiles && groups > 0 && k % groups == 0, "scales do not match the codes");
    const int64_t per_group = k / groups / kBlock;
    TORCH_CHECK(per_group > 0 && (per_group & (per_group - 1)) == 0 && per_group * kBlock * groups == k,
                "group size must be 32 times a power of two");
    super_groups = (groups + kGroupsPerSuper - 1) / kGroupsPerSuper;
    if (int4)
      TORCH_CHECK(supers && supers->dim() == 3 && supers->size(0) == tiles &&
                      supers->size(1) == super_groups && supers->size(2) == 2 * kTile &&
                      supers->scalar_type() == at::kHalf && supers->is_contiguous(),
                  "supers: fp16 [N/16, ceil(K/G / 8), 32]");
    gshift = __builtin_ctzll(per_group);
    tile_bytes = codes.size(1) * 64;
    this->codes = static_cast<const uint8_t*>(codes.data_ptr());
    this->scales = static_cast<const uint8_t*>(scales.data_ptr());
    this->supers = int4 ? reinterpret_cast<const uint16_t*>(supers->data_ptr<at::Half>()) : nullptr;
  }

  Weights tile(int64_t t) const {
    Weights w{codes + t * tile_bytes, nullptr, nullptr, nullptr, gshift};
    if (int4) {
      w.groups = scales + t * groups * 2 * kTile;
      w.supers = supers + t * super_groups * 2 * kTile;
    } else {
      w.scales = reinterpret_cast<const uint16_t*>(scales) + t * groups * kTile;
    }
    return w;
  }
};

// Output tiles (of 16 columns) a thread takes at least: ~32 KiB of K x rows (<= kRows) work.
int64_t tile_grain(int64_t k, int64_t rows) {
  return std::max<int64_t>(1, 32768 / (k * std::min<int64_t>(rows, kRows)));
}

at::Tensor qlinear(bool int4, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& supers, const c10::optional<at::Tensor>& bias,
                   int64_t isa) {
  const int64_t k = x.size(1);
  const Layout layout(int4, k, codes, scales, supers);
  const int64_t tiles = layout.tiles, n = tiles * kTile;
  if (bias)
    TORCH_CHECK(
        bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
        "bias: contiguous fp32 [N]");
  const int64_t m = x.size(0);
  const bool automatic = isa < 0;
  isa = resolve_isa(isa);
  if (automatic && isa == kAmx && m < kAmxMinRows) isa = kAvx512;
  // past the first 16 rows AMX reads whole tiles of 16: the last one is padded
  const int64_t rows = isa == kAmx && m > kAmxRows ? (m + kAmxRows - 1) / kAmxRows * kAmxRows : m;
  const auto [q, scale, sum] = quantize_rows_padded(x, isa, rows, isa == kAmx);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const Acts acts{q.data_ptr<int8_t>(), scale.data_ptr<float>(), sum.data_ptr<float>(), k / kBlock, m};
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // split over output tiles only: every element is computed the same way whatever the thread count
  // AMX takes output tiles two by two (the odd one out alone) where the call's activations outgrow L1, so
  // that each block's are loaded once for both; else one by one (the pairs' registers spill)
  const bool pairs = isa == kAmx && m * k > kPairFromBytes;
  at::parallel_for(0, tiles, tile_grain(k, m), [&](int64_t t0, int64_t t1) {
    if (isa == kAmx) amx_configure(static_cast<int>(std::min<int64_t>(m, kAmxRows)));  // per thread
    for (int64_t t = t0, step; t < t1; t += step) {
      step = pairs ? std::min<int64_t>(2, t1 - t) : 1;
      const Weights w[2] = {layout.tile(t), layout.tile(t + step - 1)};
      const float* b = bp ? bp + t * kTile : nullptr;
      float* o = op + t * kTile;
      if (isa == kAmx)
        int4 ? rows_of_tiles_amx<true>(w, step, acts, m, b, o, n)
             : rows_of_tiles_amx<false>(w, step, acts, m, b, o, n);
      else if (int4)
        rows_of_tile<true>(isa, w[0], acts, m, b, o, n);
      else
        rows_of_tile<false>(isa, w[0], acts, m, b, o, n);
    }
    if (isa == kAmx) amx_release();
  });
  return out;
}

// Mixture-of-experts layers: E weights of one shape, their buffers stacked [E, ...], and rows sorted by
// expert, counts[e] rows for expert e (zero for most). One call computes every expert's rows, in parallel
// over (expert with rows, output tile): a decode or verification step pays one activation quantization
// and one parallel region per projection instead of one per active expert, and each expert's tiles are
// read once for all its rows. Each row's result is bitwise that of a call on its expert's rows alone
// (the tiles are row-invariant). AMX is not used: it reads whole tiles of 16 rows, block-major, across
// segments; automatic calls take the AVX-512 path there, which gives the same bits.
at::Tensor grouped_qlinear(bool int4, const at::Tensor& x, const at::Tensor& counts, const at::Tensor& codes,
                           const at::Tensor& scales, const c10::optional<at::Tensor>& supers, int64_t isa) {
  TORCH_CHECK(codes.dim() == 4 && scales.dim() == 4 && (!int4 || (supers && supers->dim() == 4)),
              "stacked buffers: [E, N/16, _, _]");
  const int64_t experts = codes.size(0);
  TORCH_CHECK(experts > 0 && scales.size(0) == experts && (!int4 || supers->size(0) == experts),
              "stacked buffers: one number of experts");
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == experts && counts.scalar_type() == at::kLong &&
                  counts.is_cpu(),
              "counts: int64 [E] on the CPU");
  TORCH_CHECK(x.dim() == 2, "x: [rows, K]");
  const int64_t k = x.size(1);
  // expert e's buffers are its slices; their checks cover the stacked ones (contiguous slices of them)
  const at::Tensor codes0 = codes[0], scales0 = scales[0];
  const c10::optional<at::Tensor> supers0 = int4 ? c10::optional<at::Tensor>((*supers)[0]) : c10::nullopt;
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && (!int4 || supers->is_contiguous()),
              "stacked buffers: contiguous");
  const Layout first(int4, k, codes0, scales0, supers0);
  struct Segment {
    int64_t expert, start, rows;
  };
  std::vector<Segment> segments;
  const at::Tensor count_values = counts.contiguous();
  const int64_t* cp = count_values.data_ptr<int64_t>();
  int64_t total = 0, most = 0;
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK(cp[e] >= 0, "counts: negative count for expert ", e);
    if (cp[e]) segments.push_back({e, total, cp[e]});
    total += cp[e];
    most = std::max(most, cp[e]);
  }
  TORCH_CHECK(total == x.size(0), "counts add up to ", total, " rows, x has ", x.size(0));
  const bool automatic = isa < 0;
  isa = resolve_isa(isa);
  TORCH_CHECK(automatic || isa != kAmx, "grouped calls have no AMX path (its bits are AVX-512's)");
  if (isa == kAmx) isa = kAvx512;
  const auto [q, scale, sum] = quantize_rows_padded(x, isa, total, false);
  const int64_t tiles = first.tiles, n = tiles * kTile, nb = k / kBlock;
  at::Tensor out = at::empty({total, n}, x.options());
  if (segments.empty()) return out;
  const int64_t codes_step = codes0.numel(), scales_step = scales0.nbytes();
  const int64_t supers_step = int4 ? supers0->numel() : 0;
  const int8_t* qp = q.data_ptr<int8_t>();
  const float *sp = scale.data_ptr<float>(), *up = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // work items (segment, tile) in that order: a thread's range covers whole experts where it can
  const int64_t items = static_cast<int64_t>(segments.size()) * tiles;
  at::parallel_for(0, items, tile_grain(k, most), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Segment& s = segments[i / tiles];
      const int64_t t = i % tiles;
      Layout layout = first;
      layout.codes += s.expert * codes_step;
      layout.scales += s.expert * scales_step;
      if (int4) layout.supers += s.expert * supers_step;
      const Acts acts{qp + s.start * nb * kBlock, sp + s.start * nb, up + s.start * nb, nb, s.rows};
      float* o = op + s.start * n + t * kTile;
      if (int4)
        rows_of_tile<true>(isa, layout.tile(t), acts, s.rows, nullptr, o, n);
      else
        rows_of_tile<false>(isa, layout.tile(t), acts, s.rows, nullptr, o, n);
    }
  });
  return out;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& supers, const c10::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(codes.scalar_type() == at::kByte, "int4 codes: uint8");
  return qlinear(true, x, codes, scales, supers, bias, isa);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(codes.scalar_type() == at::kChar, "int8 codes: int8");
  return qlinear(false, x, codes, scales, c10::nullopt, bias, isa);
}

at::Tensor int4_grouped_linear(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& codes,
                               const at::Tensor& scales, const at::Tensor& supers, int64_t isa) {
  TORCH_CHECK(codes.scalar_type() == at::kByte, "int4 codes: uint8");
  return grouped_qlinear(true, x, counts, codes, scales, supers, isa);
}

at::Tensor int8_grouped_linear(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& codes,
                               const at::Tensor& scales, int64_t isa) {
  TORCH_CHECK(codes.scalar_type() == at::kChar, "int8 codes: int8");
  return grouped_qlinear(false, x, counts, codes, scales, c10::nullopt, isa);
}

// How many threads `at::parallel_for` runs a large range on here: 1 if the library was built without
// OpenMP (ATen's parallel_for is then a serial loop in the extension, whatever torch's thread count).
int64_t parallel_threads() {
  std::vector<char> seen(at::get_num_threads(), 0);
  at::parallel_for(0, 1 << 20, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  return std::count(seen.begin(), seen.end(), 1);
}

}  // namespace

TORCH_LIBRARY(specserve, m) {
  m.def("best_isa() -> int", &best_isa);
  m.def("cap_isa(int isa) -> ()", &cap_isa);
  m.def("parallel_threads() -> int", &parallel_threads);
  m.def("quantize_rows(Tensor x, int isa=-1) -> (Tensor, Tensor, Tensor)", &quantize_rows);
  m.def(
      "int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor supers, Tensor? bias=None, int isa=-1) -> "
      "Tensor",
      &int4_linear);
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias=None, int isa=-1) -> Tensor",
        &int8_linear);
  m.def(
      "int4_grouped_linear(Tensor x, Tensor counts, Tensor codes, Tensor scales, Tensor supers, int isa=-1) "
      "-> Tensor",
      &int4_grouped_linear);
  m.def(
      "int8_grouped_linear(Tensor x, Tensor counts, Tensor codes, Tensor scales, int isa=-1) -> Tensor",
      &int8_grouped_linear);
}
