"""Benchmark trainer -> rollout weight sync, measured side by side in one run.

Adapter sync: latency of a LoRA adapter sync (rank 8 / 16 / 64, all seven targets) exactly as
the training loop runs it — a fresh adapter each repeat, packed, hashed and put in Ray's object
store by a trainer actor, its handle forwarded by the driver through the configured sync hooks
(default: checksum + timing) run by rl.loop.make_sync, copied into a Ray actor's in-process
vLLM engine, which digests what it now holds — and the engine-side copy alone
(`RolloutEngine.set_adapter*` in this process; skipped with --loop-only).
Full-weight sync: throughput of `RolloutEngine.update_params_packed` (the loop's path: the
fused parameters as the trainer holds them, one buffer) and of vLLM's reload
(`update_weights`, HF names) for every weight of the model, against a plain `copy_` of the same
bytes into preallocated tensors.

    python scripts/bench_sync.py [--model smollm2] [--ranks 8,16,64] [--repeats 20] [--loop-only]
        [--out bench_results/bench_sync.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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
    and packs it the way trainer.megatron.worker.TrainerWorker.rollout_packed does (into the
    object store, hashed once)."""

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
        import ray

        from parity.wire import packed

        return packed(self.tensors, store=ray.put), self.lora_scaling()


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch allocation of the model's adapter buffers
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def _engine_rows(path: Path, spec, weights: dict[str, torch.Tensor], dtype: torch.dtype, dtype_name: str,
                 ranks: list[int], repeats: int, results: list[dict]) -> dict:
    """An engine in this process: the adapter copy into the model alone (rows appended to
    results), and full weights against memcpy (returned)."""
    from parity.wire import pack_tensors
    from rollout.engine import RolloutEngine

    engine = RolloutEngine(str(path), dtype=dtype_name, multiprocess=False, max_model_len=256, max_num_seqs=8)
    scaling = 2.0
    for rank in ranks:
        adapter = _adapter(spec, rank, dtype, rank)
        mb = sum(t.numel() * t.element_size() for t in adapter.values()) / 2**20
        ms = _median_ms(lambda a=adapter: engine.set_adapter(a, scaling), repeats)
        results.append({"what": "set_adapter (dict of tensors, in-process)", "rank": rank, "mb": mb, "ms": ms})
        packed = pack_tensors(adapter)
        ms = _median_ms(lambda p=packed: engine.set_adapter_packed(*p, scaling), repeats)
        results.append({"what": "set_adapter_packed (one buffer, in-process)", "rank": rank, "mb": mb, "ms": ms})
    engine.clear_adapter()
    total = sum(t.numel() * t.element_size() for t in weights.values())
    full_ms = _median_ms(lambda: engine.update_weights(weights), max(3, repeats // 4))
    packed_full = pack_tensors(_fused(weights, spec))  # what the trainer sends a parity engine
    fused_ms = _median_ms(lambda: engine.update_params_packed(*packed_full), max(3, repeats // 4))
    dst = {k: torch.empty_like(v) for k, v in weights.items()}

    def memcpy():
        for k, v in weights.items():
            dst[k].copy_(v)

    copy_ms = _median_ms(memcpy, max(3, repeats // 4))
    engine.close()
    gbps = {name: total / (ms / 1000) / 1e9 for name, ms in
            (("full", full_ms), ("fused", fused_ms), ("copy", copy_ms))}
    print(f"full weights ({total / 2**20:.1f} MB): memcpy {copy_ms:.1f} ms = {gbps['copy']:.2f} GB/s; "
          f"update_params_packed (the loop's path) {fused_ms:.1f} ms = {gbps['fused']:.2f} GB/s = "
          f"{gbps['fused'] / gbps['copy']:.2f} of memcpy (target >= 0.50); vLLM reload (update_weights, HF "
          f"names) {full_ms:.1f} ms = {gbps['full'] / gbps['copy']:.2f} of memcpy")
    return {"mb": total / 2**20, "memcpy_ms": copy_ms, "memcpy_gbps": gbps["copy"],
            "update_params_packed_ms": fused_ms, "update_params_packed_gbps": gbps["fused"],
            "fraction_of_memcpy": gbps["fused"] / gbps["copy"],
            "update_weights_ms": full_ms, "update_weights_fraction": gbps["full"] / gbps["copy"]}


def _loop_rows(path: Path, spec, dtype: torch.dtype, dtype_name: str, ranks: list[int], repeats: int,
               results: list[dict]) -> None:
    """Through Ray, exactly as the training loop syncs: the trainer actor packs its adapter
    into the object store (trainer.megatron.worker.TrainerWorker.rollout_packed), the driver
    takes its handle (rl.loop.Run.policy_tensors) and runs rl.loop.make_sync's WeightSync with
    the configured hooks, the workers copy it in and digest what they hold. Each repeat syncs
    a fresh adapter (the stand-in trainer draws new values first, outside the timed region)."""
    import ray

    from rl.cluster import start_ray
    from rl.config import RayConfig, load_config
    from rl.loop import Run, make_sync
    from rollout.worker import RolloutWorker

    start_ray(RayConfig(), ROOT / "bench_results" / "ray", num_cpus_needed=1)
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}}  # as rl.loop.Run
    worker = ray.remote(RolloutWorker).options(num_cpus=1, runtime_env=env).remote(
        0, str(path), dtype=dtype_name, parity=True, seed=0, max_model_len=256, max_num_seqs=8,
        max_num_batched_tokens=None,
    )
    for rank in ranks:
        trainer = ray.remote(AdapterTrainer).options(num_cpus=0).remote(spec, rank, dtype)
        mb = ray.get(trainer.megabytes.remote())
        # Both hook sets interleaved, sync by sync: run one set after the other, the second
        # set found Ray's object store and the actors warm and came out 19 ms faster.
        variants = (["checksum", "timing"], ["timing"])
        syncs = []
        for hooks in variants:
            cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
                f"sync.hooks={hooks}", f"model.path={path}", f"model.dtype={dtype_name}"])
            run = SimpleNamespace(cfg=cfg, trainer=trainer, workers=[worker])
            syncs.append((hooks, run, make_sync(run, cfg, probe=[])))
        times: dict[int, list[float]] = {v: [] for v in range(len(variants))}
        for i in range(repeats + 1):  # the first sync of a layout validates it: not timed
            for v, (hooks, run, sync) in enumerate(syncs):
                ray.get(trainer.fresh.remote(2 * i + v))
                t = time.perf_counter()
                kind, tensors, scaling = Run.policy_tensors(run)
                metrics = sync.sync(i + 1, tensors, kind=kind, scaling=scaling)
                times[v].append(time.perf_counter() - t)
                if "checksum" in hooks and metrics.get("sync/checksum_ok") != 1.0:
                    raise SystemExit(f"sync {i + 1} not verified: {metrics}")
        for v, (hooks, _, _) in enumerate(syncs):
            steps = "pack, store, copy, verify" if "checksum" in hooks else "pack, store, copy"
            results.append({"what": f"the loop's sync, hooks {'+'.join(hooks)} ({steps})",
                            "rank": rank, "mb": mb, "ms": statistics.median(times[v][1:]) * 1000,
                            "repeats": repeats})
        ray.kill(trainer)
    ray.get(worker.close.remote())
    ray.shutdown()


def main() -> None:
    from rich.console import Console
    from rich.table import Table
    from safetensors.torch import load_file

    from parity.model_spec import ModelSpec

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2", help="smollm2 or a checkpoint directory")
    ap.add_argument("--ranks", default="8,16,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cache", default=str(ROOT / "models"))
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "bench_sync.json"))
    ap.add_argument("--loop-only", action="store_true",
                    help="only the loop's sync through Ray (no in-process engine rows, no full weights)")
    args = ap.parse_args()
    load_before = os.getloadavg()

    from rl.models import bench_model

    path = bench_model(args.model, Path(args.cache))
    spec = ModelSpec.from_dir(path)
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    dtype = next(iter(weights.values())).dtype
    dtype_name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    ranks = [int(r) for r in args.ranks.split(",")]
    results: list[dict] = []
    full = None if args.loop_only else _engine_rows(path, spec, weights, dtype, dtype_name, ranks, args.repeats, results)
    _loop_rows(path, spec, dtype, dtype_name, ranks, args.repeats, results)

    table = Table(title=f"weight sync · {path.name} ({dtype_name}, {spec.num_layers} layers)")
    for col in ("what", "rank", "MB", "ms"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["what"], str(r["rank"]), f"{r['mb']:.2f}", f"{r['ms']:.2f}")
    Console().print(table)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": path.name, "dtype": dtype_name, "threads": torch.get_num_threads(), "commit": commit,
        # The machine's 1-minute load average before and after: numbers taken on a busy machine are noisy.
        "loadavg_1m": [load_before[0], os.getloadavg()[0]], "cpus": os.cpu_count(),
        "adapter": results, "full_weights": full,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
