"""Sampling that matches: `kimi-rl parity check --temperature 0.7 --top-p 0.9 --top-k 20` on real
vLLM and real Megatron, tiny Llama (fp32) and Qwen3 (bf16).

vLLM returns the processed log-probs (logprobs_mode="processed_logprobs": after the temperature
and the top-k / top-p cut, renormalised over the kept set); the trainer computes the same
distribution with parity.sampling. Every sampled token's log-prob must be torch.equal, and the
filters must really have changed the log-probs (each is above the temperature-only one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity.sampling import Sampling
from rl.checker import CheckArgs, run_check
from tests.conftest import write_prompt_file

PROMPT_LENS = (1, 5, 17, 64, 130, 300)
BATCH_SIZES = [1, 8]
BUDGET = 256  # chunked prefill of the 300-token prompt, mixed prefill/decode steps
SAMPLING = Sampling(temperature=0.7, top_p=0.9, top_k=20)
# Both architectures and both dtypes, in two engine starts (the sampling ops are the same code
# for every model; test_parity.py covers all four pairs with plain sampling).
CASES = [("llama", "fp32"), ("qwen3", "bf16")]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompt_file(tmp_path_factory.mktemp("prompts"), PROMPT_LENS)


def _rescore(model_dir: str, dtype: str, completions, sampling: Sampling) -> list[torch.Tensor]:
    from trainer.megatron.logprobs import sequence_logprobs
    from trainer.megatron.model import load_model

    model = load_model(model_dir, dtype).eval()
    with torch.no_grad():
        return sequence_logprobs(model, [c.prompt_ids + c.token_ids for c in completions],
                                 [len(c.prompt_ids) for c in completions], sampling=sampling)


@pytest.mark.parametrize("arch,dtype", CASES, ids=[f"{a}-{d}" for a, d in CASES])
def test_sampled_logprobs_equal_with_temperature_top_p_top_k(model_factory, prompt_file, megatron, arch, dtype):
    model_dir = model_factory(arch, dtype)
    args = CheckArgs(
        model=Path(model_dir), dtype=dtype, prompts=prompt_file, num_prompts=len(PROMPT_LENS),
        max_tokens=12, batch_sizes=BATCH_SIZES, parity=True, seed=0, report=None,
        max_num_batched_tokens=BUDGET, sampling=SAMPLING,
    )
    result = run_check(args)
    expected = sum(-(-len(PROMPT_LENS) // bs) * bs for bs in BATCH_SIZES)
    assert len(result.completions) == len(result.train_logprobs) == expected
    for c, train in zip(result.completions, result.train_logprobs, strict=True):
        assert len(c.token_ids) > 0
        assert torch.equal(c.rollout_logprobs, train), (len(c.prompt_ids), c.rollout_logprobs - train)
    report = result.report
    assert report["passed"] and report["bitwise_equal_fraction"] == 1.0
    assert report["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 20}

    # The filters bite: renormalised over at most 20 of the vocabulary, every sampled token's
    # log-prob is above its temperature-only log-prob (and both differ from the raw one).
    tempered = _rescore(model_dir, dtype, result.completions, Sampling(temperature=0.7))
    raw = _rescore(model_dir, dtype, result.completions, Sampling())
    rollout = torch.cat([c.rollout_logprobs for c in result.completions])
    assert torch.isfinite(rollout).all()
    assert (rollout > torch.cat(tempered)).all()
    assert not torch.equal(torch.cat(tempered), torch.cat(raw))


def test_cli_flags_reach_the_check(model_factory):
    """The flags become the CheckArgs run_check samples and scores with (validated before any
    engine starts)."""
    from rl.checker import validate
    from rl.cli import build_parser

    ns = build_parser().parse_args(["parity", "check", "--model", model_factory("llama"),
                                    "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20"])
    assert validate(ns).sampling == SAMPLING


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "0"], "--temperature must be >= 1e-05"),
    (["--top-p", "1.5"], r"--top-p must be in (0, 1], got 1.5"),
    (["--top-k", "-2"], "--top-k must be an integer >= 0"),
])
def test_bad_sampling_flags(model_factory, capsys, flags, message):
    from rl.cli import main

    code = main(["parity", "check", "--model", model_factory("llama"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
