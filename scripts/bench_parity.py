"""Benchmark the parity layer's cost: stock and parity measured interleaved in one run.

Rollout: tokens/s of vLLM with the parity model (eager) vs stock vLLM (same weights, prompts,
batch, max tokens) in eager mode and in vLLM's default compiled mode. All engines are started
first and timed in turn, repeat by repeat (stock, stock default, parity, stock, ...), so each
sees the same machine; the median of the repeats counts. EOS is ignored, so every engine
generates the same token counts (checked). `--shape grpo` samples the way a GRPO step does:
8 prompts x 8 samples each (the same prompt 8 times; parity engines hit the prefix cache).
Trainer: forward+backward seconds of the parity Megatron model vs stock Megatron (same
weights and batch), interleaved the same way.

kimi-mini (`--models kimi`) has no stock engine on either side, so its baseline is the same
model with the invariant kernels swapped for plain torch ops (KIMI_RL_INVARIANT_KERNELS=0:
F.linear, unchunked pointwise, dense attention; the KDA recurrence and MoE loop stay). Its rows
also give the cache bytes per token (MLA latent + RoPE key + index key) and the KDA state per
request, next to a dense-attention layer of the same width.

The GEMM table puts the parity GEMM, with its weight prepacked once as the models run it
(rollout.sync.PackedWeight, the trainer's frozen packs), next to MKL/oneDNN (F.linear) at
M = 1, 16, 256, 4096.

The JSON (default: docs/bench/parity-<models>-<shape>-<commit>.json) names the commit, the
CPU model, its ISA flags, the kernels' code path, the 1-minute load average before and after,
and `--label` (e.g. "smoke, loaded machine"); scripts/bench_table.py turns every JSON there
into the table in docs/benchmarks.md.

    python scripts/bench_parity.py [--models tiny,smollm2,kimi|none] [--shape batch|grpo]
        [--repeats 5] [--gemm NxK|none] [--label TEXT] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
GRPO_PROMPTS, GRPO_SAMPLES = 8, 8


def ensure_models(names: list[str], cache: Path) -> dict[str, tuple[Path, str]]:
    from rl.models import import_smollm2, init_model

    out = {}
    for name in names:
        path = cache / name
        if name == "tiny":
            if not (path / "config.json").exists():
                init_model(arch="llama", preset="tiny", seed=0, out_dir=path, dtype="fp32")
            out[name] = (path, "fp32")
        elif name == "kimi":
            if not (path / "config.json").exists():
                init_model(arch="kimi-mini", preset="tiny", seed=0, out_dir=path, dtype="fp32")
            out[name] = (path, "fp32")
        elif name == "smollm2":
            if not (path / "config.json").exists():
                import_smollm2(path, dtype="bf16")
            out[name] = (path, "bf16")
        else:
            raise SystemExit(f"unknown model {name!r} (tiny, smollm2, kimi)")
    return out


@contextmanager
def invariant_kernels(on: bool):
    """kimi-mini's baseline: the environment variable reaches engine processes started inside
    the block; the module flag covers this process (the trainer)."""
    from parity import kernels

    old_env, old_flag = os.environ.get("KIMI_RL_INVARIANT_KERNELS"), kernels.INVARIANT
    os.environ["KIMI_RL_INVARIANT_KERNELS"] = "1" if on else "0"
    kernels.INVARIANT = on
    try:
        yield
    finally:
        kernels.INVARIANT = old_flag
        if old_env is None:
            os.environ.pop("KIMI_RL_INVARIANT_KERNELS")
        else:
            os.environ["KIMI_RL_INVARIANT_KERNELS"] = old_env


def kimi_cache_bytes(path: Path, dtype: str) -> dict:
    """What kimi-mini keeps per token and per request, next to a dense MHA layer of its width."""
    from parity.model_spec import KimiSpec

    spec = KimiSpec.from_dir(path)
    elem = 4 if dtype == "fp32" else 2
    kda = sum(t == "kda" for t in spec.layer_types)
    mla = spec.num_layers - kda
    kda_state = ((spec.kda_conv_size - 1) * spec.kda_conv_channels + spec.kda_num_heads * spec.kda_head_dim**2) * 4
    return {
        "mla_bytes_per_token_per_layer": spec.mla_cache_width * elem,
        "dense_bytes_per_token_per_layer": 2 * spec.hidden_size * elem,
        "kda_state_bytes_per_request_per_layer": kda_state,
        "model_bytes_per_token": mla * spec.mla_cache_width * elem,
        "model_bytes_per_request": kda * kda_state,
        "dense_model_bytes_per_token": spec.num_layers * 2 * spec.hidden_size * elem,
        "layers": {"kda": kda, "mla": mla},
    }


def machine() -> dict:
    """The CPU model, its ISA flags (those the kernels or MKL may use), the parity kernels' code
    path, the thread count and the commit: what a number is only comparable under."""
    from parity.native import ops

    cpu, flags = platform.processor(), set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and cpu in ("", "x86_64"):
            cpu = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return {"commit": commit + ("-dirty" if dirty else ""), "cpu": cpu, "cpus": os.cpu_count(),
            "isa_flags": [f for f in ISA_FLAGS if f in flags], "kernel_isa": ops().isa(),
            "threads": torch.get_num_threads()}


def make_prompts(shape: str, batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    count = GRPO_PROMPTS if shape == "grpo" else batch
    prompts = [torch.randint(10, 400, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 64, (count,), generator=g)]
    if shape == "grpo":  # each prompt sampled GRPO_SAMPLES times in one batch, as a GRPO step does
        prompts = [p for p in prompts for _ in range(GRPO_SAMPLES)]
    return prompts


def start_engines(name: str, path: Path, dtype: str, batch: int) -> dict:
    """The engines one model's rows compare, all started before any is timed."""
    from rollout.engine import RolloutEngine

    def engine(parity: bool, eager: bool = True):
        return RolloutEngine(str(path), dtype=dtype, parity=parity, seed=0, max_num_seqs=batch,
                             max_model_len=256, enforce_eager=eager)

    engines = {}
    if name == "kimi":
        with invariant_kernels(False):  # read by the engine's processes as they start
            engines["stock"] = engine(True)
    else:
        engines["stock"] = engine(False)
        engines["stock_default"] = engine(False, eager=False)  # vLLM's default (compiled) mode
    engines["parity"] = engine(True)
    return engines


