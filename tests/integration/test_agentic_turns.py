"""Agentic turns on the real vLLM engine: a turn ends at the close of its tool call, and prefix
caching between turns changes no bit.

Stop at `</tool_call>`. A random-init model never writes a tool call, so these tests build one
that always does: a tiny Llama whose layers add nothing (o_proj and down_proj zero: the next
token is a function of the current token alone) and whose lm_head maps the assistant header to
`<tool_call>`, that to the call's JSON, that to `</tool_call>`, each with a logit of 30 (the
rest are the random ones, about 1). The call's tokens are added to the tokenizer: once with
`</tool_call>` as a token of its own (the stop is its id, matched by the engine), once only
inside the token that holds the call's JSON (the stop is a string, matched on vLLM's
detokenized text). After `</tool_call>` the model writes random tokens: only the stop ends the
turn there. Every turn's call is parsed and run by rl.env.ToolEnv; the trajectory is exactly
what vLLM generated plus the observation ids, and the trainer's log-probs equal the rollout's.

Prefix caching: the same 3-turn trajectories sampled with the engine's prefix cache on and off
(a cold recompute of every turn) give the same tokens and bitwise-equal log-probs, and turns 2
and 3 take their earlier turns' blocks from the cache (hits counted per turn).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity.sampling import Sampling
from rl.checker import CheckArgs, env_samples, rescore
from rl.env import ToolEnv, chat_prompt_ids, tool_call_stop
from rl.env_check import run_env_check, sample_trajectories
from rl.tools import ToolCall, parse_tool_calls
from rollout.engine import Stop

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BODY = '{"name": "calculator", "arguments": {"expression": "6 * 7"}}'
# The added tokens of each variant: the stop by id, the stop by string.
CHAINS = {"stop-id": [OPEN, BODY, CLOSE], "stop-string": [OPEN, BODY + CLOSE]}
TURNS = 3


def _tool_caller(out: Path, chain_texts: list[str]) -> str:
    """The tiny Llama of the module docstring, writing `chain_texts` (added tokens) after every
    assistant header; returns its directory."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from rl.models import init_model

    path = init_model(arch="llama", preset="tiny", seed=0, out_dir=out,
                      overrides={"vocab_size": 576, "tie_word_embeddings": False})
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens(chain_texts)  # ids 512.. (the vocabulary is padded to 576)
    tokenizer.save_pretrained(str(path), save_jinja_files=False)
    header = chat_prompt_ids(tokenizer, [{"role": "user", "content": "?"}])[-1]
    chain = [header, *tokenizer.convert_tokens_to_ids(chain_texts)]
    w = load_file(str(path / "model.safetensors"))
    for name, tensor in w.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    embed, head, norm = w["model.embed_tokens.weight"], w["lm_head.weight"], w["model.norm.weight"]
    g = torch.Generator().manual_seed(1)
    for i, t in enumerate(chain[1:], 1):  # new rows orthogonal to the chain's earlier ones
        v = torch.randn(embed.shape[1], generator=g)
        for b in chain[:i]:
            v -= (v @ embed[b]) / (embed[b] @ embed[b]) * embed[b]
        embed[t] = v / v.norm() * embed[header].norm()
    hidden = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    for a, b in zip(chain, chain[1:], strict=False):
        head[b] = 30 * hidden[a] / (hidden[a] @ hidden[a])
    logits = hidden[chain[:-1]] @ head.T
    assert logits.argmax(-1).tolist() == chain[1:] and (logits.topk(2).values.diff().abs() > 20).all()
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory):
    cache: dict[str, str] = {}

    def make(variant: str) -> str:
        if variant not in cache:
            cache[variant] = _tool_caller(tmp_path_factory.mktemp(variant) / "model", CHAINS[variant])
        return cache[variant]

    return make


def _args(model: str, dtype: str = "fp32", env: str = "tools", num_prompts: int = 2, max_tokens: int = 12,
          **kwargs) -> CheckArgs:
    return CheckArgs(model=Path(model), dtype=dtype, prompts=None, num_prompts=num_prompts,
                     max_tokens=max_tokens, batch_sizes=[num_prompts], parity=True, seed=0, report=None,
                     max_num_batched_tokens=None, sampling=Sampling(), env=env, max_turns=TURNS, **kwargs)


