// The CPU code paths of the parity kernels (gemm.cpp, elementwise.cpp, sampling.cpp), widest
// first. Every path computes the same bits; the choice only changes speed. avx512_bf16 is
// avx512 plus the bf16 dot-product instruction for bf16 GEMMs (gemm.cpp); the other kernels run
// their avx512 code on it.
//
// The path an op runs when the caller names none: KIMI_RL_ISA (avx512_bf16 | avx512 | avx2 |
// scalar) when set, refused when this CPU cannot run it, else the widest this CPU has
// (avx512_bf16 only where the instruction is the faster bf16 GEMM); `set_isa` changes it for
// the whole process (parity/native.py). One switch for every compiled library of the process.
#pragma once

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

namespace kimi_parity {

// Whether `isa` runs the avx512 kernels (every kernel but the bf16 GEMM's on avx512_bf16).
inline bool avx512_kernels(const std::string& isa) { return isa == "avx512" || isa == "avx512_bf16"; }

inline bool cpu_has(const std::string& isa) {
  __builtin_cpu_init();
  if (isa == "avx512_bf16") return cpu_has("avx512") && __builtin_cpu_supports("avx512bf16");
  if (isa == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return isa == "scalar";
}

// Whether this CPU's VDPBF16PS computes the bf16 pair order and beats the same order in fp32
// FMAs (a start-up self-test and timing; gemm.cpp).
bool bf16_dot_preferred();

// The code paths this CPU can run, widest first.
inline std::vector<std::string> isas() {
  std::vector<std::string> out;
  for (const char* isa : {"avx512_bf16", "avx512", "avx2", "scalar"})
    if (cpu_has(isa)) out.emplace_back(isa);
  return out;
}

inline const std::vector<std::string>& known_isas() {
  static const std::vector<std::string> names = {"avx512_bf16", "avx512", "avx2", "scalar"};
  return names;
}

inline int isa_index(const std::string& isa) {
  for (size_t i = 0; i < known_isas().size(); ++i)
    if (known_isas()[i] == isa) return static_cast<int>(i);
  TORCH_CHECK(false, "KIMI_RL_ISA must be one of avx512_bf16, avx512, avx2, scalar, got '", isa, "'");
}

inline void check_runnable(const std::string& isa) {
  isa_index(isa);
  TORCH_CHECK(cpu_has(isa), "KIMI_RL_ISA=", isa, ": this CPU cannot run the ", isa, " kernels");
}

// An index into known_isas(); an inline function's static is one object across libraries'
// translation units, so gemm.cpp and elementwise.cpp see the same choice.
inline std::atomic<int>& isa_slot() {
  static std::atomic<int> slot([] {
    const char* env = std::getenv("KIMI_RL_ISA");
    std::string isa = env != nullptr && *env != '\0' ? std::string(env) : isas().front();
    // Else the widest path, avx512_bf16 only where the instruction is the faster bf16 GEMM.
    if ((env == nullptr || *env == '\0') && isa == "avx512_bf16" && !bf16_dot_preferred()) isa = "avx512";
    check_runnable(isa);
    return isa_index(isa);
  }());
  return slot;
}

// The path of every op called without an explicit one.
inline std::string current_isa() { return known_isas()[isa_slot().load()]; }

inline void set_isa(const std::string& isa) {
  check_runnable(isa);
  isa_slot().store(isa_index(isa));
}

}  // namespace kimi_parity
