// Implementations of the index builders declared in index_builders.h.
#include "index_builders.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessel {
namespace data_index {

namespace {

// numpy's random_interval for max < 2**32 (numpy/random/src/distributions): the smallest
// all-ones mask covering `max`, then 32-bit draws rejected until one lands in [0, max].
// std::mt19937 is MT19937 with init_genrand seeding and tempered 32-bit output, which is
// exactly what numpy.random.RandomState(seed) draws from, so the same draws come out.
inline uint32_t random_interval(std::mt19937& gen, uint32_t max) {
  if (max == 0) return 0;
  uint32_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  uint32_t value;
  do {
    value = static_cast<uint32_t>(gen()) & mask;
  } while (value > max);
  return value;
}

// One in-place Fisher-Yates pass in numpy's order: i from n-1 down to 1, swap a[i], a[j],
// j = random_interval(i). The draws do not depend on the data, so they are taken in blocks
// first and the swaps then prefetch a few targets ahead: the random reads into a
// multi-megabyte array are what costs, not the generator.
void shuffle_in_place(int32_t* a, int64_t n, std::mt19937& gen) {
  constexpr int64_t kBlock = 4096;
  constexpr int64_t kAhead = 16;
  std::vector<uint32_t> draws(kBlock);
  for (int64_t hi = n - 1; hi >= 1; hi -= kBlock) {
    const int64_t count = std::min<int64_t>(kBlock, hi);  // i runs hi, hi-1, ..., hi-count+1
    for (int64_t k = 0; k < count; ++k) {
      draws[k] = random_interval(gen, static_cast<uint32_t>(hi - k));
    }
    for (int64_t k = 0; k < count; ++k) {
      if (k + kAhead < count) __builtin_prefetch(a + draws[k + kAhead], 1);
      const int64_t i = hi - k;
      const uint32_t j = draws[k];
      const int32_t tmp = a[j];
      a[j] = a[i];
      a[i] = tmp;
    }
  }
}

std::string position_message(int64_t position, int64_t doc, int64_t num_sizes) {
  return "document_index[" + std::to_string(position) + "] = " + std::to_string(doc) +
         " is out of range for sizes of length " + std::to_string(num_sizes) +
         "; document_index must hold ids in [0, len(sizes))";
}

std::string too_few_tokens_message(int64_t total_tokens, int64_t available) {
  return "tokens_per_epoch * num_epochs = " + std::to_string(total_tokens) +
         " exceeds the " + std::to_string(available) +
         " tokens that document_index holds; pass the token count of one epoch of documents";
}

}  // namespace

int64_t num_samples_for(int64_t total_tokens, int64_t seq_length, bool drop_last_partial,
                        int64_t extra) {
  if (seq_length < 1) throw std::invalid_argument("seq_length must be >= 1");
  const int64_t usable = total_tokens - extra;
  if (usable <= 0) return 0;
  // Megatron-LM rounds up through a float32 ceil, which loses exactness past 2**24 tokens;
  // integer ceiling division here.
  return drop_last_partial ? usable / seq_length : (usable + seq_length - 1) / seq_length;
}

void build_document_index(const int32_t* documents, int64_t num_documents, int64_t num_epochs,
                          uint32_t seed, int32_t* out) {
  if (num_epochs < 1) throw std::invalid_argument("num_epochs must be >= 1");
  if (num_documents < 0 || num_documents > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("documents must hold at most 2**31 - 1 entries");
  }
  std::mt19937 gen(seed);
  for (int64_t epoch = 0; epoch < num_epochs; ++epoch) {
    int32_t* block = out + epoch * num_documents;
    std::memcpy(block, documents, sizeof(int32_t) * static_cast<size_t>(num_documents));
    shuffle_in_place(block, num_documents, gen);
  }
}

template <typename T>
void build_sample_index(const int32_t* sizes, int64_t num_sizes, const int32_t* document_index,
                        int64_t num_positions, int64_t seq_length, int64_t total_tokens,
                        int64_t num_samples, bool drop_last_partial, int64_t extra, T* out) {
  if (seq_length < 1) throw std::invalid_argument("seq_length must be >= 1");
  if (num_samples != num_samples_for(total_tokens, seq_length, drop_last_partial, extra)) {
    throw std::invalid_argument("num_samples does not match total_tokens and seq_length");
  }
  for (int64_t d = 0; d < num_sizes; ++d) {
    if (sizes[d] < 0) {
      throw std::invalid_argument("sizes[" + std::to_string(d) + "] = " +
                                  std::to_string(sizes[d]) +
                                  " is negative; document sizes must be >= 0");
    }
  }
  auto size_at = [&](int64_t position) -> int64_t {
    const int64_t doc = document_index[position];
    if (doc < 0 || doc >= num_sizes) {
      throw std::invalid_argument(position_message(position, doc, num_sizes));
    }
    return sizes[doc];
  };

  out[0] = 0;
  out[1] = 0;
  // One merge-like walk: `j` is the first position whose cumulative token count `cum_end`
  // reaches the sample's exclusive end E = i * seq_length + extra, so it only moves forward.
  int64_t j = 0;
  int64_t cum_end = num_positions > 0 ? size_at(0) : 0;
  int64_t last_nonempty = cum_end > 0 ? 0 : -1;
  for (int64_t i = 1; i <= num_samples; ++i) {
    int64_t end = i * seq_length + extra;
    while (cum_end < end && j + 1 < num_positions) {
      ++j;
      const int64_t size = size_at(j);
      cum_end += size;
      if (size > 0) last_nonempty = j;
    }
    int64_t position = j;
    int64_t position_end = cum_end;
    if (cum_end < end) {
      // The walk has consumed every position, so cum_end is the stream's total here.
      if (drop_last_partial || i != num_samples || last_nonempty < 0) {
        throw std::invalid_argument(too_few_tokens_message(total_tokens, cum_end));
      }
      // The kept partial sample stops at the end of the stream, in the last non-empty
      // document (trailing empty documents hold no token to point at).
      end = cum_end;
      position = last_nonempty;
    }
    const int64_t position_start = position_end - size_at(position);
    out[2 * i] = static_cast<T>(position);
    out[2 * i + 1] = static_cast<T>(end - extra - position_start);
  }
  // Ids past the last sample are never read by the walk, but they are checked (and their
  // tokens counted) so that the native and numpy paths reject exactly the same inputs.
  for (int64_t p = j + 1; p < num_positions; ++p) cum_end += size_at(p);
  if (cum_end < total_tokens) {
    throw std::invalid_argument(too_few_tokens_message(total_tokens, cum_end));
  }
}

template void build_sample_index<int32_t>(const int32_t*, int64_t, const int32_t*, int64_t,
                                          int64_t, int64_t, int64_t, bool, int64_t, int32_t*);
template void build_sample_index<int64_t>(const int32_t*, int64_t, const int32_t*, int64_t,
                                          int64_t, int64_t, int64_t, bool, int64_t, int64_t*);

void build_blending_indices(const double* weights, int64_t num_datasets, int64_t size,
                            int16_t* dataset_index, int64_t* dataset_sample_index) {
  if (num_datasets < 1 || num_datasets > std::numeric_limits<int16_t>::max()) {
    throw std::invalid_argument("weights must hold between 1 and 32767 entries");
  }
  if (size < 0) throw std::invalid_argument("size must be >= 0");
  // Counts kept as doubles: exact below 2**53, and the error below is then the same two
  // IEEE operations (multiply, subtract) as the numpy reference, so picks agree bit for bit.
  // setup.py compiles with -std=c++17 (ISO mode), where GCC does not contract a*b-c into an
  // FMA, which would round differently.
  std::vector<double> counts(static_cast<size_t>(num_datasets), 0.0);
  for (int64_t i = 0; i < size; ++i) {
    // Target after this pick: weights[k] * (i + 1). Megatron-LM uses max(i, 1), one step
    // behind, which lets realised counts drift more than one sample from their targets.
    const double step = static_cast<double>(i + 1);
    int64_t best = 0;
    double best_error = weights[0] * step - counts[0];
    for (int64_t k = 1; k < num_datasets; ++k) {
      const double error = weights[k] * step - counts[k];
      if (error > best_error) {
        best_error = error;
        best = k;
      }
    }
    dataset_index[i] = static_cast<int16_t>(best);
    dataset_sample_index[i] = static_cast<int64_t>(counts[best]);
    counts[best] += 1.0;
  }
}

}  // namespace data_index
}  // namespace tessel
