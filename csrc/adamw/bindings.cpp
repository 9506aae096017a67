// pybind11 bindings of the multi-tensor fused AdamW: engine._adamw.
//
// fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, bf16_out, lr, beta1, beta2, eps, weight_decay,
// step) updates the lists in place. Every tensor is checked (dtype, device, shape, contiguity)
// before anything is written; a bad input raises ValueError naming the list, the index and the
// fix. CUDA tensors go to the CUDA launcher when the module was built with TESSEL_WITH_CUDA.
// ATen and torch's pybind11 casters, not <torch/extension.h>: that one also parses the C++ frontend (nn,
// optim, data), 2x the compile time, none of it used here.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#ifdef TESSEL_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "adamw/adamw.h"

namespace py = pybind11;
namespace aw = tessel::adamw;

namespace {

[[noreturn]] void fail(const std::string& msg) { throw py::value_error("fused_adamw_: " + msg); }

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << " " << t.sizes() << " on " << t.device();
  return os.str();
}

void check_list(const std::vector<at::Tensor>& list, const char* name, size_t n,
                const std::vector<at::Tensor>& params, at::ScalarType dtype) {
  if (list.size() != n) {
    fail(std::string(name) + " has " + std::to_string(list.size()) + " tensors but params has " +
         std::to_string(n) + "; pass one per parameter, in the same order");
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = list[i];
    const std::string where = std::string(name) + "[" + std::to_string(i) + "]";
    if (t.scalar_type() != dtype) {
      fail(where + " is " + describe(t) + "; expected " + c10::toString(dtype) +
           (dtype == at::kFloat ? " (fp32 master weights, grads and moments)" : ""));
    }
    if (t.device() != params[0].device()) {
      fail(where + " is on " + t.device().str() + " but params[0] is on " +
           params[0].device().str() + "; keep all optimizer tensors on one device");
    }
    if (!t.sizes().equals(params[i].sizes())) {
      fail(where + " has shape " + describe(t) + " but params[" + std::to_string(i) +
           "] has shape " + describe(params[i]) + "; they must match");
    }
    if (!t.is_contiguous()) fail(where + " is not contiguous; call .contiguous() once at setup");
  }
}

void fused_adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                 const std::optional<std::vector<at::Tensor>>& bf16_out, double lr, double beta1,
                 double beta2, double eps, double weight_decay, int64_t step) {
  const size_t n = params.size();
  if (n == 0) return;
  if (step < 1) fail("step=" + std::to_string(step) + " must be >= 1 (count steps from 1)");
  check_list(params, "params", n, params, at::kFloat);
  check_list(grads, "grads", n, params, at::kFloat);
  check_list(exp_avgs, "exp_avgs", n, params, at::kFloat);
  check_list(exp_avg_sqs, "exp_avg_sqs", n, params, at::kFloat);
  if (bf16_out.has_value()) check_list(*bf16_out, "bf16_out", n, params, at::kBFloat16);

  std::vector<aw::TensorRef> refs(n);
  for (size_t i = 0; i < n; ++i) {
    refs[i].param = params[i].data_ptr<float>();
    refs[i].grad = grads[i].data_ptr<float>();
    refs[i].exp_avg = exp_avgs[i].data_ptr<float>();
    refs[i].exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    refs[i].bf16_out = bf16_out.has_value()
                           ? reinterpret_cast<uint16_t*>((*bf16_out)[i].data_ptr<at::BFloat16>())
                           : nullptr;
    refs[i].numel = params[i].numel();
  }
  const aw::Scalars s = aw::make_scalars(lr, beta1, beta2, eps, weight_decay, step);
  const at::Device device = params[0].device();
  if (device.is_cuda()) {
#ifdef TESSEL_WITH_CUDA
    const c10::cuda::CUDAGuard guard(device);
    const int err = aw::adamw_cuda(refs.data(), static_cast<int64_t>(n), s,
                                   c10::cuda::getCurrentCUDAStream(device.index()).stream());
    if (err != 0) throw std::runtime_error(std::string("fused_adamw_: CUDA launch failed: ") + aw::cuda_error_string(err));
    return;
#else
    fail("tensors are on " + device.str() + " but engine._adamw was built without CUDA; rebuild on a "
         "machine with nvcc and a CUDA torch, or use backend='reference'");
#endif
  }
  if (!device.is_cpu()) fail("unsupported device " + device.str() + "; use CPU or CUDA tensors");
  py::gil_scoped_release release;
  aw::adamw_cpu(refs.data(), static_cast<int64_t>(n), s);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Multi-tensor fused AdamW (decoupled weight decay, bias correction), fp32 state";
#ifdef TESSEL_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  m.def("fused_adamw_", &fused_adamw, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("bf16_out"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        "In-place AdamW step over lists of fp32 tensors (same math and order as "
        "torch.optim.AdamW(foreach=False)); optionally writes a bf16 copy of each updated param.");
}
