// The parity attention walk (parity.kernels.paged_attention), compiled: causal GQA attention of
// a flat set of queries over a paged KV cache, an online softmax over 64-key blocks visited from
// position 0, each query over the blocks 0 .. q_pos / 64 of its own sequence.
//
// It computes what parity/kernels.py's `_paged_attention_walk` computes, operation for
// operation, so the bits are the same (tests/unit/test_kernels.py checks torch.equal on every
// code path): per (query, query head), per block,
//   scores[b] = fl(dot(q, k[b]) * scale)   dot: one FMA chain over d = 0..D-1 from +0.0f
//                                           (the compiled bmm's order); masked: -inf
//   m_new = max(m, max_b scores[b]);  c = exp(m - m_new);  p[b] = exp(scores[b] - m_new)
//   denom = fl(denom * c) + row_sum(p)      row_sum: the fixed 16-lane tree
//   acc[e] = fl(acc[e] * c) + pv[e]         pv: one FMA chain over b = 0..63 from +0.0f,
//                                           a masked key's value read as 0
// and finally out = acc / denom. exp is fixed_math.h's, with the one canonical NaN. Every step
// is one correctly rounded IEEE-754 operation or an explicit FMA (-ffp-contract=off), so the
// AVX-512, AVX2 and scalar loops below give the same bits; a query's bits depend on its own
// position and its own sequence's keys alone, never on the batch or the thread that runs it.
// The Python walk drove this from Python, a dozen torch calls per block and layer: that
// overhead, not the arithmetic, was most of a small model's rollout step.
//
// One task per (run, KV head): a run is up to kRun consecutive queries of one sequence (equal
// q_seq; a prefill's queries come so, a decode step's are runs of one). The task gathers each
// block once, transposed and widened to fp32, up to the run's furthest position, and every query
// of the run at or past the block's start takes its step from that copy; with a task per
// (query, KV head), a prefill gathered every block again for every query. A query's step is the
// same whichever run it is in and wherever in it: its scores past its own position are replaced
// by -inf and its values there read from a row of zeros, never the keys a later query of the
// run sees. The two FMA-chain loops of a step are written per ISA (Chains*), their 64 chains in
// registers; everything else is one loop body for all three paths.
//
// Registered as torch.ops.kimi_parity.{paged_attention, paged_attention_on}.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

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

constexpr int64_t kBlock = 64;  // parity.kernels.KV_BLOCK
// Queries per run (the queries a block's gather serves). On a 4 x 256-token prefill (9 query
// heads over 3 KV heads, D 64, one thread) the walk took 22.6 ms with runs of 1 (a task per
// query), 9.1 ms with 16, 8.5 with 32, 8.2 with 64: longer runs gain little, and leave fewer
// tasks for the threads (a 256-token prompt is 8 runs of 32 per KV head).
constexpr int64_t kRun = 32;
// pv's FMA chains run kChunk value elements at a time, in registers (4 zmm or 8 ymm); vb's
// rows are padded to a multiple of it.
constexpr int64_t kChunk = 64;
int64_t padded(int64_t d) { return (d + kChunk - 1) / kChunk * kChunk; }

// One query head's part of a block step: its q row [D], its output row (the accumulators,
// divided at the end), its m and denom, and how many of the block's keys it sees.
struct Head {
  const float* q;
  float* out;
  float* m;
  float* denom;
  int64_t valid;
};

// One (run, KV head) task's inputs and fp32 scratch. The run: n queries of one sequence, query j
// at position pos[j], its g query heads that share KV head `h` at q + j * stride [g][D], its
// outputs at out + j * stride; the cache [S][2][hkv][D] in its element type; the sequence's
// slots. Scratch: kb [D][64], vb [64][dp] and a row of zeros [dp] (dp = padded(D); the pad
// lanes stay zero), s [64], pv [kChunk], m and denom [kRun][g].
template <typename T>
struct Task {
  const float* q;
  float* out;
  const T* kv;
  const int64_t* slots;
  const int64_t* pos;
  int64_t n, stride, g, d, hkv, h;
  float scale;
  float *kb, *vb, *zero, *s, *pv, *m, *denom;
};

