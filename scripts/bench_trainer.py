"""Benchmark one trainer step per backend, side by side in one run: the Megatron backend
(trainer.megatron.policy), plain, with trainer.packed_sequences (a micro-batch's sequences end
to end in one row) and with trainer.deterministic_layout (per-sequence gradients summed in row
order), and the deepspeed backend (trainer.deepspeed.policy) at ZeRO stages 0-3
(`--stages ''`: none), on the same model, batch and settings, one rank each (gloo), in this
process.

A step is `train_step` on a fixed GRPO batch: scoring the old log-probs, advantages, and one
optimizer step over the micro-batches (forward + backward + step). `--ragged` draws each
response's length from 1..--response-tokens (RL's ragged batches, what packing is for)
instead of all --response-tokens. Each backend runs
`--warmup` steps, then `--steps` timed ones, the backends interleaved step by step; the table
shows the median and the ratio to Megatron. Rollout log-probs are the trainer's own (the bench measures the trainer only).

    python scripts/bench_trainer.py [--preset small] [--lora on|off] [--dtype fp32]
        [--ragged] [--out bench_results/bench_trainer.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _batch(n: int, prompt: int, response: int, vocab: int, group: int, ragged: bool) -> dict:
    rng = random.Random(0)
    lengths = [rng.randint(1, response) if ragged else response for _ in range(n)]
    seqs = [[rng.randrange(3, vocab) for _ in range(prompt + m)] for m in lengths]
    return {"sequences": seqs, "starts": [prompt] * n, "rewards": torch.arange(n, dtype=torch.float32) % 3,
            "group_size": group}


def _step_time(trainer, batch: dict) -> float:
    old = trainer.logprobs(batch["sequences"], batch["starts"])
    t = time.perf_counter()
    trainer.train_step({**batch, "rollout_logprobs": old})
    return time.perf_counter() - t


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from rl.models import init_model

    sys.path.insert(0, str(ROOT))  # run as a file: the repository root holds `scripts`
    from scripts.bench_parity import machine
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
    ap.add_argument("--ragged", action="store_true", help="response lengths drawn from 1..--response-tokens")
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
    batch = _batch(args.sequences, args.prompt_tokens, args.response_tokens, spec.vocab_size, 4, args.ragged)
    lora = LoraConfig(enabled=args.lora == "on", rank=16, alpha=32)
    algorithm = AlgorithmConfig(name="grpo")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(tmp / "torch_extensions"))

    init_distributed(0, 1, free_port())
    init_megatron()

    def config(stage: int = 2) -> TrainerConfig:
        return TrainerConfig(lr=1e-3, micro_batch_size=args.micro_batch_size,
                             deepspeed=DeepSpeedConfig(zero_stage=stage))

    trainers = {"megatron": PolicyTrainer(model, args.dtype, lora=lora, trainer=config(), algorithm=algorithm)}
    for name, key in (("megatron packed_sequences", "packed_sequences"),
                      ("megatron deterministic_layout", "deterministic_layout")):
        trainers[name] = PolicyTrainer(model, args.dtype, lora=lora, algorithm=algorithm,
                                       trainer=dataclasses.replace(config(), **{key: True}))
    for stage in (int(s) for s in args.stages.split(",") if s):
        trainers[f"deepspeed ZeRO-{stage}"] = DeepSpeedPolicyTrainer(model, args.dtype, lora=lora, trainer=config(stage),
                                                                     algorithm=algorithm)
    # Interleaved: round i steps every trainer once, so a slower phase of a shared machine
    # falls on all of them alike.
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for i in range(args.warmup + args.steps):
        for name, trainer in trainers.items():
            t = _step_time(trainer, batch)
            if i >= args.warmup:
                times[name].append(t)
    rows = [{"backend": name, "median_s": statistics.median(ts), "min_s": min(ts), "times_s": ts}
            for name, ts in times.items()]
    base = rows[0]["median_s"]
    for r in rows:
        r["vs_megatron"] = r["median_s"] / base
    title = (f"trainer step · {args.arch}-{args.preset} {args.dtype} · LoRA {args.lora} · "
             f"{args.sequences}×({args.prompt_tokens}+{'1..' if args.ragged else ''}{args.response_tokens}) tokens · "
             f"{args.threads} thread(s)")
    table = Table(title=title)
    for col in ("backend", "median s/step", "min s/step", "vs megatron"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["backend"], f"{r['median_s']:.3f}", f"{r['min_s']:.3f}", f"{r['vs_megatron']:.2f}×")
    Console().print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "machine": machine(), "results": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
