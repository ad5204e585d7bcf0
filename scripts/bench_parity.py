"""Benchmark the parity layer's cost, measured side by side in one run.

Rollout: tokens/s of vLLM with the parity model vs stock vLLM (same weights, prompts, batch,
max tokens, eager mode on both). Trainer: forward+backward seconds of the parity Megatron model
vs stock Megatron (same weights and batch). Prints a table and writes JSON.

    python scripts/bench_parity.py [--models tiny,smollm2] [--out bench_results/bench_parity.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
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
        elif name == "smollm2":
            if not (path / "config.json").exists():
                import_smollm2(path, dtype="bf16")
            out[name] = (path, "bf16")
        else:
            raise SystemExit(f"unknown model {name!r} (tiny, smollm2)")
    return out


def bench_rollout(path: Path, dtype: str, parity: bool, batch: int, max_tokens: int, repeats: int) -> float:
    from rollout.engine import RolloutEngine

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 400, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 64, (batch,), generator=g)]
    with RolloutEngine(str(path), dtype=dtype, parity=parity, seed=0, max_num_seqs=batch,
                       max_model_len=256) as engine:
        engine.generate(prompts, max_tokens=4)  # warm-up (sampler compile, allocations)
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            done = engine.generate(prompts, max_tokens=max_tokens)
            rates.append(sum(len(c.token_ids) for c in done) / (time.perf_counter() - t))
    return statistics.median(rates)


def bench_trainer(path: Path, dtype: str, parity: bool, batch: int, seq: int, repeats: int) -> float:
    from trainer.logprobs import sequence_logprobs
    from trainer.model import load_model

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


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from trainer.megatron_patches import init_megatron

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default=str(ROOT / "models"))
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "bench_parity.json"))
    args = ap.parse_args()

    models = ensure_models(args.models.split(","), Path(args.cache))
    results = []
    for name, (path, dtype) in models.items():
        stock = bench_rollout(path, dtype, False, args.batch, args.max_tokens, args.repeats)
        parity = bench_rollout(path, dtype, True, args.batch, args.max_tokens, args.repeats)
        results.append({
            "model": name, "dtype": dtype, "what": "rollout tokens/s",
            "stock": stock, "parity": parity, "slowdown": stock / parity, "target": 1.10,
            "batch": args.batch, "max_tokens": args.max_tokens,
        })
    init_megatron()
    for name, (path, dtype) in models.items():
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
    Console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
