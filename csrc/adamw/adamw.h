// Multi-tensor fused AdamW: shared declarations and the per-element update.
//
// Included by adamw.cu (nvcc, no torch headers) and by the torch-facing .cpp files, so it uses
// only the C++ standard library. The per-element update is written once, with the exact operation
// order of torch.optim.AdamW's single-tensor path (foreach=False, capturable=False), and compiled
// for host (CPU fallback) and device (CUDA kernel): both give the same bits, because the device
// side uses round-to-nearest intrinsics that nvcc never contracts into FMAs (--use_fast_math only
// adds flush-to-zero of denormals).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TESSEL_HD __host__ __device__ __forceinline__
#else
#define TESSEL_HD inline
#endif

namespace tessel {
namespace adamw {

// One tensor to update: fp32 master param, fp32 grad, fp32 moments, optional bf16 copy (raw bits).
struct TensorRef {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  uint16_t* bf16_out;  // nullptr: no bf16 copy
  int64_t numel;
};

// Step constants, computed in double on the host exactly as torch computes its Python floats,
// then rounded to float like torch does when it applies a Python scalar to a float32 tensor.
struct Scalars {
  float decay;            // 1 - lr * weight_decay
  float lerp_weight;      // 1 - beta1 (exp_avg.lerp_(grad, 1 - beta1))
  float beta2;            // exp_avg_sq.mul_(beta2)
  float one_minus_beta2;  // .addcmul_(grad, grad, value=1 - beta2)
  float neg_step_size;    // -lr / (1 - beta1 ** step)
  float bc2_sqrt;         // (1 - beta2 ** step) ** 0.5
  float eps;
  bool apply_decay;       // torch skips the decay multiply when weight_decay == 0
};

inline Scalars make_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                            int64_t step) {
  Scalars s;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.lerp_weight = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  s.neg_step_size = static_cast<float>(-(lr / bc1));
  s.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  s.eps = static_cast<float>(eps);
  s.apply_decay = weight_decay != 0.0;
  return s;
}

// IEEE single-precision ops with one rounding each (no contraction into FMA on either side).
TESSEL_HD float op_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TESSEL_HD float op_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TESSEL_HD float op_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TESSEL_HD float op_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
TESSEL_HD float op_sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// One AdamW element update, in torch's order:
//   p = p * decay; m = lerp(m, g, w); v = v * b2; v = v + (1 - b2) * g * g;
//   denom = sqrt(v) / bc2_sqrt + eps; p = p + (-step_size) * m / denom
// lerp as torch evaluates it: w < 0.5 ? m + w * (g - m) : g - (g - m) * (1 - w).
template <bool kSmallWeight>
TESSEL_HD void update(float& p, float g, float& m, float& v, const Scalars& s) {
  if (s.apply_decay) p = op_mul(p, s.decay);
  const float diff = op_sub(g, m);
  m = kSmallWeight ? op_add(m, op_mul(s.lerp_weight, diff))
                   : op_sub(g, op_mul(diff, op_sub(1.0f, s.lerp_weight)));
  v = op_add(op_mul(v, s.beta2), op_mul(op_mul(s.one_minus_beta2, g), g));
  const float denom = op_add(op_div(op_sqrt(v), s.bc2_sqrt), s.eps);
  p = op_add(p, op_div(op_mul(s.neg_step_size, m), denom));
}

// float -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN), as torch's .to(bfloat16).
TESSEL_HD uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
#if defined(__CUDA_ARCH__)
  u = __float_as_uint(f);
#else
  std::memcpy(&u, &f, sizeof(u));
#endif
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// CPU fallback (adamw_cpu.cpp): updates every tensor, parallel over fixed-size chunks.
void adamw_cpu(const TensorRef* tensors, int64_t num_tensors, const Scalars& s);

// CUDA launcher (adamw.cu): packs (tensor, chunk) blocks into as few launches as the kernel
// argument space allows. `stream` is a cudaStream_t. Returns a cudaError_t value (0 = success).
int adamw_cuda(const TensorRef* tensors, int64_t num_tensors, const Scalars& s, void* stream);
const char* cuda_error_string(int error);

}  // namespace adamw
}  // namespace tessel
