// FP8 (e4m3 or e5m2) cast + transpose + amax, CUDA kernel and launcher (no torch headers).
//
// One 32x32 tile per block (32x8 threads, 4 rows each): the tile is read once, coalesced; its
// scaled fp8 bytes are written row-major directly and transposed through shared memory; the
// block's max |x| (as bit patterns, so NaN wins) goes to amax with one atomicMax. One scale for
// the tensor, or (the _grid launcher) a grid of scales looked up per element. The one-scale kernel
// may instead be handed an amax and derive the scale itself (scale_from_amax, fp8.h), and writes the
// dequantisation scale 1 / scale: per-tensor current scaling is then one launch after the amax.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fp8/fp8.h"

namespace tessel {
namespace fp8 {
namespace {

constexpr int kTile = 32;
constexpr int kRowsPerThread = 4;  // blockDim = (32, 8)

// fp8.h's scale_from_amax in IEEE round-to-nearest arithmetic (__fdiv_rn; setup.py builds this
// extension without fast math, so subnormals are kept). "Positive and finite" is read from the bits.
__device__ __forceinline__ float scale_from_amax(float amax, float fp8_max) {
  const unsigned int bits = __float_as_uint(amax);
  const float s = (bits > 0u && bits < 0x7f800000u) ? __fdiv_rn(fp8_max, amax) : 1.0f;  // 0, inf, NaN, < 0: 1
  return fminf(s, 3.402823466e+38f);  // FLT_MAX: a tiny amax overflows the division to inf
}

template <typename T>
__device__ __forceinline__ float load_float(const T* p);
template <>
__device__ __forceinline__ float load_float<float>(const float* p) { return *p; }
template <>
__device__ __forceinline__ float load_float<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}

// kGrid: scale is a grid (see fp8.h), looked up per element; else one scale for the tensor.
// out / out_t may be null (grid launches only): that output is not written.
template <typename T, __nv_fp8_interpretation_t kFormat, bool kGrid>
__global__ void __launch_bounds__(kTile * kTile / kRowsPerThread)
cast_transpose_kernel(const T* __restrict__ in, int64_t rows, int64_t cols, const float* __restrict__ scale,
                      int64_t block_rows, int64_t block_cols, int64_t scale_cols,
                      uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, unsigned int* __restrict__ amax_bits,
                      bool from_amax, float fp8_max, float* __restrict__ scale_inv) {
  __shared__ uint8_t tile[kTile][kTile + 4];  // +4: no bank conflicts on the transposed read
  __shared__ unsigned int warp_max[kTile * kTile / kRowsPerThread / 32];
  const float s0 = kGrid ? 0.0f : (from_amax ? scale_from_amax(*scale, fp8_max) : *scale);
  if (!kGrid && scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    *scale_inv = __frcp_rn(s0);
  }
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  unsigned int local_max = 0;
  const int64_t col = col0 + threadIdx.x;                     // this thread's column, fixed over its rows
  const int64_t scale_col = kGrid ? col / block_cols : 0;     // 64-bit divisions: once per column, once per row
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int r = threadIdx.y + k * (kTile / kRowsPerThread);
    const int64_t row = row0 + r;
    if (row < rows && col < cols) {
      const float x = load_float(in + row * cols + col);
      local_max = max(local_max, __float_as_uint(x) & 0x7fffffffu);
      const float s = kGrid ? scale[(row / block_rows) * scale_cols + scale_col] : s0;
      const uint8_t q = static_cast<uint8_t>(__nv_cvt_float_to_fp8(x * s, __NV_SATFINITE, kFormat));
      if (out != nullptr) out[row * cols + col] = q;
      tile[r][threadIdx.x] = q;
    }
  }
  __syncthreads();
  if (out_t != nullptr) {
    for (int k = 0; k < kRowsPerThread; ++k) {
      const int c = threadIdx.y + k * (kTile / kRowsPerThread);  // column of the input tile
      const int64_t col = col0 + c, row = row0 + threadIdx.x;
      if (row < rows && col < cols) out_t[col * rows + row] = tile[threadIdx.x][c];
    }
  }
  if (amax_bits == nullptr) return;  // amax not wanted (the same for the whole grid: no divergent barrier)
  for (int offset = 16; offset > 0; offset /= 2) {
    local_max = max(local_max, __shfl_xor_sync(0xffffffffu, local_max, offset));
  }
  const int lane = (threadIdx.y * kTile + threadIdx.x) % 32;
  const int warp = (threadIdx.y * kTile + threadIdx.x) / 32;
  if (lane == 0) warp_max[warp] = local_max;
  __syncthreads();
  if (warp == 0) {
    unsigned int m = lane < kTile * kTile / kRowsPerThread / 32 ? warp_max[lane] : 0u;
    for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (lane == 0) atomicMax(amax_bits, m);
  }
}

// An empty input's dequantisation scale (the cast kernel has no block to write it from).
__global__ void scale_inv_kernel(const float* scale, bool from_amax, float fp8_max, float* scale_inv) {
  *scale_inv = __frcp_rn(from_amax ? scale_from_amax(*scale, fp8_max) : *scale);
}

template <bool kGrid>
int launch(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale, int64_t block_rows,
           int64_t block_cols, uint8_t* out, uint8_t* out_t, float* amax, bool e5m2, cudaStream_t stream,
           bool from_amax = false, float* scale_inv = nullptr) {
  // amax is a max over bit patterns of |x|: start from +0. Null: not wanted, no memset (one launch fewer).
  if (amax != nullptr) {
    const cudaError_t err = cudaMemsetAsync(amax, 0, sizeof(float), stream);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  const float fp8_max = e5m2 ? 57344.0f : 448.0f;
  if (rows == 0 || cols == 0) {  // nothing to cast; the dequantisation scale is still wanted
    if (scale_inv != nullptr) {
      scale_inv_kernel<<<1, 1, 0, stream>>>(scale, from_amax, fp8_max, scale_inv);
      return static_cast<int>(cudaGetLastError());
    }
    return 0;
  }
  const dim3 block(kTile, kTile / kRowsPerThread);
  const dim3 grid(static_cast<unsigned int>((cols + kTile - 1) / kTile),
                  static_cast<unsigned int>((rows + kTile - 1) / kTile));
  unsigned int* amax_bits = reinterpret_cast<unsigned int*>(amax);
  const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
  const auto* in_bf = static_cast<const __nv_bfloat16*>(in);
  const auto* in_f = static_cast<const float*>(in);
#define TESSEL_FP8_LAUNCH(T, FMT, IN)                                                                     \
  cast_transpose_kernel<T, FMT, kGrid><<<grid, block, 0, stream>>>(IN, rows, cols, scale, block_rows,     \
                                                                   block_cols, scale_cols, out, out_t, amax_bits, \
                                                                   from_amax, fp8_max, scale_inv)
  if (in_bf16 && e5m2) {
    TESSEL_FP8_LAUNCH(__nv_bfloat16, __NV_E5M2, in_bf);
  } else if (in_bf16) {
    TESSEL_FP8_LAUNCH(__nv_bfloat16, __NV_E4M3, in_bf);
  } else if (e5m2) {
    TESSEL_FP8_LAUNCH(float, __NV_E5M2, in_f);
  } else {
    TESSEL_FP8_LAUNCH(float, __NV_E4M3, in_f);
  }
#undef TESSEL_FP8_LAUNCH
  return static_cast<int>(cudaGetLastError());
}

// fp8.h's pow2_scale_from_amax: the ratio rounded to nearest (__fdiv_rn), frexpf exact, the result from bits.
__device__ __forceinline__ float pow2_scale_from_amax(float amax, float fp8_max) {
  const unsigned int bits = __float_as_uint(amax);
  if (!(bits > 0u && bits < 0x7f800000u)) return 1.0f;  // 0, inf, NaN, < 0
  const float ratio = __fdiv_rn(amax, fp8_max);
  int exp = 0;
  const float mant = frexpf(ratio, &exp);  // ratio = mant * 2**exp, mant in [0.5, 1)
  const int raw = ratio > 0.0f ? (mant == 0.5f ? exp - 1 : exp) : -126;  // underflowed ratio: the smallest
  const int e = min(max(raw, -126), 126);
  return __uint_as_float(static_cast<unsigned int>(127 - e) << 23);  // 2**-e
}

__global__ void scales_from_amax_kernel(const float* __restrict__ amax, int64_t n, float fp8_max, bool pow2,
                                        float* __restrict__ scale, float* __restrict__ scale_inv) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) {
    const float s = pow2 ? pow2_scale_from_amax(amax[i], fp8_max) : scale_from_amax(amax[i], fp8_max);
    scale[i] = s;
    scale_inv[i] = __frcp_rn(s);
  }
}

}  // namespace

