// The parity sampler: everything from a row of logits to the sampled token and its log-prob,
// with one arithmetic and one order fixed by construction (parity/sampling.py is the caller).
//
// log_softmax: per row, m = the fixed-order row max, e_i = exp(x_i - m) (our exp), s = the
// fixed-tree row sum of e (fixed_math.h), out_i = (x_i - m) - log(s) (our log; s >= 1).
//
// kept (the top-k / top-p set of a row of temperature-scaled logits): top-k keeps every logit not
// below the k-th largest value (an order statistic: ties at the k-th value all stay). Top-p then
// orders the kept tokens by (logit descending, token id ascending) — a strict total order, so
// the order is unique whatever sort algorithm produced it — and keeps the shortest prefix whose
// probability reaches p: token j of the order stays iff the sum of the probabilities before it,
// accumulated in float64 left to right from 0, is < p. Probabilities are q_i = e_i / s in fp32
// over the top-k-kept row (e and s as in log_softmax). The first token always stays.
//
// sample: Gumbel-max over a row of (processed) log-probs, token = the lowest id with the largest
// lp_i - log(-log(u_i)), -inf entries never chosen. u_i comes from Philox 4x32-10 (Salmon et al.,
// SC'11; the Random123 constants), a counter-based generator: block j = i / 4 of a row is
// philox(counter = (j, position low, position high, 0), key = the request's 64-bit key), word
// i % 4 of it, as u = (w >> 9 + 0.5) 2^-23, in (0, 1) exactly. The token is therefore a pure
// function of (request key, position, the row's log-probs): no generator state, no dependence on
// the batch, the schedule, the thread or the code path.
//
// Every row runs on its own (rows are split between threads, a row never is); each op has an
// AVX-512, an AVX2 and a scalar loop over the same always-inlined code, all under the IEEE
// default FP environment (fixed_math.h). For a GPU port: one block per row, the same fixed lane
// tree for max and sum, a sort by (value, index), a sequential (or fixed-tree) fp64 prefix sum,
// and Philox 4x32-10 per 4 elements. Registered as torch.ops.kimi_parity.{log_softmax,
// log_softmax_on, kept, kept_on, sample, sample_on, philox}.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "fixed_math.h"
#include "isa.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace kimi_parity::fixed;
using kimi_parity::cpu_has;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// Philox 4x32-10: ten rounds of two 32x32 -> 64-bit multiplies and xors, the key bumped by the
// Weyl constants between rounds. Integer arithmetic only: the same words on every path.

