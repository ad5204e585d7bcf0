// The parity GEMM: out[m, n] = sum_k x[m, k] * w[n, k] with one summation order fixed by
// construction.
//
// The order: every output element is ONE fused-multiply-add chain over k = 0, 1, ..., K-1,
// starting from +0.0f in fp32:  acc = fmaf(x[m, k], w[n, k], acc).  Vector lanes run over
// output columns (16 columns of a packed weight panel), never over k, so the chain of an element
// is the same whether it is computed by the AVX-512 kernel (one 16-lane register), the AVX2
// kernel (two 8-lane registers) or the scalar reference (std::fmaf); by any thread; in any row
// block; for any M. Threads split rows and column panels, never k. bf16 inputs are widened to
// fp32 (exact), accumulated in fp32 and rounded once by the caller.
//
// A bf16 weight is packed in bf16 (the weight's own bytes, not twice as many) and each panel
// value is widened to fp32 as the kernel loads it: bf16 -> fp32 is exact (the 16 bits become
// the high half of the fp32 word), so every FMA sees the same fp32 operand either way and the
// results are the same bits as with an fp32 pack.
//
// K-splits (the tensor-parallel order, parity/tp.py): with `splits` = S > 1, K is cut into S
// equal contiguous slices, each element's chain restarts from +0.0f at every slice boundary,
// and the S partial sums are added in slice order in fp32: ((p0 + p1) + p2) + ...  A
// row-parallel shard over whole slices computes the same partials on fewer columns, so TP = 1
// and TP = N give the same bits when the ranks' partials are added in rank order. `sum` = false
// returns the partials themselves ([S, M, N]) for that cross-rank sum.
//
// Registered as torch.ops.kimi_parity.{pack, gemm, gemm_on, bmm, bmm_on, isas, isa, set_isa,
// gemm_reference}; loaded by parity/native.py.
// Compiled with -ffp-contract=off: the only fused operations are the explicit FMAs below.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>

#include "fixed_math.h"
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;  // columns per packed weight panel (one AVX-512 register)
constexpr int kMaxRows = 8;      // rows per register block, at most
constexpr int kMaxPanels = 2;    // panels per register block, at most
constexpr int64_t kChunkBlocks = 12;  // register blocks of rows per cache-blocking task

// ---------------------------------------------------------------------------------------------
// Panel loads: W is float (an fp32 pack) or uint16_t (a bf16 pack: the raw bf16 bits), widened
// exactly to fp32 on load.

using Bf16 = uint16_t;

