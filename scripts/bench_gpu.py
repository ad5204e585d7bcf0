"""Measure the CUDA parity kernels on a GPU, in one run: the card's ceilings, whether stock
cuBLAS / torch reductions are row invariant, the parity GEMM and attention against cuBLAS and
torch's SDPA, and the Megatron trainer on CUDA with the parity kernels.

    python scripts/bench_gpu.py [--out bench_results/bench_gpu.json] [--skip-trainer]
    python scripts/bench_gpu.py --only rollout_speed --models DIR[,DIR...]   (stock vs parity engines)

Prints one line per measurement and writes all numbers as JSON (see docs/gpu.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parity import cuda, kernels  # noqa: E402

RESULTS: dict = {}


def log(section: str, key: str, value) -> None:
    RESULTS.setdefault(section, {})[key] = value
    print(f"[{section}] {key}: {value}", flush=True)


def bench(fn) -> float:
    """Median milliseconds (CUDA events, after warm-up)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def randn(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def environment() -> None:
    import triton

    p = torch.cuda.get_device_properties(0)
    log("env", "device", f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
    log("env", "torch", torch.__version__)
    log("env", "triton", triton.__version__)
    log("env", "cuda", torch.version.cuda)


def ceilings() -> None:
    x = torch.empty(2**30, dtype=torch.float32, device="cuda").normal_()  # 4 GiB
    y = torch.empty_like(x)
    ms = bench(lambda x=x, y=y: y.copy_(x))
    log("ceiling", "d2d_copy_TB/s", round(2 * x.numel() * 4 / ms / 1e9, 2))
    del x, y
    a, b = randn(8192, 8192), randn(8192, 8192, seed=1)
    ms = bench(lambda: a @ b)
    log("ceiling", "cublas_bf16_8192^3_TFLOP/s", round(2 * 8192**3 / ms / 1e9, 1))


def stock_invariance() -> None:
    """Which stock ops give a row the same bits alone and in a batch (why the kernels exist)."""
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).split(".")[-1]
        w = randn(4096, 4096, dtype=dtype, seed=1)
        x = randn(8192, 4096, dtype=dtype, seed=2)
        alone = F.linear(x[:1], w)[0]
        differs = [m for m in (2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 8192)
                   if not torch.equal(F.linear(x[:m], w)[0], alone)]
        log("stock", f"cublas_{name}_row0_differs_from_alone_at_M", differs)
        ours = kernels.linear(x[:1], w)[0]
        log("stock", f"parity_{name}_row0_differs_at_M",
            [m for m in (2, 3, 16, 128, 1024, 8192) if not torch.equal(kernels.linear(x[:m], w)[0], ours)])
        h = randn(8192, 4096, dtype=dtype, seed=3)
        s1 = h[:1].sum(-1)
        log("stock", f"torch_sum_{name}_row0_differs_at_rows",
            [m for m in (2, 16, 128, 1024, 8192) if not torch.equal(h[:m].sum(-1)[:1], s1)])
    for vocab in (512, 49152, 151936):
        lg = randn(4096, vocab, dtype=torch.bfloat16, seed=4)
        one = lg[:1].log_softmax(-1, dtype=torch.float32)
        log("stock", f"torch_log_softmax_V{vocab}_row0_differs_at_rows",
            [m for m in (2, 7, 64, 512, 4096) if not torch.equal(lg[:m].log_softmax(-1, dtype=torch.float32)[:1], one)])


LARGE_TILE = cuda.LinearConfig(128, 128, 64, 8, 3, "tf32")
# (N, K, row-parallel K-slices): the mid Llama's layers (hidden 1024, 16 / 4 heads of 64,
# intermediate 2816: qkv, o_proj, gate_up, down; row_splits = 4) and a Llama-3-8B-sized pair.
LINEAR_SHAPES = ((1536, 1024, 1), (1024, 1024, 4), (5632, 1024, 1), (1024, 2816, 4),
                 (4096, 4096, 1), (4096, 14336, 8))


def _fp32_partials_then_sum(x: torch.Tensor, w: torch.Tensor, splits: int) -> torch.Tensor:
    """The row-parallel path before tensor cores: each K-slice widened to fp32 and run on the
    fp32 ("ieee") GEMM, then summed in order (kept here as the baseline it replaced)."""
    k = x.shape[1] // splits
    wf = w.float()
    parts = torch.stack([cuda.linear_forward(x[:, s * k : (s + 1) * k].float(), wf[:, s * k : (s + 1) * k])
                         for s in range(splits)])
    acc = parts[0]
    for part in parts[1:]:
        acc = acc + part
    return acc.to(x.dtype)


def linear_speed() -> None:
    """bf16, cuBLAS vs the parity GEMM as the model runs it (the tile picked by M and the
    K-slices, cuda.linear_config; row-parallel layers' slices summed inside the kernel), and
    what each replaced (the 128 x 128 tile; fp32 partials summed by torch)."""
    for n, k, splits in LINEAR_SHAPES:
        w = randn(n, k, seed=1)
        for m in (1, 16, 32, 128, 256, 1024, 4096):
            x = randn(m, k, seed=2)
            flops = 2 * m * n * k
            t_cublas = bench(lambda x=x, w=w: F.linear(x, w))
            t_ours = bench(lambda x=x, w=w, s=splits: cuda.linear_forward(x, w, k_splits=s))
            row = {"cublas_ms": round(t_cublas, 4), "parity_ms": round(t_ours, 4),
                   "parity_TFLOP/s": round(flops / t_ours / 1e9, 1),
                   "cublas_over_parity": round(t_cublas / t_ours, 3)}
            if splits > 1:
                t_old = bench(lambda x=x, w=w, s=splits: _fp32_partials_then_sum(x, w, s))
                row["before_fp32_slices_ms"] = round(t_old, 4)
            elif m <= cuda.MID_M:
                t_old = bench(lambda x=x, w=w: cuda.linear_forward(x, w, LARGE_TILE))
                row["before_128x128_tile_ms"] = round(t_old, 4)
            ref = x.double() @ w.double().t()
            got = cuda.linear_forward(x, w, k_splits=splits).double()
            row["rel_err_vs_fp64"] = f"{((got - ref).norm() / ref.norm()).item():.2e}"
            log("linear_bf16", f"M={m} N={n} K={k} splits={splits}", row)
    w, x = randn(4096, 4096, dtype=torch.float32, seed=1), randn(4096, 4096, dtype=torch.float32)
    t_c = bench(lambda: F.linear(x, w))
    t_p = bench(lambda: cuda.linear_forward(x, w))
    log("linear_fp32", "M=N=K=4096", {"cublas_ms": round(t_c, 3), "parity_ms": round(t_p, 3),
                                       "parity_TFLOP/s": round(2 * 4096**3 / t_p / 1e9, 1)})


def paged_decode_speed() -> None:
    """Decode attention as the rollout runs it: the paged kernel over vLLM-style block tables
    (page 16, pages scattered), against the gather + contiguous kernel it replaced and SDPA."""
    hkv, g, page = 4, 4, 16
    for d, seqs, ctx in ((64, 32, 256), (64, 32, 2048), (128, 64, 2048)):
        hq = hkv * g
        pages_per = ctx // page
        n_pages = seqs * pages_per + 1
        cache = randn(n_pages * page, 2, hkv, d, seed=3)
        perm = torch.randperm(n_pages - 1, device="cuda") + 1
        bt = perm[: seqs * pages_per].view(seqs, pages_per).to(torch.int32)
        q = randn(seqs, hq, d, seed=4)
        qsl = torch.arange(seqs + 1, dtype=torch.int32, device="cuda")
        seq_lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
        tiles = cuda.paged_tile_plan(qsl.cpu(), cuda.attention_config(d, q.dtype).block_q).cuda()
        out = torch.empty_like(q)
        scale = d**-0.5
        paged = functools.partial(cuda.paged_attention_forward, q, cache, bt, page, qsl, seq_lens, tiles, scale, out)
        t_paged = bench(paged)
        pos = torch.arange(ctx, device="cuda")
        slots = (bt[:, pos // page].long() * page + pos % page)
        seq, qpos = torch.arange(seqs, device="cuda"), torch.full((seqs,), ctx - 1, device="cuda")

        def gathered(q=q, cache=cache, slots=slots, seq=seq, qpos=qpos, scale=scale):
            ctx_kv = cache[slots]
            return cuda.attention_forward(q, ctx_kv[:, :, 0], ctx_kv[:, :, 1], seq, qpos, scale)

        t_gather = bench(gathered)
        same = torch.equal(gathered(), paged())
        kk = cache[slots][:, :, 0].transpose(1, 2).repeat_interleave(g, 1)
        vv = cache[slots][:, :, 1].transpose(1, 2).repeat_interleave(g, 1)
        t_sdpa = bench(functools.partial(F.scaled_dot_product_attention, q.unsqueeze(2), kk, vv))
        log("paged_decode", f"D={d} seqs={seqs} ctx={ctx} Hq={hq} Hkv={hkv}",
            {"paged_ms": round(t_paged, 4), "gather_then_contiguous_ms": round(t_gather, 4),
             "sdpa_contiguous_ms": round(t_sdpa, 4), "paged_equals_gathered": same})


def attention_speed() -> None:
    hq, hkv, d = 32, 8, 128
    variants = {f"block_q={b}": cuda.AttentionConfig(b, 4 if b <= 64 else 8, 2, "tf32") for b in (16, 32, 64, 128)}
    for b, t in ((4, 2048), (1, 8192)):
        q, k, v = randn(b * t, hq, d), randn(b, t, hkv, d, seed=1), randn(b, t, hkv, d, seed=2)
        seq, pos = torch.arange(b).repeat_interleave(t), torch.arange(t).repeat(b)
        scale = kernels.attention_scale(d)
        qs = q.view(b, t, hq, d).transpose(1, 2)
        ks, vs = k.transpose(1, 2), v.transpose(1, 2)
        t_sdpa = bench(lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
        flops = 4 * b * hq * d * t * t / 2
        row = {"sdpa_causal_ms": round(t_sdpa, 3), "sdpa_TFLOP/s": round(flops / t_sdpa / 1e9, 1)}
        for name, cfg in variants.items():
            ms = bench(lambda q=q, k=k, v=v, seq=seq, pos=pos, cfg=cfg, scale=scale: cuda.attention_forward(q, k, v, seq, pos, scale, cfg))
            row[name] = {"ms": round(ms, 3), "TFLOP/s": round(flops / ms / 1e9, 1), "vs_sdpa": round(ms / t_sdpa, 2)}
        ms = bench(lambda q=q, seq=seq: cuda.attention_tile_plan(seq, 64))
        row["tile_plan_cpu_ms"] = round(ms, 3)
        out = cuda.attention_forward(q, k, v, seq, pos, scale)
        ref = F.scaled_dot_product_attention(qs.float(), ks.float(), vs.float(), is_causal=True, enable_gqa=True)
        row["max_abs_err_vs_fp32_sdpa"] = f"{(out.float().view(b, t, hq, d).transpose(1, 2) - ref).abs().max().item():.2e}"
        log("attention_train_bf16", f"B={b} T={t} Hq={hq} Hkv={hkv} D={d}", row)
    for r, length in ((64, 2048), (8, 8192)):
        k, v = randn(r, length, hkv, d, seed=1), randn(r, length, hkv, d, seed=2)
        q = randn(r, hq, d)
        seq, pos = torch.arange(r), torch.full((r,), length - 1)
        scale = kernels.attention_scale(d)
        qv, kt, vt = q.view(r, hq, 1, d), k.transpose(1, 2), v.transpose(1, 2)
        t_sdpa = bench(lambda qv=qv, kt=kt, vt=vt: F.scaled_dot_product_attention(qv, kt, vt, enable_gqa=True))
        t_ours = bench(lambda q=q, k=k, v=v, seq=seq, pos=pos, scale=scale: cuda.attention_forward(q, k, v, seq, pos, scale))
        gb = 2 * k.numel() * 2 / 1e9
        log("attention_decode_bf16", f"R={r} L={length}", {
            "sdpa_ms": round(t_sdpa, 4), "parity_ms": round(t_ours, 4),
            "parity_GB/s": round(gb / t_ours * 1e3, 1), "vs_sdpa": round(t_ours / t_sdpa, 2)})


def norm_speed() -> None:
    x, w = randn(16384, 4096), randn(4096, seed=1)
    t_ours = bench(lambda: kernels.rms_norm(x, w, 1e-6))

    def stock():
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    log("rms_norm_bf16", "16384x4096", {"parity_ms": round(t_ours, 4), "torch_ms": round(bench(stock), 4)})


def stress() -> None:
    """Invariance at volume: every row / every position, counted (the tests sample a few)."""
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).split(".")[-1]
        for hq, hkv, d, length in ((4, 2, 32, 1000), (32, 8, 128, 600)):
            q = randn(length, hq, d, dtype=dtype)
            k, v = randn(1, length, hkv, d, dtype=dtype, seed=1), randn(1, length, hkv, d, dtype=dtype, seed=2)
            pad = torch.full((1, 64, hkv, d), float("nan"), dtype=dtype, device="cuda")
            kd, vd = torch.cat([k, pad], 1), torch.cat([v, pad], 1)
            scale = kernels.attention_scale(d)
            full = kernels.attention(q, k, v, torch.zeros(length, dtype=torch.long), torch.arange(length), scale)
            bad_rows = [t for t in range(length) if not torch.equal(
                kernels.attention(q[t : t + 1], kd, vd, torch.zeros(1, dtype=torch.long), torch.tensor([t]), scale)[0], full[t])]
            log("stress", f"attention_{name}_Hq{hq}_Hkv{hkv}_D{d}_decode_vs_whole_rows_differing",
                f"{len(bad_rows)} of {length} {bad_rows[:10]}")
        for n, kk in ((512, 128), (768, 256), (4096, 4096)):
            x, w = randn(2048, kk, dtype=dtype), randn(n, kk, dtype=dtype, seed=1)
            full = kernels.linear(x, w)
            bad = [i for i in range(x.shape[0]) if not torch.equal(kernels.linear(x[i : i + 1], w)[0], full[i])]
            log("stress", f"linear_{name}_N{n}_K{kk}_alone_vs_2048_rows_differing", f"{len(bad)} of 2048 {bad[:10]}")
        x, w = randn(2048, 128, dtype=dtype), randn(128, dtype=dtype, seed=1)
        full = kernels.rms_norm(x, w, 1e-6)
        bad = [i for i in range(2048) if not torch.equal(kernels.rms_norm(x[i : i + 1], w, 1e-6)[0], full[i])]
        log("stress", f"rms_norm_{name}_H128_rows_differing", f"{len(bad)} of 2048")


def trainer() -> None:
    """The Megatron trainer on CUDA: parity model on the GPU, batch/prefix invariance, training."""
    import tempfile

    from rl.models import init_model
    from trainer.megatron.logprobs import sequence_logprobs
    from trainer.megatron.model import load_model
    from trainer.megatron.patches import init_megatron

    init_megatron()
    tmp = Path(tempfile.mkdtemp())
    for arch, dtype, preset in (("llama", "fp32", "tiny"), ("qwen3", "bf16", "tiny"), ("qwen3", "bf16", "small")):
        path = init_model(arch=arch, preset=preset, seed=0, out_dir=tmp / f"{arch}-{preset}-{dtype}", dtype=dtype)
        model = load_model(path, dtype, parity=True).eval()
        devices = sorted({str(p.device) for p in model.parameters()})
        g = torch.Generator().manual_seed(2)
        seqs = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (70, 9, 33, 2, 300, 129, 64, 65)]
        with torch.no_grad():
            t0 = time.perf_counter()
            alone = [sequence_logprobs(model, [s], [1])[0] for s in seqs]
            t_alone = time.perf_counter() - t0
            batched = sequence_logprobs(model, seqs, [1] * len(seqs), batch_size=8)
            batched3 = sequence_logprobs(model, seqs, [1] * len(seqs), batch_size=3)
            prefix = sequence_logprobs(model, [seqs[4][:200]], [1])[0]
        same = all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(alone, batched, batched3, strict=True))
        model.train()
        ids = torch.randint(0, 400, (2, 40), generator=torch.Generator().manual_seed(3)).tolist()
        logp = sequence_logprobs(model, ids, [1, 1])
        torch.stack(logp).mean().backward()
        finite = all(p.grad is not None and torch.isfinite(p.grad).all().item() for p in model.parameters())
        log("trainer_cuda", f"{arch}-{preset}-{dtype}", {
            "param_devices": devices, "alone==batch8==batch3": same,
            "prefix==whole": torch.equal(prefix, alone[4][:199]),
            "grads_finite": finite, "score_8_seqs_alone_s": round(t_alone, 3),
            "mean_logprob": round(torch.cat(alone).mean().item(), 4)})
        del model
        torch.cuda.empty_cache()


# Engines of rollout_speed: (name, parity, eager). vLLM's default mode for stock (torch.compile
# and CUDA graphs); the parity model eager, and with graphs asked for (what vLLM then captures
# of it is in its log: the parity attention backend declares no CUDA-graph support).
ROLLOUT_ENGINES = (("stock, graphs", False, False), ("parity, eager", True, True),
                   ("parity, graphs asked", True, False))


def rollout_speed(model_dirs: list[str], batch: int = 32, max_tokens: int = 128, repeats: int = 5) -> None:
    """Decode tokens/s of whole rollout engines, stock vs parity, side by side in one run:
    `batch` random 16-token prompts, `max_tokens` each (EOS ignored), after a warm-up call;
    the median of `repeats` generate calls (one call is under a second: single calls of two
    runs on one H100 differed up to 3x)."""
    from rollout.engine import RolloutEngine

    for model_dir in model_dirs:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, 500, (batch, 16), generator=g).tolist()
        row = {}
        for name, parity, eager in ROLLOUT_ENGINES:
            t0 = time.perf_counter()
            with RolloutEngine(model_dir, dtype="bf16", parity=parity, enforce_eager=eager,
                               max_model_len=16 + max_tokens + 1, max_num_seqs=batch) as engine:
                start = time.perf_counter() - t0
                engine.generate(prompts, max_tokens=8, ignore_eos=True)
                rates = []
                for _ in range(repeats):
                    t1 = time.perf_counter()
                    out = engine.generate(prompts, max_tokens=max_tokens, ignore_eos=True)
                    rates.append(sum(len(c.token_ids) for c in out) / (time.perf_counter() - t1))
            row[name] = {"tokens_per_s": round(sorted(rates)[len(rates) // 2], 1),
                         "all_tokens_per_s": [round(r, 1) for r in rates], "engine_start_s": round(start, 1)}
            log("rollout_speed", f"{Path(model_dir).name} {name}", row[name])
        stock = row[ROLLOUT_ENGINES[0][0]]["tokens_per_s"]
        for name, _, _ in ROLLOUT_ENGINES[1:]:
            log("rollout_speed", f"{Path(model_dir).name} {name} / stock",
                round(row[name]["tokens_per_s"] / stock, 3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "bench_gpu.json"))
    ap.add_argument("--skip-trainer", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated sections")
    ap.add_argument("--models", default="", help="rollout_speed: comma-separated model dirs"
                    " (the section runs only when given; it needs vLLM's CUDA build)")
    args = ap.parse_args()
    sections = [environment, ceilings, stock_invariance, linear_speed, paged_decode_speed, attention_speed, norm_speed, stress]
    if not args.skip_trainer:
        sections.append(trainer)
    if args.models:
        sections.append(lambda: rollout_speed(args.models.split(",")))
        sections[-1].__name__ = "rollout_speed"
    only = set(filter(None, args.only.split(",")))
    for fn in sections:
        if only and fn.__name__ not in only:
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # keep going: one failing section must not cost the others
            log(fn.__name__, "error", f"{type(e).__name__}: {e}")
        log("seconds", fn.__name__, round(time.perf_counter() - t, 1))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(RESULTS, indent=1))
    print("wrote", args.out, "pid", os.getpid())


if __name__ == "__main__":
    main()