// The largest of a block's 64 scores as the walk's running `s > max ? s : max` from -inf finds
// it, NaNs skipped. The value does not depend on the order, so row_max_body's vector order finds
// it; only which zero survives of +0.0 / -0.0 does, so a zero maximum is looked up in order.
KP_INLINE float block_max_of(const float* s) {
  float block_max = row_max_body(s, kBlock);
  if (block_max == 0.0f) {
    block_max = -std::numeric_limits<float>::infinity();
    for (int64_t b = 0; b < kBlock; ++b) block_max = s[b] > block_max ? s[b] : block_max;
  }
  return block_max;
}

// A block step's two sets of 64 FMA chains, one implementation per ISA. The dot products:
// out[b] = the chain over e = 0..d-1 from +0.0f of q[e] * kb[e][b]. The value products:
// out[l] = the chain over b = 0..63 from +0.0f of p[b] * row_b[l], l = 0..63, where row_b is
// vb's row b (at the caller's column offset) for b < valid and the zero row past it. A lane is
// one chain, so the vector width never changes a bit. The vector ones keep the 64 chains in
// registers (4 zmm or 8 ymm) over the chain's loop: through memory, every FMA waited on the
// store and the load of the one before it (and the compiler's own vectorisation of the loops
// kept them in registers or not as the code around them changed).
struct ChainsAvx512 {
  __attribute__((target("avx512f,fma"))) static void dot(const float* q, const float* kb, int64_t d, float* out) {
    __m512 acc[4];
    for (int v = 0; v < 4; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; ++e) {
      const __m512 qe = _mm512_set1_ps(q[e]);
      for (int v = 0; v < 4; ++v) acc[v] = _mm512_fmadd_ps(qe, _mm512_loadu_ps(kb + e * kBlock + 16 * v), acc[v]);
    }
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + 16 * v, acc[v]);
  }
  __attribute__((target("avx512f,fma"))) static void pv(const float* p, const float* vb, const float* zero,
                                                        int64_t valid, int64_t dp, float* out) {
    __m512 acc[4];
    for (int v = 0; v < 4; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kBlock; ++b) {
      const __m512 pb = _mm512_set1_ps(p[b]);
      const float* row = b < valid ? vb + b * dp : zero;
      for (int v = 0; v < 4; ++v) acc[v] = _mm512_fmadd_ps(pb, _mm512_loadu_ps(row + 16 * v), acc[v]);
    }
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + 16 * v, acc[v]);
  }
};

struct ChainsAvx2 {
  __attribute__((target("avx2,fma"))) static void dot(const float* q, const float* kb, int64_t d, float* out) {
    __m256 acc[8];
    for (int v = 0; v < 8; ++v) acc[v] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; ++e) {
      const __m256 qe = _mm256_set1_ps(q[e]);
      for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(qe, _mm256_loadu_ps(kb + e * kBlock + 8 * v), acc[v]);
    }
    for (int v = 0; v < 8; ++v) _mm256_storeu_ps(out + 8 * v, acc[v]);
  }
  __attribute__((target("avx2,fma"))) static void pv(const float* p, const float* vb, const float* zero,
                                                     int64_t valid, int64_t dp, float* out) {
    __m256 acc[8];
    for (int v = 0; v < 8; ++v) acc[v] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kBlock; ++b) {
      const __m256 pb = _mm256_set1_ps(p[b]);
      const float* row = b < valid ? vb + b * dp : zero;
      for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(row + 8 * v), acc[v]);
    }
    for (int v = 0; v < 8; ++v) _mm256_storeu_ps(out + 8 * v, acc[v]);
  }
};