__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const Bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
__attribute__((target("avx2"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2"))) inline __m256 load8(const Bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float widen(float v) { return v; }
inline float widen(Bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ---------------------------------------------------------------------------------------------
// Micro-kernels: MR rows x NP consecutive 16-column panels, k = 0..K-1 in order.
// x: row-major fp32 with row stride lda; panels: NP x [K][16] of W, `pstride` elements apart;
// out: MR rows at stride ldo, `cols` (1 .. NP * 16) valid columns, stored (add = false) or added
// to what out holds (add = true: out = out + acc, one fp32 add, the next K-slice's partial).

template <int MR, int NP, typename W>
__attribute__((target("avx512f,fma"))) void block_avx512(
    const float* x, int64_t lda, int64_t K, const void* panels_in, int64_t pstride, float* out,
    int64_t ldo, int64_t cols, bool add) {
  const W* panels = static_cast<const W*>(panels_in);
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[NP];
    for (int p = 0; p < NP; ++p) w[p] = load16(panels + p * pstride + k * kPanel);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * lda + k]);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(a, w[p], acc[r][p]);
    }
  }
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

// Writes `cols` finished sums, or adds them to what `out` holds (the next K-slice's partial).
inline void store(const float* acc, float* out, int64_t cols, bool add) {
  for (int64_t c = 0; c < cols; ++c) out[c] = add ? out[c] + acc[c] : acc[c];
}

template <int MR, int NP, typename W>
__attribute__((target("avx2,fma"))) void block_avx2(
    const float* x, int64_t lda, int64_t K, const void* panels_in, int64_t pstride, float* out,
    int64_t ldo, int64_t cols, bool add) {
  static_assert(NP == 1, "AVX2 blocks are one panel wide (16 registers)");
  const W* panels = static_cast<const W*>(panels_in);
  __m256 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 wl = load8(panels + k * kPanel);
    const __m256 wh = load8(panels + k * kPanel + 8);
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

template <int MR, int NP, typename W>
void block_scalar(const float* x, int64_t lda, int64_t K, const void* panels_in, int64_t pstride,
                  float* out, int64_t ldo, int64_t cols, bool add) {
  static_assert(NP == 1, "scalar blocks are one panel wide");
  const W* panels = static_cast<const W*>(panels_in);
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc = std::fmaf(x[r * lda + k], widen(panels[k * kPanel + c]), acc);
      out[r * ldo + c] = add ? out[r * ldo + c] + acc : acc;
    }
}

using BlockFn = void (*)(const float*, int64_t, int64_t, const void*, int64_t, float*, int64_t, int64_t, bool);

// The register blocking of one ISA: fn[rows - 1][panels - 1] for rows <= max_rows and
// panels <= max_panels. Blocking changes speed only, never an element's arithmetic.
struct Kernels {
  int max_rows;
  int max_panels;
  BlockFn fn[kMaxRows][kMaxPanels];
};

#define KIMI_ROWS_1(f, W) {f<1, 1, W>, nullptr}, {f<2, 1, W>, nullptr}, {f<3, 1, W>, nullptr}, \
  {f<4, 1, W>, nullptr}, {f<5, 1, W>, nullptr}, {f<6, 1, W>, nullptr}
#define KIMI_ROWS_2(f, W) {f<1, 1, W>, f<1, 2, W>}, {f<2, 1, W>, f<2, 2, W>}, {f<3, 1, W>, f<3, 2, W>}, \
  {f<4, 1, W>, f<4, 2, W>}, {f<5, 1, W>, f<5, 2, W>}, {f<6, 1, W>, f<6, 2, W>}, {f<7, 1, W>, f<7, 2, W>}, \
  {f<8, 1, W>, f<8, 2, W>}

const Kernels kAvx512{8, 2, {KIMI_ROWS_2(block_avx512, float)}};
const Kernels kAvx2{6, 1, {KIMI_ROWS_1(block_avx2, float)}};
const Kernels kScalar{6, 1, {KIMI_ROWS_1(block_scalar, float)}};
const Kernels kAvx512Bf16{8, 2, {KIMI_ROWS_2(block_avx512, Bf16)}};
const Kernels kAvx2Bf16{6, 1, {KIMI_ROWS_1(block_avx2, Bf16)}};
const Kernels kScalarBf16{6, 1, {KIMI_ROWS_1(block_scalar, Bf16)}};

using kimi_parity::cpu_has;
using kimi_parity::isas;

// The kernels of an ISA for panels of fp32 (bf16 = false) or bf16.
const Kernels& kernels_for(const std::string& isa, bool bf16 = false) {
  TORCH_CHECK(cpu_has(isa), "kimi_parity: this CPU cannot run the ", isa, " kernels");
  if (bf16) return isa == "avx512" ? kAvx512Bf16 : isa == "avx2" ? kAvx2Bf16 : kScalarBf16;
  return isa == "avx512" ? kAvx512 : isa == "avx2" ? kAvx2 : kScalar;
}

at::Tensor as_fp32_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "kimi_parity: expected a 2-D input, got ", x.dim(), "-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "kimi_parity: fp32 or bf16 only, got ", x.scalar_type());
  return x.to(at::kFloat).contiguous();  // bf16 -> fp32 is exact
}

