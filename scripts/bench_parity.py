"""Benchmark the parity layer's cost, measured side by side in one run.

Rollout: tokens/s of vLLM with the parity model (eager) vs stock vLLM (same weights, prompts,
batch, max tokens) in eager mode and in vLLM's default compiled mode. Trainer: forward+backward seconds of the parity Megatron model
vs stock Megatron (same weights and batch). Prints a table and writes JSON.

kimi-mini (`--models kimi`) has no stock engine on either side, so its baseline is the same
model with the invariant kernels swapped for plain torch ops (KIMI_RL_INVARIANT_KERNELS=0:
F.linear, unchunked pointwise, dense attention; the KDA recurrence and MoE loop stay). Its rows
also give the cache bytes per token (MLA latent + RoPE key + index key) and the KDA state per
request, next to a dense-attention layer of the same width.

The GEMM table puts the parity GEMM next to MKL/oneDNN (F.linear) at M = 1, 16, 256, 4096.

    python scripts/bench_parity.py [--models tiny,smollm2,kimi|none] [--gemm NxK|none]
        [--out bench_results/bench_parity.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


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


def bench_rollout(
    path: Path, dtype: str, parity: bool, batch: int, max_tokens: int, repeats: int, eager: bool = True
) -> float:
    from rollout.engine import RolloutEngine

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 400, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 64, (batch,), generator=g)]
    with RolloutEngine(str(path), dtype=dtype, parity=parity, seed=0, max_num_seqs=batch,
                       max_model_len=256, enforce_eager=eager) as engine:
        engine.generate(prompts, max_tokens=4, ignore_eos=True)  # warm-up (sampler compile, allocations)
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            # EOS ignored: stock and parity engines sample different tokens, and a sequence
            # that stops early would shrink one engine's batch and not the other's.
            done = engine.generate(prompts, max_tokens=max_tokens, ignore_eos=True)
            rates.append(sum(len(c.token_ids) for c in done) / (time.perf_counter() - t))
    return statistics.median(rates)


def bench_trainer(path: Path, dtype: str, parity: bool, batch: int, seq: int, repeats: int) -> float:
    from trainer.megatron.logprobs import sequence_logprobs
    from trainer.megatron.model import load_model

    model = load_model(path, dtype, parity=parity).train()
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(10, 400, (batch, seq), generator=g).tolist()
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        logp = sequence_logprobs(model, seqs, [1] * batch, batch_size=batch)
        torch.stack(logp).mean().backward()
        model.zero_grad(set_to_none=True)
        if i:  # the first iteration is warm-up
            times.append(time.perf_counter() - t)
    return statistics.median(times)


GEMM_ROWS = (1, 16, 256, 4096)


def bench_gemm(n: int, k: int, dtype: torch.dtype, threads: int, repeats: int) -> list[dict]:
    """The parity GEMM (weights prepacked, as in the engines) against MKL/oneDNN through
    F.linear, at M = GEMM_ROWS, interleaved batch by batch so that both see the same machine;
    the best batch of each counts (on a shared machine the median mostly measures neighbours)."""
    import torch.nn.functional as F

    from parity import kernels

    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(dtype)
    rows = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    for m in GEMM_ROWS:
        x = torch.randn(m, k, generator=g).to(dtype)
        calls = max(3, 4096 // m)
        times = {"mkl": [], "parity": []}
        for _ in range(repeats + 1):
            for name, fn in (("mkl", F.linear), ("parity", kernels.linear)):
                t = time.perf_counter()
                for _ in range(calls):
                    fn(x, w)
                times[name].append((time.perf_counter() - t) / calls)
        flops = 2 * m * n * k
        mkl, ours = (flops / min(times[key][1:]) / 1e9 for key in ("mkl", "parity"))
        rows.append({"m": m, "n": n, "k": k, "dtype": str(dtype).removeprefix("torch."), "threads": threads,
                     "mkl_gflops": mkl, "parity_gflops": ours, "ratio": ours / mkl, "target": 0.7})
    torch.set_num_threads(before)
    return rows


def print_gemm(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="parity GEMM vs MKL (F.linear), GFLOP/s")
    for col in ("M", "N x K", "dtype", "threads", "MKL", "parity", "parity / MKL", "target"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["m"]), f"{r['n']} x {r['k']}", r["dtype"], str(r["threads"]), f"{r['mkl_gflops']:.1f}",
                      f"{r['parity_gflops']:.1f}", f"{r['ratio']:.2f}", f">= {r['target']:.1f}")
    Console().print(table)


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from trainer.megatron.patches import init_megatron

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2, kimi (or none)")
    ap.add_argument("--gemm", default="1536x576", help="N x K of the GEMM table (SmolLM2's MLP up); 'none' skips it")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default=str(ROOT / "models"))
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "bench_parity.json"))
    args = ap.parse_args()

    gemm = []
    if args.gemm != "none":
        n, k = (int(v) for v in args.gemm.split("x"))
        gemm = [row for threads in sorted({1, torch.get_num_threads()}) for dtype in (torch.float32, torch.bfloat16)
                for row in bench_gemm(n, k, dtype, threads, max(args.repeats, 7))]
        print_gemm(gemm)
    names = [] if args.models == "none" else args.models.split(",")
    models = ensure_models(names, Path(args.cache))
    results = []
    for name, (path, dtype) in models.items():
        if name == "kimi":
            with invariant_kernels(False):
                stock = bench_rollout(path, dtype, True, args.batch, args.max_tokens, args.repeats)
        else:
            stock = bench_rollout(path, dtype, False, args.batch, args.max_tokens, args.repeats)
            # vLLM's default mode (torch.compile + its CPU kernels), the other baseline users run.
            default = bench_rollout(path, dtype, False, args.batch, args.max_tokens, args.repeats, eager=False)
        parity = bench_rollout(path, dtype, True, args.batch, args.max_tokens, args.repeats)
        results.append({
            "model": name, "dtype": dtype, "what": "rollout tokens/s",
            "stock": stock, "parity": parity, "slowdown": stock / parity, "target": 1.10,
            "batch": args.batch, "max_tokens": args.max_tokens,
            "baseline": "invariant kernels off" if name == "kimi" else "stock vLLM, eager",
        })
        if name != "kimi":
            results.append({
                "model": name, "dtype": dtype, "what": "rollout tokens/s vs default mode",
                "stock": default, "parity": parity, "slowdown": default / parity, "target": 1.10,
                "batch": args.batch, "max_tokens": args.max_tokens, "baseline": "stock vLLM, default (compiled)",
            })
    if models:
        init_megatron()
    for name, (path, dtype) in models.items():
        if name == "kimi":
            with invariant_kernels(False):
                stock = bench_trainer(path, dtype, True, args.train_batch, args.train_seq, args.repeats)
        else:
            stock = bench_trainer(path, dtype, False, args.train_batch, args.train_seq, args.repeats)
        parity = bench_trainer(path, dtype, True, args.train_batch, args.train_seq, args.repeats)
        results.append({
            "model": name, "dtype": dtype, "what": "trainer fwd+bwd s",
            "stock": stock, "parity": parity, "slowdown": parity / stock, "target": 1.25,
            "batch": args.train_batch, "seq": args.train_seq,
        })

    table = Table(title="parity layer cost (slowdown = parity time / stock time)")
    for col in ("model", "dtype", "measure", "stock", "parity", "slowdown", "target"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["model"], r["dtype"], r["what"], f"{r['stock']:.3f}", f"{r['parity']:.3f}",
                      f"{r['slowdown']:.2f}x", f"<= {r['target']:.2f}x")
    if results:
        Console().print(table)
    cache = {name: kimi_cache_bytes(path, dtype) for name, (path, dtype) in models.items() if name == "kimi"}
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "results": results, "gemm": gemm, "cache": cache},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