def bench_rollout(engines: dict, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict[str, list[float]]:
    """tokens/s of every engine, repeat by repeat in turn (interleaved)."""
    for engine in engines.values():
        engine.generate(prompts, max_tokens=4, ignore_eos=True)  # warm-up (sampler compile, allocations)
    rates: dict[str, list[float]] = {key: [] for key in engines}
    for _ in range(repeats):
        for key, engine in engines.items():
            t = time.perf_counter()
            # EOS ignored: stock and parity engines sample different tokens, and a sequence
            # that stops early would shrink one engine's batch and not the other's.
            done = engine.generate(prompts, max_tokens=max_tokens, ignore_eos=True)
            elapsed = time.perf_counter() - t
            tokens = sum(len(c.token_ids) for c in done)
            if tokens != len(prompts) * max_tokens:
                raise SystemExit(f"{key}: {tokens} tokens generated, expected {len(prompts) * max_tokens}")
            rates[key].append(tokens / elapsed)
    return rates


def bench_trainer(name: str, path: Path, dtype: str, batch: int, seq: int, repeats: int) -> dict[str, list[float]]:
    """forward+backward seconds of stock and parity Megatron, repeat by repeat in turn."""
    from contextlib import nullcontext

    from trainer.megatron.logprobs import sequence_logprobs
    from trainer.megatron.model import load_model

    parity_model = load_model(path, dtype, parity=True).train()
    if name == "kimi":  # the same model with the invariant kernels off
        sides = {"stock": (parity_model, lambda: invariant_kernels(False)), "parity": (parity_model, nullcontext)}
    else:
        sides = {"stock": (load_model(path, dtype, parity=False).train(), nullcontext),
                 "parity": (parity_model, nullcontext)}
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(10, 400, (batch, seq), generator=g).tolist()
    times: dict[str, list[float]] = {key: [] for key in sides}
    for i in range(repeats + 1):
        for key, (model, context) in sides.items():
            with context():
                t = time.perf_counter()
                logp = sequence_logprobs(model, seqs, [1] * batch, batch_size=batch)
                torch.stack(logp).mean().backward()
                model.zero_grad(set_to_none=True)
                if i:  # the first round is warm-up
                    times[key].append(time.perf_counter() - t)
    return times


GEMM_ROWS = (1, 16, 256, 4096)


def bench_gemm(n: int, k: int, dtype: torch.dtype, threads: int, repeats: int) -> list[dict]:
    """The parity GEMM with its weight packed once (as the engines run it: kernels.pack, then
    linear(packed=)) against MKL/oneDNN through F.linear, at M = GEMM_ROWS, interleaved batch by
    batch so that both see the same machine; the best batch of each counts (on a shared machine
    the median mostly measures neighbours), the median is recorded too. On a CPU with
    AVX512-BF16 a bf16 GEMM is also timed on the other of the two paths that compute its order,
    VDPBF16PS (avx512_bf16) and fp32 FMAs (avx512)."""
    import torch.nn.functional as F

    from parity import kernels, native

    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(dtype)
    packed = kernels.pack(w)
    rows = []
    other = {"avx512_bf16": "avx512", "avx512": "avx512_bf16"}.get(native.isa())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    with torch.no_grad():
        for m in GEMM_ROWS:
            x = torch.randn(m, k, generator=g).to(dtype)
            calls = max(3, 4096 // m)
            fns = [("mkl", F.linear), ("parity", lambda x, w: kernels.linear(x, w, packed=packed))]
            if dtype == torch.bfloat16 and other in native.cpu_isas():
                fns.append(("parity_other", lambda x, w, isa=other: native.ops().gemm_on(x, packed, n, isa, 1, True).to(dtype)))
            times: dict[str, list[float]] = {name: [] for name, _ in fns}
            for _ in range(repeats + 1):
                for name, fn in fns:
                    t = time.perf_counter()
                    for _ in range(calls):
                        fn(x, w)
                    times[name].append((time.perf_counter() - t) / calls)
            flops = 2 * m * n * k
            best = {key: flops / min(v[1:]) / 1e9 for key, v in times.items()}
            median = {key: flops / statistics.median(v[1:]) / 1e9 for key, v in times.items()}
            rows.append({"m": m, "n": n, "k": k, "dtype": str(dtype).removeprefix("torch."), "threads": threads,
                         "mkl_gflops": best["mkl"], "parity_gflops": best["parity"],
                         "ratio": best["parity"] / best["mkl"], "median_ratio": median["parity"] / median["mkl"],
                         "weight": "prepacked", "target": 0.7, "isa": native.isa(),
                         **({"other_isa": other, "parity_other_gflops": best["parity_other"]}
                            if "parity_other" in best else {})})
    torch.set_num_threads(before)
    return rows


def print_gemm(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="parity GEMM vs MKL (F.linear), GFLOP/s")
    for col in ("M", "N x K", "dtype", "threads", "MKL", "parity", "parity / MKL", "target", "path",
                "other path"):
        table.add_column(col, justify="right")
    for r in rows:
        fma = f"{r['other_isa']}: {r['parity_other_gflops']:.1f}" if "other_isa" in r else "-"
        table.add_row(str(r["m"]), f"{r['n']} x {r['k']}", r["dtype"], str(r["threads"]), f"{r['mkl_gflops']:.1f}",
                      f"{r['parity_gflops']:.1f}", f"{r['ratio']:.2f}", f">= {r['target']:.1f}", r["isa"], fma)
    Console().print(table)


def _row(name: str, dtype: str, what: str, baseline: str, runs: dict[str, list[float]], stock_key: str,
         higher_is_better: bool, target: float, **shape) -> dict:
    stock, parity = statistics.median(runs[stock_key]), statistics.median(runs["parity"])
    return {"model": name, "dtype": dtype, "what": what, "baseline": baseline, "stock": stock, "parity": parity,
            "slowdown": stock / parity if higher_is_better else parity / stock, "target": target,
            "stock_runs": runs[stock_key], "parity_runs": runs["parity"], **shape}


def run_models(models: dict[str, tuple[Path, str]], args: argparse.Namespace) -> list[dict]:
    results = []
    prompts = make_prompts(args.shape, args.batch)
    shape = {"shape": args.shape, "sequences": len(prompts), "max_tokens": args.max_tokens, "repeats": args.repeats}
    for name, (path, dtype) in models.items():
        engines = start_engines(name, path, dtype, len(prompts))
        try:
            rates = bench_rollout(engines, prompts, args.max_tokens, args.repeats)
        finally:
            for engine in engines.values():
                engine.close()
        results.append(_row(name, dtype, "rollout tokens/s", "invariant kernels off" if name == "kimi"
                            else "stock vLLM, eager", rates, "stock", True, 1.10, **shape))
        if "stock_default" in rates:
            results.append(_row(name, dtype, "rollout tokens/s vs default mode", "stock vLLM, default (compiled)",
                                rates, "stock_default", True, 1.10, **shape))
    if models and args.train_batch:
        from trainer.megatron.patches import init_megatron

        init_megatron()
    for name, (path, dtype) in models.items() if args.train_batch else ():
        times = bench_trainer(name, path, dtype, args.train_batch, args.train_seq, args.repeats)
        results.append(_row(name, dtype, "trainer fwd+bwd s", "invariant kernels off" if name == "kimi"
                            else "stock Megatron", times, "stock", False, 1.25,
                            batch=args.train_batch, seq=args.train_seq, repeats=args.repeats))
    return results


def print_results(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="parity layer cost (slowdown = parity time / stock time; medians, interleaved)")
    for col in ("model", "dtype", "measure", "shape", "stock", "parity", "slowdown", "target"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["model"], r["dtype"], r["what"], r.get("shape", ""), f"{r['stock']:.3f}", f"{r['parity']:.3f}",
                      f"{r['slowdown']:.2f}x", f"<= {r['target']:.2f}x")
    if results:
        Console().print(table)


def print_cache(cache: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    for name, c in cache.items():
        cache_table = Table(title=f"{name}: cache per token / state per request (bytes)")
        for col in ("", "kimi-mini", "dense attention, same width"):
            cache_table.add_column(col, justify="right")
        cache_table.add_row("per token, one attention layer", str(c["mla_bytes_per_token_per_layer"]),
                            str(c["dense_bytes_per_token_per_layer"]))
        cache_table.add_row("per token, whole model", str(c["model_bytes_per_token"]),
                            str(c["dense_model_bytes_per_token"]))
        cache_table.add_row("per request, KDA state (all KDA layers)", str(c["model_bytes_per_request"]), "0")
        Console().print(cache_table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2, kimi (or none)")
    ap.add_argument("--shape", choices=("batch", "grpo"), default="batch",
                    help=f"batch: --batch distinct prompts; grpo: {GRPO_PROMPTS} prompts x {GRPO_SAMPLES} samples")
    ap.add_argument("--gemm", default="1536x576", help="N x K of the GEMM table (SmolLM2's MLP up); 'none' skips it")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--train-batch", type=int, default=8, help="0 skips the trainer rows")
    ap.add_argument("--train-seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per side (medians; >= 5 for results)")
    ap.add_argument("--cache", default=str(ROOT / "models"))
    ap.add_argument("--label", default="", help='what the run is, e.g. "smoke, loaded machine"')
    ap.add_argument("--out", default=None, help="JSON path (default: docs/bench/parity-<models>-<shape>-<commit>.json)")
    args = ap.parse_args()

    load_before = os.getloadavg()[0]
    info = machine()
    gemm = []
    if args.gemm != "none":
        n, k = (int(v) for v in args.gemm.split("x"))
        gemm = [row for threads in sorted({1, torch.get_num_threads()}) for dtype in (torch.float32, torch.bfloat16)
                for row in bench_gemm(n, k, dtype, threads, max(args.repeats, 7))]
        print_gemm(gemm)
    names = [] if args.models == "none" else args.models.split(",")
    models = ensure_models(names, Path(args.cache))
    results = run_models(models, args)
    print_results(results)
    cache = {name: kimi_cache_bytes(path, dtype) for name, (path, dtype) in models.items() if name == "kimi"}
    print_cache(cache)
    out = Path(args.out) if args.out else ROOT / "docs" / "bench" / (
        f"parity-{'-'.join(names) or 'gemm'}-{args.shape}-{info['commit']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "label": args.label, "date": time.strftime("%Y-%m-%d", time.gmtime()), **info,
        # The machine's 1-minute load average before and after the run: > cpus means shared.
        "loadavg_1m": [load_before, os.getloadavg()[0]],
        "results": results, "gemm": gemm, "cache": cache,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
