// What this CPU can run, and where the worker threads go.
#pragma once

#include <string>
#include <vector>

namespace ftnative {

// ISA paths the running CPU (and OS) supports, best first; always ends with "scalar".
// "avx512bf16" is "avx512" whose bf16 weights take the vdpbf16ps kernels (kernels_bf16dot.h);
// listed right after "avx512" because it is opt-in ("auto" takes the first entry).
std::vector<std::string> supported_isas();

bool isa_supported(const std::string& isa);

// One logical CPU per physical core among the CPUs this process may run on (sched_getaffinity),
// so that SMT siblings do not share a core's load ports. Falls back to every allowed CPU when
// the topology is unreadable.
std::vector<int> physical_core_cpus();

}  // namespace ftnative
