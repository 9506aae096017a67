// FP8 (e4m3 or e5m2) cast + transpose + amax, CPU fallback. The conversion is c10::Float8_e4m3fn's
// or c10::Float8_e5m2's, i.e. exactly torch's .to(float8) (round to nearest even) after a NaN-keeping
// clamp to the format's range (+-448 / +-57344: c10's e5m2 conversion would overflow to inf).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "fp8/fp8.h"

namespace tessel {
namespace fp8 {
namespace {

constexpr int64_t kBlock = 64;  // rows x cols block: the transposed writes stay cache-resident

inline float load(const void* in, bool in_bf16, int64_t i) {
  if (in_bf16) {
    uint16_t bits = static_cast<const uint16_t*>(in)[i];
    return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
  }
  return static_cast<const float*>(in)[i];
}

inline float saturate(float x, float m) { return x != x ? x : std::min(std::max(x, -m), m); }  // NaN stays

template <bool kE5m2>
inline uint8_t to_fp8(float x) {
  if constexpr (kE5m2) return c10::Float8_e5m2(saturate(x, 57344.0f)).x;
  return c10::Float8_e4m3fn(saturate(x, 448.0f)).x;
}

inline uint32_t abs_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u & 0x7fffffffu;
}

}  // namespace

namespace {

// kGrid: scale is a grid (fp8.h) looked up per element; else scale[0] for the tensor. out / out_t may
// be null (not written).
template <bool kE5m2, bool kGrid>
void cast_transpose_impl(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale,
                         int64_t block_rows, int64_t block_cols, uint8_t* out, uint8_t* out_t, float* amax) {
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock;
  const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
  const float s0 = kGrid ? 0.f : scale[0];  // grid mode reads the grid per block (which may be empty)
  const uint32_t max_bits = at::parallel_reduce(
      0, row_blocks, 1, uint32_t{0},
      [&](int64_t lo, int64_t hi, uint32_t acc) {
        for (int64_t rb = lo; rb < hi; ++rb) {
          const int64_t r_end = std::min((rb + 1) * kBlock, rows);
          for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
            const int64_t c_end = std::min(c0 + kBlock, cols);
            for (int64_t r = rb * kBlock; r < r_end; ++r) {
              const float* srow = kGrid ? scale + (r / block_rows) * scale_cols : nullptr;
              for (int64_t c = c0; c < c_end; ++c) {
                const float x = load(in, in_bf16, r * cols + c);
                acc = std::max(acc, abs_bits(x));
                const uint8_t q = to_fp8<kE5m2>(x * (kGrid ? srow[c / block_cols] : s0));
                if (out != nullptr) out[r * cols + c] = q;
                if (out_t != nullptr) out_t[c * rows + r] = q;
              }
            }
          }
        }
        return acc;
      },
      [](uint32_t a, uint32_t b) { return std::max(a, b); });
  if (amax != nullptr) std::memcpy(amax, &max_bits, sizeof(float));  // null: not wanted (fp8.h)
}

template <bool kGrid>
void dispatch(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale, int64_t block_rows,
              int64_t block_cols, uint8_t* out, uint8_t* out_t, float* amax, bool e5m2) {
  if (e5m2) {
    cast_transpose_impl<true, kGrid>(in, in_bf16, rows, cols, scale, block_rows, block_cols, out, out_t, amax);
  } else {
    cast_transpose_impl<false, kGrid>(in, in_bf16, rows, cols, scale, block_rows, block_cols, out, out_t, amax);
  }
}

}  // namespace

float scale_from_amax_cpu(float amax, bool e5m2) {
  uint32_t bits;
  std::memcpy(&bits, &amax, sizeof(bits));
  const float fp8_max = e5m2 ? 57344.0f : 448.0f;
  const float s = (bits > 0u && bits < 0x7f800000u) ? fp8_max / amax : 1.0f;  // 0, inf, NaN, < 0: 1
  return std::min(s, std::numeric_limits<float>::max());
}

float pow2_scale_from_amax_cpu(float amax, bool e5m2) {
  uint32_t bits;
  std::memcpy(&bits, &amax, sizeof(bits));
  if (!(bits > 0u && bits < 0x7f800000u)) return 1.0f;  // 0, inf, NaN, < 0
  const float ratio = amax / (e5m2 ? 57344.0f : 448.0f);
  int exp = 0;
  const float mant = std::frexp(ratio, &exp);  // ratio = mant * 2**exp, mant in [0.5, 1)
  const int raw = ratio > 0.0f ? (mant == 0.5f ? exp - 1 : exp) : -126;  // underflowed ratio: the smallest
  const int e = std::min(std::max(raw, -126), 126);
  const uint32_t out = static_cast<uint32_t>(127 - e) << 23;  // 2**-e
  float s;
  std::memcpy(&s, &out, sizeof(s));
  return s;
}

void cast_transpose_cpu(const void* in, bool in_bf16, int64_t rows, int64_t cols, float scale,
                        uint8_t* out, uint8_t* out_t, float* amax, bool e5m2) {
  dispatch<false>(in, in_bf16, rows, cols, &scale, 1, 1, out, out_t, amax, e5m2);
}

void cast_transpose_grid_cpu(const void* in, bool in_bf16, int64_t rows, int64_t cols, const float* scale,
                             int64_t block_rows, int64_t block_cols, uint8_t* out, uint8_t* out_t, float* amax,
                             bool e5m2) {
  dispatch<true>(in, in_bf16, rows, cols, scale, block_rows, block_cols, out, out_t, amax, e5m2);
}

}  // namespace fp8
}  // namespace tessel
