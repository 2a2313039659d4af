#include "cpu_features.h"

#include <fstream>
#include <set>
#include <utility>

#ifdef __linux__
#include <sched.h>
#endif

namespace ftnative {

namespace {

#ifndef FTNATIVE_NO_X86
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

// libgcc also checks that the OS saves the zmm state (XCR0) before reporting avx512*.
bool has_avx512() {
  __builtin_cpu_init();
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// vdpbf16ps (the bf16-dot kernels, kernels_bf16dot.h).
bool has_avx512bf16() {
  __builtin_cpu_init();
  return has_avx512() && __builtin_cpu_supports("avx512bf16");
}
#else
bool has_avx2() { return false; }
bool has_avx512() { return false; }
bool has_avx512bf16() { return false; }
#endif

int read_int(const std::string& path, int fallback) {
  std::ifstream f(path);
  int v = fallback;
  if (!(f >> v)) return fallback;
  return v;
}

std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
#endif
  return cpus;
}

}  // namespace

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  if (has_avx512()) out.emplace_back("avx512");
  // avx512 plus bf16-dot for bf16 weights. Opt-in for now (after avx512, so "auto" does not take
  // it): it rounds the experts' activations to bf16, and near-tie-sensitive GGUF references
  // (tests/test_gguf_experts_per_layer.py) part from the fp32-activation path.
  if (has_avx512bf16()) out.emplace_back("avx512bf16");
  if (has_avx2()) out.emplace_back("avx2");
  out.emplace_back("scalar");
  return out;
}

bool isa_supported(const std::string& isa) {
  for (const auto& s : supported_isas())
    if (s == isa) return true;
  return false;
}

std::vector<int> physical_core_cpus() {
  std::vector<int> out;
  std::set<std::pair<int, int>> seen;  // (package, core)
  for (int c : allowed_cpus()) {
    const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    const int pkg = read_int(base + "physical_package_id", 0);
    const int core = read_int(base + "core_id", -1 - c);  // unreadable: every CPU its own core
    if (seen.insert({pkg, core}).second) out.push_back(c);
  }
  return out;
}

}  // namespace ftnative
