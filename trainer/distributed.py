"""torch.distributed helpers that both trainer backends (and the scoring processes) use."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch.distributed as dist


def free_port() -> int:
    """A TCP port on the loopback interface that is free now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interface_of(address: str) -> str:
    """The name of this host's network interface that holds `address` (an IPv4 address)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addresses):
            return name
    raise RuntimeError(f"no network interface of this host has the address {address}")


class Rendezvous:
    """The key-value table where trainer ranks meet (torch.distributed's store), kept in a Ray
    actor: the ranks reach it through Ray's authenticated connections from any node, and it
    opens no socket of its own (a TCPStore listens on every interface; a FileStore needs a
    file system the ranks share, i.e. one host)."""

    def __init__(self) -> None:
        self.table: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.table[key] = value

    def get(self, key: str) -> bytes | None:
        return self.table.get(key)

    def add(self, key: str, amount: int) -> int:
        value = int(self.table.get(key, b"0")) + amount
        self.table[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        current = self.table.get(key)
        if (current is None and not expected) or current == expected:
            self.table[key] = desired
            return desired
        return expected if current is None else current

    def check(self, keys: list[str]) -> bool:
        return all(k in self.table for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.table.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self.table)


_LIVE_STORES: list[RayStore] = []


class RayStore(dist.Store):
    """torch.distributed's Store over a Rendezvous actor. A rank's `get` / `wait` polls until
    the key is there or the timeout has passed, as the C++ stores block."""

    POLL_S = 0.005

    def __init__(self, rendezvous, timeout: timedelta = timedelta(minutes=10)) -> None:
        super().__init__()
        self.rendezvous = rendezvous
        self.wait_timeout = timeout
        # torch keeps a C++ pointer to this store and calls its methods through the Python
        # object, which must therefore outlive the process groups: the process holds it.
        _LIVE_STORES.append(self)

    def _call(self, method: str, *args):
        import ray

        return ray.get(getattr(self.rendezvous, method).remote(*args))

    def _until(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.wait_timeout).total_seconds()
        while not self._call("check", keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer rendezvous: keys {keys} not set within {timeout or self.wait_timeout}")
            time.sleep(self.POLL_S)

    def set(self, key: str, value) -> None:
        self._call("set", key, _bytes(value))

    def get(self, key: str) -> bytes:
        self._until([key])
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", key, _bytes(expected), _bytes(desired))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._until(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def set_timeout(self, timeout: timedelta) -> None:
        self.wait_timeout = timeout

    def clone(self) -> RayStore:  # gloo asks for one per process group it builds
        return RayStore(self.rendezvous, self.wait_timeout)


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
