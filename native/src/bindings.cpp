// Python module `ftnative`. Tensors cross the boundary as raw addresses (int, from
// torch.Tensor.data_ptr()) plus shapes: no copies, no PyTorch headers, any framework works.
// The Python wrapper (freetokend.experts.cpu_executor) validates dtypes, shapes and contiguity
// and keeps the bank tensors alive as long as the executor exists.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>

#include "cpu_features.h"
#include "executor.h"

namespace py = pybind11;
using ftnative::ActKind;
using ftnative::ActSpec;
using ftnative::BankSpec;
using ftnative::Executor;
using ftnative::ExecutorOptions;
using ftnative::WDtype;

namespace {

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

WDtype dtype_code(int code, const char* what) {
  if (code == 0) return WDtype::F32;
  if (code == 1) return WDtype::BF16;
  throw py::value_error(std::string(what) + ": dtype code must be 0 (fp32) or 1 (bf16)");
}

std::unique_ptr<Executor> make_executor(uintptr_t gate_up, uintptr_t down, uintptr_t gate_up_bias,
                                        uintptr_t down_bias, int weight_dtype, int bias_dtype,
                                        int64_t num_flat, int hidden, int inter, int act,
                                        float alpha, float limit, int threads,
                                        const std::string& isa, int tile_min_tokens, int spin_us,
                                        bool pin, int qformat, uintptr_t gate_up_scale,
                                        uintptr_t down_scale, uintptr_t gate_up_global,
                                        uintptr_t down_global) {
  BankSpec b;
  b.gate_up = ptr<const void>(gate_up);
  b.down = ptr<const void>(down);
  b.gate_up_bias = ptr<const void>(gate_up_bias);
  b.down_bias = ptr<const void>(down_bias);
  b.weight_dtype = dtype_code(weight_dtype, "weight_dtype");
  b.bias_dtype = dtype_code(bias_dtype, "bias_dtype");
  b.num_flat = num_flat;
  b.hidden = hidden;
  b.inter = inter;
  if (qformat < -1 || qformat >= ftnative::kNumQFormats)
    throw py::value_error("qformat must be -1 (float banks), 0 fp8_block, 1 mxfp4 or 2 nvfp4");
  b.quant = qformat >= 0;
  b.qformat = static_cast<ftnative::QFormat>(b.quant ? qformat : 0);
  b.gate_up_scale = ptr<const void>(gate_up_scale);
  b.down_scale = ptr<const void>(down_scale);
  b.gate_up_global = ptr<const float>(gate_up_global);
  b.down_global = ptr<const float>(down_global);
  if (act < 0 || act > 3)
    throw py::value_error("act must be 0 (SILU), 1 (GPTOSS), 2 (GELU_TANH) or 3 (SWIGLU_CLAMP)");
  ActSpec a{static_cast<ActKind>(act), alpha, limit};
  ExecutorOptions o;
  o.threads = threads;
  o.isa = isa;
  o.tile_min_tokens = tile_min_tokens;
  o.spin_us = spin_us;
  o.pin = pin;
  return std::make_unique<Executor>(b, a, o);
}

}  // namespace

PYBIND11_MODULE(ftnative, m) {
  m.doc() = "freetoken native CPU expert executor (see native/src/executor.h)";
  m.def("supported_isas", &ftnative::supported_isas, "ISA paths this CPU runs, best first.");
  m.def("physical_core_cpus", &ftnative::physical_core_cpus,
        "One logical CPU per physical core in this process's affinity mask.");

  py::class_<Executor>(m, "Executor")
      .def(py::init(&make_executor), py::arg("gate_up"), py::arg("down"), py::arg("gate_up_bias"),
           py::arg("down_bias"), py::arg("weight_dtype"), py::arg("bias_dtype"),
           py::arg("num_flat"), py::arg("hidden"), py::arg("inter"), py::arg("act"),
           py::arg("alpha"), py::arg("limit"), py::arg("threads") = 0, py::arg("isa") = "auto",
           py::arg("tile_min_tokens") = 12, py::arg("spin_us") = 0, py::arg("pin") = true,
           py::arg("qformat") = -1, py::arg("gate_up_scale") = 0, py::arg("down_scale") = 0,
           py::arg("gate_up_global") = 0, py::arg("down_global") = 0,
           "Bank addresses (0 = no bias), dtype codes 0 fp32 / 1 bf16, shapes N, H, I. "
           "qformat -1: float banks of weight_dtype; 0 fp8_block, 1 mxfp4, 2 nvfp4: packed "
           "gate_up/down with the scale (and, nvfp4, global scale) bank addresses.")
      .def(
          "forward",
          [](Executor& e, uintptr_t x, uintptr_t ids, uintptr_t weights, uintptr_t out, int T,
             int K) {
            py::gil_scoped_release release;  // other Python threads (e.g. a GPU branch) run
            e.forward(ptr<const float>(x), ptr<const int32_t>(ids), ptr<const float>(weights),
                      ptr<float>(out), T, K);
          },
          py::arg("x"), py::arg("flat_ids"), py::arg("weights"), py::arg("out"), py::arg("T"),
          py::arg("K"),
          "x [T,H] fp32, flat_ids [T,K] int32, weights [T,K] fp32, out [T,H] fp32 addresses.")
      .def_property_readonly(
          "forward_on_entry",
          [](Executor& e) {
            const ftnative::ForwardOnFn fn = [](void* exec, const float* x, const int32_t* ids,
                                               const float* w, float* out, int T, int K,
                                               const ftnative::ExternalPool* ext) {
              static_cast<Executor*>(exec)->forward_on(*ext, x, ids, w, out, T, K);
            };
            return std::make_tuple(reinterpret_cast<uintptr_t>(fn),
                                   reinterpret_cast<uintptr_t>(&e));
          },
          "(function address, executor address): forward on another module's thread pool "
          "(executor_bridge.h); valid while this executor lives.")
      .def_property_readonly("isa", &Executor::isa)
      .def_property_readonly("bf16_dot", &Executor::bf16_dot)
      .def_property_readonly("threads", &Executor::threads);
}
