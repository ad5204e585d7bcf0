"""Memory of a rollout engine, parity against stock vLLM: the process's resident set after
start-up and after one short generation (every parity linear's compiled-GEMM pack is made by its
first forward), and for the parity engine the bytes of the weights and of the packs it holds.

Each engine runs in a process of its own (multiprocess=False inside it, so the RSS is the whole
engine's: weights, packs, the KV cache vLLM reserves — the same for both sides — and the Python /
torch runtime), stock and parity alternating, `--repeats` processes each; the table gives the
medians and parity / stock.

    python scripts/bench_memory.py [--model smollm2] [--repeats 2] [--out bench_results/bench_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURES = ("rss_after_start_mb", "rss_after_generate_mb", "peak_rss_mb")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _held_bytes(worker) -> dict:
    """Worker side (in-process): bytes of the model's parameters and of its GEMM packs."""
    from rollout.sync import PackedWeight

    model = worker.model_runner.get_model()
    packs = [m.pack() for m in model.modules() if isinstance(m, PackedWeight) and m._has_pack]
    return {
        "weights_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        "packs_mb": sum(p.numel() * p.element_size() for p in packs if p is not None) / 2**20,
        "pack_dtypes": sorted({str(p.dtype) for p in packs if p is not None}),
    }


def measure_one(path: Path, parity: bool, prompts: int, max_tokens: int) -> dict:
    """One engine in this process: its RSS after start-up and after a short generation."""
    from rollout.engine import RolloutEngine

    dtype = json.loads((path / "config.json").read_text()).get("torch_dtype", "float32")
    dtype = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    engine = RolloutEngine(str(path), dtype=dtype, parity=parity, multiprocess=False, max_model_len=256,
                           max_num_seqs=8)
    started = _rss_mb()
    engine.generate([[3 + (7 * i + j) % 400 for j in range(16)] for i in range(prompts)],
                    max_tokens=max_tokens, ignore_eos=True)
    result = {"dtype": dtype, "rss_after_start_mb": started, "rss_after_generate_mb": _rss_mb(),
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if parity:
        result.update(engine.llm.collective_rpc(_held_bytes)[0])
    engine.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2", help="smollm2 or a checkpoint directory")
    ap.add_argument("--cache", default=str(ROOT / "models"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="processes per side, alternating")
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "bench_memory.json"))
    ap.add_argument("--one", choices=("stock", "parity"), help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args()

    from rl.models import bench_model

    path = bench_model(args.model, Path(args.cache))
    if args.one:
        print(json.dumps(measure_one(path, args.one == "parity", args.prompts, args.max_tokens)))
        return
    runs: dict[str, list[dict]] = {"stock": [], "parity": []}
    for i in range(args.repeats):
        for side in runs:
            done = subprocess.run(
                [sys.executable, __file__, "--model", args.model, "--cache", args.cache, "--prompts",
                 str(args.prompts), "--max-tokens", str(args.max_tokens), "--one", side],
                capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                raise SystemExit(f"{side} engine (repeat {i + 1}) failed:\n{done.stderr[-3000:]}")
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"repeat {i + 1}/{args.repeats} {side}: "
                  f"{runs[side][-1]['rss_after_generate_mb']:.0f} MB after a generation", flush=True)
    sys.path.insert(0, str(ROOT))  # run as a file: the repository root holds `scripts`
    from scripts.bench_parity import machine

    medians = {side: {m: statistics.median(r[m] for r in rs) for m in MEASURES} for side, rs in runs.items()}
    result = {
        "model": args.model, "dtype": runs["parity"][0]["dtype"], "repeats": args.repeats, **machine(),
        "median": medians,
        "parity_over_stock": {m: medians["parity"][m] / medians["stock"][m] for m in MEASURES},
        "parity_held": {k: runs["parity"][0][k] for k in ("weights_mb", "packs_mb", "pack_dtypes")},
        "runs": runs,
    }
    print(f"{'MB (median)':<24}{'stock':>10}{'parity':>10}{'parity/stock':>14}")
    for m in MEASURES:
        print(f"{m:<24}{medians['stock'][m]:>10.0f}{medians['parity'][m]:>10.0f}"
              f"{result['parity_over_stock'][m]:>13.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