// The panel transpose of pack, for elements of type T (bytes moved, none changed).
template <typename T>
void pack_panels(const T* src, T* dst, int64_t n, int64_t k, int64_t panels) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    const kimi_parity::fixed::DefaultFpEnv env;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      const T* rows = src + p * kPanel * k;
      T* panel = dst + p * k * kPanel;
      // Writes in order (one cache line per k or two), reads as `cols` sequential streams.
      for (int64_t i = 0; i < k; ++i)
        for (int64_t c = 0; c < cols; ++c) panel[i * kPanel + c] = rows[c * k + i];
    }
  });
}

// w [N, K] -> panels [ceil(N / 16), K, 16] in w's dtype (fp32 or bf16: a bf16 pack is as
// many bytes as the weight; the kernels widen it on load), columns past N zero.
at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "kimi_parity: expected a 2-D weight, got ", weight.dim(), "-D");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "kimi_parity: fp32 or bf16 only, got ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = n % kPanel ? at::zeros({panels, k, kPanel}, w.options())
                                 : at::empty({panels, k, kPanel}, w.options());
  if (w.scalar_type() == at::kBFloat16)
    pack_panels(static_cast<const Bf16*>(w.data_ptr()), static_cast<Bf16*>(packed.data_ptr()), n, k, panels);
  else
    pack_panels(w.data_ptr<float>(), packed.data_ptr<float>(), n, k, panels);
  return packed;
}

// x [M, K] (fp32/bf16) times a packed weight of `n` rows, K cut into `splits` slices, on the
// `isa` code path -> [M, n] fp32, the slices' partials added in order (sum = true), or the
// partials [splits, M, n] (sum = false).
at::Tensor gemm_on(const at::Tensor& x_in, const at::Tensor& packed, int64_t n, const std::string& isa,
                   int64_t splits, bool sum) {
  const at::Tensor x = as_fp32_rows(x_in);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16),
              "kimi_parity: weight is not a packed panel tensor");
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "kimi_parity: K mismatch: input ", k, ", weight ", packed.size(1));
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "kimi_parity: bad N ", n);
  TORCH_CHECK(splits >= 1 && k % splits == 0, "kimi_parity: K = ", k, " is not ", splits, " equal slices");
  at::Tensor out = sum ? at::empty({m, n}, x.options()) : at::empty({splits, m, n}, x.options());
  if (m == 0 || n == 0) return out;
  if (k == 0) return out.zero_();
  const int64_t ks = k / splits;
  const float* xp = x.data_ptr<float>();
  const char* wp = static_cast<const char*>(packed.data_ptr());
  const int64_t wsize = packed.element_size();
  float* op = out.data_ptr<float>();
  const Kernels& kern = kernels_for(isa, bf16);
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
    const kimi_parity::fixed::DefaultFpEnv env;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t cb = t % col_blocks, chunk = t / col_blocks;
      const int64_t p0 = cb * kern.max_panels, np = std::min<int64_t>(kern.max_panels, panels - p0);
      const int64_t c0 = p0 * kPanel, cols = std::min(np * kPanel, n - c0);
      const int64_t chunk_end = std::min(m, (chunk + 1) * chunk_rows);
      for (int64_t r0 = chunk * chunk_rows; r0 < chunk_end; r0 += kern.max_rows) {
        const int64_t rows = std::min<int64_t>(kern.max_rows, chunk_end - r0);
        for (int64_t s = 0; s < splits; ++s) {
          float* dst = op + (sum ? 0 : s * m * n) + r0 * n + c0;
          kern.fn[rows - 1][np - 1](xp + r0 * k + s * ks, k, ks, wp + (p0 * k * kPanel + s * ks * kPanel) * wsize,
                                    k * kPanel, dst, n, cols, sum && s > 0);
        }
      }
    }
  });
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
// fast kernels are tested against bit for bit.
at::Tensor gemm_reference(const at::Tensor& x_in, const at::Tensor& w_in, int64_t splits) {
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
        for (int64_t kk = s * ks; kk < (s + 1) * ks; ++kk) acc = std::fmaf(xp[i * k + kk], wp[j * k + kk], acc);
        total = s == 0 ? acc : total + acc;
      }
      op[i * n + j] = total;
    }
  return out;
}

}  // namespace

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
}