struct ChainsScalar {  // std::fmaf (the libm call where the CPU has no FMA), through memory
  __attribute__((optimize("no-tree-vectorize"))) static void dot(const float* q, const float* kb, int64_t d,
                                                                 float* out) {
    for (int64_t b = 0; b < kBlock; ++b) out[b] = 0.0f;
    for (int64_t e = 0; e < d; ++e)
      for (int64_t b = 0; b < kBlock; ++b) out[b] = __builtin_fmaf(q[e], kb[e * kBlock + b], out[b]);
  }
  __attribute__((optimize("no-tree-vectorize"))) static void pv(const float* p, const float* vb, const float* zero,
                                                                int64_t valid, int64_t dp, float* out) {
    for (int64_t l = 0; l < kChunk; ++l) out[l] = 0.0f;
    for (int64_t b = 0; b < kBlock; ++b) {
      const float* row = b < valid ? vb + b * dp : zero;
      for (int64_t l = 0; l < kChunk; ++l) out[l] = __builtin_fmaf(p[b], row[l], out[l]);
    }
  }
};

// One query head's block step (see the header) over the gathered kb [D][64], vb [64][dp]; s
// [64] and pv [64] are scratch.
template <typename Chains>
KP_INLINE void step(const Head& h, const float* kb, const float* vb, const float* zero, float* s, float* pv, int64_t d,
                    float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t dp = padded(d);
  Chains::dot(h.q, kb, d, s);
  for (int64_t b = 0; b < kBlock; ++b) s[b] = b < h.valid ? s[b] * scale : neg_inf;
  const float block_max = block_max_of(s);
  const float m_new = *h.m > block_max ? *h.m : block_max;
  const float c = one_nan(exp_fixed(*h.m - m_new));
  for (int64_t b = 0; b < kBlock; ++b) s[b] = one_nan(exp_fixed(s[b] - m_new));
  *h.denom = *h.denom * c + row_sum_body(s, kBlock);
  *h.m = m_new;
  // kChunk value elements at a time (the pad lanes computed and dropped). A masked key's value
  // is read as 0, as the walk's masked_fill leaves it: the FMA by a zero p of a real value
  // could differ (a NaN or inf value, or -0.0 + +0.0).
  for (int64_t e0 = 0; e0 < d; e0 += kChunk) {
    Chains::pv(s, vb + e0, zero + e0, h.valid, dp, pv);
    const int64_t width = std::min<int64_t>(kChunk, d - e0);
    for (int64_t l = 0; l < width; ++l) h.out[e0 + l] = h.out[e0 + l] * c + pv[l];
  }
}

