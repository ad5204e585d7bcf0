"""The weight-sync hook machinery (rl/sync.py). The pushes here go to plain in-process holders
of tensors; tests/integration/test_train.py runs the same hooks against real vLLM workers in Ray."""

from __future__ import annotations

import pytest
import torch

from parity.compare import tensor_checksum
from rl.errors import UserError
from rl.sync import (
    ChecksumHook,
    SyncError,
    SyncHook,
    TimingHook,
    WeightSync,
    buckets,
    build_hooks,
    checksums,
)


class Holder:
    """What a rollout worker does with a sync: keep the tensors, report their checksums."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def receive(self, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
        self.tensors.update({k: v.clone() for k, v in tensors.items()})
        return checksums(self.tensors)


class RecordingHook(SyncHook):
    """Imported by build_hooks through "tests.unit.test_sync:RecordingHook"."""

    needs_checksums = True
    events: list = []

    def before_sync(self, event):
        RecordingHook.events.append(("before", event.step, sorted(event.tensors)))

    def after_sync(self, event):
        RecordingHook.events.append(("after", event.step, event.buckets, len(event.worker_checksums[0])))


class DoubleB(SyncHook):
    """A transforming hook: the workers must receive what it leaves in event.tensors."""

    def before_sync(self, event):
        event.tensors = {k: (v * 2 if k.endswith("B") else v) for k, v in event.tensors.items()}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer0.A": torch.randn(4, 16, generator=g),
        "layer0.B": torch.randn(16, 4, generator=g).to(torch.bfloat16),
        "layer1.A": torch.randn(4, 16, generator=g),
    }


def _sync(hooks, holders, bucket_mb=64):
    return WeightSync(
        hooks, len(holders),
        push_adapter=lambda t, scaling, sums: [h.receive(t) if sums else {} for h in holders],
        push_full=lambda bucket, sums: [h.receive(bucket) if sums else {} for h in holders],
        bucket_mb=bucket_mb,
    )


def test_checksum_sees_every_bit():
    t = torch.randn(8, 8)
    assert tensor_checksum(t) == tensor_checksum(t.clone())
    flipped = t.clone()
    flipped.view(torch.int32)[3, 3] ^= 1  # one mantissa bit
    assert tensor_checksum(flipped) != tensor_checksum(t)
    assert tensor_checksum(t.t()) != tensor_checksum(t)  # row-major bytes, not storage


def test_buckets_respect_the_size_and_keep_everything():
    tensors = {f"w{i}": torch.zeros(256) for i in range(10)}  # 1 KiB each
    parts = buckets(tensors, bucket_bytes=3 * 1024)
    assert [len(p) for p in parts] == [3, 3, 3, 1]
    assert [k for p in parts for k in p] == list(tensors)
    big = {"small": torch.zeros(10), "huge": torch.zeros(10_000)}
    assert [list(p) for p in buckets(big, 1024)] == [["small"], ["huge"]]


def test_adapter_sync_runs_hooks_and_workers_hold_the_transformed_tensors():
    holders = [Holder(), Holder()]
    metrics = _sync([DoubleB(), ChecksumHook(), TimingHook()], holders).sync(
        3, _tensors(), kind="adapter", scaling=2.0)
    assert metrics["sync/checksum_ok"] == 1.0
    assert metrics["sync/seconds"] >= 0.0 and metrics["sync/mb"] > 0
    for h in holders:
        assert torch.equal(h.tensors["layer0.B"], _tensors()["layer0.B"] * 2)
        assert torch.equal(h.tensors["layer0.A"], _tensors()["layer0.A"])


def test_full_sync_goes_in_buckets():
    holders = [Holder()]
    tensors = {f"w{i}": torch.full((2**18,), float(i)) for i in range(5)}  # 1 MiB each
    RecordingHook.events = []
    _sync([ChecksumHook(), RecordingHook()], holders, bucket_mb=2).sync(1, tensors, kind="full")
    assert RecordingHook.events[-1] == ("after", 1, 3, 5)
    assert checksums(holders[0].tensors) == checksums(tensors)


def test_checksum_hook_names_the_worker_and_the_tensor():
    class Corrupting(Holder):
        def receive(self, tensors):
            super().receive(tensors)
            self.tensors["layer1.A"][0, 0] += 1.0  # a worker that holds something else
            return checksums(self.tensors)

    with pytest.raises(SyncError, match=r"worker 1 .*'layer1.A'"):
        _sync([ChecksumHook()], [Holder(), Corrupting()]).sync(5, _tensors(), kind="adapter")


def test_missing_tensor_is_reported():
    class Dropping(Holder):
        def receive(self, tensors):
            return {k: v for k, v in super().receive(tensors).items() if k != "layer0.A"}

    with pytest.raises(SyncError, match=r"worker 0 holds missing for 'layer0.A'"):
        _sync([ChecksumHook()], [Dropping()]).sync(0, _tensors(), kind="adapter")


def test_build_hooks_from_names():
    hooks = build_hooks(["checksum", "timing", "tests.unit.test_sync:RecordingHook"])
    assert [type(h).__name__ for h in hooks] == ["ChecksumHook", "TimingHook", "RecordingHook"]
    with pytest.raises(UserError, match=r"sync.hooks\[0\]: parity_probe"):
        build_hooks(["parity_probe"])
    with pytest.raises(UserError, match=r"sync.hooks\[1\].*no_such_module"):
        build_hooks(["timing", "no_such_module:Hook"])
    with pytest.raises(UserError, match=r"sync.hooks\[0\].*before_sync"):
        build_hooks(["tests.unit.test_sync:_tensors"])


def test_workers_hash_only_when_a_hook_reads_checksums():
    holders = [Holder()]
    RecordingHook.needs_checksums = False
    try:
        RecordingHook.events = []
        _sync([TimingHook(), RecordingHook()], holders).sync(2, _tensors(), kind="adapter")
        assert RecordingHook.events[-1] == ("after", 2, 1, 0)
    finally:
        RecordingHook.needs_checksums = True
