// The parity element-wise and row kernels: exp, sigmoid, SiLU, softplus, rsqrt, and the row sum,
// each with one arithmetic fixed by construction.
//
// Element-wise ops: every element runs the same straight-line sequence of IEEE-754 fp32 adds,
// multiplies, divides, square roots, comparisons and bit operations (exp and log are our own
// range reduction + polynomial below, not libm's or a vendor's vector math). Each of those is
// correctly rounded, so an element's bits are a function of its value alone: the same in the
// AVX-512 loop, the AVX2 loop and the scalar loop, at any position in the tensor, on any thread.
// (torch's loops, which this replaces, run a vector body and a scalar tail that differ in the
// last bit, so an element's bits depended on where it fell in the flattened tensor.)
//
// Row sum: 16 lane accumulators, element i of the row added in order to lane i % 16 (from
// +0.0f), then the lanes combined by one fixed tree: lanes l and l + 8, then l and l + 4, ...
// The order depends on the row length alone; rows are split between threads, a row never is.
//
// Compiled with -ffp-contract=off (no implicit fused multiply-adds) and without -ffast-math (no
// reassociation), so whatever vector width the compiler picks for a loop, it computes the code
// as written. Registered as torch.ops.kimi_parity.{unary, unary_on, row_sum, row_sum_on}.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "fixed_math.h"
#include "isa.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace kimi_parity::fixed;

enum Op : int { kExp, kSigmoid, kSilu, kSoftplus, kRsqrt };

template <int OP>
KP_INLINE float math(float x) {
  if constexpr (OP == kExp) {
    return exp_fixed(x);
  } else if constexpr (OP == kSigmoid || OP == kSilu) {
    // The stable form: e = exp(-|x|) never overflows, so sigmoid(x) = 1 / (1 + e) for x >= 0
    // and e / (1 + e) below; silu(x) = x sigmoid(x) with the product taken before the divide.
    const float e = exp_fixed(x >= 0.0f ? -x : x);
    const float d = 1.0f + e;
    if constexpr (OP == kSigmoid) return (x >= 0.0f ? 1.0f : e) / d;
    return (x >= 0.0f ? x : x * e) / d;
  } else if constexpr (OP == kSoftplus) {
    // torch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x)), with
    // log1p(y) = log(1 + y) * y / ((1 + y) - 1), exact to ~1 ulp (Goldberg), and y where 1 + y
    // rounds to 1.
    const float y = exp_fixed(x);
    const float u = 1.0f + y;
    const float d = u - 1.0f;
    const float l = u == 1.0f ? y : log_fixed(u) * (y / (d == 0.0f ? 1.0f : d));
    return x > 20.0f ? x : l;
  } else {
    return 1.0f / __builtin_sqrtf(x);  // correctly rounded sqrt, then a correctly rounded divide
  }
}

// Every NaN result leaves as the one canonical quiet NaN (fixed_math.h, one_nan).
template <int OP>
KP_INLINE float apply(float x) {
  return one_nan(math<OP>(x));
}

// One loop per ISA. The bodies are the same always-inlined code; only the vector width the
// compiler may use differs, and with it the speed, never the bits.
template <int OP>
__attribute__((target("avx512f"))) void unary_avx512(const float* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = apply<OP>(in[i]);
}

template <int OP>
__attribute__((target("avx2"))) void unary_avx2(const float* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = apply<OP>(in[i]);
}

template <int OP>
__attribute__((optimize("no-tree-vectorize"))) void unary_scalar(const float* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = apply<OP>(in[i]);
}

__attribute__((target("avx512f"))) void row_sum_avx512(const float* x, float* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) out[r] = row_sum_body(x + r * n, n);
}

__attribute__((target("avx2"))) void row_sum_avx2(const float* x, float* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) out[r] = row_sum_body(x + r * n, n);
}

__attribute__((optimize("no-tree-vectorize"))) void row_sum_scalar(const float* x, float* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) out[r] = row_sum_body(x + r * n, n);
}

using kimi_parity::cpu_has;


at::Tensor as_fp32(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "kimi_parity: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "kimi_parity: fp32 or bf16 only, got ", x.scalar_type());
  return x.to(at::kFloat).contiguous();  // bf16 -> fp32 is exact
}

using UnaryFn = void (*)(const float*, float*, int64_t);

template <int OP>
UnaryFn unary_for(const std::string& isa) {
  return kimi_parity::avx512_kernels(isa) ? &unary_avx512<OP> : isa == "avx2" ? &unary_avx2<OP> : &unary_scalar<OP>;
}

// fn(x) element-wise in fp32 on the `isa` code path -> fp32, x's shape (bf16 input is widened).
at::Tensor unary_on(const at::Tensor& x_in, const std::string& fn, const std::string& isa) {
  TORCH_CHECK(cpu_has(isa), "kimi_parity: this CPU cannot run the ", isa, " kernels");
  UnaryFn f = fn == "exp"        ? unary_for<kExp>(isa)
              : fn == "sigmoid"  ? unary_for<kSigmoid>(isa)
              : fn == "silu"     ? unary_for<kSilu>(isa)
              : fn == "softplus" ? unary_for<kSoftplus>(isa)
              : fn == "rsqrt"    ? unary_for<kRsqrt>(isa)
                                 : nullptr;
  TORCH_CHECK(f != nullptr, "kimi_parity: unknown element-wise op '", fn, "'");
  const at::Tensor x = as_fp32(x_in);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, x.numel(), 1 << 15, [&](int64_t begin, int64_t end) {
    const DefaultFpEnv env;
    f(in + begin, o + begin, end - begin);
  });
  return out;
}

at::Tensor unary(const at::Tensor& x, const std::string& fn) { return unary_on(x, fn, kimi_parity::current_isa()); }

// Sum over the last dim in fp32 on the `isa` code path -> fp32 [...] (bf16 input is widened).
at::Tensor row_sum_on(const at::Tensor& x_in, const std::string& isa) {
  TORCH_CHECK(cpu_has(isa), "kimi_parity: this CPU cannot run the ", isa, " kernels");
  TORCH_CHECK(x_in.dim() >= 1, "kimi_parity: row_sum needs at least one dim");
  const at::Tensor x = as_fp32(x_in);
  const int64_t n = x.size(-1);
  const std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  at::Tensor out = at::empty(shape, x.options());
  const int64_t out_rows = out.numel();
  if (out_rows == 0) return out;
  if (n == 0) return out.zero_();
  auto f = kimi_parity::avx512_kernels(isa) ? &row_sum_avx512 : isa == "avx2" ? &row_sum_avx2 : &row_sum_scalar;
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / n);
  at::parallel_for(0, out_rows, grain, [&](int64_t begin, int64_t end) {
    const DefaultFpEnv env;
    f(in + begin * n, o + begin, end - begin, n);
  });
  return out;
}

at::Tensor row_sum(const at::Tensor& x) { return row_sum_on(x, kimi_parity::current_isa()); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kimi_parity, lib) {
  lib.def("unary(Tensor x, str fn) -> Tensor", &unary);
  lib.def("unary_on(Tensor x, str fn, str isa) -> Tensor", &unary_on);
  lib.def("row_sum(Tensor x) -> Tensor", &row_sum);
  lib.def("row_sum_on(Tensor x, str isa) -> Tensor", &row_sum_on);
}
