"""The weight-sync hook machinery (rl/sync.py) and its wire digests (parity/wire.py). The pushes
here go to plain in-process holders of tensors; tests/integration/test_train.py runs the same
hooks against real vLLM workers in Ray."""

from __future__ import annotations

import pytest
import torch

from parity.compare import tensor_checksum
from parity.wire import Packed, digest, digest_tensors, pack_tensors, packed, unpack_tensors
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
    """What a rollout worker does with a sync: keep copies of the tensors, digest what it holds
    (in the buffer's order) when asked, report per-tensor checksums."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.hashed = 0  # digests computed

    def receive(self, payload: Packed, want_digest: bool) -> str | None:
        got = unpack_tensors(*payload.data)
        self.tensors.update({k: v.clone() for k, v in got.items()})
        self.tamper()
        if not want_digest:
            return None
        self.hashed += 1
        return digest_tensors(self.tensors[n] for n in got if n in self.tensors)

    def tamper(self) -> None:
        pass

    def checksums(self, names: list[str] | None) -> dict[str, str]:
        return {k: v for k, v in checksums(self.tensors).items() if names is None or k in names}


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


def _sync(hooks, holders, bucket_mb=64, fetch=lambda data: data, pushed=None):
    def push(payload, want_digest):
        if pushed is not None:
            pushed.append(payload)
        return [h.receive(payload, want_digest) for h in holders]

    return WeightSync(
        hooks, len(holders),
        push_adapter=lambda payload, scaling, want_digest: push(payload, want_digest),
        push_full=push,
        held_checksums=lambda kind, names: [h.checksums(names) for h in holders],
        bucket_mb=bucket_mb, fetch=fetch,
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


def test_digest_is_of_the_tensors_alone():
    """pack_tensors zeroes the alignment gaps, so one digest of the buffer identifies its tensors,
    digest_tensors computes it without packing, and one flipped bit changes it."""
    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.randn(7), "c": torch.arange(3)}
    for _ in range(5):
        dirty = torch.full((192,), 255, dtype=torch.uint8)  # freed, then mostly reused by the pack
        del dirty
        flat, index = pack_tensors(tensors)
        assert [(start, n) for _, _, _, start, n in index] == [(0, 30), (64, 28), (128, 24)]
        gaps = [(start + n, end) for (*_, start, n), end in zip(index, [64, 128, len(flat)], strict=True)]
        assert all((flat[a:b] == 0).all() for a, b in gaps)
    assert digest(flat) == digest_tensors(tensors.values())
    flipped = dict(tensors, b=tensors["b"].clone())
    flipped["b"].view(torch.int32)[2] ^= 1
    assert digest_tensors(flipped.values()) != digest(flat)
    p = packed(tensors)
    assert (p.digest, p.nbytes) == (digest(flat), 30 + 28 + 24)


def test_a_packed_adapter_is_forwarded_without_reading_its_bytes():
    """With the default hooks (checksum, timing) the driver neither fetches the buffer nor hashes
    a tensor: it forwards the sender's Packed and compares one digest per worker."""
    fetched, pushed, holders = [], [], [Holder(), Holder()]
    sent = packed(_tensors())
    metrics = _sync([ChecksumHook(), TimingHook()], holders, fetch=lambda d: fetched.append(d) or d,
                    pushed=pushed).sync(1, sent, kind="adapter", scaling=2.0)
    assert pushed == [sent] and pushed[0] is sent and fetched == []
    assert metrics["sync/checksum_ok"] == 1.0 and metrics["sync/mb"] == sent.nbytes / 2**20
    assert all(checksums(h.tensors) == checksums(_tensors()) for h in holders)


def test_a_hook_that_replaces_a_packed_tensor_gets_it_repacked():
    fetched, pushed, holders = [], [], [Holder()]
    sent = packed(_tensors())
    _sync([DoubleB(), ChecksumHook()], holders, fetch=lambda d: fetched.append(d) or d,
          pushed=pushed).sync(1, sent, kind="adapter")
    assert len(fetched) == 1 and pushed[0] is not sent and pushed[0].digest != sent.digest
    assert torch.equal(holders[0].tensors["layer0.B"], _tensors()["layer0.B"] * 2)


class _Corrupting(Holder):
    def tamper(self) -> None:
        self.tensors["layer1.A"][0, 0] += 1.0  # a worker that holds something else


def test_checksum_hook_names_the_worker_and_the_tensor():
    for tensors in (_tensors(), packed(_tensors())):
        with pytest.raises(SyncError, match=r"worker 1 .*'layer1.A'"):
            _sync([ChecksumHook()], [Holder(), _Corrupting()]).sync(5, tensors, kind="adapter")


def test_missing_tensor_is_reported():
    class Dropping(Holder):
        def tamper(self) -> None:
            self.tensors.pop("layer0.A", None)

    with pytest.raises(SyncError, match=r"worker 0 holds missing for 'layer0.A'"):
        _sync([ChecksumHook()], [Dropping()]).sync(0, _tensors(), kind="adapter")


def test_a_digest_mismatch_with_equal_tensors_is_still_an_error():
    class WrongDigest(Holder):
        def receive(self, payload, want_digest):
            super().receive(payload, want_digest)
            return "0" * 32

    with pytest.raises(SyncError, match=r"worker 0 holds buffers with digests \['0+'\].*every tensor equal"):
        _sync([ChecksumHook()], [WrongDigest()]).sync(0, _tensors(), kind="adapter")


def test_build_hooks_from_names():
    hooks = build_hooks(["checksum", "timing", "tests.unit.test_sync:RecordingHook"])
    assert [type(h).__name__ for h in hooks] == ["ChecksumHook", "TimingHook", "RecordingHook"]
    with pytest.raises(UserError, match=r"sync.hooks\[0\]: parity_probe"):
        build_hooks(["parity_probe"])
    with pytest.raises(UserError, match=r"sync.hooks\[1\].*no_such_module"):
        build_hooks(["timing", "no_such_module:Hook"])
    with pytest.raises(UserError, match=r"sync.hooks\[0\].*before_sync"):
        build_hooks(["tests.unit.test_sync:_tensors"])


def test_workers_digest_only_when_a_hook_needs_it():
    """No hook sets needs_checksums: the workers hash nothing during the push; a hook that reads
    event.worker_checksums still gets them (fetched when read)."""
    holders = [Holder()]
    RecordingHook.needs_checksums = False
    try:
        RecordingHook.events = []
        _sync([TimingHook(), RecordingHook()], holders).sync(2, _tensors(), kind="adapter")
        assert holders[0].hashed == 0
        assert RecordingHook.events[-1] == ("after", 2, 1, 3)
    finally:
        RecordingHook.needs_checksums = True
