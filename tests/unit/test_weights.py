"""The one name map (parity/weights.py): every checkpoint tensor has exactly one place, the
Megatron and rollout names are one-to-one, from_hf / to_hf are inverses (bitwise), and TP
shards reassemble to the full tensor."""

from __future__ import annotations

import json

import pytest
import torch

from parity import weights
from parity.model_spec import load_spec
from rl.models import init_model


@pytest.fixture(scope="module", params=["llama", "qwen3", "kimi-mini"])
def spec(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "model"
    init_model(arch=request.param, preset="tiny", seed=0, out_dir=out, dtype="fp32")
    return load_spec(out)


def _random_hf(spec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = weights.hf_shapes(spec)
    if spec.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def test_every_checkpoint_tensor_has_one_place(spec):
    wmap = weights.weight_map(spec)
    hf_names = [n for w in wmap for n in w.hf]
    assert len(hf_names) == len(set(hf_names))
    assert set(hf_names) == set(_random_hf(spec))
    for side in ("megatron", "rollout"):
        names = [w.name(side) for w in wmap]
        assert len(names) == len(set(names))


@pytest.mark.parametrize("side", ["megatron", "rollout"])
def test_from_hf_to_hf_round_trip_is_bitwise(spec, side):
    hf = _random_hf(spec)
    back = weights.to_hf(weights.from_hf(hf, spec, side), spec, side)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)
    mg = weights.from_hf(hf, spec, "megatron")
    ro = weights.rename(mg, spec, "megatron", "rollout")
    assert all(torch.equal(ro[n], t) for n, t in weights.from_hf(hf, spec, "rollout").items())


def test_tp_shards_reassemble(spec):
    if not hasattr(spec, "num_kv_heads") or spec.num_kv_heads % 2:
        pytest.skip("dense models with an even number of KV heads shard over 2 ranks")
    full = weights.from_hf(_random_hf(spec), spec, "rollout")
    kinds = weights.shard_kinds(spec, "rollout")
    shards = [weights.shard_state(full, spec, "rollout", r, 2) for r in range(2)]
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        assert torch.equal(weights.unshard_tensor(parts, kinds[name]), tensor), name


def test_check_hf_weights_names_what_is_wrong(spec):
    hf = _random_hf(spec)
    weights.check_hf_weights(spec, hf)
    fused = next(w for w in weights.weight_map(spec) if w.pack)
    partial = {n: hf[n] for n in fused.hf[:1]}
    with pytest.raises(ValueError, match="missing"):
        weights.check_hf_weights(spec, partial)
    with pytest.raises(ValueError, match="unexpected weight"):
        weights.check_hf_weights(spec, {"model.layers.99.foo.weight": torch.zeros(1)})
    name = next(iter(hf))
    with pytest.raises(ValueError, match="shape"):
        weights.check_hf_weights(spec, {name: torch.zeros(3, 3, 3)})
    json.dumps([w.megatron for w in weights.weight_map(spec)])  # plain strings
