"""kimi-mini end to end on real vLLM and real Megatron: `kimi-rl parity check` (fp32 and bf16,
with and without a LoRA adapter), the discrete choices (experts per token, the indexer's
positions; kimi-mini and kimi-linear) compared between the two engines, and a 3-step PPO run
with bitwise parity.

Prompts run from 1 to 300 tokens (the indexer keeps index_topk = 16 of them, so the sparsity
really selects), batch sizes 1 and 16, and a 64-token step budget chunks the long prompts and
mixes prefill with decode.
"""

from __future__ import annotations

import json

import pytest
import torch

from parity.model_spec import KimiSpec
from rl.checker import CheckArgs, run_check
from tests.conftest import write_prompt_file, write_random_adapter

PROMPT_LENS = (1, 5, 17, 40, 130, 300)
BATCH_SIZES = [1, 16]
BUDGET = 64
# fp32 without and bf16 with an adapter (bf16 without one: kimi-linear's and the FP8 tests).
CASES = [("fp32", False), ("bf16", True)]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompt_file(tmp_path_factory.mktemp("prompts"), PROMPT_LENS)


@pytest.mark.parametrize("dtype,lora", CASES, ids=[f"{d}-{'lora' if on else 'base'}" for d, on in CASES])
def test_kimi_rollout_logprobs_equal_trainer_logprobs(model_factory, prompt_file, tmp_path, dtype, lora):
    model_dir = model_factory("kimi-mini", dtype)
    adapter = write_random_adapter(model_dir, tmp_path / "adapter") if lora else None
    args = CheckArgs(
        model=model_dir, dtype=dtype, prompts=prompt_file, num_prompts=len(PROMPT_LENS),
        max_tokens=8, batch_sizes=BATCH_SIZES, parity=True, seed=0, report=None,
        max_num_batched_tokens=BUDGET, adapter=adapter,
    )
    result = run_check(args)
    expected = sum(-(-len(PROMPT_LENS) // bs) * bs for bs in BATCH_SIZES)
    assert len(result.completions) == expected
    for c, train in zip(result.completions, result.train_logprobs, strict=True):
        assert len(c.token_ids) > 0
        assert torch.equal(c.rollout_logprobs, train), (len(c.prompt_ids), c.rollout_logprobs - train)
    report = result.report
    assert report["passed"] and report["bitwise_equal_fraction"] == 1.0
    assert report["max_abs_diff"] == report["kl_k1"] == report["kl_k3"] == 0.0


# kimi-linear with DeepSeek-V3.2's indexer (a low-rank query, K3's output gate): grouped routing
# with e_score_correction_bias after a dense first layer.
KIMI_LINEAR_INDEXER = dict(q_lora_rank=48, index_n_heads=4, index_head_dim=32, index_topk=16,
                           mla_use_output_gate=True)


@pytest.mark.parametrize("arch", ["kimi-mini", "kimi-linear"])
def test_kimi_experts_and_indexer_positions_equal_trainer(model_factory, prompt_file, megatron, tmp_path, arch):
    """The rollout engine's per-token choices (traced while it samples, prefill chunks and
    decode steps alike) equal the trainer's from one teacher-forced forward of the same tokens,
    with a LoRA adapter on both sides (it moves the hidden states the router and indexer see)."""
    from rl.checker import load_adapter
    from rl.models import init_model
    from rollout.engine import RolloutEngine
    from trainer.megatron.kimi import routing_trace
    from trainer.megatron.lora import apply_lora, load_peft_state_dict
    from trainer.megatron.model import load_model

    if arch == "kimi-mini":
        model_dir = model_factory("kimi-mini", "bf16")
    else:
        model_dir = str(init_model(arch=arch, preset="tiny", seed=0, out_dir=tmp_path / "model", dtype="bf16",
                                   overrides=KIMI_LINEAR_INDEXER))
    spec = KimiSpec.from_dir(model_dir)
    adapter = load_adapter(write_random_adapter(model_dir, tmp_path / "adapter"))
    prompts = [json.loads(line)["prompt_ids"] for line in prompt_file.read_text().splitlines()]
    with RolloutEngine(model_dir, dtype="bf16", multiprocess=False, max_num_batched_tokens=BUDGET,
                       max_model_len=400) as engine:
        tensors, rank, alpha, targets = adapter
        engine.set_adapter({k: v.to(torch.bfloat16) for k, v in tensors.items()}, alpha / rank)
        engine.trace(True)
        completions = engine.generate(prompts, max_tokens=8)
        trace = engine.take_trace()
        engine.trace(False)
    model = load_model(model_dir, "bf16").eval()
    apply_lora(model, spec, rank, alpha, list(targets))
    load_peft_state_dict(model, tensors)
    assert len(trace) == len(completions)
    selecting = 0
    for c, rollout in zip(completions, trace, strict=True):
        seq = c.prompt_ids + c.token_ids
        with torch.no_grad():
            (train,) = routing_trace(model, torch.tensor([seq]))
        processed = len(seq) - 1  # the last sampled token is never fed back
        for i, kind in enumerate(spec.layer_types):
            key = f"layers.{i}.mlp.experts"
            if i >= spec.first_k_dense_replace:  # a dense first layer routes nothing
                assert rollout[key].shape[0] == processed
                assert torch.equal(rollout[key], train[key][:processed]), key
            else:
                assert key not in rollout and key not in train
            if kind == "mla":
                key = f"layers.{i}.self_attn.selected"
                assert torch.equal(rollout[key], train[key][:processed]), key
                selecting += max(0, processed - spec.index_topk)
    assert selecting > 300  # positions where the indexer dropped keys


@pytest.mark.parametrize("arch,kv_cache_dtype", [("kimi-mini", "auto"), ("kimi-linear", "fp8")])
def test_kimi_ppo_three_steps_bitwise(model_factory, tmp_path, arch, kv_cache_dtype):
    from rl.config import load_config
    from rl.loop import train
    from rl.metrics import read_metrics
    from tests.integration.test_train import QUICKSTART, _assert_every_step_bitwise

    run_dir = tmp_path / "run"
    cfg = load_config(QUICKSTART, [
        f"model.path={model_factory(arch)}", f"run_dir={run_dir}", f"rollout.kv_cache_dtype={kv_cache_dtype}",
        "logging.wandb=disabled",
        "logging.console=false", "data.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "rollout.max_tokens=8", "algorithm.name=ppo", "total_steps=3", "algorithm.kl_coef=0.01",
        "sync.hooks=[checksum,timing,parity_probe]",
        "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,kv_a_proj_with_mqa,kv_b_proj,gate_proj,up_proj,down_proj]",
    ])
    train(cfg)
    records = read_metrics(run_dir)
    _assert_every_step_bitwise(records, 3)
    assert all(r["sync/probe_equal"] == 1.0 for r in records)


def test_check_adapter_errors_come_before_any_engine(model_factory, tmp_path, capsys):
    from rl.cli import main

    model_dir = model_factory("kimi-mini")
    base = ["parity", "check", "--model", model_dir]
    assert main([*base, "--adapter", str(tmp_path / "missing")]) == 2
    assert "adapter_config.json" in capsys.readouterr().err
    adapter = write_random_adapter(model_dir, tmp_path / "adapter")
    assert main([*base, "--adapter", str(adapter), "--parity", "off"]) == 2
    assert "--parity on" in capsys.readouterr().err
    # Graphs replay the buffers of their capture: Kimi cannot reserve its adapter before it yet.
    assert main([*base, "--adapter", str(adapter), "--cuda-graphs", "on"]) == 2
    assert "--cuda-graphs off" in capsys.readouterr().err
    (adapter / "adapter_config.json").write_text("{\n  \"r\": 4,\n  oops\n}")
    assert main([*base, "--adapter", str(adapter)]) == 2
    assert "adapter_config.json:3" in capsys.readouterr().err
