"""Tensor parallelism, real vLLM (two worker processes) and real Megatron (two gloo ranks), tiny
dense Llama and Qwen3, fp32 and bf16.

- Cross-layout `kimi-rl parity check --rollout-tp A --trainer-tp B` (rl.checker.run_check):
  every sampled token's log-prob is torch.equal between vLLM at TP=A and Megatron at TP=B, in
  both directions (2 -> 1 and 1 -> 2), on both architectures and both dtypes (bf16 with an odd
  vocabulary, padded at TP=2). It holds because the row-parallel layers' K-order is fixed by
  the model (parity.tp.row_splits): TP=1 adds the same fp32 slice partials in the same order
  as the ranks' all-gathered ones.
- The same tokens re-scored by Megatron at TP=2 and TP=1: the same bits (TP=2 on both sides).
- With a LoRA adapter on every linear (replicated, parity/tp.py), TP=2 on both sides.
- Full-weight sync and checksums under TP=2: the caller sends and reads full tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl.checker import CheckArgs, rescore, run_check
from tests.conftest import write_prompt_file

PROMPT_LENS = (1, 5, 17, 64, 130, 300)
BATCH_SIZES = [1, 8]
BUDGET = 256  # below the 300-token prompt: chunked prefill, mixed prefill/decode steps
TP = 2


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompt_file(tmp_path_factory.mktemp("prompts"), PROMPT_LENS)


def _args(model_dir, dtype, prompt_file, rollout_tp=TP, trainer_tp=TP) -> CheckArgs:
    return CheckArgs(
        model=Path(model_dir), dtype=dtype, prompts=prompt_file, num_prompts=len(PROMPT_LENS),
        max_tokens=12, batch_sizes=BATCH_SIZES, parity=True, seed=0, report=None,
        max_num_batched_tokens=BUDGET, rollout_tp=rollout_tp, trainer_tp=trainer_tp,
    )


def _assert_bitwise(result, rollout_tp: int, trainer_tp: int) -> None:
    expected = sum(-(-len(PROMPT_LENS) // bs) * bs for bs in BATCH_SIZES)
    assert len(result.completions) == len(result.train_logprobs) == expected
    for c, train in zip(result.completions, result.train_logprobs, strict=True):
        assert len(c.token_ids) > 0
        assert torch.equal(c.rollout_logprobs, train), (len(c.prompt_ids), c.rollout_logprobs - train)
    report = result.report
    assert (report["rollout_tp"], report["trainer_tp"]) == (rollout_tp, trainer_tp)
    assert report["passed"] and report["bitwise_equal_fraction"] == 1.0
    assert report["max_abs_diff"] == report["kl_k1"] == report["kl_k3"] == 0.0
    print(f"\nrollout TP={rollout_tp} vs trainer TP={trainer_tp}, {report['dtype']}: "
          f"{report['tokens_compared']} tokens, bitwise fraction {report['bitwise_equal_fraction']}")


@pytest.fixture(scope="module")
def llama_fp32_2to1(model_factory, prompt_file):
    """vLLM at TP=2, Megatron at TP=1 (in this process)."""
    return run_check(_args(model_factory("llama", "fp32"), "fp32", prompt_file, rollout_tp=2, trainer_tp=1))


def test_cross_layout_llama_fp32_rollout_tp2_trainer_tp1(llama_fp32_2to1):
    _assert_bitwise(llama_fp32_2to1, 2, 1)


def test_trainer_tp2_scores_the_tp1_bits(model_factory, llama_fp32_2to1):
    """The same vLLM TP=2 samples re-scored by Megatron at TP=2 (two gloo ranks): equal to the
    TP=1 trainer's log-probs and to vLLM's, bit for bit (so TP=2 on both sides holds too)."""
    cs = llama_fp32_2to1.completions
    args = _args(model_factory("llama", "fp32"), "fp32", None)
    tp2 = rescore(args, [c.prompt_ids + c.token_ids for c in cs], [len(c.prompt_ids) for c in cs])
    for c, t1, t2 in zip(cs, llama_fp32_2to1.train_logprobs, tp2, strict=True):
        assert torch.equal(t1, t2) and torch.equal(c.rollout_logprobs, t2)


def test_cross_layout_llama_bf16_odd_vocabulary_rollout_tp1_trainer_tp2(tmp_path, prompt_file):
    """A vocabulary of 515 rows does not split over 2 ranks: the TP=2 side pads it with zero
    rows to 516 (parity/tp.py) and cuts the padded logit off before anything reads it."""
    from rl.models import init_model

    model = init_model("llama", "tiny", 0, tmp_path / "odd", "bf16", overrides={"vocab_size": 515})
    result = run_check(_args(model, "bf16", prompt_file, rollout_tp=1, trainer_tp=2))
    _assert_bitwise(result, 1, 2)
    assert all(t < 515 for c in result.completions for t in c.token_ids)


def test_cross_layout_qwen3_bf16_rollout_tp2_trainer_tp1(model_factory, prompt_file):
    _assert_bitwise(run_check(_args(model_factory("qwen3", "bf16"), "bf16", prompt_file, 2, 1)), 2, 1)


def test_cross_layout_qwen3_fp32_rollout_tp1_trainer_tp2(model_factory, prompt_file):
    _assert_bitwise(run_check(_args(model_factory("qwen3", "fp32"), "fp32", prompt_file, 1, 2)), 1, 2)


def _random_adapter(spec, rank: int, seed: int = 1) -> dict[str, torch.Tensor]:
    from parity.lora import TARGETS, part_shapes, peft_key

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(spec.num_layers):
        for target, (fan_in, fan_out) in part_shapes(spec).items():
            assert target in TARGETS
            out[peft_key(layer, target, "A")] = torch.randn(rank, fan_in, generator=gen) * 0.1
            out[peft_key(layer, target, "B")] = torch.randn(fan_out, rank, generator=gen) * 0.1
    return out


def test_tp2_lora_and_weight_sync(model_factory, prompt_file):
    """An adapter on every linear (set_adapter and set_adapter_packed), full-weight sync and
    checksums, all through a TP=2 engine: the caller deals in full tensors only."""
    from safetensors.torch import load_file

    from parity.compare import tensor_checksum
    from parity.lora import TARGETS
    from parity.model_spec import ModelSpec
    from parity.wire import digest, pack_tensors
    from rollout.engine import RolloutEngine
    from trainer.megatron.convert import hf_to_megatron, megatron_to_rollout

    model_dir = model_factory("llama", "fp32")
    spec = ModelSpec.from_dir(model_dir)
    hf = load_file(str(next(Path(model_dir).glob("*.safetensors"))))
    lora_rank, alpha = 4, 8.0
    adapter = _random_adapter(spec, lora_rank)
    prompts = [[3 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]
    with RolloutEngine(model_dir, dtype="fp32", tensor_parallel_size=TP, max_model_len=512,
                       max_num_batched_tokens=BUDGET) as engine:
        # Checksums are of the full (gathered) tensors: they equal the checkpoint's.
        assert engine.weight_checksums() == {
            k: tensor_checksum(v) for k, v in hf.items() if k != "lm_head.weight"
        }
        full = megatron_to_rollout(hf_to_megatron(hf, spec), spec)
        flat, index = pack_tensors(full)
        engine.update_params_packed(flat, index)  # full tensors in, each worker keeps its shard
        assert engine.param_checksums() == {k: tensor_checksum(v) for k, v in full.items()}
        assert engine.param_digest([name for name, *_ in index]) == digest(flat)  # the sync's one digest

        engine.set_adapter(adapter, alpha / lora_rank)
        assert engine.adapter_checksums() == {k: tensor_checksum(v) for k, v in adapter.items()}
        with_adapter = engine.generate(prompts, max_tokens=8)
        sequences = [c.prompt_ids + c.token_ids for c in with_adapter]
        engine.clear_adapter()
        base_logprobs = engine.prompt_logprobs(sequences)
        flat, index = pack_tensors(adapter)
        engine.set_adapter_packed(flat, index, alpha / lora_rank)
        assert engine.adapter_digest() == digest(flat)
        packed_logprobs = engine.prompt_logprobs(sequences)
    args = _args(model_dir, "fp32", prompt_file)
    train = rescore(
        args, [c.prompt_ids + c.token_ids for c in with_adapter],
        [len(c.prompt_ids) for c in with_adapter], adapter=(adapter, lora_rank, alpha, TARGETS),
    )
    # The adapter is really applied (it moves every sequence's log-probs).
    assert all(not torch.equal(b, p) for b, p in zip(base_logprobs, packed_logprobs, strict=True))
    for c, t, p in zip(with_adapter, train, packed_logprobs, strict=True):
        assert torch.equal(c.rollout_logprobs, t), (len(c.prompt_ids), c.rollout_logprobs - t)
        # Teacher-forced in vLLM through the packed adapter: the same bits for the sampled part.
        assert torch.equal(p[len(c.prompt_ids) - 1 :], t)


def test_config_takes_any_tp_on_either_side(model_factory, tmp_path):
    from rl.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text(
        f"run_dir: {tmp_path / 'run'}\ntotal_steps: 3\nmodel: {{path: {model_factory('llama', 'fp32')}}}\n"
        "rollout:\n  tensor_parallel_size: 2\n"
    )
    assert load_config(path).rollout.tensor_parallel_size == 2  # against the trainer's 1
    path.write_text(path.read_text().replace("tensor_parallel_size: 2", "tensor_parallel_size: 3"))
    with pytest.raises(ConfigError, match=rf"{path}:5: rollout.tensor_parallel_size: "
                       "num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        load_config(path)
    cfg = load_config(path, ["rollout.tensor_parallel_size=1", "trainer.tensor_parallel_size=2"])
    assert cfg.trainer.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="trainer.tensor_parallel_size: num_attention_heads=4 is not "
                       "divisible by tensor_parallel_size=3"):
        load_config(path, ["rollout.tensor_parallel_size=1", "trainer.tensor_parallel_size=3"])
    two = ["rollout.tensor_parallel_size=1", "trainer.tensor_parallel_size=2"]
    with pytest.raises(ConfigError, match="trainer.tensor_parallel_size: is 2: a TP trainer trains "
                       "replicated LoRA adapters; set lora.enabled true"):
        load_config(path, [*two, "lora.enabled=false"])
    with pytest.raises(ConfigError, match="trainer.tensor_parallel_size: is 2: with parity off"):
        load_config(path, [*two, "parity.enabled=false"])
    with pytest.raises(ConfigError, match="trainer.tensor_parallel_size: is 2: tensor parallelism is the "
                       "megatron backend's"):
        load_config(path, [*two, "trainer.backend=deepspeed"])


def test_check_cli_refuses_indivisible_tp(model_factory, capsys):
    from rl.cli import main

    code = main(["parity", "check", "--model", model_factory("llama", "fp32"),
                 "--tensor-parallel-size", "3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--tensor-parallel-size: num_attention_heads=4 is not divisible by" in err
    code = main(["parity", "check", "--model", model_factory("llama", "fp32"), "--trainer-tp", "3"])
    assert code == 2
    assert "--trainer-tp: num_attention_heads=4 is not divisible by" in capsys.readouterr().err
