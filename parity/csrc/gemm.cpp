// The parity GEMM: out[m, n] = sum_k x[m, k] * w[n, k] with one summation order fixed by
// construction.
//
// The order: every output element is ONE fused-multiply-add chain over k = 0, 1, ..., K-1,
// starting from +0.0f in fp32:  acc = fmaf(x[m, k], w[n, k], acc).  Vector lanes run over
// output columns (16 columns of a packed weight panel), never over k, so the chain of an element
// is the same whether it is computed by the AVX-512 kernel (one 16-lane register), the AVX2
// kernel (two 8-lane registers) or the scalar reference (std::fmaf); by any thread; in any row
// block; for any M. Threads split rows and column panels, never k. This is the order of an fp32
// weight (a bf16 input is widened to fp32, exactly) and of `bmm`; the fp32 result is rounded
// once by the caller.
//
// A bf16 weight has its own order, the one the AVX512-BF16 dot-product instruction VDPBF16PS
// computes, so that the instruction can run it where the CPU has it (2 products per lane per
// instruction, bf16 operands read as they are): k goes in pairs (0, 1), (2, 3), ... of each
// K-slice (an odd slice's last pair is its last k and a zero), and a pair is two fp32 FMAs, the
// ODD k first:  acc = fma(x[k+1], w[k+1], acc); acc = fma(x[k], w[k], acc),  with denormal
// operands read as zero (DAZ) and denormal results flushed to zero (FTZ, decided after rounding).
// The avx512 / avx2 kernels compute that with their fp32 FMAs under MXCSR DAZ|FTZ, the scalar
// kernel with fma_ftz below. The instruction is used (avx512_bf16, bf16 inputs) only after a
// self-test on this CPU against the avx512 kernel, boundary cases included, and avx512_bf16 is
// the default path only where the instruction is also faster (bf16_dot_status says which).
// The pack of a bf16 weight is in bf16 (as many bytes as the weight) with the pairs interleaved:
// panel p holds, for pair j and column c, w[c][2j] then w[c][2j + 1] (K padded to even).
//
// K-splits (the tensor-parallel order, parity/tp.py): with `splits` = S > 1, K is cut into S
// equal contiguous slices, each element's chain restarts from +0.0f at every slice boundary,
// and the S partial sums are added in slice order in fp32: ((p0 + p1) + p2) + ...  A
// row-parallel shard over whole slices computes the same partials on fewer columns, so TP = 1
// and TP = N give the same bits when the ranks' partials are added in rank order. `sum` = false
// returns the partials themselves ([S, M, N]) for that cross-rank sum.
//
// Registered as torch.ops.kimi_parity.{pack, gemm, gemm_on, bmm, bmm_on, isas, isa, set_isa,
// gemm_reference, bf16_dot_status}; loaded by parity/native.py.
// Compiled with -ffp-contract=off: the only fused operations are the explicit FMAs below.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>

#include "fixed_math.h"
#include "isa.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;  // columns per packed weight panel (one AVX-512 register)
constexpr int kMaxRows = 8;      // rows per register block, at most
constexpr int kMaxPanels = 2;    // panels per register block, at most
constexpr int64_t kChunkBlocks = 12;  // register blocks of rows per cache-blocking task

using Bf16 = uint16_t;
using kimi_parity::fixed::widen_bf16;  // a bf16 value widened to fp32, exactly

// ---------------------------------------------------------------------------------------------
// Micro-kernels: MR rows x NP consecutive 16-column panels, k = 0..K-1 in order.
// x: row-major fp32 with row stride lda; panels: NP x [K][16] of W, `pstride` elements apart;
// out: MR rows at stride ldo, `cols` (1 .. NP * 16) valid columns, stored (add = false) or added
// to what out holds (add = true: out = out + acc, one fp32 add, the next K-slice's partial).

// Writes an MR x NP block of accumulators (`cols` valid columns at stride ldo), or adds it to
// what `out` holds (add = true: the next K-slice's partial, one fp32 add).
template <int MR, int NP>
__attribute__((target("avx512f"))) inline void store_block(const __m512 (&acc)[MR][NP], float* out, int64_t ldo,
                                                           int64_t cols, bool add) {
  for (int p = 0; p < NP; ++p) {
    const int64_t c = std::min<int64_t>(kPanel, cols - p * kPanel);
    const __mmask16 mask = static_cast<__mmask16>((1u << c) - 1u);
    for (int r = 0; r < MR; ++r) {
      float* dst = out + r * ldo + p * kPanel;
      const __m512 v = add ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask, dst), acc[r][p]) : acc[r][p];
      _mm512_mask_storeu_ps(dst, mask, v);
    }
  }
}

