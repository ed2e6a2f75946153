// Element conversions between float and the 16-bit float formats, for the CPU handlers.
#ifndef JAX_WGRAD_FFI_CONVERT_CPU_H_
#define JAX_WGRAD_FFI_CONVERT_CPU_H_

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace jax_wgrad {

struct Bf16 { uint16_t bits; };
struct F16 { uint16_t bits; };

inline float ToFloat(float v) { return v; }
inline float ToFloat(Bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float ToFloat(F16 v) {
  _Float16 h;
  std::memcpy(&h, &v.bits, sizeof(h));
  return static_cast<float>(h);
}

template <typename T> T FromFloat(float f);
template <> inline float FromFloat<float>(float f) { return f; }
template <> inline Bf16 FromFloat<Bf16>(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return Bf16{static_cast<uint16_t>(u >> 16)};
}
template <> inline F16 FromFloat<F16>(float f) {
  _Float16 h = static_cast<_Float16>(f);
  F16 r;
  std::memcpy(&r.bits, &h, sizeof(h));
  return r;
}

template <typename T>
void Widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = ToFloat(src[i]);
}
template <typename T>
void Narrow(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = FromFloat<T>(src[i]);
}

// float16 arrays: the loops above call libgcc's software conversion per element when the
// extension is built for baseline x86-64 (~10 ns each, slower than the GEMM they feed).
// With F16C (every x86-64 CPU since 2012), 8 elements per instruction, bit-identical:
// the conversion to float is exact, the one from float rounds to nearest even like the
// software cast.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define JAX_WGRAD_HAVE_F16C_PATH 1
__attribute__((target("avx,f16c"))) inline void WidenF16C(const F16* src, float* dst,
                                                         int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  if (i < n) {  // the last < 8 elements through a zero-padded block
    uint16_t h[8] = {};
    float f[8];
    std::memcpy(h, src + i, (n - i) * sizeof(uint16_t));
    _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
    std::memcpy(dst + i, f, (n - i) * sizeof(float));
  }
}
__attribute__((target("avx,f16c"))) inline void NarrowF16C(const float* src, F16* dst,
                                                          int64_t n) {
  int64_t i = 0;
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kRound);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  if (i < n) {  // the last < 8 elements through a zero-padded block
    float f[8] = {};
    uint16_t h[8];
    std::memcpy(f, src + i, (n - i) * sizeof(float));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h), _mm256_cvtps_ph(_mm256_loadu_ps(f), kRound));
    std::memcpy(dst + i, h, (n - i) * sizeof(uint16_t));
  }
}
inline bool HasF16C() {
  static const bool has = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return has;
}
template <>
inline void Widen<F16>(const F16* src, float* dst, int64_t n) {
  if (HasF16C()) return WidenF16C(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = ToFloat(src[i]);
}
template <>
inline void Narrow<F16>(const float* src, F16* dst, int64_t n) {
  if (HasF16C()) return NarrowF16C(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = FromFloat<F16>(src[i]);
}
#endif

}  // namespace jax_wgrad

#endif  // JAX_WGRAD_FFI_CONVERT_CPU_H_
