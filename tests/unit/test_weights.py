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


@pytest.fixture(scope="module", params=["llama", "qwen3", "kimi-mini", "kimi-linear", "qwen3-vocab515"])
def spec(request, tmp_path_factory):
    arch, _, vocab = request.param.partition("-vocab")
    out = tmp_path_factory.mktemp(request.param) / "model"
    init_model(arch=arch, preset="tiny", seed=0, out_dir=out, dtype="fp32",
               overrides={"vocab_size": int(vocab)} if vocab else None)
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


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("side", ["megatron", "rollout"])
def test_tp_shards_reassemble(spec, side, size):
    if not hasattr(spec, "num_kv_heads") or spec.num_kv_heads % size or spec.num_heads % size:
        pytest.skip(f"needs KV heads that shard over {size} ranks")
    full = weights.from_hf(_random_hf(spec), spec, side)
    kinds = weights.shard_kinds(spec, side)
    shards = [weights.shard_state(full, spec, side, r, size) for r in range(size)]
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        assert len({p.shape for p in parts}) == 1, name  # every rank holds the same shape
        assert torch.equal(weights.unshard_tensor(parts, kinds[name], spec.vocab_size), tensor), name


@pytest.mark.parametrize("vocab,size", [(515, 2), (515, 4), (512, 2), (7, 3), (1, 2)])
def test_vocab_shards_are_padded_with_zero_rows(vocab, size):
    from parity.tp import padded_vocab, shard_vocab

    t = torch.arange(vocab * 3, dtype=torch.float32).view(vocab, 3) + 1
    parts = [shard_vocab(t, r, size) for r in range(size)]
    padded = padded_vocab(vocab, size)
    assert padded % size == 0 and vocab <= padded < vocab + size
    assert all(p.shape == (padded // size, 3) for p in parts)
    whole = torch.cat(parts)
    assert torch.equal(whole[:vocab], t) and not whole[vocab:].any()


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


@pytest.mark.parametrize("fused", ["qkv", "gate_up"])
def test_delta_columns_unshard_in_rank_order(fused):
    """A column-parallel adapter delta's columns, sharded for 1, 2 or 4 ranks and put back
    (the gradient gather of the ordered backward): the full delta, exactly."""
    from parity import tp

    delta = torch.randn(3, 5, 48)
    for size in (1, 2, 4):
        shards = [tp.shard_delta_cols(delta, fused, r, size) for r in range(size)]
        assert torch.equal(tp.unshard_delta_cols(shards, fused), delta), size
