"""End to end: `kimi-rl parity check` on real vLLM and real Megatron, tiny Llama and Qwen3
models, fp32 and bf16.

Each check samples in vLLM, closes the engine, then re-scores exactly the sampled tokens with
the Megatron trainer (teacher-forced, in batches of 8 — not the batches vLLM used) and compares
every token's log-prob with torch.equal. The prompts cover lengths 1 to 620 tokens; the vLLM
token budget of 256 per step forces chunked prefill of the long prompts and mixes prefill and
decode of different lengths in one step; batch sizes 1, 3, 8 and 32 put every prompt at several
batch positions (see rl.checker.batches_for). The deepspeed trainer backend's model re-scores
the same tokens too (`--trainer deepspeed`).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rl.checker import CheckArgs, rescore, run_check
from tests.conftest import write_prompt_file

PROMPT_LENS = (1, 5, 17, 64, 130, 300, 620)
BATCH_SIZES = [1, 3, 8, 32]
BUDGET = 256  # max_num_batched_tokens: below the long prompts, so they are chunked
CASES = [("llama", "fp32"), ("llama", "bf16"), ("qwen3", "fp32"), ("qwen3", "bf16")]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompt_file(tmp_path_factory.mktemp("prompts"), PROMPT_LENS)


def _args(model_dir, dtype, prompt_file, parity: bool, batch_sizes=BATCH_SIZES) -> CheckArgs:
    return CheckArgs(
        model=model_dir, dtype=dtype, prompts=prompt_file, num_prompts=len(PROMPT_LENS),
        max_tokens=12, batch_sizes=batch_sizes, parity=parity, seed=0, report=None,
        max_num_batched_tokens=BUDGET,
    )


def _check(model_dir, dtype, prompt_file, parity: bool, batch_sizes=BATCH_SIZES):
    return run_check(_args(model_dir, dtype, prompt_file, parity, batch_sizes))


@pytest.mark.parametrize("arch,dtype", CASES, ids=[f"{a}-{d}" for a, d in CASES])
def test_rollout_logprobs_equal_trainer_logprobs(model_factory, prompt_file, arch, dtype):
    result = _check(model_factory(arch, dtype), dtype, prompt_file, parity=True)
    # Every prompt was sampled at every batch size (the check covers what it claims to).
    expected = sum(-(-len(PROMPT_LENS) // bs) * bs for bs in BATCH_SIZES)
    assert len(result.completions) == len(result.train_logprobs) == expected
    assert {len(c.prompt_ids) for c in result.completions} == set(PROMPT_LENS)
    for c, train in zip(result.completions, result.train_logprobs, strict=True):
        assert c.rollout_logprobs.dtype == train.dtype == torch.float32
        assert len(c.token_ids) > 0
        assert torch.equal(c.rollout_logprobs, train), (len(c.prompt_ids), c.rollout_logprobs - train)
    report = result.report
    assert report["passed"] and report["bitwise_equal_fraction"] == 1.0
    assert report["max_abs_diff"] == report["kl_k1"] == report["kl_k3"] == 0.0
    assert sorted(report["per_batch_size"]) == sorted(str(b) for b in BATCH_SIZES)
    # The same tokens re-scored by the deepspeed backend's model (`--trainer deepspeed`: the HF
    # model under ZeRO-2, ZeRO-3 in bf16), bitwise too; no second vLLM engine needed.
    args = dataclasses.replace(_args(model_factory(arch, dtype), dtype, prompt_file, True),
                               trainer="deepspeed", zero_stage=3 if dtype == "bf16" else 2)
    ds = rescore(args, [c.prompt_ids + c.token_ids for c in result.completions],
                         [len(c.prompt_ids) for c in result.completions])
    assert all(torch.equal(c.rollout_logprobs, d) for c, d in zip(result.completions, ds, strict=True))


def test_parity_off_shows_the_mismatch(model_factory, prompt_file):
    """Stock vLLM and stock Megatron on the same weights disagree: the parity layer is what
    removes the mismatch."""
    result = _check(model_factory("llama", "fp32"), "fp32", prompt_file, parity=False, batch_sizes=[1, 8])
    report = result.report
    assert report["parity"] == "off"
    assert not report["passed"]
    assert report["bitwise_equal_fraction"] < 1.0
    assert report["max_abs_diff"] > 0.0
    # Stock engines are still close: a mismatch of rounding, not a different model.
    assert report["max_abs_diff"] < 1e-2


# --- bad input: one line, exit 2, no traceback, before any engine starts -------------------


def _cli(argv, capsys) -> tuple[int, str]:
    from rl.cli import main

    code = main(argv)
    err = capsys.readouterr().err
    return code, err


def test_missing_model_dir(tmp_path, capsys):
    code, err = _cli(["parity", "check", "--model", str(tmp_path / "nope")], capsys)
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_invalid_model_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json\n")
    code, err = _cli(["parity", "check", "--model", str(tmp_path)], capsys)
    assert code == 2 and "config.json:1" in err and "invalid JSON" in err
    assert len(err.strip().splitlines()) == 1


def test_unknown_arch(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    code, err = _cli(["parity", "check", "--model", str(tmp_path)], capsys)
    assert code == 2 and "GPT2LMHeadModel" in err
    assert len(err.strip().splitlines()) == 1


def test_prompt_file_with_a_bad_line(model_factory, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": \n')
    code, err = _cli(["parity", "check", "--model", model_factory("llama"), "--prompts", str(prompts)], capsys)
    assert code == 2 and f"{prompts}:2" in err and "invalid JSON" in err
    assert len(err.strip().splitlines()) == 1


def test_prompt_row_without_a_prompt(model_factory, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "no prompt field"}\n')
    code, err = _cli(["parity", "check", "--model", model_factory("llama"), "--prompts", str(prompts)], capsys)
    assert code == 2 and f"{prompts}:1" in err and "'prompt'" in err


@pytest.mark.parametrize("sizes,word", [("0", ">= 1"), ("1,x", "'x'"), ("-3", ">= 1")])
def test_bad_batch_sizes(model_factory, capsys, sizes, word):
    code, err = _cli(["parity", "check", "--model", model_factory("llama"), "--batch-sizes", sizes], capsys)
    assert code == 2 and "--batch-sizes" in err and word in err
    assert len(err.strip().splitlines()) == 1


def test_bad_dtype_is_an_argparse_error(model_factory, capsys):
    with pytest.raises(SystemExit) as e:
        _cli(["parity", "check", "--model", model_factory("llama"), "--dtype", "fp16"], capsys)
    assert e.value.code == 2


def test_parity_off_on_a_head_dim_stock_vllm_cannot_run(tmp_path, capsys):
    from rl.models import init_model

    model = init_model("llama", "tiny", 0, tmp_path / "m", overrides={"head_dim": 16})
    code, err = _cli(["parity", "check", "--model", str(model), "--parity", "off"], capsys)
    assert code == 2 and "head_dim 16" in err and "supports head sizes" in err and "32" in err
    assert len(err.strip().splitlines()) == 1


def test_parity_off_on_kimi_mini(model_factory, capsys):
    code, err = _cli(["parity", "check", "--model", model_factory("kimi-mini"), "--parity", "off"], capsys)
    assert code == 2 and "kimi-mini has no stock vLLM model" in err


def test_adapter_that_does_not_fit_the_model(model_factory, tmp_path, capsys):
    """Names and shapes are checked against the model before any engine starts."""
    from safetensors.torch import save_file

    from parity.lora import peft_key

    for name, tensors in [
        ("layer", {peft_key(99, "q_proj", "A"): torch.zeros(4, 128), peft_key(99, "q_proj", "B"): torch.zeros(128, 4)}),
        ("shape", {peft_key(0, "q_proj", "A"): torch.zeros(4, 100), peft_key(0, "q_proj", "B"): torch.zeros(128, 4)}),
    ]:
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
        code, err = _cli(["parity", "check", "--model", model_factory("llama"), "--adapter", str(d)], capsys)
        assert code == 2 and "does not fit" in err, err
        assert ("2 layers" if name == "layer" else "are not [r, 128]") in err, err
        assert len(err.strip().splitlines()) == 1
