"""Where the time goes: a per-op-class profile of parity vs stock, rollout and trainer.

Rollout: one GRPO-shaped `generate` (8 prompts x 8 samples, 32 new tokens each, EOS ignored) in
vLLM eager mode, in this process (vLLM's engine core and worker run in-process, so
torch.profiler sees every op). Trainer: one `train_step` of the Megatron backend (scoring the
old log-probs, then forward + backward + optimizer step) on the same-shaped batch, LoRA on.
Each side runs with parity on and off, on the same model, after one warm-up call.

The time of each class is the CPU time of the outermost op (or parity kernel call) that
belongs to it: the parity kernels (`parity.kernels.linear`, `attention`, ...) are timed as
scopes, so an attention made of several small ops counts as attention; stock ops are
classified by name. "python" is the wall time of the call less all of that: the interpreter,
vLLM's scheduler and the profiler's own cost (which inflates it; compare rows with each other,
not with the benchmarks).

    python scripts/profile_parity.py [--models tiny,smollm2] [--sides rollout,trainer]
        [--out docs/bench/profile.json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("gemm", "attention", "norm", "elementwise", "log_softmax", "sampler", "other", "python")
# parity.kernels functions -> class (timed as one scope each, ops inside included).
PARITY_SCOPES = {
    "linear": "gemm", "linear_partials": "gemm", "bmm": "gemm",
    "attention": "attention", "rms_norm": "norm",
    "silu_and_mul": "elementwise", "apply_rope": "elementwise", "embedding": "elementwise",
    "log_softmax": "log_softmax", "token_logprobs": "log_softmax",
}
# Stock op names -> class, first match wins (substrings of the profiler's op names).
STOCK_RULES = (
    ("log_softmax", "log_softmax"),
    ("attention", "attention"), ("attn", "attention"), ("sdpa", "attention"), ("paged", "attention"),
    ("kv_cache", "attention"),
    ("norm", "norm"),
    ("sort", "sampler"), ("topk", "sampler"), ("cumsum", "sampler"), ("multinomial", "sampler"),
    ("exponential", "sampler"), ("softmax", "sampler"), ("argmax", "sampler"), ("kept", "sampler"),
    ("sample", "sampler"), ("philox", "sampler"),
    ("gemm", "gemm"), ("linear", "gemm"), ("mm", "gemm"), ("matmul", "gemm"), ("onednn", "gemm"),
    ("embedding", "elementwise"), ("index_select", "elementwise"),
)
ELEMENTWISE = ("add", "mul", "sub", "div", "silu", "exp", "sigmoid", "unary", "rope", "rotary", "neg", "pow",
               "rsqrt", "copy", "to", "cat", "where", "fill", "zero", "clamp", "row_sum", "sum", "mean")


def classify(name: str) -> str:
    low = name.lower()
    for key, cls in STOCK_RULES:
        if key in low:
            return cls
    op = low.split("::")[-1]
    return "elementwise" if any(op.startswith(e) or op.endswith(e) for e in ELEMENTWISE) else "other"


@contextlib.contextmanager
def parity_scopes():
    """Wrap the parity.kernels functions in profiler scopes named parity.<function>."""
    from parity import kernels

    saved = {name: getattr(kernels, name) for name in PARITY_SCOPES if hasattr(kernels, name)}

    def scoped(name, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with torch.profiler.record_function(f"parity.{name}"):
                return fn(*args, **kwargs)
        return run

    for name, fn in saved.items():
        setattr(kernels, name, scoped(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)


def attribute(events, wall_s: float) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
    """(seconds per class, the 10 largest entries as (name, class, seconds)): each outermost
    parity scope or op once (its total CPU time); unnamed user scopes are descended into."""
    entries: dict[str, float] = defaultdict(float)

    def visit(ev) -> None:
        if ev.name.startswith("parity.") or "::" in ev.name:
            entries[ev.name] += ev.cpu_time_total / 1e6
        else:
            for child in ev.cpu_children:
                visit(child)

    for ev in events:
        if ev.cpu_parent is None:
            visit(ev)

    def cls(name: str) -> str:
        return PARITY_SCOPES[name.removeprefix("parity.")] if name.startswith("parity.") else classify(name)

    out: dict[str, float] = defaultdict(float)
    for name, seconds in entries.items():
        out[cls(name)] += seconds
    out["python"] = max(0.0, wall_s - sum(out.values()))
    top = sorted(entries.items(), key=lambda kv: -kv[1])[:10]
    return {c: out.get(c, 0.0) for c in CLASSES}, [(name, cls(name), seconds) for name, seconds in top]


def profiled(call) -> dict:
    with parity_scopes(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        call()
        wall = time.perf_counter() - t
    classes, top = attribute(prof.events(), wall)
    return {"wall_s": wall, "classes_s": classes, "top_ops": top}


def markdown(rows: list[dict]) -> str:
    """The table docs/ shows: share of the wall time per class."""
    lines = ["| model | side | parity | wall s | " + " | ".join(CLASSES) + " |",
             "|---" * (4 + len(CLASSES)) + "|"]
    for r in rows:
        shares = [f"{100 * r['classes_s'][c] / r['wall_s']:.0f} %" for c in CLASSES]
        lines.append(f"| {r['model']} {r['dtype']} | {r['side']} | {'on' if r['parity'] else 'off'} | "
                     f"{r['wall_s']:.2f} | " + " | ".join(shares) + " |")
    return "\n".join(lines)


def grpo_prompts(vocab: int, prompts: int = 8, samples: int = 8, length: int = 32) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    base = [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(prompts)]
    return [p for p in base for _ in range(samples)]


def profile_rollout(model: Path, dtype: str, parity: bool, vocab: int) -> dict:
    from rollout.engine import RolloutEngine

    prompts = grpo_prompts(vocab)
    with RolloutEngine(str(model), dtype=dtype, parity=parity, multiprocess=False, max_model_len=256,
                       max_num_seqs=64, enforce_eager=True) as engine:
        engine.generate(prompts[:8], max_tokens=4, ignore_eos=True)  # warm-up
        result = profiled(lambda: engine.generate(prompts, max_tokens=32, ignore_eos=True))
    result["tokens"] = len(prompts) * 32
    return result


@functools.cache
def one_rank() -> None:
    """This process as the one rank of a gloo group, with Megatron's parallel state."""
    from trainer.deepspeed.engine import init_distributed
    from trainer.distributed import free_port
    from trainer.megatron.patches import init_megatron

    init_distributed(0, 1, free_port())
    init_megatron()


