"""Benchmark trainer -> rollout weight sync, measured side by side in one run.

Adapter sync: latency of a LoRA adapter sync (rank 8 / 16 / 64, all seven targets) exactly as
the training loop runs it — a fresh adapter each repeat, packed by a trainer actor, through Ray's
object store, the configured sync hooks (default: checksum + timing) run by rl.loop.make_sync,
copied into a Ray actor's in-process vLLM engine, which hashes what it now holds — and the
engine-side copy alone (`RolloutEngine.set_adapter*` in this process).
Full-weight sync: throughput of `RolloutEngine.update_params_packed` (the loop's path: the
fused parameters as the trainer holds them, one buffer) and of vLLM's reload
(`update_weights`, HF names) for every weight of the model, against a plain `copy_` of the same
bytes into preallocated tensors.

    python scripts/bench_sync.py [--model smollm2] [--out bench_results/bench_sync.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]


def _adapter(spec, rank: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    from parity.lora import TARGETS, part_shapes, peft_key

    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(spec.num_layers):
        for target, (fan_in, fan_out) in part_shapes(spec).items():
            if target in TARGETS:
                out[peft_key(layer, target, "A")] = (torch.randn(rank, fan_in, generator=g) * 0.01).to(dtype)
                out[peft_key(layer, target, "B")] = (torch.randn(fan_out, rank, generator=g) * 0.01).to(dtype)
    return out


def _fused(weights: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
    """HF checkpoint weights in the rollout parity model's parameter names and fused layouts
    (what trainer.megatron.convert.megatron_to_rollout gives for the same model)."""
    from parity.layouts import pack_gate_up, pack_qkv

    out = {}
    for name, t in weights.items():
        if ".q_proj." in name:
            base = name.replace(".q_proj.", ".{}.")
            out[name.replace("q_proj", "qkv_proj")] = pack_qkv(
                t, weights[base.format("k_proj")], weights[base.format("v_proj")], spec.num_kv_heads)
        elif ".gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = pack_gate_up(t, weights[name.replace("gate_proj", "up_proj")])
        elif not any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[name] = t
    return out


class AdapterTrainer:
    """Stands in for the trainer actor in the sync path: holds an adapter in the model dtype
    and packs it the way trainer.megatron.worker.TrainerWorker.rollout_packed does."""

    def __init__(self, spec, rank: int, dtype: torch.dtype) -> None:
        self.spec, self.rank, self.dtype = spec, rank, dtype
        self.fresh(0)

    def fresh(self, seed: int) -> None:
        self.tensors = _adapter(self.spec, self.rank, self.dtype, 1000 * self.rank + seed)

    def megabytes(self) -> float:
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) / 2**20

    def lora_scaling(self) -> float:
        return 2.0

    def rollout_packed(self):
        from parity.wire import pack_tensors

        return pack_tensors(self.tensors)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch allocation of the model's adapter buffers
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    import ray
    from rich.console import Console
    from rich.table import Table
    from safetensors.torch import load_file

    from parity.model_spec import ModelSpec
    from parity.wire import pack_tensors
    from rl.cluster import start_ray
    from rl.config import RayConfig, load_config
    from rl.loop import Run, make_sync
    from rollout.engine import RolloutEngine
    from rollout.worker import RolloutWorker

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2", help="smollm2 or a checkpoint directory")
    ap.add_argument("--ranks", default="8,16,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cache", default=str(ROOT / "models"))
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "bench_sync.json"))
    args = ap.parse_args()

    if args.model == "smollm2":
        from rl.models import import_smollm2

        path = Path(args.cache) / "smollm2"
        if not (path / "config.json").exists():
            import_smollm2(path, dtype="bf16")
    else:
        path = Path(args.model)
    spec = ModelSpec.from_dir(path)
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    dtype = next(iter(weights.values())).dtype
    dtype_name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    ranks = [int(r) for r in args.ranks.split(",")]
    results = []

    # Engine in this process: the copy into the model alone, and full weights vs memcpy.
    engine = RolloutEngine(str(path), dtype=dtype_name, multiprocess=False, max_model_len=256, max_num_seqs=8)
    scaling = 2.0
    for rank in ranks:
        adapter = _adapter(spec, rank, dtype, rank)
        mb = sum(t.numel() * t.element_size() for t in adapter.values()) / 2**20
        ms = _median_ms(lambda a=adapter: engine.set_adapter(a, scaling), args.repeats)
        results.append({"what": "set_adapter (dict of tensors, in-process)", "rank": rank, "mb": mb, "ms": ms})
        packed = pack_tensors(adapter)
        ms = _median_ms(lambda p=packed: engine.set_adapter_packed(*p, scaling), args.repeats)
        results.append({"what": "set_adapter_packed (one buffer, in-process)", "rank": rank, "mb": mb, "ms": ms})
    engine.clear_adapter()
    total = sum(t.numel() * t.element_size() for t in weights.values())
    full_ms = _median_ms(lambda: engine.update_weights(weights), max(3, args.repeats // 4))
    fused = _fused(weights, spec)  # what the trainer sends a parity engine
    packed_full = pack_tensors(fused)
    fused_ms = _median_ms(lambda: engine.update_params_packed(*packed_full), max(3, args.repeats // 4))
    dst = {k: torch.empty_like(v) for k, v in weights.items()}

    def memcpy():
        for k, v in weights.items():
            dst[k].copy_(v)

    copy_ms = _median_ms(memcpy, max(3, args.repeats // 4))
    engine.close()

    # Through Ray, exactly as the training loop syncs: the trainer actor packs its adapter
    # (trainer.megatron.worker.TrainerWorker.rollout_packed -> the object store), the driver takes it
    # (rl.loop.Run.policy_tensors) and runs rl.loop.make_sync's WeightSync with the configured
    # hooks, the workers copy it in and hash what they hold. Each repeat syncs a fresh adapter
    # (the stand-in trainer draws new values first, outside the timed region).
    run_dir = ROOT / "bench_results" / "ray"
    start_ray(RayConfig(), run_dir, num_cpus_needed=1)
    worker = ray.remote(RolloutWorker).options(num_cpus=1).remote(
        0, str(path), dtype=dtype_name, parity=True, seed=0, max_model_len=256, max_num_seqs=8,
        max_num_batched_tokens=None,
    )
    for rank in ranks:
        trainer = ray.remote(AdapterTrainer).options(num_cpus=0).remote(spec, rank, dtype)
        mb = ray.get(trainer.megabytes.remote())
        for hooks in (["checksum", "timing"], ["timing"]):
            cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
                f"sync.hooks={hooks}", f"model.path={path}", f"model.dtype={dtype_name}"])
            run = SimpleNamespace(cfg=cfg, trainer=trainer, workers=[worker], packed_adapter=(None, {}))
            sync = make_sync(run, cfg, probe=[])
            step = iter(range(1, 10**6))

            def loop_sync(run=run, sync=sync, step=step, trainer=trainer):
                kind, tensors, scaling = Run.policy_tensors(run)
                sync.sync(next(step), tensors, kind=kind, scaling=scaling)

            times = []
            for i in range(args.repeats + 1):
                ray.get(trainer.fresh.remote(i))
                t = time.perf_counter()
                loop_sync()
                times.append(time.perf_counter() - t)
            steps = "pack, store, copy, verify" if "checksum" in hooks else "pack, store, copy"
            results.append({"what": f"the loop's sync, hooks {'+'.join(hooks)} ({steps})",
                            "rank": rank, "mb": mb, "ms": statistics.median(times[1:]) * 1000})
        ray.kill(trainer)
    ray.get(worker.close.remote())
    ray.shutdown()

    gbps_full = total / (full_ms / 1000) / 1e9
    gbps_fused = total / (fused_ms / 1000) / 1e9
    gbps_copy = total / (copy_ms / 1000) / 1e9
    table = Table(title=f"weight sync · {path.name} ({dtype_name}, {spec.num_layers} layers)")
    for col in ("what", "rank", "MB", "ms"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["what"], str(r["rank"]), f"{r['mb']:.2f}", f"{r['ms']:.2f}")
    Console().print(table)
    print(f"full weights ({total / 2**20:.1f} MB): memcpy {copy_ms:.1f} ms = {gbps_copy:.2f} GB/s; "
          f"update_params_packed (the loop's path) {fused_ms:.1f} ms = {gbps_fused:.2f} GB/s = "
          f"{gbps_fused / gbps_copy:.2f} of memcpy (target >= 0.50); vLLM reload (update_weights, HF "
          f"names) {full_ms:.1f} ms = {gbps_full / gbps_copy:.2f} of memcpy")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": str(path), "dtype": dtype_name, "threads": torch.get_num_threads(),
        "adapter": results,
        "full_weights": {"mb": total / 2**20, "memcpy_ms": copy_ms, "memcpy_gbps": gbps_copy,
                         "update_params_packed_ms": fused_ms, "update_params_packed_gbps": gbps_fused,
                         "fraction_of_memcpy": gbps_fused / gbps_copy,
                         "update_weights_ms": full_ms, "update_weights_fraction": gbps_full / gbps_copy},
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
