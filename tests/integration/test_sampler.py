"""The rollout samples with parity.sampling, on real vLLM and real Megatron:

- the hook (rollout/vllm_patches.py, patch 5) is in place on every worker, and every sampled
  token is exactly what parity.sampling.sample_tokens draws from the trainer's own logits with
  the request's key and the token's position (vLLM's sampler would draw others);
- the same check with the same seed samples the same tokens for every sequence, run after run
  and at batch sizes 1, 8 and 32 (and with rollout TP 2);
- the rollout on one ISA code path and the trainer on another give bitwise-equal log-probs;
- report.json says which path and kernels each side ran, and counts prefix-cache hits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity import native
from parity.sampling import Sampling, processed_logprobs, request_key, sample_tokens
from rl.checker import CheckArgs, batches_for, run_check
from tests.conftest import write_prompt_file

SAMPLING = Sampling(temperature=0.7, top_p=0.9, top_k=20)
PROMPT_LENS = (1, 5, 17, 40, 130)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompt_file(tmp_path_factory.mktemp("prompts"), PROMPT_LENS)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 500, (length,), generator=g).tolist() for length in PROMPT_LENS[:n]]


def _engine(model_dir: str, dtype: str, **kwargs):
    from rollout.engine import RolloutEngine

    return RolloutEngine(model_dir, dtype=dtype, max_model_len=256, max_num_seqs=8,
                         max_num_batched_tokens=64, **kwargs)


def _redraw(model_dir: str, dtype: str, completions, keys: list[int]):
    """From the trainer's logits: (processed log-probs of the sampled tokens, the tokens
    sample_tokens draws at each position) per completion."""
    from trainer.megatron.logprobs import forward_logits
    from trainer.megatron.model import load_model

    model = load_model(model_dir, dtype).eval()
    out = []
    with torch.no_grad():
        for c, key in zip(completions, keys, strict=True):
            ids = torch.tensor([c.prompt_ids + c.token_ids])
            start, n = len(c.prompt_ids), len(c.token_ids)
            logprobs = processed_logprobs(forward_logits(model, ids)[0, start - 1 : start - 1 + n], SAMPLING)
            tokens = sample_tokens(logprobs, [key] * n, list(range(n)))
            out.append((logprobs.gather(1, torch.tensor(c.token_ids).view(-1, 1)).squeeze(1), tokens))
    return out


def test_every_token_comes_from_the_parity_sampler(model_factory, megatron):
    model_dir = model_factory("qwen3", "bf16")
    keys = [request_key(5, 3, i, 0) for i in range(len(PROMPT_LENS))]
    with _engine(model_dir, "bf16") as engine:
        info = engine.kernel_info()
        completions = engine.generate(_prompts(len(PROMPT_LENS)), 10, SAMPLING, keys=keys)
    assert engine.parity_sampler and info["sampler"] == "ParitySampler"
    assert info["isa"] == native.isa() and info["invariant_kernels"] is True
    for c, (logprobs, tokens) in zip(completions, _redraw(model_dir, "bf16", completions, keys), strict=True):
        assert len(c.token_ids) > 0
        assert tokens.tolist() == c.token_ids
        assert torch.equal(c.rollout_logprobs, logprobs)


def _check(model_dir: Path, prompt_file, seed: int, rollout_tp: int = 1):
    args = CheckArgs(
        model=model_dir, dtype="fp32", prompts=prompt_file, num_prompts=len(PROMPT_LENS), max_tokens=8,
        batch_sizes=[1, 8, 32], parity=True, seed=seed, report=None, max_num_batched_tokens=64,
        sampling=SAMPLING, rollout_tp=rollout_tp,
    )
    result = run_check(args)
    assert result.report["passed"]
    kernels = result.report["kernels"]  # report.json records what computed on each side
    assert kernels["rollout"]["isa"] == kernels["trainer"]["isa"] == native.isa()
    assert kernels["rollout"]["invariant_kernels"] is kernels["trainer"]["invariant_kernels"] is True
    assert kernels["rollout"]["sampler"] == "ParitySampler"
    # Batch sizes 8 and 32 resample the prompts of batch size 1: the 130-token one hits.
    assert result.report["prefix_cache"]["on"] and result.report["prefix_cache"]["hit_tokens"] > 0
    return [c.token_ids for c in result.completions]


def test_one_seed_samples_the_same_tokens_at_every_batch_size_run_after_run(model_factory, prompt_file, megatron):
    model_dir = Path(model_factory("llama", "fp32"))
    first = _check(model_dir, prompt_file, seed=7)
    assert first == _check(model_dir, prompt_file, seed=7)
    # Batch sizes 1, 8 and 32 (full batches cycling through the prompts) sample each prompt
    # under its own key wherever it lands: one completion per prompt.
    order = [i for bs in (1, 8, 32) for batch in batches_for(len(PROMPT_LENS), bs) for i in batch]
    by_prompt = {i: {tuple(t) for t, j in zip(first, order, strict=True) if j == i} for i in set(order)}
    assert all(len(tokens) == 1 for tokens in by_prompt.values()), by_prompt
    assert first != _check(model_dir, prompt_file, seed=8)


def test_rollout_tp_2_samples_the_tokens_of_tp_1(model_factory, prompt_file, megatron):
    model_dir = Path(model_factory("llama", "fp32"))
    assert _check(model_dir, prompt_file, seed=7, rollout_tp=2) == _check(model_dir, prompt_file, seed=7)


@pytest.mark.parametrize("rollout_isa", native.ISAS)
def test_rollout_on_one_code_path_trainer_on_another(model_factory, megatron, monkeypatch, rollout_isa):
    """Every path this CPU runs takes the rollout side once, with the trainer on the next one
    (scalar always; AVX2 and AVX-512 where present): log-probs and tokens bitwise equal."""
    paths = native.cpu_isas()
    if rollout_isa not in paths:
        pytest.skip(f"this CPU cannot run {rollout_isa}")
    trainer_isa = paths[(paths.index(rollout_isa) + 1) % len(paths)]
    model_dir = model_factory("qwen3", "bf16")
    keys = [request_key(0, 0, i, 0) for i in range(3)]
    before = native.isa()
    for name, value in native.isa_environment(rollout_isa).items():
        monkeypatch.setenv(name, value)  # the engine's processes start on this path
    try:
        with _engine(model_dir, "bf16") as engine:
            rollout_info = engine.kernel_info()
            completions = engine.generate(_prompts(3), 8, SAMPLING, keys=keys)
        native.set_isa(trainer_isa)
        redrawn = _redraw(model_dir, "bf16", completions, keys)
    finally:
        native.set_isa(before)
    assert rollout_info["isa"] == rollout_isa and native.isa() == before
    for c, (logprobs, tokens) in zip(completions, redrawn, strict=True):
        assert torch.equal(c.rollout_logprobs, logprobs), (rollout_isa, trainer_isa)
        assert tokens.tolist() == c.token_ids


def test_parity_check_rollout_isa_flag(model_factory, prompt_file, tmp_path, megatron):
    """`parity check --rollout-isa scalar`: the rollout's processes run the scalar path (the
    report says so), the trainer this process's path, and every token is bitwise."""
    import json

    from rl.cli import main

    model_dir = model_factory("qwen3", "bf16")
    report = tmp_path / "report"
    assert main(["parity", "check", "--model", model_dir, "--dtype", "bf16", "--prompts", str(prompt_file),
                 "--num-prompts", "3", "--max-tokens", "6", "--batch-sizes", "1,3", "--temperature", "0.7",
                 "--top-p", "0.9", "--top-k", "20", "--rollout-isa", "scalar", "--report", str(report)]) == 0
    data = json.loads((report / "report.json").read_text())
    assert data["kernels"]["rollout"]["isa"] == "scalar"
    assert data["kernels"]["trainer"]["isa"] == native.isa()
    assert data["bitwise_equal_fraction"] == 1.0 and data["tokens_compared"] > 0