@pytest.mark.parametrize("variant", list(CHAINS))
def test_a_turn_ends_at_the_close_of_its_tool_call(tool_caller, megatron, variant):
    from transformers import AutoTokenizer

    model = tool_caller(variant)
    tokenizer = AutoTokenizer.from_pretrained(model)
    chain = tokenizer.convert_tokens_to_ids(CHAINS[variant])
    expected_stop = Stop(token_ids=(chain[-1],)) if variant == "stop-id" else Stop(strings=(CLOSE,))
    assert tool_call_stop(tokenizer) == expected_stop
    args = _args(model, env_kwargs={"system_prompt": False})
    result = run_env_check(args, ToolEnv, env_samples(args), rescore)
    for t in result.trajectories:
        assert len(t.turns) == TURNS and t.error is None
        for gen, _ in t.turns:
            # The turn is the call and nothing after it, as the ids vLLM sampled.
            assert gen == chain
            (call,) = parse_tool_calls(tokenizer.decode(gen, skip_special_tokens=True))
            assert call == ToolCall("calculator", {"expression": "6 * 7"})
        for _, obs in t.turns[:-1]:
            assert "\n42<|im_end|>" in tokenizer.decode(obs)
        assert t.ids() == t.prompt_ids + [i for gen, obs in t.turns for i in gen + obs]
    for turn, outputs in enumerate(result.engine_outputs):
        for t, out in zip(result.trajectories, outputs, strict=True):
            assert out.prompt_ids == t.prompt_ids + [i for gen, obs in t.turns[:turn] for i in gen + obs]
            assert out.token_ids == t.turns[turn][0]
    report = result.report
    assert report["passed"] and report["tokens_compared"] == report["tokens_equal"] == 2 * TURNS * len(chain)
    assert (report["tool_calls"], report["tool_errors"]) == (2 * TURNS, 0)


class NoStop(ToolEnv):
    """ToolEnv without the stop: a turn runs on to EOS or its budget."""

    def turn_stop(self) -> None:
        return None


def test_without_the_stop_the_model_runs_on_after_its_call(tool_caller):
    from transformers import AutoTokenizer

    model = tool_caller("stop-id")
    tokenizer = AutoTokenizer.from_pretrained(model)
    args = _args(model, env_kwargs={"system_prompt": False})
    trajectories, _, _ = sample_trajectories(args, NoStop, env_samples(args))
    first = trajectories[0].turns[0][0]
    assert first[:3] == tokenizer.convert_tokens_to_ids(CHAINS["stop-id"]) and len(first) == args.max_tokens


# --- prefix caching between turns ------------------------------------------------------------

CACHE_CASES = [("llama", "fp32"), ("qwen3", "fp32"), ("llama", "bf16"), ("qwen3", "bf16")]
BLOCK = 128  # vLLM's CPU KV-cache block: only full blocks are cached


def _long_samples() -> list:
    """Prompts of about 100-300 tokens with no common prefix: every hit is a trajectory's own
    earlier turns."""
    from rl.data import Sample

    words = "Alice Bob Carol Dave Emma Frank Grace Henry Iris Jack Kate Liam".split()
    return [Sample(" ".join(words[(i * 5 + j) % len(words)] for j in range(n)) + f" {i}?")
            for i, n in enumerate((60, 110, 170))]


@pytest.mark.parametrize("arch,dtype", CACHE_CASES, ids=[f"{a}-{d}" for a, d in CACHE_CASES])
def test_prefix_caching_between_turns_changes_no_bit(model_factory, megatron, arch, dtype):
    from rl.env import ProbeEnv

    model, samples = model_factory(arch, dtype), _long_samples()
    warm = run_env_check(_args(model, dtype, "probe", len(samples), 40, prefix_caching=True),
                         ProbeEnv, samples, rescore)
    cold, cold_outputs, _ = sample_trajectories(_args(model, dtype, "probe", len(samples), 40, prefix_caching=False),
                                                ProbeEnv, samples)
    assert warm.report["passed"] and warm.report["turns_mean"] == TURNS
    for w_out, c_out in zip(warm.engine_outputs, cold_outputs, strict=True):
        for w, c in zip(w_out, c_out, strict=True):
            assert w.prompt_ids == c.prompt_ids and w.token_ids == c.token_ids
            assert torch.equal(w.rollout_logprobs, c.rollout_logprobs)
            assert c.cached_tokens == 0
    for turn in range(1, TURNS):  # turn 1 has nothing cached: no two prompts share a block
        for w, prev in zip(warm.engine_outputs[turn], warm.engine_outputs[turn - 1], strict=True):
            # Every full block the previous turn computed (its input and what it sampled, but
            # the last sampled token), short of the last input token (vLLM always computes it).
            computed = len(prev.prompt_ids) + len(prev.token_ids) - 1
            assert w.cached_tokens == min(computed, len(w.prompt_ids) - 1) // BLOCK * BLOCK
    hits = warm.report["prefix_hits_per_turn"]
    assert hits[0] == 0 and hits[1] > 0 and hits[2] > 0
    for w, c in zip(warm.trajectories, cold, strict=True):
        assert w.ids() == c.ids() and w.mask == c.mask


def test_kimi_turns_are_recomputed_cold(model_factory):
    """kimi-mini's engine keeps prefix caching off: its KDA layers' recurrent state is not in
    vLLM's paged KV cache, so a cached prefix could not restore it. Every turn is a cold
    prefill (tests/integration/test_agentic.py checks its turns bitwise)."""
    from rl.env import ProbeEnv

    samples = _long_samples()
    args = _args(model_factory("kimi-mini", "fp32"), "fp32", "probe", len(samples), 40)
    trajectories, outputs, _ = sample_trajectories(args, ProbeEnv, samples)
    assert max(len(t.ids()) for t in trajectories) > 2 * BLOCK
    assert [c.cached_tokens for turn in outputs for c in turn] == [0] * sum(len(t.turns) for t in trajectories)
