// The fixed arithmetic shared by the element-wise, row and sampling kernels (elementwise.cpp,
// sampling.cpp): our own exp and log (range reduction + polynomial, correctly rounded IEEE-754
// steps only), the fixed-order row sum and row max, and the floating-point environment every
// kernel runs under. Always inlined into each ISA's loop, so every path runs this code as written
// (-ffp-contract=off, no -ffast-math: no fused or reassociated operation the source lacks).
#pragma once

#include <xmmintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace kimi_parity::fixed {

#define KP_INLINE inline __attribute__((always_inline))

KP_INLINE float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

KP_INLINE uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// A bf16 value widened to fp32, exactly (its 16 bits become the high half of the fp32 word).
KP_INLINE float widen_bf16(uint16_t v) { return from_bits(static_cast<uint32_t>(v) << 16); }

// y, or the one canonical quiet NaN when y is a NaN: IEEE-754 leaves a NaN's sign and payload
// to the implementation, and the vector and scalar instruction sequences pick differently
// (measured: -NaN from the vector loops, +NaN from the scalar one).
KP_INLINE float one_nan(float y) { return y == y ? y : from_bits(0x7fc00000u); }

// exp(x): x = n ln2 + r with n = round(x / ln2) and |r| <= ln2 / 2 (Cody-Waite: ln2 split in a
// 9-bit head, so n * head is exact, and a tail); exp(r) by the degree-7 Cephes polynomial;
// times 2^n as two exact powers of two (so n down to -150 reaches the subnormals).
// Max error ~1 ulp. exp(NaN) = NaN, exp(+inf) = +inf, exp(-inf) = 0.
KP_INLINE float exp_fixed(float x) {
  constexpr float kHi = 88.72283935546875f;    // above: overflow to +inf
  constexpr float kLo = -103.97208404541016f;  // below: 0
  float xc = x >= kLo ? x : kLo;               // NaN -> kLo, restored at the end
  xc = xc <= kHi ? xc : kHi;
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to integer
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const float z = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * z + r;
  y = y + 1.0f;
  const int32_t ni = static_cast<int32_t>(n);  // exact: n is an integer in [-150, 128]
  const int32_t n1 = ni >> 1, n2 = ni - n1;      // both in [-75, 64]: normal powers of two
  y = y * from_bits(static_cast<uint32_t>(n1 + 127) << 23);
  y = y * from_bits(static_cast<uint32_t>(n2 + 127) << 23);
  y = x >= kLo ? y : 0.0f;
  y = x > kHi ? std::numeric_limits<float>::infinity() : y;
  return x == x ? y : x;  // NaN stays NaN
}

// log(u) for a positive normal u (softplus and log-softmax give it u >= 1, the sampler's Gumbel
// noise u in (0, 1)): u = m 2^e with m in [sqrt(1/2), sqrt(2)), log(m) by the Cephes polynomial
// in f = m - 1, plus e ln2 (split).
KP_INLINE float log_fixed(float u) {
  const uint32_t bits = to_bits(u);
  int32_t e = static_cast<int32_t>((bits >> 23) & 0xffu) - 126;
  float m = from_bits((bits & 0x007fffffu) | 0x3f000000u);  // [0.5, 1)
  const bool small = m < 0.707106781186547524f;
  e = small ? e - 1 : e;
  const float f = small ? (m + m) - 1.0f : m - 1.0f;
  const float fe = static_cast<float>(e);
  const float z = f * f;
  float p = 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  float y = p * f;
  y = y * z;
  y = y + fe * -2.12194440e-4f;
  y = y - 0.5f * z;
  float out = f + y;
  return out + fe * 0.693359375f;
}

constexpr int kLanes = 16;

KP_INLINE float row_sum_body(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = acc[l] + x[i + l];
  for (int l = 0; i + l < n; ++l) acc[l] = acc[l] + x[i + l];
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] = acc[l] + acc[l + width];
  return one_nan(acc[0]);
}

// Row max in the row sum's order (lane i % 16, then the same tree), `a > b ? a : b` at every
// step: which of +0.0 / -0.0 (equal values) survives is then fixed by the order too. NaNs are
// skipped (a NaN row is caught by the sum that follows); -inf for an empty or all -inf row.
KP_INLINE float row_max_body(const float* x, int64_t n) {
  float acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = x[i + l] > acc[l] ? x[i + l] : acc[l];
  for (int l = 0; i + l < n; ++l) acc[l] = x[i + l] > acc[l] ? x[i + l] : acc[l];
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] = acc[l + width] > acc[l] ? acc[l + width] : acc[l];
  return acc[0];
}

// The IEEE-754 default environment for the block: round to nearest even, no flush-to-zero, no
// denormals-are-zero (MXCSR 0x1f80), whatever the thread had (torch.set_flush_denormal sets
// FTZ/DAZ on the threads it reaches). Every path and every thread then rounds subnormals alike.
class DefaultFpEnv {
 public:
  DefaultFpEnv() : saved_(_mm_getcsr()) { _mm_setcsr(0x1f80u); }
  ~DefaultFpEnv() { _mm_setcsr(saved_); }
  DefaultFpEnv(const DefaultFpEnv&) = delete;
  DefaultFpEnv& operator=(const DefaultFpEnv&) = delete;

 private:
  unsigned saved_;
};

// The default environment plus flush-to-zero and denormals-are-zero (MXCSR 0x9fc0): set for a
// whole task of the bf16 pair order's fp32 kernels (gemm.cpp), whose FMAs then round as
// VDPBF16PS does. (Setting MXCSR costs: once a block call made bf16 GEMMs 30 % slower.)
constexpr unsigned kFlushCsr = 0x9fc0u;

}  // namespace kimi_parity::fixed
