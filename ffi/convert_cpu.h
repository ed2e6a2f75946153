// Element conversions between float and the 16-bit float formats, for the CPU handlers.
#ifndef JAX_WGRAD_FFI_CONVERT_CPU_H_
#define JAX_WGRAD_FFI_CONVERT_CPU_H_

#include <cstdint>
#include <cstring>

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

}  // namespace jax_wgrad

#endif  // JAX_WGRAD_FFI_CONVERT_CPU_H_
