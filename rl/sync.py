"""Trainer -> rollout weight sync, and the hooks that observe, transform, verify and time it.

After every optimizer step the driver calls `WeightSync.sync(step, tensors, ...)` with what the
rollout workers must hold: the LoRA adapter (peft names, model dtype) or, without LoRA, the full
weights (the rollout parity model's parameter names and fused layouts; HF names for a stock
engine when parity is off). The sync runs

    for hook in hooks: hook.before_sync(event)      # may observe or replace event.tensors
    push event.tensors to every worker, in memory  # adapter: one message; full: buckets
    for hook in hooks: hook.after_sync(event)       # sees each worker's digests and timings

and returns the metrics the hooks report (`sync/...`). A hook is any object with those two
methods (subclass `SyncHook` to get no-op defaults). Built-in hooks, named in the config's
`sync.hooks`: "checksum" (every worker holds bit-identical tensors, else `SyncError` naming the
worker and the tensor), "timing" (`sync/seconds`, `sync/mb`), "parity_probe" (re-scores a fixed
probe batch on the trainer and every worker after the sync and requires bitwise equality).
User hooks come from the config by "module:attr" (a class, instantiated with no arguments, or
an instance).

The adapter may arrive already packed (parity.wire.Packed: the trainer packed it, hashed the
buffer once and put it in Ray's object store). Then the driver forwards the handle: the bytes
cross the store once (the trainer's put, each worker's read), unless a hook reads
`event.tensors`, which fetches them on first read. Verification is one digest per buffer on each
side (parity.wire.digest); the per-tensor checksums in `event.worker_checksums` are fetched from
the workers only when read (the checksum hook reads them to name a tensor that differs).

Example (also in the README):

    class ScaleCheck(SyncHook):
        def before_sync(self, event):
            norms = [t.float().norm() for t in event.tensors.values()]
            event.metrics["sync/adapter_norm"] = float(torch.stack(norms).norm())
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from parity.compare import tensor_checksum
from parity.wire import Index, Packed, packed, unpack_tensors
from rl.errors import UserError

Kind = Literal["adapter", "full"]


class SyncError(RuntimeError):
    """A sync did not leave every worker with the trainer's tensors."""


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_checksum(t) for name, t in tensors.items()}


class SyncEvent:
    """One trainer -> rollout sync, as the hooks see it.

    step, kind ("adapter" | "full"), num_workers
    tensors            by name; before_sync hooks may replace entries or the dict (a transform).
                       A packed payload is fetched and unpacked (views) on first read.
    digests            parity.wire.digest of each buffer pushed (one per bucket), after the push
    worker_digests     per worker, its digest of what it holds, per buffer (None: not asked,
                       as when no hook sets needs_checksums)
    worker_checksums   per worker, {name: tensor_checksum} of what it holds: fetched from the
                       workers on first read (a round trip and a hash per tensor)
    seconds            wall time of the push (hooks excluded); buckets: how many buffers
    metrics            hooks add their metrics here; the driver logs them with the step's
    """

    def __init__(
        self, step: int, kind: Kind, tensors: dict[str, torch.Tensor] | Packed, num_workers: int,
        fetch: Callable[[Any], tuple[Any, Index]] = lambda data: data,
        held_checksums: Callable[[Kind, list[str] | None], list[dict[str, str]]] | None = None,
    ) -> None:
        self.step, self.kind, self.num_workers = step, kind, num_workers
        self._packed = tensors if isinstance(tensors, Packed) else None
        self._tensors = None if self._packed is not None else dict(tensors)
        self._views: dict[str, torch.Tensor] = {}  # the unpacked payload, as first read
        self._fetch, self._held_checksums = fetch, held_checksums
        self._worker_checksums: list[dict[str, str]] | None = None
        self.digests: list[str] = []
        self.worker_digests: list[list[str | None]] = []
        self.seconds = 0.0
        self.buckets = 0
        self.metrics: dict[str, float] = {}

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._views = unpack_tensors(*self._fetch(self._packed.data))
            self._tensors = dict(self._views)
        return self._tensors

    @tensors.setter
    def tensors(self, value: dict[str, torch.Tensor]) -> None:
        self._tensors = value

    def unchanged_packed(self) -> Packed | None:
        """The payload as it arrived packed, if no hook replaced a tensor; else None."""
        if self._packed is None:
            return None
        t = self._tensors
        if t is None or (t.keys() == self._views.keys() and all(t[k] is v for k, v in self._views.items())):
            return self._packed
        return None

    @property
    def nbytes(self) -> int:
        if self._tensors is None:
            return self._packed.nbytes
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    @property
    def worker_checksums(self) -> list[dict[str, str]]:
        if self._worker_checksums is None:
            if self._held_checksums is None:
                raise RuntimeError("this sync cannot ask its workers for per-tensor checksums")
            # An adapter's workers hash all they hold; full weights, this sync's names.
            names = list(self.tensors) if self.kind == "full" else None
            self._worker_checksums = self._held_checksums(self.kind, names)
        return self._worker_checksums

    @worker_checksums.setter
    def worker_checksums(self, value: list[dict[str, str]]) -> None:
        self._worker_checksums = value


