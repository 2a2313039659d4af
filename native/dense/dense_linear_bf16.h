// Dense bf16 projections on the bf16-dot kernels (native/src/kernels_bf16dot.h): the same
// y = x.to(bfloat16) @ W^T with fp32 accumulation as dense_linear.h's bf16 path (which already
// rounds x to bf16), taken on CPUs with AVX512-BF16 (isa "avx512bf16"; "emubf16" in tests).
// x is rounded once per call and shared by every weight of the call.
#pragma once

#include <string>
#include <vector>

#include "dense_linear.h"
#include "kernels_bf16dot.h"

namespace ftdense {

// The bf16-dot kernels `isa` ("auto", "avx512bf16", "emubf16", others) selects, or null: "auto"
// takes them where the CPU has AVX512-BF16.
const ftnative::Bf16DotSet* bf16dot_set(const std::string& isa);

// `in.bf16` must be true (bf16 weights); in.round_input is implied.
void linear_bf16dot(Pool& pool, const ftnative::Bf16DotSet& ks, const Input& in,
                    const std::vector<Output>& outs);

// bf16 weights with a rounded input on `dot` when it is set (the configured bf16-dot kernels),
// anything else on `ks`: the choice every caller makes.
void linear_any(Pool& pool, const ftnative::KernelSet& ks, const ftnative::Bf16DotSet* dot,
                const Input& in, const std::vector<Output>& outs);

}  // namespace ftdense