template <int MR, int NP>
__attribute__((target("avx512f,fma"))) void block_avx512(
    const void* x_in, int64_t lda, int64_t K, const void* panels_in, int64_t pstride, float* out,
    int64_t ldo, int64_t cols, bool add) {
  const float* x = static_cast<const float*>(x_in);
  const float* panels = static_cast<const float*>(panels_in);
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NP];
    for (int p = 0; p < NP; ++p) w[p] = _mm512_loadu_ps(panels + p * pstride + k * kPanel);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * lda + k]);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(a, w[p], acc[r][p]);
    }
  }
  store_block(acc, out, ldo, cols, add);
}

// Writes `cols` finished sums, or adds them to what `out` holds (the next K-slice's partial).
inline void store(const float* acc, float* out, int64_t cols, bool add) {
  for (int64_t c = 0; c < cols; ++c) out[c] = add ? out[c] + acc[c] : acc[c];
}

template <int MR, int NP>
__attribute__((target("avx2,fma"))) void block_avx2(
    const void* x_in, int64_t lda, int64_t K, const void* panels_in, int64_t pstride, float* out,
    int64_t ldo, int64_t cols, bool add) {
  static_assert(NP == 1, "AVX2 blocks are one panel wide (16 registers)");
  const float* x = static_cast<const float*>(x_in);
  const float* panels = static_cast<const float*>(panels_in);
  __m256 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 wl = _mm256_loadu_ps(panels + k * kPanel);
    const __m256 wh = _mm256_loadu_ps(panels + k * kPanel + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_set1_ps(x[r * lda + k]);
      lo[r] = _mm256_fmadd_ps(a, wl, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, wh, hi[r]);
    }
  }
  alignas(32) float tmp[kPanel];
  for (int r = 0; r < MR; ++r) {
    _mm256_store_ps(tmp, lo[r]);
    _mm256_store_ps(tmp + 8, hi[r]);
    store(tmp, out + r * ldo, cols, add);
  }
}

template <int MR, int NP>
void block_scalar(const void* x_in, int64_t lda, int64_t K, const void* panels_in, int64_t pstride,
                  float* out, int64_t ldo, int64_t cols, bool add) {
  static_assert(NP == 1, "scalar blocks are one panel wide");
  const float* x = static_cast<const float*>(x_in);
  const float* panels = static_cast<const float*>(panels_in);
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = std::fmaf(x[r * lda + k], panels[k * kPanel + c], acc);
      out[r * ldo + c] = add ? out[r * ldo + c] + acc : acc;
    }
}

// ---------------------------------------------------------------------------------------------
// The bf16 pair order (see the top): K (even, the pack's padding included) in pairs, odd k
// first. x: fp32 rows (bf16 rows for pairs_dp); panels: NP x [K/2][16][2] bf16. pairs_avx512 and
// pairs_avx2 run under DAZ|FTZ, which run_blocks sets for their whole task (Kernels::flush).

// One pair-interleaved panel row of 16 columns (64 bytes) split into the even-k and odd-k
// weights, widened exactly: a lane's 32-bit word holds w[c][k] in its low half, w[c][k+1] high.
__attribute__((target("avx512f"))) inline void load_pairs16(const Bf16* p, __m512* even, __m512* odd) {
  const __m512i v = _mm512_loadu_si512(p);
  *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
__attribute__((target("avx2"))) inline void load_pairs8(const Bf16* p, __m256* even, __m256* odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

template <int MR, int NP>
__attribute__((target("avx512f,avx512bf16"))) void pairs_dp(
    const void* x_in, int64_t lda, int64_t K, const void* panels_in, int64_t pstride, float* out,
    int64_t ldo, int64_t cols, bool add) {
  const Bf16* x = static_cast<const Bf16*>(x_in);
  const Bf16* panels = static_cast<const Bf16*>(panels_in);
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh w[NP];
    for (int p = 0; p < NP; ++p) w[p] = (__m512bh)_mm512_loadu_si512(panels + p * pstride + k * kPanel);
    for (int r = 0; r < MR; ++r) {
      uint32_t pair;  // x[k] low, x[k + 1] high: the instruction takes the high (odd) one first
      std::memcpy(&pair, x + r * lda + k, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], a, w[p]);
    }
  }
  store_block(acc, out, ldo, cols, add);  // VDPBF16PS ignores MXCSR: the add is in the default mode
}

template <int MR, int NP>
__attribute__((target("avx512f,fma"))) void pairs_avx512(
    const void* x_in, int64_t lda, int64_t K, const void* panels_in, int64_t pstride, float* out,
    int64_t ldo, int64_t cols, bool add) {
  const float* x = static_cast<const float*>(x_in);
  const Bf16* panels = static_cast<const Bf16*>(panels_in);
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512 even[NP], odd[NP];
    for (int p = 0; p < NP; ++p) load_pairs16(panels + p * pstride + k * kPanel, &even[p], &odd[p]);
    for (int r = 0; r < MR; ++r) {
      const __m512 a1 = _mm512_set1_ps(x[r * lda + k + 1]), a0 = _mm512_set1_ps(x[r * lda + k]);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(a0, even[p], _mm512_fmadd_ps(a1, odd[p], acc[r][p]));
    }
  }
  const unsigned csr = _mm_getcsr();
  if (add) _mm_setcsr(0x1f80u);  // the next slice's add rounds in the default mode, as a TP sum does
  store_block(acc, out, ldo, cols, add);
  if (add) _mm_setcsr(csr);
}

