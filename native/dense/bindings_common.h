// What the `ftdense` module's binding files share (bindings.cpp owns the state): the configured
// pool and kernels, and the GGUF type codes as Python passes them.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "decode_attention.h"
#include "dense_linear.h"
#include "kernels_bf16dot.h"
#include "prefill_attention.h"
#include "pool.h"
#include "qdot.h"
#include "sparse_attention.h"

namespace ftdense_py {

// What a call runs on, copied under the lock: the call holds its own reference to the pool
// (configure may replace it meanwhile).
struct Configured {
  std::shared_ptr<ftdense::Pool> pool;
  const ftnative::KernelSet* bf16;
  const ftnative::KernelSet* f32;
  const ftnative::Bf16DotSet* bf16dot;  // bf16 weights take it when set
  ftdense::RangeFn attention;
  const ftdense::QDotSet* qdot;
  ftdense::PrefillFn prefill;
  const ftdense::SparseKernels* sparse;  // the base ISA's (bf16-dot ISAs take their base one)
};

// Throws std::runtime_error before ftdense.configure() ran.
Configured configured();

// A qtype code (0 q8_0 ... 11 q5_k interleaved) checked; py::value_error otherwise.
ftdense::QType qtype_code(int code);

// decode_layers' classes and functions (bindings_decode.cpp).
void bind_decode_layers(pybind11::module_& m);

// index_topk and sparse_attention (bindings_sparse.cpp).
void bind_sparse(pybind11::module_& m);

// tier_read, the disk tier's read of a piece into its slot (tier_read.cpp).
void bind_tier_read(pybind11::module_& m);

// fill_rows (bindings_fill.cpp).
void bind_fill(pybind11::module_& m);

}  // namespace ftdense_py