template <typename T, typename Chains>
KP_INLINE void attend_body(const Task<T>& t) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t g = t.g, d = t.d, n = t.n, dp = padded(d);
  float *kb = t.kb, *vb = t.vb;
  int64_t last = 0;  // the run's furthest position: the end of its block walk
  for (int64_t j = 0; j < n; ++j) {
    last = std::max(last, t.pos[j]);
    float* oj = t.out + j * t.stride;
    for (int64_t i = 0; i < g; ++i) {
      t.m[j * g + i] = neg_inf;
      t.denom[j * g + i] = 0.0f;
      for (int64_t e = 0; e < d; ++e) oj[i * d + e] = 0.0f;
    }
  }
  const int64_t slot_stride = 2 * t.hkv * d;
  for (int64_t start = 0; start <= last; start += kBlock) {
    const int64_t gathered = std::min<int64_t>(kBlock, last - start + 1);  // keys start .. last
    // The block's keys transposed to [D][64] and values [64][dp], widened to fp32 (exact), once
    // for the run. Keys past `last` are zero (their scores are replaced, but stay finite); values
    // past a query's own position are never read from here (the zero row instead).
    for (int64_t b = 0; b < kBlock; ++b) {
      if (b < gathered) {
        const T* key = t.kv + t.slots[start + b] * slot_stride + t.h * d;
        const T* value = key + t.hkv * d;
        for (int64_t e = 0; e < d; ++e) {
          if constexpr (sizeof(T) == 2) {
            kb[e * kBlock + b] = widen_bf16(key[e]);
            vb[b * dp + e] = widen_bf16(value[e]);
          } else {
            kb[e * kBlock + b] = key[e];
            vb[b * dp + e] = value[e];
          }
        }
      } else {
        for (int64_t e = 0; e < d; ++e) kb[e * kBlock + b] = 0.0f;
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = t.pos[j];
      if (pos < start) continue;  // a query runs the blocks 0 .. pos / 64 only
      const int64_t valid = std::min<int64_t>(kBlock, pos - start + 1);  // keys start .. pos
      for (int64_t i = 0; i < g; ++i) {
        const int64_t row = j * t.stride + i * d;
        step<Chains>(Head{t.q + row, t.out + row, t.m + j * g + i, t.denom + j * g + i, valid}, kb, vb, t.zero, t.s,
                     t.pv, d, t.scale);
      }
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    float* oj = t.out + j * t.stride;
    for (int64_t i = 0; i < g; ++i)
      for (int64_t e = 0; e < d; ++e) oj[i * d + e] = oj[i * d + e] / t.denom[j * g + i];
  }
}

// One loop body per ISA, with its chains; only the vector width differs, never the bits.
template <typename T>
__attribute__((target("avx512f,fma"))) void attend_avx512(const Task<T>& t) { attend_body<T, ChainsAvx512>(t); }

template <typename T>
__attribute__((target("avx2,fma"))) void attend_avx2(const Task<T>& t) { attend_body<T, ChainsAvx2>(t); }

template <typename T>
__attribute__((optimize("no-tree-vectorize"))) void attend_scalar(const Task<T>& t) {
  attend_body<T, ChainsScalar>(t);
}

template <typename T>
using AttendFn = void (*)(const Task<T>&);

template <typename T>
AttendFn<T> attend_for(const std::string& isa) {
  return kimi_parity::avx512_kernels(isa) ? &attend_avx512<T> : isa == "avx2" ? &attend_avx2<T> : &attend_scalar<T>;
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& slots, const at::Tensor& q_seq,
         const at::Tensor& q_pos, float scale, at::Tensor& out, const std::string& isa) {
  const int64_t nq = q.size(0), hq = q.size(1), d = q.size(2), hkv = kv_cache.size(2), length = slots.size(1);
  const int64_t g = hq / hkv;
  const float* qp = q.data_ptr<float>();
  const T* kv = static_cast<const T*>(kv_cache.data_ptr());
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* seq = q_seq.data_ptr<int64_t>();
  const int64_t* pos = q_pos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const AttendFn<T> attend = attend_for<T>(isa);
  // The runs: consecutive queries of one sequence, at most kRun each; runs[r] .. runs[r + 1].
  std::vector<int64_t> runs;
  for (int64_t i = 0; i < nq; ++i)
    if (i == 0 || seq[i] != seq[i - 1] || i - runs.back() == kRun) runs.push_back(i);
  runs.push_back(nq);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  at::parallel_for(0, num_runs * hkv, 1, [&](int64_t begin, int64_t end) {
    const DefaultFpEnv env;
    const int64_t dp = padded(d);
    std::vector<float> scratch(d * kBlock + kBlock * dp + dp + kBlock + kChunk + 2 * kRun * g);  // zeros
    Task<T> t{};
    t.kv = kv;
    t.stride = hq * d;
    t.g = g, t.d = d, t.hkv = hkv, t.scale = scale;
    t.kb = scratch.data();
    t.vb = t.kb + d * kBlock;
    t.zero = t.vb + kBlock * dp;
    t.s = t.zero + dp;
    t.pv = t.s + kBlock;
    t.m = t.pv + kChunk;
    t.denom = t.m + kRun * g;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / hkv, first = runs[r];
      t.h = item % hkv;
      t.n = runs[r + 1] - first;
      const int64_t offset = (first * hq + t.h * g) * d;  // heads h*g .. h*g+g-1 of the run's first query
      t.q = qp + offset;
      t.out = op + offset;
      t.slots = sp + seq[first] * length;
      t.pos = pos + first;
      attend(t);
    }
  });
}

