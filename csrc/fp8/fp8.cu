// FP8 (e4m3 or e5m2) cast + transpose + amax, CUDA kernel and launcher (no torch headers).
//
// Two kernels compute the same bytes. The wide one, for inputs whose rows and columns are multiples of 8
// (every FP8 GEMM operand but a ragged token count): one 64x64 tile per block of 256 threads, each thread
// loading 8 consecutive elements with 16-byte loads and storing 8 fp8 bytes at once, row-major and
// (through shared memory) transposed. The narrow one, for any shape: one 32x32 tile per block (32x8
// threads, 4 rows each), one element per load and one byte per store. In both, the tile is read once;
// the block's max |x| (as bit patterns, so NaN wins) goes to amax with one atomicMax. One scale for
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

// The block's max |x| bits into amax_bits (one atomicMax), from each thread's local_max; all threads of
// the block call it (it has a barrier), kThreads of them.
template <int kThreads>
__device__ __forceinline__ void block_amax(unsigned int local_max, unsigned int* amax_bits, unsigned int* warp_max,
                                           int thread) {
  for (int offset = 16; offset > 0; offset /= 2) {
    local_max = max(local_max, __shfl_xor_sync(0xffffffffu, local_max, offset));
  }
  const int lane = thread % 32, warp = thread / 32;
  if (lane == 0) warp_max[warp] = local_max;
  __syncthreads();
  if (warp == 0) {
    unsigned int m = lane < kThreads / 32 ? warp_max[lane] : 0u;
    for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
    if (lane == 0) atomicMax(amax_bits, m);
  }
}

// The tensor's one scale (not kGrid: a grid's scales are read per element), given or derived from an amax
// (from_amax); ``writer`` (one thread of the grid) also writes 1 / scale for the GEMM where asked.
template <bool kGrid>
__device__ __forceinline__ float tensor_scale(const float* scale, bool from_amax, float fp8_max, float* scale_inv,
                                              bool writer) {
  if (kGrid) return 0.0f;
  const float s = from_amax ? scale_from_amax(*scale, fp8_max) : *scale;
  if (scale_inv != nullptr && writer) *scale_inv = __frcp_rn(s);
  return s;
}

// -- the wide kernel: 8 elements per load and per store -----------------------------------------------
constexpr int kWideTile = 64;                 // a 64x64 tile per block
constexpr int kWideThreads = 256;             // 8 threads per tile row (8 elements each), 32 rows per pass
constexpr int kWidePitch = kWideTile + 4;     // shared row pitch: 4-byte aligned, 2-way conflicts at most

// 8 consecutive elements as floats (exact for bf16), from a 16-byte aligned address.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&x)[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);  // 8 bf16
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float (&x)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
  x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

// Preconditions (launch checks them): rows and cols multiples of 8; in 16-byte and out / out_t 8-byte
// aligned. Then every 8-element run of a row lies wholly inside or outside the input, and so does every
// 8-element run of out_t's rows.
template <typename T, __nv_fp8_interpretation_t kFormat, bool kGrid>
__global__ void __launch_bounds__(kWideThreads)
cast_transpose_wide_kernel(const T* __restrict__ in, int64_t rows, int64_t cols, const float* __restrict__ scale,
                           int64_t block_rows, int64_t block_cols, int64_t scale_cols,
                           uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                           unsigned int* __restrict__ amax_bits, bool from_amax, float fp8_max,
                           float* __restrict__ scale_inv) {
  __shared__ __align__(16) uint8_t tile[kWideTile][kWidePitch];
  __shared__ unsigned int warp_max[kWideThreads / 32];
  const float s0 = tensor_scale<kGrid>(scale, from_amax, fp8_max, scale_inv,
                                      blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0);
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kWideTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kWideTile;
  const int run = threadIdx.x % 8;                 // this thread's 8 columns of the tile: 8 * run ...
  const int64_t col = col0 + 8 * run;
  unsigned int local_max = 0;
  float x[2][8];
  bool ok[2];
#pragma unroll
  for (int p = 0; p < 2; ++p) {                    // both loads in flight before any conversion
    const int64_t row = row0 + threadIdx.x / 8 + 32 * p;
    ok[p] = row < rows && col < cols;
    if (ok[p]) load8(in + row * cols + col, x[p]);
  }
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    if (!ok[p]) continue;
    const int r = threadIdx.x / 8 + 32 * p;       // row of the tile
    const int64_t row = row0 + r;
    float s[8];
    if (kGrid) {
      const float* srow = scale + (row / block_rows) * scale_cols;
      const int64_t first = col / block_cols;
      if (block_cols == 1) {                      // a scale per column (a row-wise cast of x.T)
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] = srow[col + i];
      } else if (first == (col + 7) / block_cols) {  // one scale for the run (blocks of 8 columns or more)
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] = srow[first];
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) s[i] = srow[(col + i) / block_cols];
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] = s0;
    }
    unsigned int lo = 0u, hi = 0u;                // fp8 bytes 0-3 and 4-7, little-endian
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      local_max = max(local_max, __float_as_uint(x[p][i]) & 0x7fffffffu);
      const unsigned int q =
          static_cast<uint8_t>(__nv_cvt_float_to_fp8(x[p][i] * s[i], __NV_SATFINITE, kFormat));
      if (i < 4) lo |= q << (8 * i); else hi |= q << (8 * (i - 4));
    }
    if (out != nullptr) *reinterpret_cast<uint2*>(out + row * cols + col) = make_uint2(lo, hi);
    *reinterpret_cast<unsigned int*>(&tile[r][8 * run]) = lo;
    *reinterpret_cast<unsigned int*>(&tile[r][8 * run + 4]) = hi;
  }
  __syncthreads();
  if (out_t != nullptr) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int c = threadIdx.x / 8 + 32 * p;      // column of the tile: a row of out_t
      const int64_t t_row = col0 + c, t_col = row0 + 8 * run;  // out_t (cols, rows)
      if (t_row < cols && t_col < rows) {
        unsigned int lo = 0u, hi = 0u;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          lo |= static_cast<unsigned int>(tile[8 * run + k][c]) << (8 * k);
          hi |= static_cast<unsigned int>(tile[8 * run + 4 + k][c]) << (8 * k);
        }
        *reinterpret_cast<uint2*>(out_t + t_row * rows + t_col) = make_uint2(lo, hi);
      }
    }
  }
  if (amax_bits == nullptr) return;  // amax not wanted (the same for the whole grid: no divergent barrier)
  block_amax<kWideThreads>(local_max, amax_bits, warp_max, threadIdx.x);
}