template <int MR, int NP>
__attribute__((target("avx2,fma"))) void pairs_avx2(
    const void* x_in, int64_t lda, int64_t K, const void* panels_in, int64_t pstride, float* out,
    int64_t ldo, int64_t cols, bool add) {
  static_assert(NP == 1, "AVX2 blocks are one panel wide (16 registers)");
  const float* x = static_cast<const float*>(x_in);
  const Bf16* panels = static_cast<const Bf16*>(panels_in);
  __m256 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m256 el, ol, eh, oh;
    load_pairs8(panels + k * kPanel, &el, &ol);
    load_pairs8(panels + k * kPanel + kPanel, &eh, &oh);
    for (int r = 0; r < MR; ++r) {
      const __m256 a1 = _mm256_set1_ps(x[r * lda + k + 1]), a0 = _mm256_set1_ps(x[r * lda + k]);
      lo[r] = _mm256_fmadd_ps(a0, el, _mm256_fmadd_ps(a1, ol, lo[r]));
      hi[r] = _mm256_fmadd_ps(a0, eh, _mm256_fmadd_ps(a1, oh, hi[r]));
    }
  }
  alignas(32) float tmp[kPanel];
  const unsigned csr = _mm_getcsr();
  if (add) _mm_setcsr(0x1f80u);  // the next slice's add rounds in the default mode, as a TP sum does
  for (int r = 0; r < MR; ++r) {
    _mm256_store_ps(tmp, lo[r]);
    _mm256_store_ps(tmp + 8, hi[r]);
    store(tmp, out + r * ldo, cols, add);
  }
  if (add) _mm_setcsr(csr);
}

// Denormals-are-zero for one operand, as the instruction and MXCSR.DAZ read it (sign kept).
inline float daz(float v) { return std::fabs(v) < 0x1p-126f ? std::copysign(0.0f, v) : v; }

// fma(a, b, c) rounded as under MXCSR.FTZ (a, b, c not denormal): a result that is tiny after
// rounding to 24 bits with an unbounded exponent is +-0. std::fmaf rounds a tiny result to a
// denormal instead, which for a sum just below 2^-126 can be 2^-126 itself where the unbounded
// rounding is tiny: near 2^-126 the sum is recomputed scaled by 2^64 (exact: an operand product
// that small has |a| < 2^49, and c is as small), where it rounds in the normal range.
inline float fma_ftz(float a, float b, float c) {
  const float r = std::fmaf(a, b, c);
  if (r == 0.0f || !(std::fabs(r) < 0x1p-124f)) return r;
  const float scaled = std::fmaf(a * 0x1p64f, b, c * 0x1p64f);
  return std::fabs(scaled) < 0x1p-62f ? std::copysign(0.0f, scaled) : scaled * 0x1p-64f;
}

// One pair of the order: the odd k first.
inline float pair_step(float acc, float x0, float w0, float x1, float w1) {
  return fma_ftz(daz(x0), daz(w0), fma_ftz(daz(x1), daz(w1), acc));
}

template <int MR, int NP>
void pairs_scalar(const void* x_in, int64_t lda, int64_t K, const void* panels_in, int64_t pstride,
                  float* out, int64_t ldo, int64_t cols, bool add) {
  static_assert(NP == 1, "scalar blocks are one panel wide");
  const float* x = static_cast<const float*>(x_in);
  const Bf16* panels = static_cast<const Bf16*>(panels_in);
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; k += 2) {
        const Bf16* w = panels + k * kPanel + 2 * c;
        acc = pair_step(acc, x[r * lda + k], widen_bf16(w[0]), x[r * lda + k + 1], widen_bf16(w[1]));
      }
      out[r * ldo + c] = add ? out[r * ldo + c] + acc : acc;
    }
}

using BlockFn = void (*)(const void*, int64_t, int64_t, const void*, int64_t, float*, int64_t, int64_t, bool);

// The register blocking of one ISA: fn[rows - 1][panels - 1] for rows <= max_rows and
// panels <= max_panels. Blocking changes speed only, never an element's arithmetic.
struct Kernels {
  int max_rows;
  int max_panels;
  BlockFn fn[kMaxRows][kMaxPanels];
  bool flush = false;  // run under MXCSR DAZ|FTZ (kFlushCsr)
};

