"""qwen3-moe (Qwen3MoeForCausalLM) without the engines: `model init` writes a checkpoint
transformers loads with no missing or unexpected keys, the spec reads its MoE fields (and names
the field it refuses), the name map covers the checkpoint and round-trips bitwise, the routing
is transformers' formula and batch invariant, TP and LoRA on the router are refused in one line,
and a LoRA adapter names every expert's projections (the checkpoint's per-expert modules)."""

from __future__ import annotations

import json

import pytest
import torch

from parity import moe, tp, weights
from parity.lora import TARGETS, AdapterLayout, adapter_shapes, peft_key
from parity.model_spec import ModelSpec, load_spec
from rl.errors import UserError
from rl.models import init_model, parse_overrides


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(init_model("qwen3-moe", "tiny", 0, tmp_path_factory.mktemp("q3m") / "model"))


def test_init_loads_in_transformers_with_no_missing_keys(tiny):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tiny, output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    spec = load_spec(tiny)
    assert spec.arch == "qwen3-moe" and spec.qk_norm
    assert (spec.num_experts, spec.num_experts_per_tok, spec.norm_topk_prob) == (8, 2, True)
    assert [spec.is_moe_layer(i) for i in range(spec.num_layers)] == [False, True, True, True]
    # The checkpoint holds the published per-expert names, exactly the name map's HF tensors.
    hf = load_file(f"{tiny}/model.safetensors")
    assert set(hf) == {n for w in weights.weight_map(spec) for n in w.hf}
    assert {n: tuple(t.shape) for n, t in hf.items()} == {
        n: s for n, s in weights.hf_shapes(spec).items() if n in hf
    }
    weights.check_hf_weights(spec, hf)
    for side in ("megatron", "rollout"):
        back = weights.to_hf(weights.from_hf(hf, spec, side), spec, side)
        assert all(torch.equal(back[n], hf[n]) for n in hf)
    mg = weights.from_hf(hf, spec, "megatron")
    assert "decoder.layers.1.mlp.router.weight" in mg
    assert mg["decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight"].shape == (64, 64)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in mg  # layer 0: mlp_only_layers, dense


def _config(tiny: str, **changes) -> dict:
    config = json.loads(open(f"{tiny}/config.json").read())
    config.update(changes)
    return config