// -- the narrow kernel: any shape --------------------------------------------------------------------
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
  const float s0 = tensor_scale<kGrid>(scale, from_amax, fp8_max, scale_inv,
                                      blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0);
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
  block_amax<kTile * kTile / kRowsPerThread>(local_max, amax_bits, warp_max, threadIdx.y * kTile + threadIdx.x);
}

// An empty input's dequantisation scale (the cast kernel has no block to write it from).
__global__ void scale_inv_kernel(const float* scale, bool from_amax, float fp8_max, float* scale_inv) {
  tensor_scale<false>(scale, from_amax, fp8_max, scale_inv, true);
}

template <bool kGrid>
int launch(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale, int64_t block_rows,
           int64_t block_cols, uint8_t* out, uint8_t* out_t, float* amax, bool e5m2, cudaStream_t stream,
           bool from_amax = false, float* scale_inv = nullptr, bool accumulate = false) {
  // amax is a max over bit patterns of |x|: start from +0, or (accumulate) from the running maximum it
  // holds. Null: not wanted. Either way no memset (one launch fewer).
  if (amax != nullptr && !accumulate) {
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
  unsigned int* amax_bits = reinterpret_cast<unsigned int*>(amax);
  const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
  const auto* in_bf = static_cast<const __nv_bfloat16*>(in);
  const auto* in_f = static_cast<const float*>(in);
  const auto aligned = [](const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; };
  const bool wide = rows % 8 == 0 && cols % 8 == 0 && aligned(in, 16) && (out == nullptr || aligned(out, 8)) &&
                    (out_t == nullptr || aligned(out_t, 8)) && (rows + kWideTile - 1) / kWideTile <= 65535;
  const dim3 block = wide ? dim3(kWideThreads) : dim3(kTile, kTile / kRowsPerThread);
  const int64_t edge = wide ? kWideTile : kTile;
  const dim3 grid(static_cast<unsigned int>((cols + edge - 1) / edge), static_cast<unsigned int>((rows + edge - 1) / edge));
#define TESSEL_FP8_LAUNCH(T, FMT, IN)                                                                          \
  if (wide) {                                                                                                  \
    cast_transpose_wide_kernel<T, FMT, kGrid><<<grid, block, 0, stream>>>(IN, rows, cols, scale, block_rows,   \
                                                                          block_cols, scale_cols, out, out_t,  \
                                                                          amax_bits, from_amax, fp8_max,       \
                                                                          scale_inv);                          \
  } else {                                                                                                     \
    cast_transpose_kernel<T, FMT, kGrid><<<grid, block, 0, stream>>>(IN, rows, cols, scale, block_rows,        \
                                                                     block_cols, scale_cols, out, out_t,       \
                                                                     amax_bits, from_amax, fp8_max, scale_inv); \
  }
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
                               void* stream_ptr, bool accumulate) {
  return launch<false>(in, in_bf16, rows, cols, scale, rows > 0 ? rows : 1, cols > 0 ? cols : 1, out, out_t, amax,
                       e5m2, static_cast<cudaStream_t>(stream_ptr), from_amax, scale_inv, accumulate);
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
