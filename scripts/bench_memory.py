"""Memory of a parity rollout engine: the process's resident set after start-up and after one
short generation (every linear's compiled-GEMM pack is made by its first forward), next to the
bytes of the weights and of the packs the model holds.

The engine runs in this process (multiprocess=False), so the RSS is the whole engine's: weights,
packs, the KV cache vLLM reserves (the same in every run of one configuration) and the Python /
torch runtime.

    python scripts/bench_memory.py [--model smollm2] [--out bench_results/bench_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def main() -> None:
    from rollout.engine import RolloutEngine

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2", help="smollm2 or a checkpoint directory")
    ap.add_argument("--cache", default=str(ROOT / "models"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "bench_memory.json"))
    args = ap.parse_args()

    from rl.models import bench_model

    path = bench_model(args.model, Path(args.cache))
    dtype = json.loads((path / "config.json").read_text()).get("torch_dtype", "float32")
    dtype = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    engine = RolloutEngine(str(path), dtype=dtype, multiprocess=False, max_model_len=256, max_num_seqs=8)
    started = _rss_mb()
    prompts = [[3 + (7 * i + j) % 400 for j in range(16)] for i in range(args.prompts)]
    engine.generate(prompts, max_tokens=args.max_tokens, ignore_eos=True)
    held = engine.llm.collective_rpc(_held_bytes)[0]
    result = {
        "model": str(path), "dtype": dtype,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip(),
        "rss_after_start_mb": started, "rss_after_generate_mb": _rss_mb(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **held,
    }
    engine.close()
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
