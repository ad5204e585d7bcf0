// The parity attention walk (parity.kernels.paged_attention), compiled: causal GQA attention of
// a flat set of queries over a paged KV cache, an online softmax over 64-key blocks visited from
// position 0, each query over the blocks 0 .. q_pos / 64 of its own sequence.
//
// It computes what parity/kernels.py's `_paged_attention_walk` computes, operation for
// operation, so the bits are the same (tests/unit/test_kernels.py checks torch.equal on every
// code path): per (query, KV head), per block,
//   scores[h, b] = fl(dot(q[h], k[b]) * scale)   dot: one FMA chain over d = 0..D-1 from +0.0f
//                                                 (the compiled bmm's order); masked: -inf
//   m_new = max(m, max_b scores[h, b]);  c = exp(m - m_new);  p[h, b] = exp(scores[h, b] - m_new)
//   denom[h] = fl(denom[h] * c) + row_sum(p[h])    row_sum: the fixed 16-lane tree
//   acc[h, e] = fl(acc[h, e] * c) + pv[h, e]       pv: one FMA chain over b = 0..63 from +0.0f,
//                                                 a masked key's value read as 0
// and finally out = acc / denom. exp is fixed_math.h's, with the one canonical NaN. Every step
// is one correctly rounded IEEE-754 operation or an explicit FMA (-ffp-contract=off), so the
// AVX-512, AVX2 and scalar loops below give the same bits; a query's bits depend on its own
// position and its own sequence's keys alone, never on the batch or the thread that runs it.
// The Python walk drove this from Python, a dozen torch calls per block and layer: that
// overhead, not the arithmetic, was most of a small model's rollout step.
//
// Registered as torch.ops.kimi_parity.{paged_attention, paged_attention_on}.

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

constexpr int64_t kBlock = 64;  // parity.kernels.KV_BLOCK

// One (query, KV head) task's inputs and fp32 scratch: the g query heads that share KV head
// `h`, q [g][D], out [g][D] (accumulators, divided at the end); the cache [S][2][hkv][D] in its
// element type; the query's sequence's slots and its position. Scratch: kb [D][64], vb [64][D],
// s [g][64], pv [D], m and denom [g].
template <typename T>
struct Task {
  const float* q;
  float* out;
  const T* kv;
  const int64_t* slots;
  int64_t g, d, hkv, h, pos;
  float scale;
  float *kb, *vb, *s, *pv, *m, *denom;
};

template <typename T>
KP_INLINE void attend_body(const Task<T>& t) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t g = t.g, d = t.d;
  float *kb = t.kb, *vb = t.vb, *out = t.out;
  for (int64_t i = 0; i < g; ++i) {
    t.m[i] = neg_inf;
    t.denom[i] = 0.0f;
    for (int64_t e = 0; e < d; ++e) out[i * d + e] = 0.0f;
  }
  const int64_t slot_stride = 2 * t.hkv * d;
  for (int64_t start = 0; start <= t.pos; start += kBlock) {
    const int64_t valid = std::min<int64_t>(kBlock, t.pos - start + 1);  // keys start .. pos
    // The block's keys transposed to [D][64] and values [64][D], widened to fp32 (exact);
    // masked keys and values are zero (the walk replaces them, never multiplies garbage).
    for (int64_t b = 0; b < kBlock; ++b) {
      if (b < valid) {
        const T* key = t.kv + t.slots[start + b] * slot_stride + t.h * d;
        const T* value = key + t.hkv * d;
        for (int64_t e = 0; e < d; ++e) {
          if constexpr (sizeof(T) == 2) {
            kb[e * kBlock + b] = widen_bf16(key[e]);
            vb[b * d + e] = widen_bf16(value[e]);
          } else {
            kb[e * kBlock + b] = key[e];
            vb[b * d + e] = value[e];
          }
        }
      } else {
        for (int64_t e = 0; e < d; ++e) {
          kb[e * kBlock + b] = 0.0f;
          vb[b * d + e] = 0.0f;
        }
      }
    }
    for (int64_t i = 0; i < g; ++i) {
      float* si = t.s + i * kBlock;
      for (int64_t b = 0; b < kBlock; ++b) si[b] = 0.0f;
      for (int64_t e = 0; e < d; ++e) {
        const float qe = t.q[i * d + e];
        for (int64_t b = 0; b < kBlock; ++b) si[b] = __builtin_fmaf(qe, kb[e * kBlock + b], si[b]);
      }
      float block_max = neg_inf;
      for (int64_t b = 0; b < kBlock; ++b) {
        si[b] = b < valid ? si[b] * t.scale : neg_inf;
        block_max = si[b] > block_max ? si[b] : block_max;
      }
      const float m_new = t.m[i] > block_max ? t.m[i] : block_max;
      const float c = one_nan(exp_fixed(t.m[i] - m_new));
      for (int64_t b = 0; b < kBlock; ++b) si[b] = one_nan(exp_fixed(si[b] - m_new));
      t.denom[i] = t.denom[i] * c + row_sum_body(si, kBlock);
      for (int64_t e = 0; e < d; ++e) t.pv[e] = 0.0f;
      for (int64_t b = 0; b < kBlock; ++b) {
        const float pb = si[b];
        for (int64_t e = 0; e < d; ++e) t.pv[e] = __builtin_fmaf(pb, vb[b * d + e], t.pv[e]);
      }
      float* oi = out + i * d;
      for (int64_t e = 0; e < d; ++e) oi[e] = oi[e] * c + t.pv[e];
      t.m[i] = m_new;
    }
  }
  for (int64_t i = 0; i < g; ++i)
    for (int64_t e = 0; e < d; ++e) out[i * d + e] = out[i * d + e] / t.denom[i];
}

// One loop body per ISA; only the vector width the compiler may use differs, never the bits.
template <typename T>
__attribute__((target("avx512f,fma"))) void attend_avx512(const Task<T>& t) { attend_body(t); }

template <typename T>
__attribute__((target("avx2,fma"))) void attend_avx2(const Task<T>& t) { attend_body(t); }

template <typename T>
__attribute__((optimize("no-tree-vectorize"))) void attend_scalar(const Task<T>& t) { attend_body(t); }

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
  at::parallel_for(0, nq * hkv, 1, [&](int64_t begin, int64_t end) {
    const DefaultFpEnv env;
    std::vector<float> scratch(2 * d * kBlock + g * kBlock + d + 2 * g);
    Task<T> t{};
    t.kv = kv;
    t.g = g, t.d = d, t.hkv = hkv, t.scale = scale;
    t.kb = scratch.data();
    t.vb = t.kb + d * kBlock;
    t.s = t.vb + d * kBlock;
    t.pv = t.s + g * kBlock;
    t.m = t.pv + d;
    t.denom = t.m + g;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / hkv;
      t.h = item % hkv;
      const int64_t offset = (i * hq + t.h * g) * d;  // heads h*g .. h*g+g-1 of query i
      t.q = qp + offset;
      t.out = op + offset;
      t.slots = sp + seq[i] * length;
      t.pos = pos[i];
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
