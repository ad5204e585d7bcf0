"""Trainer -> rollout weight sync, and the hooks that observe, transform, verify and time it.

After every optimizer step the driver calls `WeightSync.sync(step, tensors, ...)` with what the
rollout workers must hold: the LoRA adapter (peft names, model dtype) or, without LoRA, the full
weights (the rollout parity model's parameter names and fused layouts; HF names for a stock
engine when parity is off). The sync runs

    for hook in hooks: hook.before_sync(event)      # may observe or replace event.tensors
    push event.tensors to every worker, in memory  # adapter: one message; full: buckets
    for hook in hooks: hook.after_sync(event)       # sees each worker's checksums and timings

and returns the metrics the hooks report (`sync/...`). A hook is any object with those two
methods (subclass `SyncHook` to get no-op defaults). Built-in hooks, named in the config's
`sync.hooks`: "checksum" (every worker holds bit-identical tensors, else `SyncError` naming the
worker and the tensor), "timing" (`sync/seconds`, `sync/mb`), "parity_probe" (re-scores a fixed
probe batch on the trainer and every worker after the sync and requires bitwise equality).
User hooks come from the config by "module:attr" (a class, instantiated with no arguments, or
an instance).

Example (also in the README):

    class ScaleCheck(SyncHook):
        def before_sync(self, event):
            norms = [t.float().norm() for t in event.tensors.values()]
            event.metrics["sync/adapter_norm"] = float(torch.stack(norms).norm())
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from parity.compare import tensor_checksum
from rl.errors import UserError


class SyncError(RuntimeError):
    """A sync did not leave every worker with the trainer's tensors."""


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_checksum(t) for name, t in tensors.items()}


@dataclass
class SyncEvent:
    """One trainer -> rollout sync, as the hooks see it."""

    step: int
    kind: Literal["adapter", "full"]
    tensors: dict[str, torch.Tensor]  # before_sync hooks may replace entries (a transform)
    num_workers: int
    # Filled by the sync before after_sync hooks run:
    worker_checksums: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the push (hooks excluded)
    buckets: int = 0
    # Hooks add their metrics here; the driver logs them with the step's metrics.
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class SyncHook:
    """Base class with no-op methods; override either. A hook that reads
    event.worker_checksums sets `needs_checksums = True` (workers skip hashing otherwise)."""

    needs_checksums = False

    def before_sync(self, event: SyncEvent) -> None:
        pass

    def after_sync(self, event: SyncEvent) -> None:
        pass


class ChecksumHook(SyncHook):
    """Every rollout worker must hold exactly the bytes the trainer sent."""

    needs_checksums = True  # asks the workers to hash what they hold (see WeightSync)

    def after_sync(self, event: SyncEvent) -> None:
        expected = checksums(event.tensors)
        for worker, held in enumerate(event.worker_checksums):
            for name, digest in expected.items():
                if held.get(name) != digest:
                    got = "missing" if name not in held else f"xxh3 {held[name][:12]}…"
                    raise SyncError(
                        f"step {event.step}: rollout worker {worker} holds {got} for {name!r}, "
                        f"trainer sent xxh3 {digest[:12]}…"
                    )
        event.metrics["sync/checksum_ok"] = 1.0


class TimingHook(SyncHook):
    def after_sync(self, event: SyncEvent) -> None:
        event.metrics["sync/seconds"] = event.seconds
        event.metrics["sync/mb"] = event.nbytes / 2**20