class SyncHook:
    """Base class with no-op methods; override either. A hook that reads event.worker_digests
    sets `needs_checksums = True` (workers skip hashing otherwise); event.worker_checksums is
    fetched when read, whatever the flag."""

    needs_checksums = False

    def before_sync(self, event: SyncEvent) -> None:
        pass

    def after_sync(self, event: SyncEvent) -> None:
        pass


class ChecksumHook(SyncHook):
    """Every rollout worker must hold exactly the bytes the trainer sent: one digest per buffer
    on each side; on a mismatch, per-tensor checksums name the tensor."""

    needs_checksums = True  # asks the workers to hash what they hold (see WeightSync)

    def after_sync(self, event: SyncEvent) -> None:
        for worker, held_digests in enumerate(event.worker_digests):
            if held_digests == event.digests:
                continue
            held = event.worker_checksums[worker]
            for name, digest in checksums(event.tensors).items():
                if held.get(name) != digest:
                    got = "missing" if name not in held else f"xxh3 {held[name][:12]}…"
                    raise SyncError(
                        f"step {event.step}: rollout worker {worker} holds {got} for {name!r}, "
                        f"trainer sent xxh3 {digest[:12]}…"
                    )
            raise SyncError(f"step {event.step}: rollout worker {worker} holds buffers with digests "
                            f"{held_digests}, trainer sent {event.digests} (every tensor equal)")
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
    """Runs the hooks around a push to the rollout workers. The driver wires these to the Ray
    actors; a test can wire them to anything that holds tensors:

    push_adapter(packed, scaling, digest)  send a parity.wire.Packed adapter to every worker
    push_full(packed, digest)              send one bucket of full weights to every worker
        both return each worker's parity.wire.digest of what it now holds (None if not digest)
    held_checksums(kind, names)            each worker's {name: tensor_checksum} of those tensors
                                           (names None: every adapter tensor it holds)
    fetch(data)                            (flat, index) of a Packed's data (a store handle)"""

    def __init__(
        self,
        hooks: Sequence[SyncHook],
        num_workers: int,
        push_adapter: Callable[[Packed, float, bool], list[str | None]],
        push_full: Callable[[Packed, bool], list[str | None]],
        held_checksums: Callable[[Kind, list[str] | None], list[dict[str, str]]],
        bucket_mb: int = 64,
        fetch: Callable[[Any], tuple[Any, Index]] = lambda data: data,
    ) -> None:
        self.hooks = list(hooks)
        self.digests = any(getattr(h, "needs_checksums", False) for h in self.hooks)
        self.num_workers = num_workers
        self.push_adapter = push_adapter
        self.push_full = push_full
        self.held_checksums = held_checksums
        self.bucket_bytes = bucket_mb * 2**20
        self.fetch = fetch

    def sync(
        self, step: int, tensors: dict[str, torch.Tensor] | Packed, *, kind: Kind, scaling: float = 1.0,
    ) -> dict[str, float]:
        """`tensors` by name, or an adapter already packed (kind "adapter")."""
        event = SyncEvent(step, kind, tensors, self.num_workers, self.fetch, self.held_checksums)
        for hook in self.hooks:
            hook.before_sync(event)
        start = time.perf_counter()
        if kind == "adapter":
            payload = event.unchanged_packed() or packed(event.tensors)  # a hook's change: pack again
            held = [[d] for d in self.push_adapter(payload, scaling, self.digests)]
            event.digests, event.buckets = [payload.digest], 1
        else:
            held = [[] for _ in range(self.num_workers)]
            for part in buckets(event.tensors, self.bucket_bytes):
                payload = packed(part)
                for worker, d in enumerate(self.push_full(payload, self.digests)):
                    held[worker].append(d)
                event.digests.append(payload.digest)
            event.buckets = len(event.digests)
        event.worker_digests = held
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
