"""qwen3-moe (Qwen3MoeForCausalLM) on both engines against the independent reference,
transformers' Qwen3MoeForCausalLM (+ peft for an adapter):

- the Megatron trainer's fp32 logits and the vLLM rollout's fp32 prompt log-probs match
  transformers within 1e-4 on random prompts (the reference routes with torch's softmax / topk
  and sums the experts in its own order, so the match is close, not bitwise);
- with a LoRA adapter on every expert's gate_proj / up_proj / down_proj under the per-expert
  peft names, the trainer's logits match transformers + peft's (which reads those names into its
  fused-expert parameters) within 1e-4, and the adapter moves them;
- `kimi-rl parity check` is bitwise, fp32 and bf16, with a nonzero LoRA adapter on every
  target (attention, the dense layer's MLP, every expert);
- a 2-step GRPO run with LoRA on the experts keeps parity 1.0 at every step;
- tensor parallelism and LoRA on the router are refused in one line, and so is an adapter
  whose expert names do not fit the model.

The tiny preset has layer 0 dense (mlp_only_layers) and layers 1-3 sparse (8 experts, top 2),
so both feed-forward paths run.
"""

from __future__ import annotations

import random

import pytest
import torch

from parity.lora import TARGETS
from tests.reference import (
    assert_bitwise_with_adapter,
    rollout_logprob_distances,
    trainer_logit_distances,
)

LENGTHS = (1, 2, 9, 70, 130)
TOLERANCE = 1e-4
EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj")


def _sequences() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]


def write_adapter(model_dir: str, out_dir, targets=TARGETS, rank: int = 4, alpha: float = 8.0, seed: int = 0):
    """A peft adapter on `targets` (every expert's, for the MLP targets of a sparse layer), A and
    B nonzero; the names and shapes are parity.lora.adapter_shapes' (scripts/random_adapter.py's)."""
    from parity.lora import AdapterLayout, adapter_shapes
    from parity.model_spec import ModelSpec
    from trainer.checkpoint import peft_config, save_peft

    gen = torch.Generator().manual_seed(seed)
    shapes = adapter_shapes(ModelSpec.from_dir(model_dir), AdapterLayout(rank, tuple(targets), alpha / rank))
    tensors = {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in shapes.items()}
    save_peft(out_dir, tensors, peft_config(rank, alpha, list(targets), model_dir))
    return out_dir


@pytest.fixture(scope="module")
def reference(model_factory):
    """(model dir, [logits [len, vocab] fp32 per sequence]) from transformers."""
    from transformers import AutoModelForCausalLM

    model_dir = model_factory("qwen3-moe", "fp32")
    hf, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        logits = [hf.eval()(torch.tensor([s])).logits[0].float() for s in _sequences()]
    return model_dir, logits


def test_trainer_logits_match_transformers(reference, megatron):
    from trainer.megatron.model import SparseMoE, load_model

    model_dir, expected = reference
    mg = load_model(model_dir, "fp32").eval()
    assert [isinstance(layer.mlp, SparseMoE) for layer in mg.decoder.layers] == [False, True, True, True]
    assert max(trainer_logit_distances(mg, _sequences(), expected)) < TOLERANCE


def test_rollout_prompt_logprobs_match_transformers(reference):
    model_dir, expected = reference
    assert max(rollout_logprob_distances(model_dir, _sequences(), expected)) < TOLERANCE