def profile_trainer(model: Path, dtype: str, parity: bool, vocab: int) -> dict:
    from trainer.config import AlgorithmConfig, LoraConfig, TrainerConfig
    from trainer.megatron.policy import PolicyTrainer

    one_rank()

    seqs = [p + p[:32] for p in grpo_prompts(vocab)]  # 32 prompt + 32 response tokens
    batch = {"sequences": seqs, "starts": [32] * len(seqs),
             "rewards": torch.arange(len(seqs), dtype=torch.float32) % 3, "group_size": 8}
    trainer = PolicyTrainer(str(model), dtype, parity, LoraConfig(enabled=True, rank=16, alpha=32),
                            TrainerConfig(lr=1e-3, micro_batch_size=8), AlgorithmConfig(name="grpo"), seed=0)

    def step() -> None:
        old = trainer.logprobs(batch["sequences"], batch["starts"])
        trainer.train_step({**batch, "rollout_logprobs": old}, old)

    step()  # warm-up
    result = profiled(step)
    result["tokens"] = len(seqs) * 64
    return result


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    from parity.model_spec import load_spec
    from parity.native import ops
    from rl.models import import_smollm2, init_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--sides", default="rollout,trainer")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "profile.json"))
    args = ap.parse_args()
    cache = Path(tempfile.gettempdir()) / "kimi-rl-profile-models"
    rows = []
    for name in args.models.split(","):
        path = cache / name
        if not (path / "config.json").exists():
            if name == "tiny":
                init_model(arch="llama", preset="tiny", seed=0, out_dir=path, dtype="fp32")
            elif name == "smollm2":
                import_smollm2(path, dtype="bf16")
            else:
                raise SystemExit(f"--models: unknown model {name!r} (tiny, smollm2)")
        dtype = "fp32" if name == "tiny" else "bf16"
        vocab = load_spec(path).vocab_size
        for side in args.sides.split(","):
            run = {"rollout": profile_rollout, "trainer": profile_trainer}[side]
            for parity in (False, True):
                result = run(path, dtype, parity, vocab)
                rows.append({"model": name, "dtype": dtype, "side": side, "parity": parity, **result})
                print(f"{name} {side} parity={'on' if parity else 'off'}: {result['wall_s']:.2f} s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    machine = {"cpu": cpu_name(), "isa": ops().isa(), "threads": torch.get_num_threads(), "commit": commit,
               "date": time.strftime("%Y-%m-%d"), "load_average": list(os.getloadavg())}
    print(f"{machine['cpu']} · {machine['isa']} · {machine['threads']} threads · commit {commit} · "
          f"load average {machine['load_average'][0]:.1f}")
    print(markdown(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
