// pybind11 bindings of the FP8 cast-transpose: engine._fp8.
//
// cast_transpose(input, scale, e5m2=False) -> (out, out_t, amax): input (rows, cols) fp32 or bf16,
// contiguous; scale a one-element fp32 tensor on the input's device (read on the device: no host
// sync); out and out_t in float8_e4m3fn, or float8_e5m2 with e5m2=True.
// ATen and torch's pybind11 casters, not <torch/extension.h>: that one also parses the C++ frontend (nn,
// optim, data), 2x the compile time, none of it used here.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#ifdef TESSEL_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>

#include "fp8/fp8.h"

namespace py = pybind11;

namespace {

[[noreturn]] void fail(const std::string& msg) { throw py::value_error("fp8 cast_transpose: " + msg); }

// What both entry points ask of the input: 2-D, fp32 or bf16, contiguous, on the CPU or (built with CUDA) a GPU
// with at most 65535 * 32 rows (the kernels' grid).
void check_input(const at::Tensor& input) {
  if (input.dim() != 2) fail("input must be 2-D (rows, cols); reshape it to (-1, hidden) first");
  if (input.scalar_type() != at::kFloat && input.scalar_type() != at::kBFloat16) {
    fail(std::string("input dtype ") + c10::toString(input.scalar_type()) + " is not float32 or bfloat16");
  }
  if (!input.is_contiguous()) fail("input must be contiguous; call .contiguous()");
  if (input.is_cuda()) {
#ifdef TESSEL_WITH_CUDA
    if ((input.size(0) + 31) / 32 > 65535) fail("more than 65535 * 32 rows; split the input");
#else
    fail("input is on " + input.device().str() + " but engine._fp8 was built without CUDA; rebuild "
         "with nvcc and a CUDA torch, or use backend='reference'");
#endif
  } else if (!input.is_cpu()) {
    fail("unsupported device " + input.device().str());
  }
}

#ifdef TESSEL_WITH_CUDA
void check_launch(int err, const char* what) {
  if (err != 0) throw std::runtime_error(std::string("fp8 ") + what + ": CUDA launch failed: " +
                                         tessel::fp8::cuda_error_string(err));
}
#endif

std::tuple<at::Tensor, at::Tensor, at::Tensor> cast_transpose(const at::Tensor& input, const at::Tensor& scale,
                                                             bool e5m2) {
  check_input(input);
  if (scale.scalar_type() != at::kFloat || scale.numel() != 1 || scale.device() != input.device()) {
    fail("scale must be a one-element float32 tensor on the input's device, got " +
         std::string(c10::toString(scale.scalar_type())) + " with " + std::to_string(scale.numel()) +
         " elements on " + scale.device().str());
  }
  const int64_t rows = input.size(0), cols = input.size(1);
  const auto fp8 = input.options().dtype(e5m2 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn);
  at::Tensor out = at::empty({rows, cols}, fp8);
  at::Tensor out_t = at::empty({cols, rows}, fp8);  // (cols, rows): the transpose
  at::Tensor amax = at::empty({1}, input.options().dtype(at::kFloat));
  const bool bf16 = input.scalar_type() == at::kBFloat16;
  auto* out_ptr = reinterpret_cast<uint8_t*>(out.data_ptr());
  auto* out_t_ptr = reinterpret_cast<uint8_t*>(out_t.data_ptr());
#ifdef TESSEL_WITH_CUDA
  if (input.is_cuda()) {
    const c10::cuda::CUDAGuard guard(input.device());
    const at::Tensor scale_c = scale.contiguous();
    check_launch(tessel::fp8::cast_transpose_cuda(
                     input.data_ptr(), bf16, rows, cols, scale_c.data_ptr<float>(), out_ptr, out_t_ptr,
                     amax.data_ptr<float>(), e5m2, c10::cuda::getCurrentCUDAStream(input.device().index()).stream()),
                 "cast_transpose");
    return {out, out_t, amax};
  }
#endif
  const float s = scale.item<float>();
  {
    py::gil_scoped_release release;
    tessel::fp8::cast_transpose_cpu(input.data_ptr(), bf16, rows, cols, s, out_ptr, out_t_ptr,
                                    amax.data_ptr<float>(), e5m2);
  }
  return {out, out_t, amax};
}

// cast_transpose_scaled(input, scale, from_amax, e5m2, want_out_t, want_amax, amax_into) -> (out, out_t or None,
// amax or None, scale_inv): cast_transpose for per-tensor scaling in one call. amax_into: a one-element float32
// tensor holding a running maximum (a delayed-scaling state's pending amax: non-negative or NaN) that max |x|
// is folded into where the cast runs; the returned amax is then None. With from_amax, scale holds an amax (max |x| of the
// tensor the scale is for, e.g. all-reduced over a TP group) and the scale is scale_from_amax of it
// (fp8.h), computed where the cast runs (no host sync on a GPU); scale_inv is a 0-dim fp32 1 / scale.
// scale None: current scaling from the input's own amax, reduced here before the cast (the launch issued
// from C++, not from Python: the per-tensor recipes' host cost per linear); the amax returned (want_amax)
// is that reduction's, and the cast computes none of its own.
std::tuple<at::Tensor, py::object, py::object, at::Tensor> cast_transpose_scaled(const at::Tensor& input,
                                                                                 const py::object& scale_obj,
                                                                                 bool from_amax, bool e5m2,
                                                                                 bool want_out_t, bool want_amax,
                                                                                 const py::object& amax_into) {
  check_input(input);
  const bool own = scale_obj.is_none();
  if (own && from_amax) fail("from_amax=True needs the amax in scale; give None only for the input's own amax");
  at::Tensor own_amax;  // (1,) fp32 max |input| (0 for an empty input; NaN if it has one)
  if (own) {
    own_amax = input.numel() ? at::linalg_vector_norm(input, INFINITY, at::OptionalIntArrayRef(), false, at::kFloat)
                                   .reshape({1})
                             : at::zeros({1}, input.options().dtype(at::kFloat));
    from_amax = true;
  }
  const at::Tensor scale = own ? own_amax : scale_obj.cast<at::Tensor>();
  if (scale.scalar_type() != at::kFloat || scale.numel() != 1 || scale.device() != input.device()) {
    fail(std::string(from_amax ? "amax" : "scale") + " must be a one-element float32 tensor on the input's device, "
         "got " + std::string(c10::toString(scale.scalar_type())) + " with " + std::to_string(scale.numel()) +
         " elements on " + scale.device().str());
  }
  at::Tensor into;
  if (!amax_into.is_none()) {
    into = amax_into.cast<at::Tensor>();
    if (into.scalar_type() != at::kFloat || into.numel() != 1 || into.device() != input.device() ||
        !into.is_contiguous()) {
      fail("amax_into must be a contiguous one-element float32 tensor on the input's device (a running maximum), "
           "got " + std::string(c10::toString(into.scalar_type())) + " with " + std::to_string(into.numel()) +
           " elements on " + into.device().str());
    }
    if (want_amax) fail("amax_into folds max |x| into a running maximum: give it with want_amax=False");
    if (into.data_ptr() == scale.data_ptr()) {
      fail("amax_into is the scale (or amax) tensor itself: the cast would read it while folding into it");
    }
  }
  const int64_t rows = input.size(0), cols = input.size(1);
  const auto fp8 = input.options().dtype(e5m2 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn);
  at::Tensor out = at::empty({rows, cols}, fp8);
  at::Tensor out_t = want_out_t ? at::empty({cols, rows}, fp8) : at::Tensor();  // (cols, rows): the transpose
  // The cast's own amax: wanted and not already reduced (own), or folded into a running maximum.
  const bool cast_amax = want_amax && !own;
  at::Tensor amax = cast_amax ? at::empty({1}, input.options().dtype(at::kFloat)) : own_amax;
  at::Tensor scale_inv = at::empty({}, input.options().dtype(at::kFloat));
  const bool bf16 = input.scalar_type() == at::kBFloat16;
  auto* out_ptr = reinterpret_cast<uint8_t*>(out.data_ptr());
  auto* out_t_ptr = want_out_t ? reinterpret_cast<uint8_t*>(out_t.data_ptr()) : nullptr;
  float* amax_ptr = cast_amax ? amax.data_ptr<float>() : (into.defined() ? into.data_ptr<float>() : nullptr);
  auto wrap = [&]() -> std::tuple<at::Tensor, py::object, py::object, at::Tensor> {
    return {out, want_out_t ? py::cast(out_t) : py::none(), want_amax ? py::cast(amax) : py::none(), scale_inv};
  };
#ifdef TESSEL_WITH_CUDA
  if (input.is_cuda()) {
    const c10::cuda::CUDAGuard guard(input.device());
    const at::Tensor scale_c = scale.contiguous();
    check_launch(tessel::fp8::cast_transpose_scaled_cuda(
                     input.data_ptr(), bf16, rows, cols, scale_c.data_ptr<float>(), from_amax, out_ptr, out_t_ptr,
                     amax_ptr, scale_inv.data_ptr<float>(), e5m2,
                     c10::cuda::getCurrentCUDAStream(input.device().index()).stream(), into.defined()),
                 "cast_transpose_scaled");
    return wrap();
  }
#endif
  const float given = scale.item<float>();
  const float s = from_amax ? tessel::fp8::scale_from_amax_cpu(given, e5m2) : given;
  *scale_inv.data_ptr<float>() = 1.0f / s;
  {
    py::gil_scoped_release release;
    float local = 0.0f;  // this input's amax, folded into the running maximum below (amax_into)
    tessel::fp8::cast_transpose_cpu(input.data_ptr(), bf16, rows, cols, s, out_ptr, out_t_ptr,
                                    into.defined() ? &local : amax_ptr, e5m2);
    if (into.defined()) {  // max over bit patterns, as the CUDA kernel's atomicMax: NaN wins
      uint32_t a = 0, b = 0;
      std::memcpy(&a, amax_ptr, sizeof(a));
      std::memcpy(&b, &local, sizeof(b));
      if (b > a) std::memcpy(amax_ptr, &b, sizeof(b));
    }
  }
  return wrap();
}

// scales_from_amax(amax, e5m2, pow2) -> (scale, scale_inv): elementwise scale_from_amax (or, pow2,
// pow2_scale_from_amax; fp8.h) of a float32 tensor
// of amaxes and its reciprocal, both of amax's shape (contiguous): a grid of scales in one call.
std::tuple<at::Tensor, at::Tensor> scales_from_amax(const at::Tensor& amax, bool e5m2, bool pow2) {
  if (amax.scalar_type() != at::kFloat) {
    fail(std::string("scales_from_amax: amax must be float32, got ") + c10::toString(amax.scalar_type()));
  }
  const at::Tensor a = amax.contiguous();
  at::Tensor scale = at::empty_like(a), scale_inv = at::empty_like(a);
  const int64_t n = a.numel();
#ifdef TESSEL_WITH_CUDA
  if (a.is_cuda()) {
    const c10::cuda::CUDAGuard guard(a.device());
    check_launch(tessel::fp8::scales_from_amax_cuda(a.data_ptr<float>(), n, scale.data_ptr<float>(),
                                                    scale_inv.data_ptr<float>(), e5m2, pow2,
                                                    c10::cuda::getCurrentCUDAStream(a.device().index()).stream()),
                 "scales_from_amax");
    return {scale, scale_inv};
  }
#endif
  if (!a.is_cpu()) fail("scales_from_amax: unsupported device " + a.device().str());
  const float* in = a.data_ptr<float>();
  float* s = scale.data_ptr<float>();
  float* inv = scale_inv.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    s[i] = pow2 ? tessel::fp8::pow2_scale_from_amax_cpu(in[i], e5m2) : tessel::fp8::scale_from_amax_cpu(in[i], e5m2);
    inv[i] = 1.0f / s[i];
  }
  return {scale, scale_inv};
}

