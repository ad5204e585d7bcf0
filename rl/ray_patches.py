"""Every change kimi-rl makes to Ray's process state, in one place (ray 2.60.0).

`bind_to_loopback`: a private local cluster must listen on 127.0.0.1 only. Ray 2.60's
`ray.init(_node_ip_address="127.0.0.1")` does not give that: `services.resolve_ip_for_localhost`
turns a loopback address into the machine's routable IP ("make sure localhost isn't resolved
to the loopback ip"), the C++ gRPC servers (GCS, raylet, every core worker) bind all
interfaces ("::") and the runtime-env agent that routable IP. `services.get_node_ip_address`
returns the loopback IP when `ray_constants.ENABLE_RAY_CLUSTER` is false (Ray's setting for
macOS / Windows, env RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0); then the node IP is 127.0.0.1 and
every server binds 127.0.0.1 (tests/integration/test_faults.py lists the run's listening
sockets). The environment variable covers the processes Ray starts (they import ray afresh);
the constant covers this process, where ray may already be imported.
"""

from __future__ import annotations

import os

_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def bind_to_loopback() -> None:
    from ray._private import ray_constants

    os.environ[_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
