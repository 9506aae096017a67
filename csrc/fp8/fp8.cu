// FP8 (e4m3 or e5m2) cast + transpose + amax, CUDA kernel and launcher (no torch headers).
//
// One 32x32 tile per block (32x8 threads, 4 rows each): the tile is read once, coalesced; its
// scaled fp8 bytes are written row-major directly and transposed through shared memory; the
// block's max |x| (as bit patterns, so NaN wins) goes to amax with one atomicMax. One scale for
// the tensor, or (the _grid launcher) a grid of scales looked up per element.
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
                      uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, unsigned int* __restrict__ amax_bits) {
  __shared__ uint8_t tile[kTile][kTile + 4];  // +4: no bank conflicts on the transposed read
  __shared__ unsigned int warp_max[kTile * kTile / kRowsPerThread / 32];
  const float s0 = kGrid ? 0.0f : *scale;
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

template <bool kGrid>
int launch(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale, int64_t block_rows,
           int64_t block_cols, uint8_t* out, uint8_t* out_t, float* amax, bool e5m2, cudaStream_t stream) {
  // amax is a max over bit patterns of |x|: start from +0.
  cudaError_t err = cudaMemsetAsync(amax, 0, sizeof(float), stream);
  if (err != cudaSuccess || rows == 0 || cols == 0) return static_cast<int>(err);
  const dim3 block(kTile, kTile / kRowsPerThread);
  const dim3 grid(static_cast<unsigned int>((cols + kTile - 1) / kTile),
                  static_cast<unsigned int>((rows + kTile - 1) / kTile));
  unsigned int* amax_bits = reinterpret_cast<unsigned int*>(amax);
  const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
  const auto* in_bf = static_cast<const __nv_bfloat16*>(in);
  const auto* in_f = static_cast<const float*>(in);
#define TESSEL_FP8_LAUNCH(T, FMT, IN)                                                                     \
  cast_transpose_kernel<T, FMT, kGrid><<<grid, block, 0, stream>>>(IN, rows, cols, scale, block_rows,     \
                                                                   block_cols, scale_cols, out, out_t, amax_bits)
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

}  // namespace

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
