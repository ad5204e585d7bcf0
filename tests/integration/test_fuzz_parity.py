"""A fixed-seed slice of the shape fuzzer (scripts/fuzz_parity.py) on the real engines: two drawn
trials, a kimi-mini (fp32, KDA + 2 MLA layers, 9 experts / top-3, a 28-wide hidden size) and a
Qwen3 (bf16, head_dim 76, GQA group 2, odd intermediate and vocabulary), each through
`kimi-rl parity check` with chunked prefill, the rollout on one compiled-kernel path and the
trainer on another (--isa-mix) and drawn sampling parameters (--draw-sampling); every sampled
token must be bit-identical."""

from __future__ import annotations

import json

from parity import native
from scripts.fuzz_parity import DEFAULT_ARCHS, fuzz

# The seed whose first two trials are the cheapest draw covering kimi-mini and a dense model
# in both dtypes (found by drawing, not by running: the draw is cheap and deterministic).
SEED = 1553
# SEED was found with the default arch list (llama, qwen3, kimi-mini), which never grows: with
# every arch (ARCHS, since qwen3-moe joined) rng.choice draws a second kimi-mini instead.


def test_fuzz_slice_is_bitwise(tmp_path):
    out = tmp_path / "fuzz.json"
    done = fuzz(2, SEED, list(DEFAULT_ARCHS), out=out, isa_mix=True, draw_sampling=True)
    assert [(t.arch, t.dtype) for t in done] == [("kimi-mini", "fp32"), ("qwen3", "bf16")]
    assert any(t.top_p < 1.0 or t.top_k > 0 for t in done)
    for trial in done:
        if len(native.cpu_isas()) > 1:  # scalar and at least AVX2 on any x86-64 CI machine
            assert trial.rollout_isa != trial.trainer_isa
            assert {trial.rollout_isa, trial.trainer_isa} <= set(native.cpu_isas())
        assert trial.error is None, trial.error
        assert trial.tokens > 0
        assert trial.bitwise_fraction == 1.0, (trial.shape, trial.max_abs_diff)
    assert [t["index"] for t in json.loads(out.read_text())["trials"]] == [0, 1]
