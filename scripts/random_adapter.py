"""A peft LoRA adapter with random non-zero A and B for a Llama / Qwen3 / Qwen3-MoE checkpoint
(on Qwen3-MoE the MLP targets get one pair per expert of each sparse layer), to check parity
with an adapter on (`kimi-rl parity check --adapter DIR`) without training one first (a fresh
adapter has B = 0 and would test nothing).

    python scripts/random_adapter.py MODEL_DIR OUT_DIR [--rank 8] [--alpha 16] [--targets q_proj,v_proj]
"""

from __future__ import annotations

import argparse

import torch

from parity.lora import TARGETS, AdapterLayout, adapter_shapes
from parity.model_spec import ModelSpec
from trainer.checkpoint import peft_config, save_peft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated HF module names")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.05)
    args = p.parse_args()
    layout = AdapterLayout(args.rank, tuple(args.targets.split(",")), args.alpha / args.rank)
    gen = torch.Generator().manual_seed(args.seed)
    tensors = {
        name: torch.randn(shape, generator=gen) * args.std
        for name, shape in adapter_shapes(ModelSpec.from_dir(args.model_dir), layout).items()
    }
    save_peft(args.out_dir, tensors, peft_config(args.rank, args.alpha, list(layout.targets), args.model_dir))
    print(f"{args.out_dir}: {len(tensors)} tensors, rank {args.rank}, alpha {args.alpha}")


if __name__ == "__main__":
    main()
