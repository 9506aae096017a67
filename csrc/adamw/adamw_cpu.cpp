// Multi-tensor fused AdamW, CPU fallback: the same per-element update as the CUDA kernel
// (adamw.h), over a flat table of fixed-size chunks split between threads by at::parallel_for.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "adamw/adamw.h"

namespace tessel {
namespace adamw {
namespace {

constexpr int64_t kChunk = 16384;  // elements per work item: large enough to amortise scheduling

struct WorkItem {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// Straight-line loop over contiguous floats: no loop-variant branches, so -O3 vectorises it
// (sqrt and division stay IEEE: no -ffast-math in the build).
template <bool kSmallWeight>
void update_range(const TensorRef& t, int64_t begin, int64_t end, const Scalars& s) {
  float* __restrict__ p = t.param;
  const float* __restrict__ g = t.grad;
  float* __restrict__ m = t.exp_avg;
  float* __restrict__ v = t.exp_avg_sq;
  for (int64_t i = begin; i < end; ++i) update<kSmallWeight>(p[i], g[i], m[i], v[i], s);
  if (t.bf16_out != nullptr) {
    uint16_t* __restrict__ out = t.bf16_out;
    for (int64_t i = begin; i < end; ++i) out[i] = float_to_bf16_bits(p[i]);
  }
}

}  // namespace

void adamw_cpu(const TensorRef* tensors, int64_t num_tensors, const Scalars& s) {
  std::vector<WorkItem> items;
  for (int64_t t = 0; t < num_tensors; ++t) {
    for (int64_t b = 0; b < tensors[t].numel; b += kChunk) {
      items.push_back({t, b, std::min(b + kChunk, tensors[t].numel)});
    }
  }
  const bool small_weight = s.lerp_weight < 0.5f;
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const WorkItem& w = items[k];
      if (small_weight) {
        update_range<true>(tensors[w.tensor], w.begin, w.end, s);
      } else {
        update_range<false>(tensors[w.tensor], w.begin, w.end, s);
      }
    }
  });
}

}  // namespace adamw
}  // namespace tessel