def test_expert_adapter_matches_transformers_peft(model_factory, megatron, tmp_path):
    """An adapter on the experts only, under the per-expert names: the trainer's fp32 logits are
    within 1e-4 of transformers + peft's (peft reads the names into its fused 3-D expert
    parameters), the adapter moves them, and switched off the base comes back bitwise. Every
    layer sparse here: peft's conversion for fused experts drops the adapter of a dense
    (mlp_only_layers) layer's MLP."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from parity.model_spec import ModelSpec
    from rl.models import init_model
    from trainer.megatron import lora
    from trainer.megatron.logprobs import forward_logits
    from trainer.megatron.model import load_model

    model_dir = str(init_model("qwen3-moe", "tiny", 0, tmp_path / "model", overrides={"mlp_only_layers": []}))
    adapter = write_adapter(model_dir, tmp_path / "adapter", EXPERT_TARGETS)
    seqs = _sequences()[:4]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(hf, str(adapter)).eval()
    with torch.no_grad():
        expected = [peft(torch.tensor([s])).logits[0].float() for s in seqs]
    mg = load_model(model_dir, "fp32").eval()
    base = trainer_logit_distances(mg, seqs, expected)
    lora.apply_lora(mg, ModelSpec.from_dir(model_dir), 4, 8.0, list(EXPERT_TARGETS))
    lora.load_peft_state_dict(mg, load_file(str(adapter / "adapter_model.safetensors")))
    assert max(trainer_logit_distances(mg, seqs, expected)) < TOLERANCE
    assert max(base) > 100 * TOLERANCE  # without the adapter the trainer is far from peft's model
    ids = torch.tensor([seqs[3]])
    with torch.no_grad():
        on = forward_logits(mg, ids)
        with lora.adapters_disabled(mg):
            off = forward_logits(mg, ids)
    assert not torch.equal(on, off)
    assert torch.equal(off, forward_logits(load_model(model_dir, "fp32").eval(), ids))


def test_fresh_expert_adapter_is_exact_zero_and_trained_names_are_per_expert(model_factory, megatron):
    """A fresh adapter (B = 0) on every target leaves the logits bitwise the base's; its tensors
    are named and ordered as parity.lora.adapter_shapes says (what a reserved rollout adapter
    holds), one pair per expert."""
    from parity.lora import AdapterLayout, adapter_shapes
    from parity.model_spec import ModelSpec
    from trainer.megatron import lora
    from trainer.megatron.logprobs import forward_logits
    from trainer.megatron.model import load_model

    model_dir = model_factory("qwen3-moe", "fp32")
    spec = ModelSpec.from_dir(model_dir)
    mg = load_model(model_dir, "fp32").eval()
    ids = torch.tensor([_sequences()[2]])
    with torch.no_grad():
        base = forward_logits(mg, ids)
        lora.apply_lora(mg, spec, 4, 8.0, list(TARGETS))
        assert torch.equal(forward_logits(mg, ids), base)
    names = lora.peft_state_dict(mg)
    shapes = adapter_shapes(spec, AdapterLayout(4, TARGETS, 2.0))
    assert list(names) == list(shapes) and {n: tuple(t.shape) for n, t in names.items()} == shapes
    assert "base_model.model.model.layers.3.mlp.experts.7.down_proj.lora_B.weight" in names


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_parity_check_bitwise_with_lora_on_every_target(model_factory, tmp_path, dtype):
    model_dir = model_factory("qwen3-moe", dtype)
    assert_bitwise_with_adapter(model_dir, dtype, tmp_path, write_adapter(model_dir, tmp_path / "adapter"))


def test_grpo_with_lora_on_the_experts_keeps_parity(model_factory, tmp_path):
    """2 GRPO steps, LoRA on every target (the quickstart's default), the rollout holding an
    adapter reserved at start (enforce_eager false: each sync copies into the buffers laid out
    by parity.lora.adapter_shapes): parity 1.0 and KL 0 at every step, and the experts' B moved."""
    from safetensors.torch import load_file

    from rl.config import load_config
    from rl.loop import train
    from rl.metrics import read_metrics

    run_dir = tmp_path / "run"
    train(load_config("configs/quickstart.yaml", [
        f"model.path={model_factory('qwen3-moe', 'fp32')}", f"run_dir={run_dir}", "logging.wandb=disabled",
        "logging.console=false", "data.prompts_per_step=2", "rollout.samples_per_prompt=4",
        "rollout.max_tokens=6", "total_steps=2", "rollout.enforce_eager=false",
    ]))
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["parity/tokens"] > 0 and r["parity/bitwise_equal_fraction"] == 1.0, r
        assert r["parity/max_abs_diff"] == r["parity/kl_k1"] == 0.0
        assert r["sync/checksum_ok"] == 1.0  # every rollout worker holds the trainer's adapter bytes
    adapter = load_file(str(run_dir / "checkpoints" / "step_000002" / "adapter" / "adapter_model.safetensors"))
    experts = [t for k, t in adapter.items() if ".mlp.experts." in k and "lora_B" in k]
    assert len(experts) == 3 * 8 * 3 and any(t.abs().max() > 0 for t in experts)


def test_tp_router_lora_and_misfit_expert_adapters_refused(model_factory, megatron):
    from parity.lora import peft_key
    from parity.model_spec import ModelSpec
    from rollout.engine import check_adapter
    from trainer.megatron import lora
    from trainer.megatron.model import build_gpt, load_model

    model_dir = model_factory("qwen3-moe", "fp32")
    spec = ModelSpec.from_dir(model_dir)
    with pytest.raises(ValueError, match="^qwen3-moe runs without tensor parallelism: tensor_parallel_size must be 1, got 2$"):
        build_gpt(spec, torch.float32, True, tp_size=2)
    mg = load_model(model_dir, "fp32")
    with pytest.raises(ValueError, match=r"^qwen3-moe: the MoE router \(mlp.gate\) takes no LoRA adapter"):
        lora.apply_lora(mg, spec, 4, 8.0, ["q_proj", "gate"])

    def pair(layer, target, expert=None, fan_in=64, fan_out=32):
        return {peft_key(layer, target, "A", expert): torch.zeros(4, fan_in),
                peft_key(layer, target, "B", expert): torch.zeros(fan_out, 4)}

    check_adapter(spec, "fp32", pair(1, "gate_proj", 7), 2.0)  # expert 7 of sparse layer 1 fits
    for tensors, message in (
        (pair(0, "gate_proj", 0), r"layers\.0\.mlp\.experts\.0\.gate_proj\.lora_A\.weight: layer 0 is dense: "
                                  "its MLP has no experts$"),
        (pair(1, "gate_proj", fan_out=128), r"layers\.1\.mlp\.gate_proj\.lora_A\.weight: layer 1 is sparse: "
                                            r"its MLP targets are per expert \(experts 0\.\.7\)$"),
        (pair(1, "gate_proj", 8), "layer 1 is sparse"),
        (pair(2, "down_proj", 3, fan_in=64, fan_out=64), r"^layer 2 expert 3 down_proj: A \(4, 64\) and B \(64, 4\) "
                                                        r"are not \[r, 32\] and \[64, r\]$"),
        ({"base_model.model.model.layers.1.mlp.gate.lora_A.weight": torch.zeros(4, 64)},
         r"^qwen3-moe: the MoE router \(mlp.gate\) takes no LoRA adapter"),
    ):
        with pytest.raises(ValueError, match=message):
            check_adapter(spec, "fp32", tensors, 2.0)
