"""scripts/profile_parity.py's attribution: a parity kernel call counts once, as its class,
with the ops inside it; a stock op is classed by name; the rest of the wall time is python."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import profile_parity  # noqa: E402

from parity import kernels  # noqa: E402


def test_a_parity_call_counts_once_as_its_class():
    x, w = torch.randn(16, 64), torch.randn(32, 64)

    def call() -> None:
        kernels.linear(x, w)
        torch.nn.functional.linear(x, w)
        torch.log_softmax(x, -1)

    call()
    result = profile_parity.profiled(call)
    names = {name: cls for name, cls, _ in result["top_ops"]}
    assert names["parity.linear"] == "gemm" and names["aten::log_softmax"] == "log_softmax"
    assert not any(name.startswith("kimi_parity::") for name in names)  # inside the scope
    classes = result["classes_s"]
    assert classes["gemm"] > 0 and classes["log_softmax"] > 0
    assert sum(classes.values()) == pytest.approx(result["wall_s"], rel=1e-6)


@pytest.mark.parametrize(("name", "cls"), [
    ("aten::addmm", "gemm"), ("_C::onednn_mm", "gemm"), ("vllm::unified_attention_with_output", "attention"),
    ("vllm::unified_kv_cache_update", "attention"), ("_C::rms_norm", "norm"), ("aten::sort", "sampler"),
    ("aten::mul", "elementwise"), ("aten::index", "other"),
])
def test_stock_ops_are_classed_by_name(name, cls):
    assert profile_parity.classify(name) == cls
