// Element conversions between float and the 16-bit float formats, and from the 8-bit float
// formats (float8_e4m3fn, float8_e5m2: FP8 training) to float, for the CPU handlers.
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
struct F8E4M3 { uint8_t bits; };  // float8_e4m3fn: bias 7, no infinities, NaN = S.1111.111
struct F8E5M2 { uint8_t bits; };  // float8_e5m2: bias 15, IEEE-like (infinities and NaNs)

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

// The 8-bit formats: every value is exact in float (at most 4 significant bits, exponents
// within float's range), decoded once into a 256-entry table per format.
namespace fp8_detail {
// sign * (implicit + mantissa / 2^mbits) * 2^(exponent - bias); subnormals for exponent 0.
inline float Decode(uint8_t bits, int mbits, int bias, bool ieee_specials) {
  const int ebits = 7 - mbits;
  const int emax = (1 << ebits) - 1;
  const int exponent = (bits >> mbits) & emax;
  const int mantissa = bits & ((1 << mbits) - 1);
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  if (ieee_specials && exponent == emax) {  // e5m2: infinity or NaN
    return mantissa == 0 ? sign * __builtin_inff() : __builtin_nanf("");
  }
  if (!ieee_specials && exponent == emax && mantissa == (1 << mbits) - 1) {
    return __builtin_nanf("");  // e4m3fn: S.1111.111 is NaN, the only special value
  }
  const int unit_exponent = (exponent == 0 ? 1 : exponent) - bias - mbits;
  const int significand = exponent == 0 ? mantissa : ((1 << mbits) | mantissa);
  return sign * __builtin_ldexpf(static_cast<float>(significand), unit_exponent);
}
struct Table {
  float value[256];
  Table(int mbits, int bias, bool ieee_specials) {
    for (int b = 0; b < 256; ++b) {
      value[b] = Decode(static_cast<uint8_t>(b), mbits, bias, ieee_specials);
    }
  }
};
inline const Table& E4M3() {
  static const Table table(3, 7, false);
  return table;
}
inline const Table& E5M2() {
  static const Table table(2, 15, true);
  return table;
}
}  // namespace fp8_detail

inline float ToFloat(F8E4M3 v) { return fp8_detail::E4M3().value[v.bits]; }
inline float ToFloat(F8E5M2 v) { return fp8_detail::E5M2().value[v.bits]; }

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