#define KIMI_ROWS_1(f) {f<1, 1>, nullptr}, {f<2, 1>, nullptr}, {f<3, 1>, nullptr}, {f<4, 1>, nullptr}, \
  {f<5, 1>, nullptr}, {f<6, 1>, nullptr}
#define KIMI_ROWS_2(f) {f<1, 1>, f<1, 2>}, {f<2, 1>, f<2, 2>}, {f<3, 1>, f<3, 2>}, {f<4, 1>, f<4, 2>}, \
  {f<5, 1>, f<5, 2>}, {f<6, 1>, f<6, 2>}, {f<7, 1>, f<7, 2>}, {f<8, 1>, f<8, 2>}

const Kernels kAvx512{8, 2, {KIMI_ROWS_2(block_avx512)}};
const Kernels kAvx2{6, 1, {KIMI_ROWS_1(block_avx2)}};
const Kernels kScalar{6, 1, {KIMI_ROWS_1(block_scalar)}};
const Kernels kDpPairs{8, 2, {KIMI_ROWS_2(pairs_dp)}};
const Kernels kAvx512Pairs{8, 2, {KIMI_ROWS_2(pairs_avx512)}, true};
const Kernels kAvx2Pairs{6, 1, {KIMI_ROWS_1(pairs_avx2)}, true};
const Kernels kScalarPairs{6, 1, {KIMI_ROWS_1(pairs_scalar)}};

using kimi_parity::avx512_kernels;
using kimi_parity::cpu_has;
using kimi_parity::isas;

// The kernels of an ISA for fp32 panels.
const Kernels& kernels_for(const std::string& isa) {
  TORCH_CHECK(cpu_has(isa), "kimi_parity: this CPU cannot run the ", isa, " kernels");
  return avx512_kernels(isa) ? kAvx512 : isa == "avx2" ? kAvx2 : kScalar;
}

at::Tensor as_fp32_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "kimi_parity: expected a 2-D input, got ", x.dim(), "-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "kimi_parity: fp32 or bf16 only, got ", x.scalar_type());
  return x.to(at::kFloat).contiguous();  // bf16 -> fp32 is exact
}

// The blocked loop of a GEMM: x rows of `lda` elements (`xsize` bytes each), `splits` slices of
// `ks` k each, the pack's rows `splits * ks` long (`wsize`-byte elements), into out.
void run_blocks(const Kernels& kern, const char* xp, int64_t xsize, int64_t lda, int64_t ks, const char* wp,
                int64_t wsize, int64_t m, int64_t n, int64_t panels, int64_t splits, bool sum, float* op) {
  const int64_t k = splits * ks;
  // Cache blocking (speed only): a task is one chunk of up to kChunkBlocks register blocks of
  // rows (kept in L2) times one block of panels; a thread's consecutive tasks share the row
  // chunk. How tasks fall to threads never changes an element's arithmetic, and one task runs
  // an element's slices in order.
  const int64_t chunk_rows = kChunkBlocks * kern.max_rows;
  const int64_t chunks = (m + chunk_rows - 1) / chunk_rows;
  const int64_t col_blocks = (panels + kern.max_panels - 1) / kern.max_panels;
  // At least ~1 MFLOP per thread, so tiny products (decode) do not pay for waking threads.
  const int64_t task_flops = 2 * std::min(m, chunk_rows) * kern.max_panels * kPanel * k;
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / task_flops);
  at::parallel_for(0, chunks * col_blocks, grain, [&](int64_t begin, int64_t end) {
    const kimi_parity::fixed::DefaultFpEnv env;  // restores the thread's MXCSR at the end
    if (kern.flush) _mm_setcsr(kimi_parity::fixed::kFlushCsr);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t cb = t % col_blocks, chunk = t / col_blocks;
      const int64_t p0 = cb * kern.max_panels, np = std::min<int64_t>(kern.max_panels, panels - p0);
      const int64_t c0 = p0 * kPanel, cols = std::min(np * kPanel, n - c0);
      const int64_t chunk_end = std::min(m, (chunk + 1) * chunk_rows);
      for (int64_t r0 = chunk * chunk_rows; r0 < chunk_end; r0 += kern.max_rows) {
        const int64_t rows = std::min<int64_t>(kern.max_rows, chunk_end - r0);
        for (int64_t s = 0; s < splits; ++s) {
          float* dst = op + (sum ? 0 : s * m * n) + r0 * n + c0;
          kern.fn[rows - 1][np - 1](xp + (r0 * lda + s * ks) * xsize, lda, ks,
                                    wp + (p0 * k * kPanel + s * ks * kPanel) * wsize, k * kPanel, dst, n, cols,
                                    sum && s > 0);
        }
      }
    }
  });
}