def test_spec_reads_published_keys_and_names_bad_fields(tiny):
    config = _config(tiny)
    config["num_experts"] = config.pop("num_local_experts")  # what published checkpoints say
    spec = ModelSpec.from_hf_config({**config, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert spec.num_experts == 8
    assert [spec.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    for changes, field in (
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"mlp_only_layers": [4]}, "mlp_only_layers"),
        ({"num_experts": 0}, "num_experts"),
    ):
        with pytest.raises(ValueError, match=f"^{field} "):
            ModelSpec.from_hf_config({**config, **changes})


def test_set_overrides(tmp_path):
    assert parse_overrides("qwen3-moe", ["num_experts=4", "mlp_only_layers=[]", "norm_topk_prob=false"]) == {
        "num_experts": 4, "mlp_only_layers": [], "norm_topk_prob": False}
    with pytest.raises(UserError, match="^--set num_experts_per_tok: expected a positive integer"):
        init_model("qwen3-moe", "tiny", 0, tmp_path / "a", overrides={"num_experts_per_tok": 0})
    with pytest.raises(UserError, match="^--set: num_experts_per_tok must be in 1..num_experts$"):
        init_model("qwen3-moe", "tiny", 0, tmp_path / "b", overrides={"num_experts": 2, "num_experts_per_tok": 3})
    with pytest.raises(UserError, match="^--set num_experts: not settable for --arch qwen3"):
        parse_overrides("qwen3", ["num_experts=4"])


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_route_is_transformers_formula_and_batch_invariant(renormalize):
    g = torch.Generator().manual_seed(0)
    router, h = torch.randn(8, 64, generator=g), torch.randn(37, 64, generator=g)
    experts, w = moe.softmax_route(router, h, 2, renormalize)
    probs = torch.softmax(h @ router.T, dim=-1, dtype=torch.float32)
    ref_w, ref_e = torch.topk(probs, 2, dim=-1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert torch.equal(experts, ref_e)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(37))
    for i in (0, 17, 36):  # a row routed alone gets the bits it gets in the batch
        e1, w1 = moe.softmax_route(router, h[i : i + 1], 2, renormalize)
        assert torch.equal(e1[0], experts[i]) and torch.equal(w1[0], w[i])


def test_tp_and_router_lora_refused(tiny):
    spec = load_spec(tiny)
    with pytest.raises(ValueError, match="^qwen3-moe runs without tensor parallelism: tensor_parallel_size must be 1, got 2$"):
        tp.check_tp(spec, 2)
    tp.check_tp(spec, 1)
    spec.check_lora_targets(TARGETS)  # attention, dense MLP and every expert's projections
    with pytest.raises(ValueError, match=r"^qwen3-moe: the MoE router \(mlp.gate\) takes no LoRA adapter; "):
        spec.check_lora_targets(["q_proj", "gate"])
    dense = ModelSpec.from_hf_config({**_config(tiny), "architectures": ["Qwen3ForCausalLM"]})
    assert dense.num_experts == 0 and not dense.is_moe_layer(1)
    dense.check_lora_targets(["gate_proj"])


def test_adapter_shapes_name_every_expert_in_the_engines_order(tiny):
    """A reserved adapter (and scripts/random_adapter.py) has one pair per expert of a sparse
    layer under the checkpoint's per-expert module names, the dense layer 0 keeps its MLP pairs,
    in the order parity.lora.layer_linears gives (the trainer's peft_state_dict order)."""
    spec = load_spec(tiny)
    shapes = adapter_shapes(spec, AdapterLayout(4, TARGETS, 2.0))
    h, inter, dense = spec.hidden_size, spec.moe_intermediate_size, spec.intermediate_size
    per_layer = 4 * 2 + 3 * 2  # q k v o, then gate up down, A and B each
    assert len(shapes) == per_layer + (spec.num_layers - 1) * (4 * 2 + spec.num_experts * 3 * 2)
    assert shapes[peft_key(0, "gate_proj", "A")] == (4, h) and shapes[peft_key(0, "down_proj", "A")] == (4, dense)
    assert shapes[peft_key(1, "gate_proj", "B", expert=7)] == (inter, 4)
    assert shapes[peft_key(3, "down_proj", "A", expert=0)] == (4, inter)
    assert shapes[peft_key(3, "down_proj", "B", expert=0)] == (h, 4)
    assert peft_key(2, "up_proj", "A", expert=5) == "base_model.model.model.layers.2.mlp.experts.5.up_proj.lora_A.weight"
    assert not any(".mlp.gate_proj." in n for n in shapes if ".layers.0." not in n)  # sparse: experts only
    assert not any(".experts." in n for n in shapes if ".layers.0." in n)
    names = [n for n in shapes if ".layers.1." in n]
    assert names[:10] == [
        *(peft_key(1, t, w) for t in ("q_proj", "k_proj", "v_proj", "o_proj") for w in "AB"),
        peft_key(1, "gate_proj", "A", expert=0), peft_key(1, "gate_proj", "B", expert=0),
    ]
    assert names[10:14] == [peft_key(1, t, w, expert=0) for t in ("up_proj", "down_proj") for w in "AB"]
    assert names[14] == peft_key(1, "gate_proj", "A", expert=1)
    # only the attention targets: no expert pairs at all
    assert not any(".mlp." in n for n in adapter_shapes(spec, AdapterLayout(4, ("q_proj", "v_proj"), 2.0)))


def test_train_config_takes_expert_lora_refuses_router_and_deepspeed(tiny, tmp_path):
    from rl.config import ConfigError, load_config

    base = ["run_dir=" + str(tmp_path / "run"), f"model.path={tiny}"]
    quickstart = "configs/quickstart.yaml"
    cfg = load_config(quickstart, [*base, "lora.target_modules=[q_proj, v_proj]"])
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    cfg = load_config(quickstart, base)  # the default targets: attention and MLP, experts included
    assert set(cfg.lora.target_modules) == set(TARGETS)
    with pytest.raises(ConfigError, match=r"lora.target_modules\[1\].*'gate' is the MoE router \(mlp.gate\), "
                       "which takes no LoRA adapter"):
        load_config(quickstart, [*base, "lora.target_modules=[q_proj, gate]"])
    with pytest.raises(ConfigError, match="lora.target_modules.*'w1' exists in the Kimi architectures"):
        load_config(quickstart, [*base, "lora.target_modules=[w1]"])
    with pytest.raises(ConfigError, match="trainer.backend.*use trainer.backend megatron"):
        load_config(quickstart, [*base, "lora.target_modules=[q_proj]", "trainer.backend=deepspeed"])
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size.*qwen3-moe runs without tensor parallelism"):
        load_config(quickstart, [*base, "lora.target_modules=[q_proj]", "rollout.tensor_parallel_size=2"])