// cast_transpose_grid(input, scale, block_rows, block_cols, e5m2, want_out, want_out_t, want_amax) -> (out or
// None, out_t or None, amax or None): as cast_transpose, element (r, c) scaled by scale[r / block_rows][c / block_cols];
// scale a contiguous fp32 (ceil(rows / block_rows), ceil(cols / block_cols)) grid on the input's device.
std::tuple<py::object, py::object, py::object> cast_transpose_grid(const at::Tensor& input, const at::Tensor& scale,
                                                                    int64_t block_rows, int64_t block_cols,
                                                                    bool e5m2, bool want_out, bool want_out_t,
                                                                    bool want_amax) {
  check_input(input);
  if (block_rows < 1 || block_cols < 1) fail("block_rows and block_cols must be >= 1");
  if (!want_out && !want_out_t) fail("nothing to write: want_out and want_out_t are both False");
  const int64_t rows = input.size(0), cols = input.size(1);
  const int64_t grid_rows = (rows + block_rows - 1) / block_rows, grid_cols = (cols + block_cols - 1) / block_cols;
  if (scale.scalar_type() != at::kFloat || scale.dim() != 2 || scale.size(0) != grid_rows ||
      scale.size(1) != grid_cols || !scale.is_contiguous() || scale.device() != input.device()) {
    fail("scale must be a contiguous float32 (" + std::to_string(grid_rows) + ", " + std::to_string(grid_cols) +
         ") grid on the input's device (ceil(rows / block_rows), ceil(cols / block_cols)), got " +
         std::string(c10::toString(scale.scalar_type())) + " " + std::to_string(scale.dim()) + "-D on " +
         scale.device().str());
  }
  const auto fp8 = input.options().dtype(e5m2 ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn);
  at::Tensor out = want_out ? at::empty({rows, cols}, fp8) : at::Tensor();
  at::Tensor out_t = want_out_t ? at::empty({cols, rows}, fp8) : at::Tensor();
  at::Tensor amax = want_amax ? at::empty({1}, input.options().dtype(at::kFloat)) : at::Tensor();
  const bool bf16 = input.scalar_type() == at::kBFloat16;
  auto* out_ptr = want_out ? reinterpret_cast<uint8_t*>(out.data_ptr()) : nullptr;
  auto* out_t_ptr = want_out_t ? reinterpret_cast<uint8_t*>(out_t.data_ptr()) : nullptr;
  float* amax_ptr = want_amax ? amax.data_ptr<float>() : nullptr;
  auto wrap = [&]() -> std::tuple<py::object, py::object, py::object> {
    return {want_out ? py::cast(out) : py::none(), want_out_t ? py::cast(out_t) : py::none(),
            want_amax ? py::cast(amax) : py::none()};
  };
#ifdef TESSEL_WITH_CUDA
  if (input.is_cuda()) {
    const c10::cuda::CUDAGuard guard(input.device());
    check_launch(tessel::fp8::cast_transpose_grid_cuda(
                     input.data_ptr(), bf16, rows, cols, scale.data_ptr<float>(), block_rows, block_cols, out_ptr,
                     out_t_ptr, amax_ptr, e5m2,
                     c10::cuda::getCurrentCUDAStream(input.device().index()).stream()),
                 "cast_transpose_grid");
    return wrap();
  }
#endif
  {
    py::gil_scoped_release release;
    tessel::fp8::cast_transpose_grid_cpu(input.data_ptr(), bf16, rows, cols, scale.data_ptr<float>(), block_rows,
                                         block_cols, out_ptr, out_t_ptr, amax_ptr, e5m2);
  }
  return wrap();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FP8 (e4m3 or e5m2) cast + transpose + amax";
#ifdef TESSEL_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  m.def("cast_transpose", &cast_transpose, py::arg("input"), py::arg("scale"), py::arg("e5m2") = false,
        "(rows, cols) fp32/bf16 input, one-element fp32 scale -> (fp8 (rows, cols) of input*scale, "
        "fp8 (cols, rows) transpose, fp32 (1,) amax of |input|); e4m3, or e5m2 with e5m2=True; "
        "saturating, NaN-propagating amax.");
  m.def("cast_transpose_scaled", &cast_transpose_scaled, py::arg("input"), py::arg("scale"),
        py::arg("from_amax") = false, py::arg("e5m2") = false, py::arg("want_out_t") = true,
        py::arg("want_amax") = true, py::arg("amax_into") = py::none(),
        "cast_transpose for per-tensor scaling: with from_amax, scale is an amax and the scale is derived "
        "where the cast runs; scale None: from the input's own amax, reduced first; returns (out, out_t or None, amax or None (want_amax=False: not computed; "
        "amax_into: folded into that running maximum), 0-dim scale_inv = 1 / scale).");
  m.def("scales_from_amax", &scales_from_amax, py::arg("amax"), py::arg("e5m2") = false, py::arg("pow2") = false,
        "(scale, 1 / scale) of each float32 amax: fp8_max / amax (IEEE), 1 where amax is not positive and "
        "finite, at most the largest float32; with pow2, the power-of-two scale of the MX recipe.");
  m.def("cast_transpose_grid", &cast_transpose_grid, py::arg("input"), py::arg("scale"), py::arg("block_rows"),
        py::arg("block_cols"), py::arg("e5m2") = false, py::arg("want_out") = true, py::arg("want_out_t") = true,
        py::arg("want_amax") = true,
        "cast_transpose with a grid of scales: element (r, c) times scale[r / block_rows][c / block_cols]; "
        "outputs not wanted (amax included) come back as None.");
}