// The panel transpose of pack for an fp32 weight (bytes moved, none changed).
void pack_panels(const float* src, float* dst, int64_t n, int64_t k, int64_t panels) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    const kimi_parity::fixed::DefaultFpEnv env;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      const float* rows = src + p * kPanel * k;
      float* panel = dst + p * k * kPanel;
      // Writes in order (one cache line per k or two), reads as `cols` sequential streams.
      for (int64_t i = 0; i < k; ++i)
        for (int64_t c = 0; c < cols; ++c) panel[i * kPanel + c] = rows[c * k + i];
    }
  });
}

// A bf16 w [N, K] -> its pair-interleaved panels [ceil(N / 16), K rounded up to even, 16]:
// element (p, 2j + t, c) of the [panels, K/2, 16, 2] view is w[16p + c][2j + t] (zeros past N, K).
at::Tensor pack_pairs(const at::Tensor& w) {
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel, kp = k + (k & 1);
  return at::constant_pad_nd(w, {0, kp - k, 0, panels * kPanel - n})
      .view({panels, kPanel, kp / 2, 2})
      .permute({0, 2, 1, 3})
      .contiguous()
      .view({panels, kp, kPanel});
}

// The bf16 weight [panels * 16, K] that a pair pack holds.
at::Tensor unpack_pairs(const at::Tensor& packed, int64_t k) {
  const int64_t panels = packed.size(0), kp = packed.size(1);
  return packed.view({panels, kp / 2, kPanel, 2}).permute({0, 2, 1, 3}).reshape({panels * kPanel, kp}).narrow(1, 0, k);
}

// t [R, splits * ks] -> [R, splits * (ks + 1)] with a zero after each slice (odd slices only).
at::Tensor pad_slices(const at::Tensor& t, int64_t splits) {
  const int64_t ks = t.size(1) / splits;
  if (!(ks & 1)) return t.contiguous();
  return at::constant_pad_nd(t.reshape({t.size(0), splits, ks}), {0, 1}).reshape({t.size(0), splits * (ks + 1)});
}

// w [N, K] -> panels [ceil(N / 16), K, 16] (fp32) or the pair-interleaved bf16 panels of
// pack_pairs (K rounded up to even), in the weight's dtype, columns past N zero.
at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "kimi_parity: expected a 2-D weight, got ", weight.dim(), "-D");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "kimi_parity: fp32 or bf16 only, got ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  if (w.scalar_type() == at::kBFloat16) return pack_pairs(w);
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = n % kPanel ? at::zeros({panels, k, kPanel}, w.options())
                                 : at::empty({panels, k, kPanel}, w.options());
  pack_panels(w.data_ptr<float>(), packed.data_ptr<float>(), n, k, panels);
  return packed;
}

// Whether VDPBF16PS computes the pair order on this CPU: pairs_dp against pairs_avx512 (the
// order in fp32 FMAs under DAZ|FTZ) on random rows of 64 k and on the rounding boundaries:
// sums just below 2^-126 (flushed or not after rounding), denormal operands of both signs,
// signed zeros. "" when it does, else the first failing trial.
std::string dp_self_test() {
  constexpr int64_t K = 64;
  std::vector<Bf16> x(8 * K), w(K * kPanel);
  std::vector<float> xf(8 * K), a(8 * kPanel), b(8 * kPanel);
  auto bits = [](float f) { uint32_t u; std::memcpy(&u, &f, 4); return static_cast<Bf16>(u >> 16); };
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto next = [&state] { state ^= state << 13; state ^= state >> 7; state ^= state << 17; return state; };
  // Row 0 of trial 0: x = (2^-75, 1, 0, ...), so column c computes w[c][1] + 2^-75 w[c][0]: sums
  // just below +-2^-126 (tiny after rounding with an unbounded exponent, not tiny once rounded
  // to a denormal), a tie there, 2^-127, denormal operands of both signs, signed zeros.
  const float boundary[][2] = {{0x1p-126f, -0x1.8p-76f}, {0x1p-126f, -0x1.8p-75f}, {-0x1p-126f, 0x1.8p-76f},
                               {0x1p-126f, -0x1p-52f},   {0x1p-125f, -0x1.8p-51f}, {-0.0f, 0.0f},
                               {0x1p-126f, 0x1p-130f},   {0x1p-130f, -0.0f},      {-0x1p-130f, 0x1p-40f},
                               {0x1p-126f, -0x1p-51f}};
  for (int trial = 0; trial < 256; ++trial) {
    for (int64_t i = 0; i < 8 * K; ++i) {
      const uint64_t r = next();
      // Exponents near 2^-126 in a quarter of the trials, so that flushes and denormals occur.
      const uint32_t e = (trial % 4 == 0) ? 60 + r % 8 : 120 + r % 14;
      x[i] = static_cast<Bf16>(((r >> 40) & 0x8000u) | (e << 7) | (r & 0x7fu));
    }
    for (int64_t i = 0; i < K * kPanel; ++i) {
      const uint64_t r = next();
      const uint32_t e = (trial % 4 == 0) ? 60 + r % 8 : (r % 16 == 0 ? r % 3 : 120 + r % 14);
      w[i] = static_cast<Bf16>(((r >> 40) & 0x8000u) | (e << 7) | (r & 0x7fu));
    }
    if (trial == 0) {
      for (int64_t i = 0; i < K; ++i) x[i] = bits(i == 0 ? 0x1p-75f : i == 1 ? 1.0f : 0.0f);
      for (int64_t c = 0; c < 10; ++c) {  // w is [16, K] here, row-major
        w[c * K + 1] = bits(boundary[c][0]);
        w[c * K + 0] = bits(boundary[c][1]);
      }
    }
    for (int64_t i = 0; i < 8 * K; ++i) xf[i] = widen_bf16(x[i]);
    const at::Tensor packed = pack_pairs(at::from_blob(w.data(), {kPanel, K}, at::kBFloat16));
    const void* pp = packed.data_ptr();
    pairs_dp<8, 1>(x.data(), K, K, pp, K * kPanel, a.data(), kPanel, kPanel, false);
    {
      const kimi_parity::fixed::DefaultFpEnv env;
      _mm_setcsr(kimi_parity::fixed::kFlushCsr);  // as run_blocks runs it
      pairs_avx512<8, 1>(xf.data(), K, K, pp, K * kPanel, b.data(), kPanel, kPanel, false);
    }
    if (std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) != 0)
      return "self-test trial " + std::to_string(trial);
  }
  return "";
}

