// The RoPE cos/sin table with one arithmetic fixed by construction (parity/kernels.py's
// rope_table is the caller; both engines build their table with it).
//
// The steps of the usual table (HF, vLLM, Megatron), in fp32 where they are correctly rounded:
//   e_j    = fp32(2j) / fp32(head_dim)                  (fp32 division)
//   w_j    = 1 / fp32(base ^ e_j)                        (fp32 division)
//   f_tj   = fp32(t) * w_j                               (fp32 multiply)
//   cos_tj = fp32(cos(f_tj)), sin_tj = fp32(sin(f_tj))
// The three transcendental steps (base ^ e = exp(e ln base), cos, sin) are our own double-precision
// code below: range reduction and Taylor polynomials of IEEE-754 double adds and multiplies only,
// then one rounding to fp32, so an entry is (nearly always) the correctly rounded value and its
// bits are a function of (t, j, head_dim, base) alone. torch's table, which this replaces, took
// pow, cos and sin from its vectorised math (Sleef), whose last bit depends on the ISA torch picks
// (ATEN_CPU_CAPABILITY) and on where an element falls between the vector body and its tail.
//
// Range reduction of cos / sin: f = k pi/2 + r with k = round(f 2/pi) and |r| <= pi/4 (about),
// pi/2 split in four pieces of 27 significant bits (the last the rest, rounded): k < 2^25, so each
// k * piece is exact, and r = ((f - k p1) - k p2) - k p3 - k p4 (f - k p1 exact by Sterbenz).
// Positions up to 2^24 (every fp32 integer position is exact), so k < 2^24.
//
// Each ISA has its own loop over the same always-inlined code (-ffp-contract=off, no fast-math:
// no fused or reassociated operation the source lacks), under the IEEE default FP environment.
// Registered as torch.ops.kimi_parity.{rope_table, rope_table_on}.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "fixed_math.h"
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace kimi_parity::fixed;

KP_INLINE double double_from_bits(uint64_t u) {
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}

KP_INLINE uint64_t double_bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}

// Round to the nearest integer (ties to even) for |x| < 2^51: add and remove 1.5 * 2^52.
KP_INLINE double round_int(double x) { return (x + 0x1.8p52) - 0x1.8p52; }

// ln(x) for a positive, normal, finite x: x = m 2^e with m in [sqrt(1/2), sqrt(2)),
// ln(m) = 2 atanh(s) = 2 (s + s^3/3 + ... + s^25/25) with s = (m - 1) / (m + 1), |s| < 0.172
// (the first term left out is below 2^-64 relative).
KP_INLINE double log_double(double x) {
  const uint64_t bits = double_bits(x);
  int64_t e = static_cast<int64_t>((bits >> 52) & 0x7ff) - 1023;
  double m = double_from_bits((bits & 0x000fffffffffffffull) | 0x3ff0000000000000ull);  // [1, 2)
  if (m > 0x1.6a09e667f3bcdp+0) {  // sqrt(2)
    m = m * 0.5;
    e = e + 1;
  }
  const double s = (m - 1.0) / (m + 1.0);
  const double z = s * s;
  constexpr double kInvOdd[] = {0x1.47ae147ae147bp-5, 0x1.642c8590b2164p-5, 0x1.8618618618618p-5,
                                0x1.af286bca1af28p-5, 0x1.e1e1e1e1e1e1ep-5, 0x1.1111111111111p-4,
                                0x1.3b13b13b13b14p-4, 0x1.745d1745d1746p-4, 0x1.c71c71c71c71cp-4,
                                0x1.2492492492492p-3, 0x1.999999999999ap-3, 0x1.5555555555555p-2};
  double p = kInvOdd[0];  // 1/25, then 1/23, ..., 1/3
  for (int i = 1; i < 12; ++i) p = p * z + kInvOdd[i];
  const double ln_m = 2.0 * s + (2.0 * s) * (z * p);
  const double fe = static_cast<double>(e);
  return fe * 0x1.62e42ff000000p-1 + (ln_m + fe * -0x1.718432a1b0e26p-35);  // e ln2 (hi + lo)
}

// exp(x) for |x| < 700: x = n ln2 + r, |r| <= ln2 / 2 (ln2 in a 32-bit head, exact times n, and a
// tail), exp(r) by its Taylor polynomial to r^14 / 14!, times 2^n (an exact power of two).
KP_INLINE double exp_double(double x) {
  const double n = round_int(x * 0x1.71547652b82fep+0);  // x / ln2
  const double r = (x - n * 0x1.62e42ff000000p-1) - n * -0x1.718432a1b0e26p-35;
  constexpr double kInvFact[] = {0x1.93974a8c07c9dp-37, 0x1.6124613a86d09p-33, 0x1.1eed8eff8d898p-29,
                                 0x1.ae64567f544e4p-26, 0x1.27e4fb7789f5cp-22, 0x1.71de3a556c734p-19,
                                 0x1.a01a01a01a01ap-16, 0x1.a01a01a01a01ap-13, 0x1.6c16c16c16c17p-10,
                                 0x1.1111111111111p-7,  0x1.5555555555555p-5,  0x1.5555555555555p-3,
                                 0x1.0000000000000p-1,  1.0,                   1.0};
  double p = kInvFact[0];  // 1/14!, then 1/13!, ..., 1/1!, 1/0!
  for (int i = 1; i < 15; ++i) p = p * r + kInvFact[i];
  const int64_t ni = static_cast<int64_t>(n);
  return p * double_from_bits(static_cast<uint64_t>(ni + 1023) << 52);
}

