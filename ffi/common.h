// Helpers shared by every jax_wgrad FFI handler (CPU and CUDA).
#ifndef JAX_WGRAD_FFI_COMMON_H_
#define JAX_WGRAD_FFI_COMMON_H_

#include <exception>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

// Functions that the CUDA kernels call too.
#ifdef __CUDACC__
#define JAX_WGRAD_HOST_DEVICE __host__ __device__
#else
#define JAX_WGRAD_HOST_DEVICE
#endif

namespace jax_wgrad {

namespace ffi = xla::ffi;

inline const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::U8: return "uint8";
    default: return "unsupported";
  }
}

// "float32[4,3]". std::to_string, not an ostringstream: formatting an int64 through an
// ostream inside the CUDA handlers crashed the process (SIGSEGV in the stream's locale
// code, in XLA's execute thread) on an H200 machine with jax 0.11.2; to_string formats
// with the C library and involves no stream or locale objects.
inline std::string ShapeString(const ffi::AnyBuffer& b) {
  std::string s = std::string(DtypeName(b.element_type())) + "[";
  auto d = b.dimensions();
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(d[i]);
  }
  return s + "]";
}

inline bool IsSupportedFloat(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

// Runs a handler body and turns any C++ exception (std::bad_alloc from a temporary, a
// formatting error, ...) into an FFI error. An exception must never cross the C ABI of
// the handler symbol: that terminates the process instead of raising in Python.
template <typename Body>
ffi::Error Guarded(const char* op, Body&& body) noexcept {
  try {
    return std::forward<Body>(body)();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(op) + ": unexpected C++ exception: " + e.what());
  } catch (...) {
    return ffi::Error::Internal(std::string(op) + ": unexpected C++ exception");
  }
}

}  // namespace jax_wgrad

#endif  // JAX_WGRAD_FFI_COMMON_H_