// q [Nq, Hq, D] fp32/bf16; kv_cache [S, 2, Hkv, D] fp32/bf16 (slot-major, key then value);
// ctx_slots [R, L] int64; q_seq, q_pos [Nq] int64 -> [Nq, Hq, D] fp32.
at::Tensor paged_attention_on(const at::Tensor& q_in, const at::Tensor& kv_in, const at::Tensor& slots_in,
                              const at::Tensor& q_seq_in, const at::Tensor& q_pos_in, double scale,
                              const std::string& isa) {
  kimi_parity::check_runnable(isa);
  TORCH_CHECK(q_in.dim() == 3 && kv_in.dim() == 4 && kv_in.size(1) == 2 && kv_in.size(3) == q_in.size(2),
              "kimi_parity: paged_attention wants q [Nq, Hq, D] and kv_cache [S, 2, Hkv, D]; got ", q_in.sizes(),
              " and ", kv_in.sizes());
  TORCH_CHECK(kv_in.size(2) > 0 && q_in.size(1) % kv_in.size(2) == 0,
              "kimi_parity: query heads must be a multiple of KV heads");
  TORCH_CHECK(kv_in.scalar_type() == at::kFloat || kv_in.scalar_type() == at::kBFloat16,
              "kimi_parity: fp32 or bf16 cache only, got ", kv_in.scalar_type());
  for (const at::Tensor* t : {&q_in, &kv_in, &slots_in, &q_seq_in, &q_pos_in})
    TORCH_CHECK(t->device().is_cpu(), "kimi_parity: CPU tensors only");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();  // bf16 -> fp32 is exact
  const at::Tensor kv = kv_in.contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor q_seq = q_seq_in.to(at::kLong).contiguous();
  const at::Tensor q_pos = q_pos_in.to(at::kLong).contiguous();
  TORCH_CHECK(q_seq.numel() == q.size(0) && q_pos.numel() == q.size(0),
              "kimi_parity: q_seq and q_pos need one entry per query");
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.numel() == 0) return out;
  // Memory safety: every slot the walk may read is inside the cache (one pass over each index).
  const auto within = [](const at::Tensor& t, int64_t size) {
    const auto* p = t.data_ptr<int64_t>();
    return std::all_of(p, p + t.numel(), [size](int64_t v) { return v >= 0 && v < size; });
  };
  TORCH_CHECK(within(q_pos, slots.size(1)) && within(q_seq, slots.size(0)),
              "kimi_parity: a query's sequence or position is outside ctx_slots ", slots.sizes());
  TORCH_CHECK(within(slots, kv.size(0)), "kimi_parity: ctx_slots names a slot outside the cache's ", kv.size(0));
  // The Python walk multiplied an fp32 tensor by the Python float: torch rounds the scalar to
  // fp32 first.
  const float sc = static_cast<float>(scale);
  if (kv.scalar_type() == at::kFloat)
    run<float>(q, kv, slots, q_seq, q_pos, sc, out, isa);
  else
    run<uint16_t>(q, kv, slots, q_seq, q_pos, sc, out, isa);
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& slots,
                           const at::Tensor& q_seq, const at::Tensor& q_pos, double scale) {
  return paged_attention_on(q, kv, slots, q_seq, q_pos, scale, kimi_parity::current_isa());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kimi_parity, lib) {
  lib.def("paged_attention(Tensor q, Tensor kv_cache, Tensor ctx_slots, Tensor q_seq, Tensor q_pos, float scale) -> Tensor",
          &paged_attention);
  lib.def("paged_attention_on(Tensor q, Tensor kv_cache, Tensor ctx_slots, Tensor q_seq, Tensor q_pos, float scale, "
          "str isa) -> Tensor",
          &paged_attention_on);
}
