"""kimi-linear: `model init --arch kimi-linear` writes the published Kimi Linear format (config
keys, tensor names and shapes) that transformers' KimiLinearForCausalLM loads with no missing
and no unexpected keys; KimiSpec reads it (1-based layer lists) and refuses what the parity
model does not implement; the LoRA targets sit on the checkpoint's module names; the router
(DeepSeek-V3 grouped top-k with e_score_correction_bias) agrees with transformers' router."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parity import kimi
from parity.model_spec import KimiSpec, load_spec
from rl.cli import main as cli_main
from tests.conftest import use_transformers_kimi_linear_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from rl.models import init_model

    return init_model("kimi-linear", "tiny", 0, tmp_path_factory.mktemp("kl") / "model")


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_config_has_the_published_keys(model_dir):
    c = _config(model_dir)
    assert c["architectures"] == ["KimiLinearForCausalLM"] and c["model_type"] == "kimi_linear"
    assert c["linear_attn_config"] == {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 4,
                                       "head_dim": 32, "short_conv_kernel_size": 4}
    assert c["q_lora_rank"] is None and c["mla_use_nope"] is True
    assert c["moe_router_activation_func"] == "sigmoid" and c["first_k_dense_replace"] == 1
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts",
                "num_experts_per_token", "moe_intermediate_size", "moe_layer_freq", "routed_scaling_factor",
                "moe_renormalize", "num_expert_group", "topk_group", "num_shared_experts"):
        assert key in c, key


def test_tensor_names_and_shapes(model_dir):
    w = load_file(str(model_dir / "model.safetensors"))
    a = "model.layers.1.self_attn."
    assert w[a + "q_conv1d.weight"].shape == (128, 1, 4)
    assert w[a + "A_log"].shape == (1, 1, 4, 1) and w[a + "dt_bias"].shape == (128,)
    assert w[a + "g_a_proj.weight"].shape == (32, 128) and w[a + "g_b_proj.weight"].shape == (128, 32)
    assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in w
    assert not any(".indexer." in n or "g_proj" in n or ".conv1d." in n for n in w)
    assert "model.layers.0.mlp.gate_proj.weight" in w  # the dense first layer
    assert not any(n.startswith("model.layers.0.block_sparse_moe") for n in w)
    b = "model.layers.2.block_sparse_moe."
    assert w[b + "gate.e_score_correction_bias"].shape == (8,)
    assert w[b + "experts.7.w1.weight"].shape == (128, 128) and w[b + "experts.7.w2.weight"].shape == (128, 128)
    assert b + "shared_experts.down_proj.weight" in w
    assert "lm_head.weight" in w  # untied, as published
    assert set(w) == set(kimi.hf_weight_shapes(load_spec(model_dir)))


def test_transformers_loads_it_without_missing_or_unexpected_keys(model_dir):
    from transformers import AutoModelForCausalLM

    use_transformers_kimi_linear_config()
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert type(model).__name__ == "KimiLinearForCausalLM"
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert not info["mismatched_keys"] and not info["error_msgs"]
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert model.config.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    # A loaded value, not an init: the correction bias is drawn nonzero.
    bias = load_file(str(model_dir / "model.safetensors"))["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"]
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, bias) and bias.abs().sum() > 0


def test_spec_reads_the_format(model_dir):
    spec = load_spec(model_dir)
    assert isinstance(spec, KimiSpec) and not spec.has_indexer and spec.gate_rank == spec.kda_head_dim
    assert spec.layer_types == ("kda", "kda", "kda", "mla") and spec.mla_use_nope
    assert [spec.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert (spec.num_expert_group, spec.topk_group, spec.routed_scaling_factor) == (2, 1, 2.446)
    assert spec.mla_cache_width == 64 + 16 and spec.kv_layernorm_eps == 1e-6


@pytest.mark.parametrize("key,value,words", [
    ("attn_res_block_size", 2, "attn_res_block_size"),
    ("moe_layer_freq", 2, "moe_layer_freq"),
    ("moe_router_activation_func", "softmax", "moe_router_activation_func"),
    ("linear_attn_config", {"kda_layers": [1, 2], "full_attn_layers": [2], "num_heads": 4, "head_dim": 32,
                            "short_conv_kernel_size": 4}, "linear_attn_config"),
    ("num_expert_group", 3, "num_expert_group"),
    ("hidden_size", 45, "hidden_size // num_attention_heads must be even"),
])
def test_spec_refuses_what_it_does_not_implement(model_dir, key, value, words):
    with pytest.raises(ValueError, match=words):
        KimiSpec.from_hf_config({**_config(model_dir), key: value})


def test_lora_targets_are_the_checkpoint_module_names(model_dir):
    """Every LoRA part is a linear of the checkpoint (its `.weight` exists with that shape), and,
    outside the routed experts (stacked 3-D in transformers 5), a module transformers holds
    under the same path once block_sparse_moe is renamed to mlp, as its conversion does."""
    from transformers import AutoModelForCausalLM

    spec = load_spec(model_dir)
    w = load_file(str(model_dir / "model.safetensors"))
    use_transformers_kimi_linear_config()
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    modules = dict(hf.named_modules())
    paths = [(p, n) for fan_in, parts in kimi.lora_linears(spec).values() for p, n in parts]
    targets = {p.rsplit(".", 1)[-1] for p, _ in paths}
    # shared experts / dense MLPs: *_proj; routed: w1 w2 w3; q_a_proj / q_b_proj need q_lora_rank
    assert targets == set(kimi.LORA_TARGETS) - {"q_a_proj", "q_b_proj"}
    for path, fan_out in paths:
        assert w[path + ".weight"].shape[0] == fan_out
        if ".experts." not in path:
            linear = modules[path.replace(".block_sparse_moe.", ".mlp.")]
            assert isinstance(linear, torch.nn.Linear) and linear.out_features == fan_out
    assert kimi.peft_name("model.layers.2.block_sparse_moe.experts.0.w1", "A") == (
        "base_model.model.model.layers.2.block_sparse_moe.experts.0.w1.lora_A.weight")


def test_router_matches_transformers(model_dir):
    """Same experts (as sets) and the same weights within fp32 rounding as transformers'
    KimiLinearTopkRouter, on inputs where the bias and the groups change the choice."""
    from transformers import AutoConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

    spec = load_spec(model_dir)
    use_transformers_kimi_linear_config()
    router = KimiLinearTopkRouter(AutoConfig.from_pretrained(model_dir))
    g = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(8, 128, generator=g) * 0.3
    router.e_score_correction_bias.data = torch.randn(8, generator=g) * 0.3
    h = torch.randn(64, 128, generator=g)
    _, ref_w, ref_e = router(h)
    experts, weights = kimi.route(spec, router.weight.data, h, router.e_score_correction_bias.data)
    order = torch.argsort(ref_e, dim=-1)
    assert torch.equal(torch.sort(experts, -1).values, ref_e.gather(1, order))
    mine = weights.gather(1, torch.argsort(experts, dim=-1))
    assert (mine - ref_w.gather(1, order)).abs().max() < 1e-6
    # The bias and the groups matter here: plain top-k of the scores picks differently.
    plain = torch.sort(torch.sigmoid(h @ router.weight.data.T), -1, descending=True).indices[:, :2]
    assert not torch.equal(torch.sort(plain, -1).values, torch.sort(experts, -1).values)


def test_cli_init_with_overrides(tmp_path, capsys):
    out = tmp_path / "kl"
    argv = ["model", "init", "--arch", "kimi-linear", "--preset", "tiny", "--seed", "0",
            "--set", "num_experts=4", "--set", "first_k_dense_replace=2", str(out)]
    assert cli_main(argv) == 0
    w = load_file(str(out / "model.safetensors"))
    assert "model.layers.1.mlp.down_proj.weight" in w and "model.layers.2.block_sparse_moe.experts.3.w2.weight" in w
    assert "model.layers.2.block_sparse_moe.experts.4.w2.weight" not in w
    bad = tmp_path / "bad"
    assert cli_main(argv[:8] + ["--set", "moe_layer_freq=2", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "moe_layer_freq" in err and len(err.strip().splitlines()) == 1 and not bad.exists()
