// pybind11 bindings of the dataset index builders: engine._data_index.
//
// Inputs must already be C-contiguous numpy arrays of the exact dtype (no forcecast, so a wrong
// dtype is a TypeError rather than a silent copy); engine/data/index_helpers.py converts and
// validates. Outputs are allocated here as numpy arrays and filled in place with the GIL
// released, so nothing is copied on the way in or out.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <stdexcept>

#include "index_builders.h"

namespace py = pybind11;
namespace di = tessel::data_index;

namespace {

template <typename T>
using CArray = py::array_t<T, py::array::c_style>;

CArray<int32_t> document_index(const CArray<int32_t>& documents, int64_t num_epochs,
                               int64_t seed) {
  if (documents.ndim() != 1) throw std::invalid_argument("documents must be 1-D");
  if (num_epochs < 1) throw std::invalid_argument("num_epochs must be >= 1");
  if (seed < 0 || seed > static_cast<int64_t>(std::numeric_limits<uint32_t>::max())) {
    throw std::invalid_argument("seed must be in [0, 2**32 - 1]");
  }
  const int64_t n = documents.shape(0);
  CArray<int32_t> out(py::ssize_t(n * num_epochs));
  const int32_t* src = documents.data();
  int32_t* dst = out.mutable_data();
  {
    py::gil_scoped_release release;
    di::build_document_index(src, n, num_epochs, static_cast<uint32_t>(seed), dst);
  }
  return out;
}

template <typename T>
py::array sample_index_typed(const CArray<int32_t>& sizes, const CArray<int32_t>& doc_index,
                             int64_t seq_length, int64_t total_tokens, int64_t num_samples,
                             bool drop_last_partial, int64_t extra) {
  CArray<T> out({py::ssize_t(num_samples + 1), py::ssize_t(2)});  // (num_samples + 1, 2)
  const int32_t* sizes_ptr = sizes.data();
  const int32_t* doc_ptr = doc_index.data();
  T* dst = out.mutable_data();
  const int64_t num_sizes = sizes.shape(0);
  const int64_t num_positions = doc_index.shape(0);
  {
    py::gil_scoped_release release;
    di::build_sample_index<T>(sizes_ptr, num_sizes, doc_ptr, num_positions, seq_length,
                              total_tokens, num_samples, drop_last_partial, extra, dst);
  }
  return out;
}

py::array sample_index(const CArray<int32_t>& sizes, const CArray<int32_t>& doc_index,
                       int64_t seq_length, int64_t total_tokens, bool drop_last_partial,
                       bool add_extra_token) {
  if (sizes.ndim() != 1) throw std::invalid_argument("sizes must be 1-D");
  if (doc_index.ndim() != 1) throw std::invalid_argument("document_index must be 1-D");
  if (seq_length < 1) throw std::invalid_argument("seq_length must be >= 1");
  if (total_tokens < 0) throw std::invalid_argument("total_tokens must be >= 0");
  const int64_t extra = add_extra_token ? 1 : 0;
  const int64_t num_samples = di::num_samples_for(total_tokens, seq_length, drop_last_partial,
                                                  extra);
  // Rows hold positions in document_index and offsets inside one int32-sized document: int32
  // suffices unless document_index itself is longer than int32 can address.
  if (doc_index.shape(0) < std::numeric_limits<int32_t>::max()) {
    return sample_index_typed<int32_t>(sizes, doc_index, seq_length, total_tokens, num_samples,
                                       drop_last_partial, extra);
  }
  return sample_index_typed<int64_t>(sizes, doc_index, seq_length, total_tokens, num_samples,
                                     drop_last_partial, extra);
}

py::tuple blending_indices(const CArray<double>& weights, int64_t size) {
  if (weights.ndim() != 1) throw std::invalid_argument("weights must be 1-D");
  if (size < 0) throw std::invalid_argument("size must be >= 0");
  const int64_t num_datasets = weights.shape(0);
  if (num_datasets < 1 || num_datasets > std::numeric_limits<int16_t>::max()) {
    throw std::invalid_argument("weights must hold between 1 and 32767 entries");
  }
  CArray<int16_t> dataset_index(py::ssize_t{size});
  CArray<int64_t> dataset_sample_index(py::ssize_t{size});
  const double* w = weights.data();
  int16_t* di_ptr = dataset_index.mutable_data();
  int64_t* dsi_ptr = dataset_sample_index.mutable_data();
  {
    py::gil_scoped_release release;
    di::build_blending_indices(w, num_datasets, size, di_ptr, dsi_ptr);
  }
  return py::make_tuple(dataset_index, dataset_sample_index);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Dataset index builders (document, sample and blending indices), Megatron-LM semantics";
#ifdef TESSEL_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  m.def("build_document_index", &document_index, py::arg("documents"), py::arg("num_epochs"),
        py::arg("seed"),
        "int32 documents (n,) -> int32 (num_epochs * n,): each epoch a permutation of documents, "
        "bit-identical to numpy RandomState(seed).shuffle applied epoch by epoch.");
  m.def("build_sample_index", &sample_index, py::arg("sizes"), py::arg("document_index"),
        py::arg("seq_length"), py::arg("total_tokens"), py::arg("drop_last_partial"),
        py::arg("add_extra_token"),
        "int32 sizes, int32 document_index -> (num_samples + 1, 2) int32 (int64 when "
        "document_index has >= 2**31 - 1 entries) of (position, offset) rows.");
  m.def("build_blending_indices", &blending_indices, py::arg("weights"), py::arg("size"),
        "float64 normalised weights (k,) -> (int16 dataset_index (size,), int64 "
        "dataset_sample_index (size,)), greedy largest-lag rule.");
  m.def("num_samples", &di::num_samples_for, py::arg("total_tokens"), py::arg("seq_length"),
        py::arg("drop_last_partial"), py::arg("extra"),
        "Number of samples the sample index will describe.");
}
