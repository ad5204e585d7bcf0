// The CPU code paths of the parity kernels (gemm.cpp, elementwise.cpp), fastest first. Every
// path computes the same bits; the choice only changes speed.
#pragma once

#include <string>
#include <vector>

namespace kimi_parity {

inline bool cpu_has(const std::string& isa) {
  __builtin_cpu_init();
  if (isa == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return isa == "scalar";
}

// The code paths this CPU can run, fastest first.
inline std::vector<std::string> isas() {
  std::vector<std::string> out;
  for (const char* isa : {"avx512", "avx2", "scalar"})
    if (cpu_has(isa)) out.emplace_back(isa);
  return out;
}

}  // namespace kimi_parity
