"""torch.distributed helpers that both trainer backends (and the scoring processes) use."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on the loopback interface that is free now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
