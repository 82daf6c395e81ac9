// Vector helpers the kernels share: GCC vector types of L floats, compiled for AVX-512 (L = 16, a zmm)
// or AVX2 (L = 8, a ymm) by the target attribute of the function they are inlined into.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace specserve_vec {

// L: the floats of one vector, 16 (a zmm) on AVX-512, 8 (a ymm) on AVX2. AVX2's 16 registers cannot hold
// 16-lane vectors: compiled for AVX2, the 16-lane code ran 3.5x slower than 8-lane vectors (Zen 3).
template <int L>
struct VecOf {
  typedef float F __attribute__((vector_size(4 * L)));
  typedef int32_t I __attribute__((vector_size(4 * L)));
  typedef uint16_t H __attribute__((vector_size(2 * L)));
};
template <int L>
using Vec = typename VecOf<L>::F;
template <int L>
using IVec = typename VecOf<L>::I;
#define SPECSERVE_INLINE __attribute__((always_inline)) inline

template <int L>
SPECSERVE_INLINE Vec<L> splat(float x) {
  return Vec<L>{} + x;
}

template <int L>
SPECSERVE_INLINE Vec<L> load(const float* p) {
  Vec<L> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int L>
SPECSERVE_INLINE Vec<L> load(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  typename VecOf<L>::H h;
  std::memcpy(&h, p, sizeof h);
  const IVec<L> bits = __builtin_convertvector(h, IVec<L>) << 16;
  Vec<L> v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// a * b + c rounded once. The kernels build with -ffp-contract=off (no fused multiply-add but the written
// ones, so every path rounds alike); a multiply-add loop wants them. Not always_inline: a generic caller
// (a template for any L) gets them inlined by `flatten` on its target-specific entry point.
__attribute__((target("avx512f"))) inline Vec<16> fma(Vec<16> a, Vec<16> b, Vec<16> c) {
  return (Vec<16>)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
__attribute__((target("avx2,fma"))) inline Vec<8> fma(Vec<8> a, Vec<8> b, Vec<8> c) {
  return (Vec<8>)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}

// exp(x) for x <= 0 (scores minus their maximum), within 2 ulp; below -87 it is ~1e-38, not 0.
template <int L>
SPECSERVE_INLINE Vec<L> exp_nonpositive(Vec<L> x) {
  const Vec<L> floor = splat<L>(-87.f);
  x = x < floor ? floor : x;
  // 1.5 * 2^23: adding it rounds to an integer, kept in the low bits
  const Vec<L> shifter = splat<L>(12582912.f);
  const Vec<L> t = x * splat<L>(1.44269504f) + shifter;
  const Vec<L> n = t - shifter;
  const Vec<L> r = (x - n * splat<L>(0.693145752f)) - n * splat<L>(1.42860677e-6f);  // x - n ln2, 2 parts
  Vec<L> p = splat<L>(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = p * r + splat<L>(c);
  IVec<L> t_bits, shifter_bits;
  std::memcpy(&t_bits, &t, sizeof t);
  std::memcpy(&shifter_bits, &shifter, sizeof shifter);
  const IVec<L> exponent = (t_bits - shifter_bits + 127) << 23;  // 2^n
  Vec<L> scale;
  std::memcpy(&scale, &exponent, sizeof scale);
  return p * scale;
}

// The best path any kernel may take (qlinear's numbering: 0 scalar, 1 AVX2, 2 AVX-512, 3 AMX), lowered by
// SPECSERVE_ISA once the library is loaded (kernels/__init__.py), before any kernel runs: an AVX-512
// machine can then run, and time, the AVX2 paths.
inline std::atomic<int64_t>& isa_cap() {
  static std::atomic<int64_t> cap{3};
  return cap;
}

inline bool has_avx512() {
  __builtin_cpu_init();
  return isa_cap() >= 2 && __builtin_cpu_supports("avx512f");
}

inline bool has_avx2() {
  __builtin_cpu_init();
  return isa_cap() >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace specserve_vec