KP_INLINE void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c[2];
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = static_cast<uint32_t>(p1);
    c[2] = n2;
    c[3] = static_cast<uint32_t>(p0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// ---------------------------------------------------------------------------------------------
// Row bodies, always inlined into each ISA's loop.

KP_INLINE void log_softmax_row(const float* x, float* out, int64_t n) {
  const float m = row_max_body(x, n);
  for (int64_t i = 0; i < n; ++i) out[i] = exp_fixed(x[i] - m);  // out holds e until the end
  const float s = row_sum_body(out, n);
  const float nan = from_bits(0x7fc00000u);
  if (!(s == s)) {  // a NaN or +inf logit, or a row of -inf only: torch gives NaN too
    for (int64_t i = 0; i < n; ++i) out[i] = nan;
    return;
  }
  const float log_s = log_fixed(s);
  for (int64_t i = 0; i < n; ++i) {
    const float y = (x[i] - m) - log_s;
    out[i] = y == y ? y : nan;
  }
}

// e: n floats of scratch; order: the row's candidate ids.
KP_INLINE void kept_row(const float* x, bool* kept, int64_t n, int64_t k, float p, float* e,
                        std::vector<int32_t>& order) {
  float kth = kNegInf;  // top-k off: every logit is >= -inf
  if (0 < k && k < n) {
    std::copy(x, x + n, e);
    std::nth_element(e, e + (k - 1), e + n, [](float a, float b) { return a > b; });
    kth = e[k - 1];
  }
  for (int64_t i = 0; i < n; ++i) kept[i] = !(x[i] < kth);
  if (!(p < 1.0f)) return;
  const float m = row_max_body(x, n);  // the largest logit is always kept
  for (int64_t i = 0; i < n; ++i) e[i] = kept[i] ? exp_fixed(x[i] - m) : 0.0f;
  const float s = row_sum_body(e, n);
  order.clear();
  for (int64_t i = 0; i < n; ++i)
    if (kept[i]) order.push_back(static_cast<int32_t>(i));
  const auto before = [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  const int64_t size = static_cast<int64_t>(order.size());
  const double target = static_cast<double>(p);
  double mass = 0.0;
  int64_t j = 0, sorted = std::min<int64_t>(size, 64);
  for (;;) {  // sort only as far as the cut: the first `sorted` of the unique order, then more
    std::partial_sort(order.begin(), order.begin() + sorted, order.end(), before);
    for (; j < sorted && mass < target; ++j) mass += static_cast<double>(e[order[j]] / s);
    if (mass >= target || sorted == size) break;
    sorted = std::min<int64_t>(size, sorted * 8);
  }
  for (int64_t t = j; t < size; ++t) kept[order[t]] = false;  // everything after the cut
}

// The Gumbel scores of one chunk of a row (elements base .. base + len, base a multiple of 4):
// the Philox words of its blocks, then lp_i - log(-log(u_i)) for every element (dropped ones
// too: their score is -inf), in plain loops the compiler vectorises on each path; the same
// per-element steps whatever the width.
constexpr int64_t kChunk = 1024;

KP_INLINE void chunk_scores(const float* lp, int64_t base, int64_t len, uint32_t k0, uint32_t k1,
                            uint64_t position, uint32_t* w, float* score) {
  const int64_t blocks = (len + 3) / 4;
  const uint32_t pos_lo = static_cast<uint32_t>(position), pos_hi = static_cast<uint32_t>(position >> 32);
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t c[4] = {static_cast<uint32_t>(base / 4 + b), pos_lo, pos_hi, 0u};
    philox4x32_10(c, k0, k1);
    for (int l = 0; l < 4; ++l) w[4 * b + l] = c[l];
  }
  for (int64_t i = 0; i < len; ++i) {
    // (2m + 1) 2^-24 with m < 2^23: exact in fp32, in [2^-24, 1 - 2^-24].
    const float u = static_cast<float>(2 * (w[i] >> 9) + 1) * 5.9604644775390625e-8f;
    const float v = lp[base + i];
    const float g = v - log_fixed(-log_fixed(u));  // lp + Gumbel noise
    score[i] = v > kNegInf ? g : kNegInf;          // dropped (-inf) or NaN: never sampled
  }
}

// w: kChunk words, score: kChunk floats of scratch.
KP_INLINE int64_t sample_row(const float* lp, int64_t n, uint64_t key, uint64_t position, uint32_t* w,
                             float* score) {
  const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  float best = kNegInf;
  int64_t token = -1;
  for (int64_t base = 0; base < n; base += kChunk) {
    const int64_t len = std::min(kChunk, n - base);
    chunk_scores(lp, base, len, k0, k1, position, w, score);
    for (int64_t i = 0; i < len; ++i)
      if (score[i] > best) {  // strict: the lowest id wins a tie; -inf never wins
        best = score[i];
        token = base + i;
      }
  }
  return token;
}

// ---------------------------------------------------------------------------------------------
// One loop per ISA over a range of rows; the bodies are the same inlined code.

#define KP_ISA_LOOPS(NAME, PARAMS, CALL)                                                        \
  __attribute__((target("avx512f"))) void NAME##_avx512 PARAMS { CALL; }                        \
  __attribute__((target("avx2"))) void NAME##_avx2 PARAMS { CALL; }                             \
  __attribute__((optimize("no-tree-vectorize"))) void NAME##_scalar PARAMS { CALL; }

KP_ISA_LOOPS(log_softmax_rows, (const float* x, float* out, int64_t rows, int64_t n),
             for (int64_t r = 0; r < rows; ++r) log_softmax_row(x + r * n, out + r * n, n))

KP_ISA_LOOPS(kept_rows,
             (const float* x, bool* kept, int64_t rows, int64_t n, const int64_t* k, const float* p),
             std::vector<float> e(n); std::vector<int32_t> order;
             for (int64_t r = 0; r < rows; ++r)
                 kept_row(x + r * n, kept + r * n, n, k[r], p[r], e.data(), order))

KP_ISA_LOOPS(sample_rows,
             (const float* lp, int64_t* out, int64_t rows, int64_t n, const int64_t* keys,
              const int64_t* positions),
             uint32_t w[kChunk]; float score[kChunk];
             for (int64_t r = 0; r < rows; ++r) out[r] = sample_row(
                 lp + r * n, n, static_cast<uint64_t>(keys[r]), static_cast<uint64_t>(positions[r]), w, score))

template <typename Fn>
Fn pick(const std::string& isa, Fn avx512, Fn avx2, Fn scalar) {
  TORCH_CHECK(cpu_has(isa), "kimi_parity: this CPU cannot run the ", isa, " kernels");
  return kimi_parity::avx512_kernels(isa) ? avx512 : isa == "avx2" ? avx2 : scalar;
}

at::Tensor rows_fp32(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), "kimi_parity.", op, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "kimi_parity.", op, ": fp32 or bf16 only, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "kimi_parity.", op, ": needs at least one dim");
  return x.to(at::kFloat).contiguous();  // bf16 -> fp32 is exact
}

at::Tensor per_row(const at::Tensor& t, int64_t rows, at::ScalarType type, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == 1 && t.size(0) == rows,
              "kimi_parity: ", what, " must be a CPU ", type, " tensor of ", rows, " rows, got ",
              t.scalar_type(), " ", t.sizes());
  return t.contiguous();
}

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(n, 1)); }