// GFLOP/s of pairs_dp and of pairs_avx512 (under DAZ|FTZ) on one 8 x 32 block over K = 512,
// the best of 5 batches each, the two interleaved.
std::pair<double, double> dp_and_fma_speed() {
  constexpr int64_t K = 512, kCalls = 200;
  std::vector<Bf16> x(8 * K), w(2 * kPanel * K);
  std::vector<float> xf(8 * K), out(8 * 2 * kPanel);
  uint64_t state = 0x2545f4914f6cdd1dull;
  for (Bf16* v : {x.data(), w.data()})
    for (int64_t i = 0, n = v == x.data() ? 8 * K : 2 * kPanel * K; i < n; ++i) {
      state ^= state << 13; state ^= state >> 7; state ^= state << 17;
      v[i] = static_cast<Bf16>(((state >> 40) & 0x8000u) | ((124 + state % 8) << 7) | (state & 0x7fu));
    }
  for (int64_t i = 0; i < 8 * K; ++i) xf[i] = widen_bf16(x[i]);
  const at::Tensor packed = pack_pairs(at::from_blob(w.data(), {2 * kPanel, K}, at::kBFloat16));
  const void* pp = packed.data_ptr();
  double best[2] = {1e30, 1e30};
  const kimi_parity::fixed::DefaultFpEnv env;
  for (int batch = 0; batch < 5; ++batch)
    for (int which = 0; which < 2; ++which) {
      _mm_setcsr(which ? kimi_parity::fixed::kFlushCsr : 0x1f80u);
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < kCalls; ++i) {
        if (which) pairs_avx512<8, 2>(xf.data(), K, K, pp, K * kPanel, out.data(), 2 * kPanel, 2 * kPanel, false);
        else pairs_dp<8, 2>(x.data(), K, K, pp, K * kPanel, out.data(), 2 * kPanel, 2 * kPanel, false);
      }
      best[which] = std::min(best[which], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  const double flops = 2.0 * 8 * 2 * kPanel * K * kCalls / 1e9;
  return {flops / best[0], flops / best[1]};
}

// What VDPBF16PS is on this CPU, decided once: `exact` when it passed the self-test (then the
// avx512_bf16 path runs it on bf16 inputs), `preferred` when it also beat the fp32 FMA kernel
// at start-up (then avx512_bf16 is the process's default path), and why, for kernel_info.
struct DotCheck {
  bool exact = false;
  bool preferred = false;
  std::string status;
};

DotCheck check_dp() {
  DotCheck c;
  if (!cpu_has("avx512_bf16")) {
    c.status = "not on this CPU (no AVX512-BF16)";
    return c;
  }
  const std::string failed = dp_self_test();
  if (!failed.empty()) {
    c.status = "off: VDPBF16PS differs from the pair order on this CPU (" + failed + "): avx512_bf16 runs the FMA kernel";
    return c;
  }
  c.exact = true;
  const auto [dp, fma] = dp_and_fma_speed();
  c.preferred = dp > fma;
  char speeds[96];
  std::snprintf(speeds, sizeof speeds, "%.0f vs %.0f GFLOP/s in fp32 FMAs at start-up", dp, fma);
  c.status = std::string(c.preferred ? "on: " : "exact but slower here, the default path is avx512: ") + speeds;
  return c;
}

const DotCheck& dp_check() {
  static const DotCheck c = check_dp();
  return c;
}

std::string bf16_dot_status() { return dp_check().status; }

// x [M, K] times the pair pack of a bf16 weight of `n` rows (see gemm_on), on the `isa` path.
at::Tensor gemm_pairs(const at::Tensor& x_in, const at::Tensor& pack_in, int64_t n, const std::string& isa,
                      int64_t splits, bool sum) {
  TORCH_CHECK(x_in.dim() == 2, "kimi_parity: expected a 2-D input, got ", x_in.dim(), "-D");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "kimi_parity: fp32 or bf16 only, got ", x_in.scalar_type());
  TORCH_CHECK(cpu_has(isa), "kimi_parity: this CPU cannot run the ", isa, " kernels");
  const int64_t m = x_in.size(0), k = x_in.size(1), panels = pack_in.size(0);
  TORCH_CHECK(pack_in.size(1) == k + (k & 1), "kimi_parity: K mismatch: input ", k, ", weight ", pack_in.size(1));
  TORCH_CHECK(splits >= 1 && k % splits == 0, "kimi_parity: K = ", k, " is not ", splits, " equal slices");
  const int64_t ks = k / splits, ksp = ks + (ks & 1);
  // Odd slices of a split K each take their own zero pad: the pack is remade slice by slice.
  const at::Tensor packed = splits > 1 && (ks & 1) ? pack_pairs(pad_slices(unpack_pairs(pack_in, k), splits)) : pack_in;
  const bool dp = isa == "avx512_bf16" && x_in.scalar_type() == at::kBFloat16 && dp_check().exact;
  const Kernels& kern = dp ? kDpPairs : avx512_kernels(isa) ? kAvx512Pairs : isa == "avx2" ? kAvx2Pairs : kScalarPairs;
  const at::Tensor x = pad_slices(dp ? x_in : x_in.to(at::kFloat), splits);
  at::Tensor out = sum ? at::empty({m, n}, x.options().dtype(at::kFloat)) : at::empty({splits, m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return out;
  if (k == 0) return out.zero_();
  run_blocks(kern, static_cast<const char*>(x.data_ptr()), x.element_size(), splits * ksp, ksp,
             static_cast<const char*>(packed.data_ptr()), packed.element_size(), m, n, panels, splits, sum,
             out.data_ptr<float>());
  return out;
}

// x [M, K] (fp32/bf16) times a packed weight of `n` rows, K cut into `splits` slices, on the
// `isa` code path -> [M, n] fp32, the slices' partials added in order (sum = true), or the
// partials [splits, M, n] (sum = false). A bf16 pack runs the pair order.
at::Tensor gemm_on(const at::Tensor& x_in, const at::Tensor& packed, int64_t n, const std::string& isa,
                   int64_t splits, bool sum) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16),
              "kimi_parity: weight is not a packed panel tensor");
  const int64_t panels = packed.size(0);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "kimi_parity: bad N ", n);
  if (packed.scalar_type() == at::kBFloat16) return gemm_pairs(x_in, packed, n, isa, splits, sum);
  const at::Tensor x = as_fp32_rows(x_in);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.size(1) == k, "kimi_parity: K mismatch: input ", k, ", weight ", packed.size(1));
  TORCH_CHECK(splits >= 1 && k % splits == 0, "kimi_parity: K = ", k, " is not ", splits, " equal slices");
  at::Tensor out = sum ? at::empty({m, n}, x.options()) : at::empty({splits, m, n}, x.options());
  if (m == 0 || n == 0) return out;
  if (k == 0) return out.zero_();
  run_blocks(kernels_for(isa), reinterpret_cast<const char*>(x.data_ptr<float>()), sizeof(float), k, k / splits,
             static_cast<const char*>(packed.data_ptr()), sizeof(float), m, n, panels, splits, sum,
             out.data_ptr<float>());
  return out;
}

