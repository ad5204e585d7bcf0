"""Tensor parallelism, TP=2 on both sides, real vLLM (two worker processes) and real Megatron
(two gloo ranks), tiny dense Llama.

- `kimi-rl parity check --tensor-parallel-size 2` (rl.checker.run_check): every sampled
  token's log-prob is torch.equal between vLLM TP=2 and Megatron TP=2, fp32 and bf16 (bf16 with
  an odd vocabulary, padded on both sides).
- With a LoRA adapter on every linear (replicated, parity/tp.py), the same holds.
- Full-weight sync and checksums under TP=2: the caller sends and reads full tensors.
- TP=2 vs TP=1 on the trainer: measured, not hidden (the rank-ordered sum adds the two halves of
  each row-parallel product in another order than the TP=1 GEMM, so the bits move a little).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl.checker import CheckArgs, run_check, score_tensor_parallel
from tests.conftest import write_prompt_file

PROMPT_LENS = (1, 5, 17, 64, 130, 300)
BATCH_SIZES = [1, 8]
BUDGET = 256  # below the 300-token prompt: chunked prefill, mixed prefill/decode steps
TP = 2


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompt_file(tmp_path_factory.mktemp("prompts"), PROMPT_LENS)


def _args(model_dir, dtype, prompt_file, tp=TP) -> CheckArgs:
    return CheckArgs(
        model=Path(model_dir), dtype=dtype, prompts=prompt_file, num_prompts=len(PROMPT_LENS),
        max_tokens=12, batch_sizes=BATCH_SIZES, parity=True, seed=0, report=None,
        max_num_batched_tokens=BUDGET, tensor_parallel_size=tp,
    )


def _assert_bitwise(result) -> None:
    expected = sum(-(-len(PROMPT_LENS) // bs) * bs for bs in BATCH_SIZES)
    assert len(result.completions) == len(result.train_logprobs) == expected
    for c, train in zip(result.completions, result.train_logprobs, strict=True):
        assert len(c.token_ids) > 0
        assert torch.equal(c.rollout_logprobs, train), (len(c.prompt_ids), c.rollout_logprobs - train)
    report = result.report
    assert report["tensor_parallel_size"] == TP
    assert report["passed"] and report["bitwise_equal_fraction"] == 1.0
    assert report["max_abs_diff"] == report["kl_k1"] == report["kl_k3"] == 0.0


@pytest.fixture(scope="module")
def fp32_result(model_factory, prompt_file):
    return run_check(_args(model_factory("llama", "fp32"), "fp32", prompt_file))


def test_tp2_parity_fp32(fp32_result):
    _assert_bitwise(fp32_result)
    print(f"\nTP=2 fp32: {fp32_result.report['tokens_compared']} tokens, bitwise fraction "
          f"{fp32_result.report['bitwise_equal_fraction']}, seconds {fp32_result.report['seconds']}")


def test_tp2_parity_bf16_odd_vocabulary(tmp_path, prompt_file):
    """A vocabulary of 515 rows does not split over 2 ranks: both sides pad it with zero rows
    to 516 (parity/tp.py) and cut the padded logit off before anything reads it."""
    from rl.models import init_model

    model = init_model("llama", "tiny", 0, tmp_path / "odd", "bf16", overrides={"vocab_size": 515})
    result = run_check(_args(model, "bf16", prompt_file))
    _assert_bitwise(result)
    assert all(t < 515 for c in result.completions for t in c.token_ids)
    print(f"\nTP=2 bf16, vocab 515: {result.report['tokens_compared']} tokens, bitwise fraction "
          f"{result.report['bitwise_equal_fraction']}")


def test_tp2_vs_tp1_trainer_logprobs(model_factory, fp32_result, megatron):
    """The same tokens scored by Megatron at TP=1 (this process) and TP=2 (the check's ranks).
    Measured on this CPU: ~1/3 of the tokens bitwise equal, max |Δlogp| ~3e-6 (fp32): the
    row-parallel sum of two half-K GEMMs is not the one full-K GEMM. That is why both sides
    must run the same TP degree (the config refuses otherwise)."""
    from trainer.logprobs import sequence_logprobs
    from trainer.model import load_model

    model = load_model(model_factory("llama", "fp32"), "fp32").eval()
    cs = fp32_result.completions
    with torch.no_grad():
        tp1 = []
        for i in range(0, len(cs), 8):
            chunk = cs[i : i + 8]
            tp1 += sequence_logprobs(
                model, [c.prompt_ids + c.token_ids for c in chunk], [len(c.prompt_ids) for c in chunk]
            )
    a, b = torch.cat(tp1), torch.cat(fp32_result.train_logprobs)
    diff = (a - b).abs()
    frac, max_diff = (diff == 0).double().mean().item(), diff.max().item()
    print(f"\ntrainer TP=1 vs TP=2 (fp32, {a.numel()} tokens): bitwise fraction {frac:.4f}, "
          f"max |dlogp| {max_diff:.3e}, mean {diff.mean().item():.3e}")
    # What is true here: TP changes bits, by a rounding-sized amount (same model).
    assert 0.0 < max_diff < 1e-4
    assert frac < 1.0


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
    from parity.wire import pack_tensors
    from rollout.engine import RolloutEngine
    from trainer.convert import hf_to_megatron, megatron_to_rollout

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

        engine.set_adapter(adapter, alpha / lora_rank)
        assert engine.adapter_checksums() == {k: tensor_checksum(v) for k, v in adapter.items()}
        with_adapter = engine.generate(prompts, max_tokens=8)
        sequences = [c.prompt_ids + c.token_ids for c in with_adapter]
        engine.clear_adapter()
        base_logprobs = engine.prompt_logprobs(sequences)
        flat, index = pack_tensors(adapter)
        engine.set_adapter_packed(flat, index, alpha / lora_rank)
        packed_logprobs = engine.prompt_logprobs(sequences)
    args = _args(model_dir, "fp32", prompt_file)
    train = score_tensor_parallel(
        args, [c.prompt_ids + c.token_ids for c in with_adapter],
        [len(c.prompt_ids) for c in with_adapter], adapter=(adapter, lora_rank, alpha, TARGETS),
    )
    # The adapter is really applied (it moves every sequence's log-probs).
    assert all(not torch.equal(b, p) for b, p in zip(base_logprobs, packed_logprobs, strict=True))
    for c, t, p in zip(with_adapter, train, packed_logprobs, strict=True):
        assert torch.equal(c.rollout_logprobs, t), (len(c.prompt_ids), c.rollout_logprobs - t)
        # Teacher-forced in vLLM through the packed adapter: the same bits for the sampled part.
        assert torch.equal(p[len(c.prompt_ids) - 1 :], t)


def test_config_refuses_mismatched_or_unsupported_tp(model_factory, tmp_path):
    from rl.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text(
        f"run_dir: {tmp_path / 'run'}\ntotal_steps: 3\nmodel: {{path: {model_factory('llama', 'fp32')}}}\n"
        "rollout:\n  tensor_parallel_size: 2\n"
    )
    with pytest.raises(ConfigError, match=rf"{path}:5: rollout.tensor_parallel_size: is 2 but "
                       "trainer.tensor_parallel_size is 1"):
        load_config(path)
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size: is 2: kimi-rl train runs"):
        load_config(path, ["trainer.tensor_parallel_size=2"])


def test_check_cli_refuses_indivisible_tp(model_factory, capsys):
    from rl.cli import main

    code = main(["parity", "check", "--model", model_factory("llama", "fp32"),
                 "--tensor-parallel-size", "3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--tensor-parallel-size: num_attention_heads=4 is not divisible by" in err