int scales_from_amax_cuda(const float* amax, int64_t n, float* scale, float* scale_inv, bool e5m2, bool pow2,
                          void* stream_ptr) {
  if (n == 0) return 0;
  const int threads = 256;
  scales_from_amax_kernel<<<static_cast<unsigned int>((n + threads - 1) / threads), threads, 0,
                            static_cast<cudaStream_t>(stream_ptr)>>>(amax, n, e5m2 ? 57344.0f : 448.0f, pow2,
                                                                     scale, scale_inv);
  return static_cast<int>(cudaGetLastError());
}

int cast_transpose_scaled_cuda(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale,
                               bool from_amax, uint8_t* out, uint8_t* out_t, float* amax, float* scale_inv, bool e5m2,
                               void* stream_ptr) {
  return launch<false>(in, in_bf16, rows, cols, scale, rows > 0 ? rows : 1, cols > 0 ? cols : 1, out, out_t, amax,
                       e5m2, static_cast<cudaStream_t>(stream_ptr), from_amax, scale_inv);
}

int cast_transpose_cuda(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale,
                        uint8_t* out, uint8_t* out_t, float* amax, bool e5m2, void* stream_ptr) {
  return launch<false>(in, in_bf16, rows, cols, scale, rows > 0 ? rows : 1, cols > 0 ? cols : 1, out, out_t, amax,
                       e5m2, static_cast<cudaStream_t>(stream_ptr));
}

int cast_transpose_grid_cuda(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale,
                             int64_t block_rows, int64_t block_cols, uint8_t* out, uint8_t* out_t, float* amax,
                             bool e5m2, void* stream_ptr) {
  return launch<true>(in, in_bf16, rows, cols, scale, block_rows, block_cols, out, out_t, amax, e5m2,
                      static_cast<cudaStream_t>(stream_ptr));
}

const char* cuda_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace fp8
}  // namespace tessel