// The same on the process's code path (KIMI_RL_ISA, else the fastest: isa.h).
at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t splits, bool sum) {
  return gemm_on(x, packed, n, kimi_parity::current_isa(), splits, sum);
}

// Independent products of small matrices (attention's per-(query, KV head) blocks, the
// indexer's): a [E, M, K] times b [E, K, N] (fp32/bf16) -> [E, M, N] fp32, every element of every
// entry one FMA chain over k = 0..K-1 from +0.0f, the GEMM's order above, on the `isa` code path.
// An entry's bits therefore depend on its own operands alone, never on E, on its index, or on
// which thread runs it (a vendor batched GEMM picks its kernel from M, N, K and E, and measured
// on one AVX-512 machine gave an entry other bits when it travelled with 1 or 3 entries than
// with 2). Each entry's b is packed into panels in a per-thread buffer (columns past N zero).
at::Tensor bmm_on(const at::Tensor& a_in, const at::Tensor& b_in, const std::string& isa) {
  TORCH_CHECK(a_in.dim() == 3 && b_in.dim() == 3 && a_in.size(0) == b_in.size(0) && a_in.size(2) == b_in.size(1),
              "kimi_parity: bmm wants a [E, M, K] and b [E, K, N]; got ", a_in.sizes(), " and ", b_in.sizes());
  for (const at::Tensor* t : {&a_in, &b_in})
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16,
                "kimi_parity: fp32 or bf16 only, got ", t->scalar_type());
  const at::Tensor a = a_in.to(at::kFloat).contiguous(), b = b_in.to(at::kFloat).contiguous();
  const int64_t e = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  at::Tensor out = at::empty({e, m, n}, a.options());
  if (e == 0 || m == 0 || n == 0) return out;
  if (k == 0) return out.zero_();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Kernels& kern = kernels_for(isa);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, 2 * m * n * k));
  at::parallel_for(0, e, grain, [&](int64_t begin, int64_t end) {
    const kimi_parity::fixed::DefaultFpEnv env;
    std::vector<float> packed(panels * k * kPanel, 0.0f);
    for (int64_t i = begin; i < end; ++i) {
      const float* bi = bp + i * k * n;
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        float* panel = packed.data() + p * k * kPanel;
        for (int64_t kk = 0; kk < k; ++kk)
          std::copy(bi + kk * n + p * kPanel, bi + kk * n + p * kPanel + cols, panel + kk * kPanel);
      }
      for (int64_t r0 = 0; r0 < m; r0 += kern.max_rows) {
        const int64_t rows = std::min<int64_t>(kern.max_rows, m - r0);
        for (int64_t p0 = 0; p0 < panels; p0 += kern.max_panels) {
          const int64_t np = std::min<int64_t>(kern.max_panels, panels - p0);
          const int64_t cols = std::min(np * kPanel, n - p0 * kPanel);
          kern.fn[rows - 1][np - 1](ap + (i * m + r0) * k, k, k, packed.data() + p0 * k * kPanel, k * kPanel,
                                    op + (i * m + r0) * n + p0 * kPanel, n, cols, false);
        }
      }
    }
  });
  return out;
}

