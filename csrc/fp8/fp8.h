// FP8 (e4m3 or e5m2) cast + transpose + amax: shared declarations (no torch, no CUDA headers).
//
// For a row-major (rows, cols) input x (fp32 or bf16) and a device-resident fp32 scale s:
//   out   (rows, cols) fp8 = sat(x * s)       row-major, for the forward GEMM
//   out_t (cols, rows) fp8 = sat(x * s)^T     for the backward GEMMs (FP8 GEMMs want K-major)
//   amax  fp32 scalar      = max |x|          of the unscaled input, for the next scale (amax may be
//                                             null: not computed, e.g. the scale's own amax was given)
// fp8 is e4m3 (activations, weights) or, with e5m2 = true, e5m2 (output gradients).
// sat(): round to nearest even, saturating to +-448 (e4m3) or +-57344 (e5m2), inf too; NaN stays
// NaN - the semantics of CUDA's __NV_SATFINITE conversion, and of torch's .to(float8) after a clamp
// to the format's range (torch's own e5m2 conversion overflows to inf). amax propagates NaN:
// it is the maximum of |x| compared as IEEE bit patterns, where NaN > inf > every finite value.
#pragma once

#include <cstdint>

namespace tessel {
namespace fp8 {

// CPU fallback (fp8_cpu.cpp). in_bf16: input holds bfloat16 bits (uint16) instead of float.
void cast_transpose_cpu(const void* in, bool in_bf16, int64_t rows, int64_t cols, float scale,
                        uint8_t* out, uint8_t* out_t, float* amax, bool e5m2);

// The same with a grid of scales (the row-, tile- and block-wise recipes): element (r, c) is scaled by
//   scale[(r / block_rows) * scale_cols + (c / block_cols)],  scale_cols = ceil(cols / block_cols),
// e.g. (1, cols) blocks: one scale per row; (rows, 1): one per column; (1, 128): 1 x 128 tiles;
// (128, 128): blocks. out or out_t may be null (not written). amax is max |x| of the whole input.
void cast_transpose_grid_cpu(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale,
                             int64_t block_rows, int64_t block_cols, uint8_t* out, uint8_t* out_t, float* amax,
                             bool e5m2);

// Per-tensor scale from an amax (current scaling), as engine.ops.fp8_linear.amax_to_scale:
//   scale_from_amax(a) = min(fp8_max / a, FLT_MAX) for a positive finite a, else 1,
// the division rounded to nearest (IEEE); fp8_max 448 (e4m3) or 57344 (e5m2).
float scale_from_amax_cpu(float amax, bool e5m2);

// Power-of-two (E8M0-style) scale from an amax, as engine.ops.fp8_cast_transpose.pow2_scales: with r =
// amax / fp8_max (rounded to nearest), 2**-e for e = ceil(log2(r)) (the smallest power of two keeping the
// block within the format; an exact power of two is not rounded up), e clamped to [-126, 126] (-126 where a
// positive amax's r underflows to 0); 1 where the amax is not positive and finite. Exact: from exponent bits.
float pow2_scale_from_amax_cpu(float amax, bool e5m2);

// CUDA (fp8.cu). scale and amax are device pointers; stream is a cudaStream_t.
// Returns a cudaError_t value (0 = success).
int cast_transpose_cuda(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale,
                        uint8_t* out, uint8_t* out_t, float* amax, bool e5m2, void* stream);
int cast_transpose_grid_cuda(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale,
                             int64_t block_rows, int64_t block_cols, uint8_t* out, uint8_t* out_t, float* amax,
                             bool e5m2, void* stream);
// cast_transpose_cuda with scale_inv = 1 / scale written (device pointer, may be null) and, with
// from_amax, the scale derived on the device from *scale read as an amax (scale_from_amax). out_t may
// be null (not written). accumulate: amax is a running maximum (it holds a non-negative value or NaN,
// e.g. a delayed-scaling state's pending amax) that max |x| is folded into, instead of overwritten.
int cast_transpose_scaled_cuda(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale,
                               bool from_amax, uint8_t* out, uint8_t* out_t, float* amax, float* scale_inv, bool e5m2,
                               void* stream, bool accumulate = false);
// scale[i] = scale_from_amax(amax[i]) (pow2: the power-of-two scale) and scale_inv[i] = 1 / scale[i] for n
// amaxes (device pointers): the row-, tile-, block- and MX recipes' grids of scales in one launch.
int scales_from_amax_cuda(const float* amax, int64_t n, float* scale, float* scale_inv, bool e5m2, bool pow2,
                          void* stream);
const char* cuda_error_string(int error);

}  // namespace fp8
}  // namespace tessel
