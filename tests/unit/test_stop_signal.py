"""rl/loop.py's StopOnSignal with real signals to this process: the first SIGINT / SIGTERM
asks the loop to stop at the step boundary (the loop then checkpoints; see
tests/integration/test_faults.py), a second one stops at once, and the previous handlers
come back afterwards."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rl.loop import StopOnSignal


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # the handler runs at the next bytecode boundary of the main thread


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_asks_to_stop_a_second_stops_now(sig):
    before = signal.getsignal(sig)
    stop = StopOnSignal()
    try:
        _deliver(sig)
        assert stop.signum == sig
        with pytest.raises(KeyboardInterrupt, match=f"second {signal.Signals(sig).name}"):
            _deliver(sig)
    finally:
        stop.restore()
    assert signal.getsignal(sig) is before
