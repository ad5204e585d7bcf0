"""Benchmark one trainer step per backend, side by side in one run: the Megatron backend
(trainer.megatron.policy), plain and with trainer.deterministic_layout (per-sequence gradients
summed in row order), and the deepspeed backend (trainer.deepspeed.policy) at ZeRO stages 0-3
(`--stages ''`: none), on the same model, batch and settings, one rank each (gloo), in this
process.

A step is `train_step` on a fixed GRPO batch: scoring the old log-probs, advantages, and one
optimizer step over the micro-batches (forward + backward + step). Each backend runs
`--warmup` steps, then `--steps` timed ones; the table shows the median and the ratio to
Megatron. Rollout log-probs are the trainer's own (the bench measures the trainer only).

    python scripts/bench_trainer.py [--preset small] [--lora on|off] [--dtype fp32]
        [--out bench_results/bench_trainer.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _batch(n: int, prompt: int, response: int, vocab: int, group: int) -> dict:
    rng = random.Random(0)
    seqs = [[rng.randrange(3, vocab) for _ in range(prompt + response)] for _ in range(n)]
    return {"sequences": seqs, "starts": [prompt] * n, "rewards": torch.arange(n, dtype=torch.float32) % 3,
            "group_size": group}


def _time_steps(trainer, batch: dict, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        old = trainer.logprobs(batch["sequences"], batch["starts"])
        t = time.perf_counter()
        trainer.train_step({**batch, "rollout_logprobs": old})
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from rl.models import init_model
    from trainer.config import AlgorithmConfig, DeepSpeedConfig, LoraConfig, TrainerConfig
    from trainer.deepspeed.engine import init_distributed
    from trainer.deepspeed.policy import DeepSpeedPolicyTrainer
    from trainer.distributed import free_port
    from trainer.megatron.patches import init_megatron
    from trainer.megatron.policy import PolicyTrainer

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen3"])
    ap.add_argument("--preset", default="small", choices=["tiny", "small"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--lora", default="on", choices=["on", "off"])
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--response-tokens", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "bench_trainer.json"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench_trainer-"))
    model = init_model(arch=args.arch, preset=args.preset, seed=0, out_dir=tmp / "model", dtype=args.dtype)
    from parity.model_spec import load_spec

    spec = load_spec(model)
    batch = _batch(args.sequences, args.prompt_tokens, args.response_tokens, spec.vocab_size, group=4)
    lora = LoraConfig(enabled=args.lora == "on", rank=16, alpha=32)
    algorithm = AlgorithmConfig(name="grpo")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(tmp / "torch_extensions"))

    init_distributed(0, 1, free_port())
    init_megatron()
    rows = []

    def run(name: str, trainer) -> None:
        times = _time_steps(trainer, batch, args.warmup, args.steps)
        rows.append({"backend": name, "median_s": statistics.median(times), "min_s": min(times),
                     "times_s": times})

    def config(stage: int = 2) -> TrainerConfig:
        return TrainerConfig(lr=1e-3, micro_batch_size=args.micro_batch_size,
                             deepspeed=DeepSpeedConfig(zero_stage=stage))

    run("megatron", PolicyTrainer(model, args.dtype, lora=lora, trainer=config(), algorithm=algorithm))
    ordered = dataclasses.replace(config(), deterministic_layout=True)
    run("megatron deterministic_layout", PolicyTrainer(model, args.dtype, lora=lora, trainer=ordered,
                                                       algorithm=algorithm))
    for stage in (int(s) for s in args.stages.split(",") if s):
        trainer = DeepSpeedPolicyTrainer(model, args.dtype, lora=lora, trainer=config(stage), algorithm=algorithm)
        run(f"deepspeed ZeRO-{stage}", trainer)

    base = rows[0]["median_s"]
    for r in rows:
        r["vs_megatron"] = r["median_s"] / base
    title = (f"trainer step · {args.arch}-{args.preset} {args.dtype} · LoRA {args.lora} · "
             f"{args.sequences}×({args.prompt_tokens}+{args.response_tokens}) tokens · "
             f"{args.threads} thread(s)")
    table = Table(title=title)
    for col in ("backend", "median s/step", "min s/step", "vs megatron"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["backend"], f"{r['median_s']:.3f}", f"{r['min_s']:.3f}", f"{r['vs_megatron']:.2f}×")
    Console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "cpu_count": os.cpu_count(), "results": rows},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
