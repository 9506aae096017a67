// Implementations of the index builders declared in index_builders.h.
#include "index_builders.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessel {
namespace data_index {

namespace {

// MT19937 (Matsumoto & Nishimura) with init_genrand seeding and tempered 32-bit output: the
// generator behind numpy.random.RandomState(seed) and std::mt19937(seed), same words in the
// same order. Written out instead of std::mt19937 because drawing one word per call through
// the library object costs more than the whole shuffle around it: here the 624-word state is
// regenerated and tempered a block at a time in branch-free loops the compiler vectorises.
class Mt19937Block {
 public:
  static constexpr int kN = 624;

  explicit Mt19937Block(uint32_t seed) {
    state_[0] = seed;
    for (int i = 1; i < kN; ++i) {
      state_[i] = 1812433253u * (state_[i - 1] ^ (state_[i - 1] >> 30)) + static_cast<uint32_t>(i);
    }
  }

  // The next kN output words, valid until the following call.
  const uint32_t* next_block() {
    constexpr int kM = 397;
    constexpr uint32_t kUpper = 0x80000000u, kLower = 0x7fffffffu, kMatrix = 0x9908b0dfu;
    auto twist = [&](uint32_t hi_word, uint32_t lo_word, uint32_t far) {
      const uint32_t y = (hi_word & kUpper) | (lo_word & kLower);
      return far ^ (y >> 1) ^ ((0u - (y & 1u)) & kMatrix);
    };
    for (int i = 0; i < kN - kM; ++i) state_[i] = twist(state_[i], state_[i + 1], state_[i + kM]);
    for (int i = kN - kM; i < kN - 1; ++i) {
      state_[i] = twist(state_[i], state_[i + 1], state_[i + kM - kN]);
    }
    state_[kN - 1] = twist(state_[kN - 1], state_[0], state_[kM - 1]);
    for (int i = 0; i < kN; ++i) {
      uint32_t y = state_[i];
      y ^= y >> 11;
      y ^= (y << 7) & 0x9d2c5680u;
      y ^= (y << 15) & 0xefc60000u;
      y ^= y >> 18;
      out_[i] = y;
    }
    return out_;
  }

 private:
  uint32_t state_[kN];
  uint32_t out_[kN];
};

// numpy's bounded draws for Fisher-Yates, in bulk: draws[k] = random_interval(hi - k) for
// k in [0, count), every bound >= 1. random_interval (numpy/random/src/distributions) takes
// the smallest all-ones mask covering the bound and rejects masked 32-bit words above it.
// Written branch-free over the word stream: every word is masked and stored, and only an
// accepted one advances the output slot and the bound. The mask is fixed between powers of
// two, so it is recomputed once per stretch instead of per word.
class BoundedDraws {
 public:
  explicit BoundedDraws(uint32_t seed) : gen_(seed) {}

  void fill(uint32_t hi, int64_t count, uint32_t* draws) {
    int64_t k = 0;
    uint32_t bound = hi;
    while (k < count) {
      if (pos_ == Mt19937Block::kN) {
        words_ = gen_.next_block();
        pos_ = 0;
      }
      const uint32_t mask = 0xffffffffu >> __builtin_clz(bound);  // bound >= 1
      // Accepting draws until the bound reaches mask / 2 keeps the mask valid.
      const int64_t stretch_end = std::min<int64_t>(count, k + (bound - (mask >> 1)));
      int pos = pos_;
      for (; pos < Mt19937Block::kN && k < stretch_end; ++pos) {
        const uint32_t value = words_[pos] & mask;
        draws[k] = value;
        const uint32_t accept = value <= bound;
        k += accept;
        bound -= accept;
      }
      pos_ = pos;
    }
  }

