// Multi-tensor fused AdamW, CUDA kernel and launcher (no torch headers: raw pointers + stream).
//
// The work is a table of blocks, each one (tensor, chunk of kChunk elements). A launch carries up
// to kMaxTensors tensors and kMaxBlocks blocks in its kernel-argument struct (passed by value, so
// no device-side table to allocate or copy); a tensor whose chunks do not fit continues in the
// next launch. Typical model: a few hundred tensors -> a handful of launches.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "adamw/adamw.h"

namespace tessel {
namespace adamw {
namespace {

constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;
constexpr int64_t kChunk = 16384;  // elements per block
constexpr int kThreads = 512;

struct LaunchTable {
  float* param[kMaxTensors];
  const float* grad[kMaxTensors];
  float* exp_avg[kMaxTensors];
  float* exp_avg_sq[kMaxTensors];
  __nv_bfloat16* bf16_out[kMaxTensors];
  int64_t numel[kMaxTensors];
  int16_t block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};
// Kernel parameters are limited to 4 KiB on every architecture we build for.
static_assert(sizeof(LaunchTable) + sizeof(Scalars) <= 4096, "kernel argument table too large");

template <bool kSmallWeight>
__device__ __forceinline__ void update_one(const LaunchTable& t, int ti, int64_t i, const Scalars& s) {
  float p = t.param[ti][i];
  float m = t.exp_avg[ti][i];
  float v = t.exp_avg_sq[ti][i];
  update<kSmallWeight>(p, t.grad[ti][i], m, v, s);
  t.param[ti][i] = p;
  t.exp_avg[ti][i] = m;
  t.exp_avg_sq[ti][i] = v;
  if (t.bf16_out[ti] != nullptr) t.bf16_out[ti][i] = __float2bfloat16_rn(p);
}

template <bool kSmallWeight>
__global__ void __launch_bounds__(kThreads) adamw_kernel(LaunchTable table, Scalars s) {
  const int ti = table.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(table.block_chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(begin + kChunk, table.numel[ti]);
  // Vectorised path: 16-byte loads/stores when every fp32 stream is 16-byte aligned.
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(table.param[ti] + begin) |
        reinterpret_cast<uintptr_t>(table.grad[ti] + begin) |
        reinterpret_cast<uintptr_t>(table.exp_avg[ti] + begin) |
        reinterpret_cast<uintptr_t>(table.exp_avg_sq[ti] + begin)) & 15) == 0 &&
      (table.bf16_out[ti] == nullptr || (reinterpret_cast<uintptr_t>(table.bf16_out[ti] + begin) & 7) == 0);
  int64_t vec_end = begin;
  if (aligned) {
    const int64_t n_vec = (end - begin) / 4;
    vec_end = begin + n_vec * 4;
    float4* p4 = reinterpret_cast<float4*>(table.param[ti] + begin);
    const float4* g4 = reinterpret_cast<const float4*>(table.grad[ti] + begin);
    float4* m4 = reinterpret_cast<float4*>(table.exp_avg[ti] + begin);
    float4* v4 = reinterpret_cast<float4*>(table.exp_avg_sq[ti] + begin);
    for (int64_t j = threadIdx.x; j < n_vec; j += blockDim.x) {
      float4 p = p4[j], g = g4[j], m = m4[j], v = v4[j];
      update<kSmallWeight>(p.x, g.x, m.x, v.x, s);
      update<kSmallWeight>(p.y, g.y, m.y, v.y, s);
      update<kSmallWeight>(p.z, g.z, m.z, v.z, s);
      update<kSmallWeight>(p.w, g.w, m.w, v.w, s);
      p4[j] = p;
      m4[j] = m;
      v4[j] = v;
      if (table.bf16_out[ti] != nullptr) {
        __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(table.bf16_out[ti] + begin) + 2 * j;
        o2[0] = __floats2bfloat162_rn(p.x, p.y);
        o2[1] = __floats2bfloat162_rn(p.z, p.w);
      }
    }
  }
  for (int64_t i = vec_end + threadIdx.x; i < end; i += blockDim.x) update_one<kSmallWeight>(table, ti, i, s);
}

cudaError_t launch(const LaunchTable& table, int num_blocks, const Scalars& s, cudaStream_t stream) {
  if (s.lerp_weight < 0.5f) {
    adamw_kernel<true><<<num_blocks, kThreads, 0, stream>>>(table, s);
  } else {
    adamw_kernel<false><<<num_blocks, kThreads, 0, stream>>>(table, s);
  }
  return cudaGetLastError();
}

}  // namespace

int adamw_cuda(const TensorRef* tensors, int64_t num_tensors, const Scalars& s, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  LaunchTable table;
  int n_tensors = 0;
  int n_blocks = 0;
  for (int64_t t = 0; t < num_tensors; ++t) {
    const TensorRef& ref = tensors[t];
    if (ref.numel == 0) continue;
    const int64_t n_chunks = (ref.numel + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < n_chunks;) {
      // A slot for tensor t: either t is new, or the table was flushed while t had chunks left.
      table.param[n_tensors] = ref.param;
      table.grad[n_tensors] = ref.grad;
      table.exp_avg[n_tensors] = ref.exp_avg;
      table.exp_avg_sq[n_tensors] = ref.exp_avg_sq;
      table.bf16_out[n_tensors] = reinterpret_cast<__nv_bfloat16*>(ref.bf16_out);
      table.numel[n_tensors] = ref.numel;
      ++n_tensors;
      for (; c < n_chunks && n_blocks < kMaxBlocks; ++c, ++n_blocks) {
        table.block_tensor[n_blocks] = static_cast<int16_t>(n_tensors - 1);
        table.block_chunk[n_blocks] = static_cast<int32_t>(c);
      }
      if (n_blocks == kMaxBlocks || n_tensors == kMaxTensors) {
        const cudaError_t err = launch(table, n_blocks, s, stream);
        if (err != cudaSuccess) return static_cast<int>(err);
        n_blocks = 0;
        n_tensors = 0;
      }
    }
  }
  if (n_blocks > 0) {
    const cudaError_t err = launch(table, n_blocks, s, stream);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return static_cast<int>(cudaSuccess);
}

const char* cuda_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace adamw
}  // namespace tessel