// fp32 log-softmax over the last dim on the `isa` code path -> fp32, x's shape.
at::Tensor log_softmax_on(const at::Tensor& x_in, const std::string& isa) {
  auto f = pick(isa, &log_softmax_rows_avx512, &log_softmax_rows_avx2, &log_softmax_rows_scalar);
  const at::Tensor x = rows_fp32(x_in, "log_softmax");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    const DefaultFpEnv env;
    f(in + begin * n, o + begin * n, end - begin, n);
  });
  return out;
}

at::Tensor log_softmax(const at::Tensor& x) { return log_softmax_on(x, kimi_parity::current_isa()); }

// x [N, V] scaled logits, top_k int64 [N] (on iff 0 < k < V), top_p fp32 [N] (on iff < 1) ->
// bool [N, V], true where the token stays.
at::Tensor kept_on(const at::Tensor& x_in, const at::Tensor& top_k, const at::Tensor& top_p,
                   const std::string& isa) {
  auto f = pick(isa, &kept_rows_avx512, &kept_rows_avx2, &kept_rows_scalar);
  TORCH_CHECK(x_in.dim() == 2, "kimi_parity.kept: logits must be [rows, vocab], got ", x_in.sizes());
  const at::Tensor x = rows_fp32(x_in, "kept");
  TORCH_CHECK(!x.isnan().any().item<bool>(), "kimi_parity.kept: NaN in the logits");
  const int64_t rows = x.size(0), n = x.size(1);
  const at::Tensor k = per_row(top_k, rows, at::kLong, "top_k");
  const at::Tensor p = per_row(top_p, rows, at::kFloat, "top_p");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBool));
  const float* in = x.data_ptr<float>();
  bool* o = out.data_ptr<bool>();
  const int64_t* kp = k.data_ptr<int64_t>();
  const float* pp = p.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    const DefaultFpEnv env;
    f(in + begin * n, o + begin * n, end - begin, n, kp + begin, pp + begin);
  });
  return out;
}

at::Tensor kept(const at::Tensor& x, const at::Tensor& top_k, const at::Tensor& top_p) {
  return kept_on(x, top_k, top_p, kimi_parity::current_isa());
}

// logprobs [N, V], keys int64 [N] (a request's 64-bit key, two's complement), positions int64
// [N] -> int64 [N] sampled token ids.
at::Tensor sample_on(const at::Tensor& lp_in, const at::Tensor& keys, const at::Tensor& positions,
                     const std::string& isa) {
  auto f = pick(isa, &sample_rows_avx512, &sample_rows_avx2, &sample_rows_scalar);
  TORCH_CHECK(lp_in.dim() == 2, "kimi_parity.sample: log-probs must be [rows, vocab], got ", lp_in.sizes());
  const at::Tensor lp = rows_fp32(lp_in, "sample");
  const int64_t rows = lp.size(0), n = lp.size(1);
  const at::Tensor k = per_row(keys, rows, at::kLong, "keys");
  const at::Tensor pos = per_row(positions, rows, at::kLong, "positions");
  at::Tensor out = at::empty({rows}, lp.options().dtype(at::kLong));
  const float* in = lp.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t* kp = k.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    const DefaultFpEnv env;
    f(in + begin * n, o + begin, end - begin, n, kp + begin, pp + begin);
  });
  TORCH_CHECK(rows == 0 || out.min().item<int64_t>() >= 0,
              "kimi_parity.sample: a row has no finite log-prob to sample");
  return out;
}

at::Tensor sample(const at::Tensor& lp, const at::Tensor& keys, const at::Tensor& positions) {
  return sample_on(lp, keys, positions, kimi_parity::current_isa());
}

// One Philox 4x32-10 block (for tests against the published known-answer vectors).
std::vector<int64_t> philox(const std::vector<int64_t>& counter, const std::vector<int64_t>& key) {
  TORCH_CHECK(counter.size() == 4 && key.size() == 2, "kimi_parity.philox: 4 counter and 2 key words");
  uint32_t c[4];
  for (int i = 0; i < 4; ++i) c[i] = static_cast<uint32_t>(counter[i]);
  philox4x32_10(c, static_cast<uint32_t>(key[0]), static_cast<uint32_t>(key[1]));
  return {c[0], c[1], c[2], c[3]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kimi_parity, lib) {
  lib.def("log_softmax(Tensor x) -> Tensor", &log_softmax);
  lib.def("log_softmax_on(Tensor x, str isa) -> Tensor", &log_softmax_on);
  lib.def("kept(Tensor x, Tensor top_k, Tensor top_p) -> Tensor", &kept);
  lib.def("kept_on(Tensor x, Tensor top_k, Tensor top_p, str isa) -> Tensor", &kept_on);
  lib.def("sample(Tensor logprobs, Tensor keys, Tensor positions) -> Tensor", &sample);
  lib.def("sample_on(Tensor logprobs, Tensor keys, Tensor positions, str isa) -> Tensor", &sample_on);
  lib.def("philox(int[] counter, int[] key) -> int[]", &philox);
}