 private:
  Mt19937Block gen_;
  const uint32_t* words_ = nullptr;
  int pos_ = Mt19937Block::kN;  // numpy draws the first block lazily, as here
};

// One in-place Fisher-Yates pass in numpy's order (RandomState.shuffle): i from n-1 down to 1,
// swap a[i] and a[j], j = random_interval(i). The draws do not depend on the data, so a block of
// them is taken first and the swaps then prefetch their random targets a few steps ahead.
void shuffle_in_place(int32_t* a, int64_t n, BoundedDraws& rng) {
  constexpr int64_t kBlock = 4096;
  constexpr int64_t kAhead = 16;
  std::vector<uint32_t> draws(kBlock);
  for (int64_t hi = n - 1; hi >= 1; hi -= kBlock) {
    const int64_t count = std::min<int64_t>(kBlock, hi);  // i runs hi, hi-1, ..., hi-count+1
    rng.fill(static_cast<uint32_t>(hi), count, draws.data());
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
  BoundedDraws rng(seed);  // one stream across epochs, like one RandomState
  for (int64_t epoch = 0; epoch < num_epochs; ++epoch) {
    int32_t* block = out + epoch * num_documents;
    std::memcpy(block, documents, sizeof(int32_t) * static_cast<size_t>(num_documents));
    shuffle_in_place(block, num_documents, rng);
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
  // One pass over the positions. Sample i - 1 ends (exclusive, extra token included) at stream
  // token `end` = i * seq_length + extra; row i is written at the first position whose
  // cumulative count `cum_end` reaches `end`, i.e. the one holding that sample's last token.
  // sizes[] is read in document_index's (shuffled) order, so those reads are prefetched.
  constexpr int64_t kAhead = 32;
  int64_t i = 1;
  int64_t end = seq_length + extra;
  int64_t cum_end = 0;
  int64_t last_nonempty = -1;
  int64_t j = 0;
  for (; j < num_positions && i <= num_samples; ++j) {
    if (j + kAhead < num_positions) {
      const uint64_t ahead = static_cast<uint32_t>(document_index[j + kAhead]);
      if (ahead < static_cast<uint64_t>(num_sizes)) __builtin_prefetch(sizes + ahead);
    }
    const int64_t size = size_at(j);
    cum_end += size;
    if (size > 0) last_nonempty = j;
    for (; i <= num_samples && cum_end >= end; ++i, end += seq_length) {
      out[2 * i] = static_cast<T>(j);
      out[2 * i + 1] = static_cast<T>(end - extra - (cum_end - size));
    }
  }
  if (i <= num_samples) {
    // Every position is consumed, so cum_end is the stream's total. Only a kept partial last
    // sample may run past it: it stops at the end of the stream, in the last non-empty
    // document (trailing empty documents hold no token to point at).
    if (drop_last_partial || i != num_samples || last_nonempty < 0) {
      throw std::invalid_argument(too_few_tokens_message(total_tokens, cum_end));
    }
    out[2 * i] = static_cast<T>(last_nonempty);
    out[2 * i + 1] = static_cast<T>(sizes[document_index[last_nonempty]] - extra);
  }
  // Ids past the last sample are never read by the walk, but they are checked (and their
  // tokens counted) so that the native and numpy paths reject exactly the same inputs.
  for (; j < num_positions; ++j) cum_end += size_at(j);
  if (cum_end < total_tokens) {
    throw std::invalid_argument(too_few_tokens_message(total_tokens, cum_end));
  }
}

template void build_sample_index<int32_t>(const int32_t*, int64_t, const int32_t*, int64_t,
                                          int64_t, int64_t, int64_t, bool, int64_t, int32_t*);
template void build_sample_index<int64_t>(const int32_t*, int64_t, const int32_t*, int64_t,
                                          int64_t, int64_t, int64_t, bool, int64_t, int64_t*);

namespace {

// The greedy loop for a compile-time number of datasets: weights and counts then live in
// registers (the pick updates every count branch-free) instead of being reloaded each step.
// Counts are doubles: exact below 2**53, and the error is then the same two IEEE operations
// (multiply, subtract) as the numpy reference, so the picks agree bit for bit. setup.py builds
// with -std=c++17 (ISO mode), where GCC does not contract w * step - c into an FMA.
template <int K>
void blend_fixed(const double* weights, int64_t size, int16_t* dataset_index,
                 int64_t* dataset_sample_index) {
  double w[K];
  double counts[K];
  for (int k = 0; k < K; ++k) {
    w[k] = weights[k];
    counts[k] = 0.0;
  }
  for (int64_t i = 0; i < size; ++i) {
    // Target after this pick: w[k] * (i + 1). Megatron-LM uses max(i, 1), one step behind,
    // which lets realised counts drift more than one sample from their targets.
    const double step = static_cast<double>(i + 1);
    int best = 0;
    double best_error = w[0] * step - counts[0];
    for (int k = 1; k < K; ++k) {
      const double error = w[k] * step - counts[k];
      const bool larger = error > best_error;  // strict: ties go to the lower id
      best_error = larger ? error : best_error;
      best = larger ? k : best;
    }
    double picked = 0.0;
    for (int k = 0; k < K; ++k) {
      const bool hit = k == best;
      picked = hit ? counts[k] : picked;
      counts[k] += hit ? 1.0 : 0.0;
    }
    dataset_index[i] = static_cast<int16_t>(best);
    dataset_sample_index[i] = static_cast<int64_t>(picked);
  }
}

// Same rule for any number of datasets.
void blend_any(const double* weights, int64_t num_datasets, int64_t size, int16_t* dataset_index,
               int64_t* dataset_sample_index) {
  std::vector<double> counts(static_cast<size_t>(num_datasets), 0.0);
  for (int64_t i = 0; i < size; ++i) {
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

}  // namespace

void build_blending_indices(const double* weights, int64_t num_datasets, int64_t size,
                            int16_t* dataset_index, int64_t* dataset_sample_index) {
  if (num_datasets < 1 || num_datasets > std::numeric_limits<int16_t>::max()) {
    throw std::invalid_argument("weights must hold between 1 and 32767 entries");
  }
  if (size < 0) throw std::invalid_argument("size must be >= 0");
  switch (num_datasets) {
    case 1: return blend_fixed<1>(weights, size, dataset_index, dataset_sample_index);
    case 2: return blend_fixed<2>(weights, size, dataset_index, dataset_sample_index);
    case 3: return blend_fixed<3>(weights, size, dataset_index, dataset_sample_index);
    case 4: return blend_fixed<4>(weights, size, dataset_index, dataset_sample_index);
    case 5: return blend_fixed<5>(weights, size, dataset_index, dataset_sample_index);
    case 6: return blend_fixed<6>(weights, size, dataset_index, dataset_sample_index);
    case 7: return blend_fixed<7>(weights, size, dataset_index, dataset_sample_index);
    case 8: return blend_fixed<8>(weights, size, dataset_index, dataset_sample_index);
    default: return blend_any(weights, num_datasets, size, dataset_index, dataset_sample_index);
  }
}

}  // namespace data_index
}  // namespace tessel
