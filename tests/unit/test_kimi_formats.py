"""Old kimi-mini directories read as kimi-linear (parity/kimi_formats.py): the converted config
and tensors are exactly the kimi-linear checkpoint of the same function, and each step of the
conversion is exact (byte moves, an identity gate projection, a zero routing bias)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from parity import kernels, kimi, kimi_formats, weights
from parity.model_spec import KimiSpec, load_spec
from tests.conftest import OLD_KIMI_MINI_TINY, write_converted_twin, write_old_kimi_mini


def _old_config(**changes) -> dict:
    return dict(OLD_KIMI_MINI_TINY, architectures=["KimiMiniForCausalLM"], vocab_size=512, num_hidden_layers=4,
                rope_theta=1e4, rms_norm_eps=1e-6, **changes)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi-mini-old")
    old = write_old_kimi_mini(root / "old")
    return old, write_converted_twin(old, root / "twin")


def test_old_config_converts_to_its_kimi_linear_spec(dirs):
    old, twin = dirs
    spec = load_spec(old)
    assert isinstance(spec, KimiSpec) and spec == load_spec(twin)
    assert spec.layer_types == ("kda", "kda", "kda", "mla")
    assert (spec.n_routed_experts, spec.num_experts_per_tok, spec.n_shared_experts) == (8, 2, 1)
    assert spec.index_query_source == "hidden" and spec.q_lora_rank == 0 and not spec.mla_use_nope
    assert spec.gate_rank == spec.kda_num_heads * spec.kda_head_dim
    assert (spec.num_expert_group, spec.routed_scaling_factor, spec.first_k_dense_replace) == (1, 1.0, 0)
    assert spec.kv_layernorm_eps == spec.rms_norm_eps and spec.tie_word_embeddings
    config = json.loads((twin / "config.json").read_text())
    assert config["architectures"] == ["KimiLinearForCausalLM"] and config["model_type"] == "kimi_linear"


def test_converted_tensors_are_the_kimi_linear_checkpoint(dirs):
    old, twin = dirs
    spec, hf = load_spec(old), load_file(str(twin / "model.safetensors"))
    shapes = kimi.hf_weight_shapes(spec)
    assert {n: tuple(t.shape) for n, t in hf.items()} == shapes
    weights.check_hf_weights(spec, hf)
    before = load_file(str(old / "model.safetensors"))
    a = "model.layers.0.self_attn."
    conv = weights.from_hf(hf, spec, "rollout")[a + "conv1d.weight"]
    assert torch.equal(conv, before[a + "conv1d.weight"])  # split then stacked: the same bytes
    assert torch.equal(hf[a + "g_a_proj.weight"], before[a + "g_proj.weight"])
    assert torch.equal(hf[a + "g_b_proj.weight"], torch.eye(spec.kda_num_heads * spec.kda_head_dim))
    assert torch.equal(hf[a + "A_log"].flatten(), before[a + "A_log"])
    b = "model.layers.2.block_sparse_moe."
    assert torch.equal(hf[b + "gate.e_score_correction_bias"], torch.zeros(spec.n_routed_experts))
    assert torch.equal(hf[b + "experts.5.w2.weight"], before["model.layers.2.mlp.experts.5.down_proj.weight"])
    assert torch.equal(hf[b + "shared_experts.up_proj.weight"], before["model.layers.2.mlp.shared_experts.up_proj.weight"])
    assert torch.equal(hf["model.layers.3.self_attn.indexer.wq.weight"],
                       before["model.layers.3.self_attn.indexer.wq.weight"])
    # A kimi-linear checkpoint passes unchanged, even its MLA output gate's g_proj.
    linear = {"model.layers.3.self_attn.g_proj.weight": torch.ones(2, 2)}
    config = json.loads((twin / "config.json").read_text())
    assert dict(kimi_formats.linear_tensors(config, linear.items())) == linear
    # So do converted tensors next to the old config.json (a full export of a model trained from
    # an old directory keeps its config): converting is idempotent.
    old_config = json.loads((old / "config.json").read_text())
    again = dict(kimi_formats.linear_tensors(old_config, hf.items()))
    assert again.keys() == hf.keys() and all(torch.equal(again[n], t) for n, t in hf.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_gate_projection_and_zero_bias_are_exact(dtype):
    """g_b_proj = I after g_a_proj = W gives W x's bits (x * 1 plus exact zeros); a zero
    e_score_correction_bias routes as no bias."""
    gen = torch.Generator().manual_seed(0)
    y = (torch.randn(37, 96, generator=gen) * 3).to(dtype)
    assert torch.equal(kernels.linear(y, torch.eye(96, dtype=dtype)), y)
    spec = KimiSpec.from_hf_config(_old_config())
    h = torch.randn(29, spec.hidden_size, generator=gen).to(dtype)
    router = torch.randn(spec.n_routed_experts, spec.hidden_size, generator=gen).to(dtype)
    plain = kimi.route(spec, router, h)
    biased = kimi.route(spec, router, h, torch.zeros(spec.n_routed_experts, dtype=dtype))
    assert all(torch.equal(p, b) for p, b in zip(plain, biased, strict=True))


def test_old_names_map_and_old_adapters_are_refused_by_module(dirs):
    old, _ = dirs
    assert kimi_formats.linear_name("model.layers.1.mlp.experts.3.gate_proj") == \
        "model.layers.1.block_sparse_moe.experts.3.w1"
    assert kimi_formats.linear_name("base_model.model.model.layers.0.mlp.shared_experts.down_proj.lora_A.weight") == \
        "base_model.model.model.layers.0.block_sparse_moe.shared_experts.down_proj.lora_A.weight"
    assert kimi_formats.linear_name("model.layers.0.mlp.gate_proj.weight") == "model.layers.0.mlp.gate_proj.weight"
    from rollout.engine import check_adapter

    name = "base_model.model.model.layers.0.mlp.experts.1.down_proj.lora_A.weight"
    with pytest.raises(ValueError, match=r"old kimi-mini adapter \(module model\.layers\.0\.mlp\.experts\.1\.down_proj\)"):
        check_adapter(load_spec(old), "fp32", {name: torch.zeros(4, 128)}, 1.0)


def test_bad_old_config_names_the_field():
    with pytest.raises(ValueError, match="layer_types"):
        KimiSpec.from_hf_config(_old_config(layer_types=["kda", "gdn", "kda", "mla"]))
    with pytest.raises(ValueError, match="layer_types"):
        KimiSpec.from_hf_config(_old_config(layer_types=["kda", "mla"]))  # num_hidden_layers 4