// (cos f, sin f) for 0 <= f < 2^24.
KP_INLINE void cos_sin_double(double f, double* c, double* s) {
  const double k = round_int(f * 0x1.45f306dc9c883p-1);  // f * 2/pi
  double r = f - k * 0x1.921fb54000000p+0;
  r = r - k * 0x1.10b4610000000p-30;
  r = r - k * 0x1.a626330000000p-58;
  r = r - k * 0x1.45c06e0e68948p-86;
  const double z = r * r;
  // sin r = r + r z (-1/3! + z/5! - ... + z^7/17!), cos r = 1 + z (-1/2! + z/4! - ... - z^8/18!):
  // the first terms left out are below 2^-63 for |r| <= pi/4.
  constexpr double kSin[] = {0x1.952c77030ad4ap-49,  -0x1.ae7f3e733b81fp-41, 0x1.6124613a86d09p-33,
                             -0x1.ae64567f544e4p-26, 0x1.71de3a556c734p-19,  -0x1.a01a01a01a01ap-13,
                             0x1.1111111111111p-7,   -0x1.5555555555555p-3};
  constexpr double kCos[] = {-0x1.6827863b97d97p-53, 0x1.ae7f3e733b81fp-45, -0x1.93974a8c07c9dp-37,
                             0x1.1eed8eff8d898p-29,  -0x1.27e4fb7789f5cp-22, 0x1.a01a01a01a01ap-16,
                             -0x1.6c16c16c16c17p-10, 0x1.5555555555555p-5,  -0x1.0000000000000p-1};
  double ps = kSin[0];
  for (int i = 1; i < 8; ++i) ps = ps * z + kSin[i];
  double pc = kCos[0];
  for (int i = 1; i < 9; ++i) pc = pc * z + kCos[i];
  const double sin_r = r + r * (z * ps), cos_r = 1.0 + z * pc;
  switch (static_cast<int64_t>(k) & 3) {
    case 0: *c = cos_r, *s = sin_r; break;
    case 1: *c = -sin_r, *s = cos_r; break;
    case 2: *c = -cos_r, *s = -sin_r; break;
    default: *c = sin_r, *s = -cos_r; break;
  }
}

// Positions [begin, end) of the table: cos / sin [positions, half] row-major.
KP_INLINE void table_rows(const float* inv_freq, int64_t half, int64_t begin, int64_t end, float* cos_out,
                          float* sin_out) {
  for (int64_t t = begin; t < end; ++t)
    for (int64_t j = 0; j < half; ++j) {
      const float f = static_cast<float>(t) * inv_freq[j];
      double c, s;
      cos_sin_double(static_cast<double>(f), &c, &s);
      cos_out[t * half + j] = static_cast<float>(c);
      sin_out[t * half + j] = static_cast<float>(s);
    }
}

#define KP_ROPE_PARAMS \
  (const float* inv_freq, int64_t half, int64_t begin, int64_t end, float* cos_out, float* sin_out)
__attribute__((target("avx512f"))) void table_avx512 KP_ROPE_PARAMS {
  table_rows(inv_freq, half, begin, end, cos_out, sin_out);
}
__attribute__((target("avx2"))) void table_avx2 KP_ROPE_PARAMS {
  table_rows(inv_freq, half, begin, end, cos_out, sin_out);
}
__attribute__((optimize("no-tree-vectorize"))) void table_scalar KP_ROPE_PARAMS {
  table_rows(inv_freq, half, begin, end, cos_out, sin_out);
}

// fp32 (cos, sin) [max_positions, head_dim / 2] on the `isa` code path.
std::tuple<at::Tensor, at::Tensor> rope_table_on(int64_t head_dim, double base, int64_t max_positions,
                                                 const std::string& isa) {
  TORCH_CHECK(kimi_parity::cpu_has(isa), "kimi_parity: this CPU cannot run the ", isa, " kernels");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "kimi_parity.rope_table: head_dim must be even and > 0, got ",
              head_dim);
  TORCH_CHECK(0 <= max_positions && max_positions <= (int64_t{1} << 24),
              "kimi_parity.rope_table: max_positions must be in [0, 2^24], got ", max_positions);
  TORCH_CHECK(std::isfinite(base) && base > 1.0, "kimi_parity.rope_table: base must be finite and > 1, got ",
              base);
  auto f = isa == "avx512" ? &table_avx512 : isa == "avx2" ? &table_avx2 : &table_scalar;
  const int64_t half = head_dim / 2;
  std::vector<float> inv_freq(half);
  {
    const DefaultFpEnv env;
    const double log_base = log_double(base);
    for (int64_t j = 0; j < half; ++j) {
      const float e = static_cast<float>(2 * j) / static_cast<float>(head_dim);
      const float power = static_cast<float>(exp_double(static_cast<double>(e) * log_base));
      inv_freq[j] = 1.0f / power;
    }
  }
  const auto options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor cos_t = at::empty({max_positions, half}, options), sin_t = at::empty({max_positions, half}, options);
  float* c = cos_t.data_ptr<float>();
  float* s = sin_t.data_ptr<float>();
  at::parallel_for(0, max_positions, std::max<int64_t>(1, 4096 / half), [&](int64_t begin, int64_t end) {
    const DefaultFpEnv env;
    f(inv_freq.data(), half, begin, end, c, s);
  });
  return {cos_t, sin_t};
}

std::tuple<at::Tensor, at::Tensor> rope_table(int64_t head_dim, double base, int64_t max_positions) {
  return rope_table_on(head_dim, base, max_positions, kimi_parity::current_isa());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kimi_parity, lib) {
  lib.def("rope_table(int head_dim, float base, int max_positions) -> (Tensor, Tensor)", &rope_table);
  lib.def("rope_table_on(int head_dim, float base, int max_positions, str isa) -> (Tensor, Tensor)",
          &rope_table_on);
}