at::Tensor bmm(const at::Tensor& a, const at::Tensor& b) {
  return bmm_on(a, b, kimi_parity::current_isa());
}

// The order above written as the plainest loop, on unpacked operands: the specification the
// fast kernels are tested against bit for bit (the pair order for a bf16 weight).
at::Tensor gemm_reference(const at::Tensor& x_in, const at::Tensor& w_in, int64_t splits) {
  const bool pairs = w_in.scalar_type() == at::kBFloat16;
  const at::Tensor x = as_fp32_rows(x_in), w = as_fp32_rows(w_in);
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k, "kimi_parity: K mismatch");
  TORCH_CHECK(splits >= 1 && k % splits == 0, "kimi_parity: K = ", k, " is not ", splits, " equal slices");
  const int64_t ks = k / splits;
  at::Tensor out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float total = 0.0f;
      for (int64_t s = 0; s < splits; ++s) {
        float acc = 0.0f;
        const int64_t end = (s + 1) * ks;
        if (pairs) {
          for (int64_t kk = s * ks; kk < end; kk += 2) {
            const bool two = kk + 1 < end;  // else the slice's last pair is (kk, a zero)
            acc = pair_step(acc, xp[i * k + kk], wp[j * k + kk], two ? xp[i * k + kk + 1] : 0.0f,
                            two ? wp[j * k + kk + 1] : 0.0f);
          }
        } else {
          for (int64_t kk = s * ks; kk < end; ++kk) acc = std::fmaf(xp[i * k + kk], wp[j * k + kk], acc);
        }
        total = s == 0 ? acc : total + acc;
      }
      op[i * n + j] = total;
    }
  return out;
}

}  // namespace

bool kimi_parity::bf16_dot_preferred() { return dp_check().preferred; }

TORCH_LIBRARY(kimi_parity, lib) {
  lib.def("pack(Tensor weight) -> Tensor", &pack);
  lib.def("gemm(Tensor x, Tensor packed, int n, int splits=1, bool sum=True) -> Tensor", &gemm);
  lib.def("gemm_on(Tensor x, Tensor packed, int n, str isa, int splits=1, bool sum=True) -> Tensor", &gemm_on);
  lib.def("bmm(Tensor a, Tensor b) -> Tensor", &bmm);
  lib.def("bmm_on(Tensor a, Tensor b, str isa) -> Tensor", &bmm_on);
  lib.def("isas() -> str[]", &isas);
  lib.def("isa() -> str", &kimi_parity::current_isa);
  lib.def("set_isa(str isa) -> ()", &kimi_parity::set_isa);
  lib.def("gemm_reference(Tensor x, Tensor weight, int splits=1) -> Tensor", &gemm_reference);
  lib.def("bf16_dot_status() -> str", &bf16_dot_status);
}