class ParityProbeHook(SyncHook):
    """After the sync, score a fixed probe batch on every worker (teacher-forced, through vLLM)
    and on the trainer; any difference raises SyncError. `score_rollout(worker, seqs)` and
    `score_trainer(seqs)` are supplied by the driver (they call the Ray actors)."""

    def __init__(
        self,
        probe: Sequence[list[int]],
        score_rollout: Callable[[int, Sequence[list[int]]], list[torch.Tensor]],
        score_trainer: Callable[[Sequence[list[int]]], list[torch.Tensor]],
    ) -> None:
        self.probe = [list(p) for p in probe]
        self.score_rollout = score_rollout
        self.score_trainer = score_trainer

    def after_sync(self, event: SyncEvent) -> None:
        expected = self.score_trainer(self.probe)
        for worker in range(event.num_workers):
            got = self.score_rollout(worker, self.probe)
            for i, (g, e) in enumerate(zip(got, expected, strict=True)):
                if not torch.equal(g, e):
                    raise SyncError(
                        f"step {event.step}: parity probe {i} differs on rollout worker {worker}: "
                        f"max |Δlogp| {float((g - e).abs().max()):.3e}"
                    )
        event.metrics["sync/probe_equal"] = 1.0


def buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split into groups of at most bucket_bytes each (a larger single tensor gets its own),
    in name order, so full-weight syncs never materialise more than one bucket in flight."""
    out: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            out.append(current)
            current, size = {}, 0
        current[name] = t
        size += n
    if current:
        out.append(current)
    return out


class WeightSync:
    """Runs the hooks around a push to the rollout workers.

    `push_adapter(tensors, scaling, checksums)` and `push_full(bucket, checksums)` send to
    every worker and return each worker's checksums of what it now holds ({} when checksums is
    False). The driver wires them to the Ray actors; a test can wire them to anything that
    holds tensors."""

    def __init__(
        self,
        hooks: Sequence[SyncHook],
        num_workers: int,
        push_adapter: Callable[[dict[str, torch.Tensor], float, bool], list[dict[str, str]]],
        push_full: Callable[[dict[str, torch.Tensor], bool], list[dict[str, str]]],
        bucket_mb: int = 64,
    ) -> None:
        self.hooks = list(hooks)
        self.checksums = any(getattr(h, "needs_checksums", False) for h in self.hooks)
        self.num_workers = num_workers
        self.push_adapter = push_adapter
        self.push_full = push_full
        self.bucket_bytes = bucket_mb * 2**20

    def sync(
        self, step: int, tensors: dict[str, torch.Tensor], *, kind: Literal["adapter", "full"],
        scaling: float = 1.0,
    ) -> dict[str, float]:
        event = SyncEvent(step=step, kind=kind, tensors=dict(tensors), num_workers=self.num_workers)
        for hook in self.hooks:
            hook.before_sync(event)
        start = time.perf_counter()
        if kind == "adapter":
            event.worker_checksums = self.push_adapter(event.tensors, scaling, self.checksums)
            event.buckets = 1
        else:
            held: list[dict[str, str]] = [{} for _ in range(self.num_workers)]
            parts = buckets(event.tensors, self.bucket_bytes)
            for part in parts:
                for worker, sums in enumerate(self.push_full(part, self.checksums)):
                    held[worker].update(sums)
            event.worker_checksums, event.buckets = held, len(parts)
        event.seconds = time.perf_counter() - start
        for hook in self.hooks:
            hook.after_sync(event)
        return event.metrics


def build_hooks(names: Sequence[str], parity_probe: Callable[[], SyncHook] | None = None) -> list[SyncHook]:
    """Hooks from the config's sync.hooks: built-in names or "module:attr" (class or instance).
    `parity_probe` builds the probe hook (it needs the driver's actors)."""
    from rl.config import resolve_callable

    hooks: list[SyncHook] = []
    for i, name in enumerate(names):
        if name == "checksum":
            hooks.append(ChecksumHook())
        elif name == "timing":
            hooks.append(TimingHook())
        elif name == "parity_probe":
            if parity_probe is None:
                raise UserError(f"sync.hooks[{i}]: parity_probe needs the driver's rollout workers")
            hooks.append(parity_probe())
        else:
            obj: Any = resolve_callable(name, key=f"sync.hooks[{i}]")
            hook = obj() if isinstance(obj, type) else obj
            if not (callable(getattr(hook, "before_sync", None)) and callable(getattr(hook, "after_sync", None))):
                raise UserError(f"sync.hooks[{i}]: {name} has no before_sync/after_sync methods")
            hooks.append(hook)
    return hooks
