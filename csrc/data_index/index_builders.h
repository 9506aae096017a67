// Index builders for GPT-style datasets (Megatron-LM semantics), free of Python and torch.
//
// Every function works on raw, contiguous buffers that the caller has allocated, so the
// pybind11 layer (bindings.cpp) can hand numpy memory straight in and run these loops with the
// GIL released. Bad inputs raise std::invalid_argument (pybind11 turns it into ValueError);
// the Python wrapper (engine/data/index_helpers.py) validates the same conditions first, so
// these checks are the last line of defence against out-of-bounds reads when the module is
// called directly.
#pragma once

#include <cstdint>

namespace tessel {
namespace data_index {

// Number of sample-index rows minus one (the number of samples), exact integer arithmetic:
// floor((total_tokens - extra) / seq_length) when dropping the last partial sample, else the
// ceiling; zero when total_tokens <= extra.
int64_t num_samples_for(int64_t total_tokens, int64_t seq_length, bool drop_last_partial,
                        int64_t extra);

// out[e * num_documents + k] for epoch e is a permutation of documents[0..num_documents):
// each epoch copies `documents` and shuffles it in place with the Fisher-Yates walk of
// numpy's legacy RandomState.shuffle, drawing from one MT19937 stream seeded with `seed`
// (init_genrand), so the result is bit-identical to
//   rs = numpy.random.RandomState(seed); for each epoch: rs.shuffle(epoch_block)
// Requires num_documents <= 2**31 - 1 (32-bit draws only, like numpy below 2**32).
void build_document_index(const int32_t* documents, int64_t num_documents, int64_t num_epochs,
                          uint32_t seed, int32_t* out);

// Fills out[(num_samples + 1) * 2] (row-major rows of (position in document_index, token
// offset in that document)). Row 0 is (0, 0); row i >= 1 is where sample i starts, i.e. global
// token P = i * seq_length, written as (j, P - first token of position j) with j the first
// position whose documents reach token P + extra (the position that holds the previous
// sample's last token, as Megatron-LM's walk leaves it). A kept partial last sample ends at the
// end of the token stream, at the last non-empty position. num_samples must equal
// num_samples_for(total_tokens, ...). Throws when a size is negative, a document id is out of
// [0, num_sizes), or document_index holds fewer than total_tokens tokens.
template <typename T>
void build_sample_index(const int32_t* sizes, int64_t num_sizes, const int32_t* document_index,
                        int64_t num_positions, int64_t seq_length, int64_t total_tokens,
                        int64_t num_samples, bool drop_last_partial, int64_t extra, T* out);

// Greedy blend (Megatron-LM's rule with the target one step later): at step i pick the first
// dataset k maximising weights[k] * (i + 1) - count[k], the one lagging its target most, record
// (k, count[k]) and increment count[k]. Weights are used as given (the caller normalises them).
void build_blending_indices(const double* weights, int64_t num_datasets, int64_t size,
                            int16_t* dataset_index, int64_t* dataset_sample_index);

}  // namespace data_index
}  // namespace tessel
