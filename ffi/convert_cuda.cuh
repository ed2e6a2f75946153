// Device-side conversions between the handlers' element types and fp32 (CUDA handlers).
#ifndef JAX_WGRAD_FFI_CONVERT_CUDA_CUH_
#define JAX_WGRAD_FFI_CONVERT_CUDA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jax_wgrad {

__device__ __forceinline__ float ToF(float v) { return v; }
__device__ __forceinline__ float ToF(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToF(__half v) { return __half2float(v); }

// fp32 -> T, rounded to nearest even.
template <typename T> __device__ __forceinline__ T FromF(float v);
template <> __device__ __forceinline__ float FromF<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half FromF<__half>(float v) {
  return __float2half_rn(v);
}

}  // namespace jax_wgrad

#endif  // JAX_WGRAD_FFI_CONVERT_CUDA_CUH_
