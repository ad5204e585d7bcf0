"""rl.env: trajectories kept as token ids. The model's ids go in exactly as generated, the
observations are the chat template's tool turn as ids, the mask marks the model's tokens, and
the budgets (turns, tokens per trajectory, the engine's context) end a trajectory. `generate`
here replays fixed model outputs: what is under test is the bookkeeping around the engine (the
real engine is in tests/integration/test_agentic.py)."""

from __future__ import annotations

import pytest
import torch

from rl.config import resolve_env
from rl.data import Sample
from rl.env import (
    Budget,
    Env,
    ToolEnv,
    env_metrics,
    run_trajectories,
    tool_call_stop,
    tool_turn_ids,
)
from rl.models import TOKENIZER_VOCAB, build_tokenizer
from rollout.engine import Stop

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123456789 * 987654321"}}</tool_call>'
BIG = 512


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TOKENIZER_VOCAB["tiny"], 4096)


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _replay(tokenizer, turns_text):
    """generate(prompts, turn, stop) that answers every prompt with turn `turn`'s fixed text,
    with log-probs -(position + 1) / 100 (distinct, to check where each lands); the stops it
    was given are in generate.stops."""
    calls = []

    def generate(prompts, turn, stop):
        calls.append([list(p) for p in prompts])
        generate.stops.append(stop)
        ids = _ids(tokenizer, turns_text[turn])
        lp = -torch.arange(1, len(ids) + 1, dtype=torch.float32) / 100 - turn
        return [{"token_ids": list(ids), "rollout_logprobs": lp.clone()} for _ in prompts]

    generate.stops = []
    return generate, calls


def test_tool_turn_ids_finish_the_model_turn(tokenizer):
    ended = _ids(tokenizer, CALL + "<|im_end|>")
    obs = tool_turn_ids(tokenizer, ended, "42")
    assert tokenizer.decode(obs) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    cut = tool_turn_ids(tokenizer, ended[:-1], "42")  # the turn hit its budget: close it
    assert tokenizer.decode(cut) == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.convert_ids_to_tokens(obs[1]) == "<|im_start|>"  # a special token, as one id


def test_two_turn_trajectory_is_generated_plus_observation_ids(tokenizer):
    env = ToolEnv(tokenizer, reward_fn=lambda text, s: float(text.strip() == s.answer), system_prompt=False)
    answer = str(123456789 * 987654321)
    generate, calls = _replay(tokenizer, [CALL + "<|im_end|>", answer + "<|im_end|>"])
    budget = Budget(max_turns=4, max_tokens=64, max_trajectory_tokens=BIG, max_model_len=4096)
    (traj,) = run_trajectories([env], [Sample("What is 123456789 * 987654321?", answer)], budget, generate)
    (gen1, obs1), (gen2, obs2) = traj.turns
    assert gen1 == _ids(tokenizer, CALL + "<|im_end|>") and gen2 == _ids(tokenizer, answer + "<|im_end|>")
    assert obs2 == [] and tokenizer.decode(obs1) == f"\n<|im_start|>tool\n{answer}<|im_end|>\n<|im_start|>assistant\n"
    # The trajectory is the prompt, then exactly the generated ids and the observation ids.
    assert traj.ids() == traj.prompt_ids + gen1 + obs1 + gen2
    assert calls[1] == [traj.prompt_ids + gen1 + obs1]  # turn 2's input: the ids, not a re-encoding
    assert traj.mask == [1] * len(gen1) + [0] * len(obs1) + [1] * len(gen2)
    c = traj.completion()
    assert torch.equal(c["mask"], torch.tensor(traj.mask, dtype=torch.float32))
    on = c["mask"].bool()
    expected = torch.cat([-torch.arange(1, len(gen1) + 1) / 100, -torch.arange(1, len(gen2) + 1) / 100 - 1])
    assert torch.equal(c["rollout_logprobs"][on], expected.float())
    assert torch.equal(c["rollout_logprobs"][~on], torch.zeros(len(obs1)))
    assert traj.reward == 1.0 and traj.done and traj.error is None
    assert env_metrics([env], [traj]) == {"env/turns_mean": 2.0, "env/tool_calls": 1.0,
                                          "env/tool_errors": 0.0, "env/errors": 0.0}


def test_malformed_call_is_an_error_observation(tokenizer):
    env = ToolEnv(tokenizer, reward_fn=lambda text, s: 0.5, system_prompt=False)
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 +"}}</tool_call>' \
          '<tool_call>{"name": "nope"}</tool_call><tool_call>{oops</tool_call>'
    generate, _ = _replay(tokenizer, [bad, "done"])
    budget = Budget(max_turns=2, max_tokens=64, max_trajectory_tokens=BIG, max_model_len=4096)
    (traj,) = run_trajectories([env], [Sample("q", "1")], budget, generate)
    text = tokenizer.decode(traj.turns[0][1])
    assert text.count("error: ") == 3 and "cannot parse" in text and "unknown tool 'nope'" in text
    assert (env.tool_calls, env.tool_errors) == (3, 3) and traj.reward == 0.5


def test_max_turns_ends_a_trajectory_without_a_dangling_observation(tokenizer):
    env = ToolEnv(tokenizer, reward_fn=lambda text, s: 1.0, system_prompt=False)
    generate, calls = _replay(tokenizer, [CALL] * 3)
    budget = Budget(max_turns=3, max_tokens=64, max_trajectory_tokens=BIG, max_model_len=4096)
    (traj,) = run_trajectories([env], [Sample("q", "1")], budget, generate)
    assert len(calls) == 3 and len(traj.turns) == 3 and traj.turns[-1][1] == []
    assert traj.mask[-1] == 1 and traj.reward == 0.0  # never answered


def test_trajectory_budget_cuts_the_model_turn(tokenizer):
    env = ToolEnv(tokenizer, reward_fn=lambda text, s: 1.0, system_prompt=False)
    generate, _ = _replay(tokenizer, [CALL + "<|im_end|>", "x" * 200])
    gen1 = _ids(tokenizer, CALL + "<|im_end|>")
    obs1 = tool_turn_ids(tokenizer, gen1, str(123456789 * 987654321))
    budget = Budget(max_turns=5, max_tokens=64, max_trajectory_tokens=len(gen1) + len(obs1) + 10,
                    max_model_len=4096)
    (traj,) = run_trajectories([env], [Sample("q", "1")], budget, generate)
    assert len(traj.token_ids) == budget.max_trajectory_tokens and traj.done
    assert traj.turns[0] == (gen1, obs1) and traj.turns[1][0] == _ids(tokenizer, "x" * 200)[:10]


def test_context_budget_stops_before_an_observation_that_does_not_fit(tokenizer):
    env = ToolEnv(tokenizer, reward_fn=lambda text, s: 1.0, system_prompt=False)
    generate, calls = _replay(tokenizer, [CALL, CALL])
    prompt = len(env.reset(Sample("q", "1")))
    n1 = len(_ids(tokenizer, CALL))
    budget = Budget(max_turns=5, max_tokens=64, max_trajectory_tokens=BIG, max_model_len=prompt + n1 + 70)
    (traj,) = run_trajectories([env], [Sample("q", "1")], budget, generate)
    assert len(calls) == 1 and traj.done and traj.mask == [1] * n1


class Exploding(Env):
    def reset(self, sample):
        return [5, 6, 7]

    def step(self, generated_ids):
        raise RuntimeError("boom")


def test_an_environment_that_raises_ends_its_trajectory_only(tokenizer):
    envs = [Exploding(tokenizer), ToolEnv(tokenizer, reward_fn=lambda t, s: 1.0, system_prompt=False)]
    generate, _ = _replay(tokenizer, ["hello", "again"])
    budget = Budget(max_turns=2, max_tokens=64, max_trajectory_tokens=BIG, max_model_len=4096)
    bad, good = run_trajectories(envs, [Sample("a", "1"), Sample("b", "1")], budget, generate)
    assert bad.error == "RuntimeError: boom" and bad.done and bad.reward == 0.0
    assert good.error is None and good.reward == 1.0
    assert env_metrics(envs, [bad, good])["env/errors"] == 1.0


def test_resolve_env():
    assert resolve_env("tools") is ToolEnv
    assert resolve_env("tests.unit.test_env:Exploding") is Exploding
    with pytest.raises(Exception, match="env.name"):
        resolve_env("tests.unit.test_env:Missing")
    with pytest.raises(ValueError, match="unknown tool 'calc'"):
        ToolEnv.check_kwargs({"tools": ["calc"]})
    with pytest.raises(ValueError, match="unknown key 'tool'"):
        ToolEnv.check_kwargs({"tool": ["calculator"]})
    with pytest.raises(ValueError, match="example must be true or false"):
        ToolEnv.check_kwargs({"example": "yes"})
    ToolEnv.check_kwargs({"tools": ["python"], "system_prompt": False, "example": True})


def test_probe_env_answers_every_turn(tokenizer):
    env = resolve_env("probe")(tokenizer=tokenizer, reward_fn=None)
    generate, calls = _replay(tokenizer, ["a b c", "d e", "f"])
    budget = Budget(max_turns=3, max_tokens=16, max_trajectory_tokens=BIG, max_model_len=4096)
    (traj,) = run_trajectories([env], [Sample("hello", None)], budget, generate)
    assert len(calls) == 3 and [len(o) > 0 for _, o in traj.turns] == [True, True, False]
    n = len(traj.turns[0][0])
    assert tokenizer.decode(traj.turns[0][1]) == f"<|im_end|>\n<|im_start|>tool\n{n ** 3}<|im_end|>\n<|im_start|>assistant\n"
    assert traj.reward == 0.0 and env.tool_calls == 3
    assert generate.stops == [None] * 3  # no tool-call format: a turn runs to EOS or its budget


def test_tool_turns_stop_at_the_close_of_the_call(tokenizer):
    """Every turn's generate gets the ToolEnv's stop: `</tool_call>` as a stop string where the
    tokenizer splits it (the tiny BPE), as its one token id where the tokenizer has it whole."""
    env = ToolEnv(tokenizer, reward_fn=lambda text, s: 0.0, system_prompt=False)
    generate, _ = _replay(tokenizer, [CALL, "7"])
    budget = Budget(max_turns=2, max_tokens=64, max_trajectory_tokens=BIG, max_model_len=4096)
    (traj,) = run_trajectories([env], [Sample("q", "1")], budget, generate)
    assert generate.stops == [Stop(strings=("</tool_call>",))] * 2 and len(traj.turns) == 2
    assert len(_ids(tokenizer, "</tool_call>")) > 1
    # A turn cut at the stop (no end-of-turn token) is closed by the observation.
    assert tokenizer.decode(traj.turns[0][1]).startswith("<|im_end|>\n<|im_start|>tool\n")
    whole = build_tokenizer(TOKENIZER_VOCAB["tiny"], 4096)
    whole.add_tokens(["<tool_call>", "</tool_call>"])
    (close_id,) = _ids(whole, "</tool_call>")
    assert tool_call_stop(whole) == Stop(token_ids=(close_id,))
    assert ToolEnv(whole).turn_stop() == Stop(token_ids=(close_id,))


def test_the_docs_example_environment_runs(tokenizer, tmp_path, monkeypatch):
    """docs/agentic.md's `# myenv.py` example, as a user copies it."""
    import re
    import sys
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "agentic.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", docs, flags=re.S) if "# myenv.py" in b)
    (tmp_path / "myenv.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = resolve_env("myenv:Echo")
    env = cls(tokenizer=tokenizer, reward_fn=lambda text, s: 2.0)
    generate, _ = _replay(tokenizer, ["hello", "done"])
    budget = Budget(max_turns=3, max_tokens=16, max_trajectory_tokens=BIG, max_model_len=4096)
    (traj,) = run_trajectories([env], [Sample("hi", None)], budget, generate)
    assert traj.reward == 2.0 and len(traj.turns) == 2 and env.tool_calls == 1
    assert "you said 5 characters" in tokenizer.decode(traj.turns[0][1])
    sys.modules.pop("myenv", None)


def test_loop_rewards_and_parity_views_of_trajectories():
    from rl.loop import env_rewards, model_tokens

    mask = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
    c = {"prompt_ids": [1, 2], "token_ids": [10, 11, 20, 21, 12], "mask": mask,
         "rollout_logprobs": torch.tensor([-0.5, -0.25, 0.0, 0.0, -1.0]), "reward": 1.0, "env_error": None}
    samples = [Sample("p0", "1"), Sample("p1", "1"), Sample("p2", "1"), Sample("p3", "1")]
    rewards, issues = env_rewards([c, {**c, "env_error": "RuntimeError: boom"}, {**c, "reward": float("nan")},
                                   {**c, "reward": "1"}], samples)
    assert rewards == [1.0, 0.0, 0.0, 0.0]
    assert [(i.index, i.non_finite) for i in issues] == [(1, False), (2, True), (3, False)]
    assert issues[0].error == "env: RuntimeError: boom" and issues[0].prompt == "p1"
    trainer = torch.tensor([-0.5, -0.25, -7.0, -8.0, -1.0])  # observation tokens: whatever the trainer says
    (view,), (kept,) = model_tokens([c], [trainer])
    assert view["token_ids"] == [10, 11, 12] and torch.equal(view["rollout_logprobs"], kept)
    plain = {"prompt_ids": [1], "token_ids": [5], "rollout_logprobs": torch.tensor([-1.0])}
    assert model_tokens([plain], [trainer[:1]]) == ([plain], [trainer[:1]])


@pytest.mark.parametrize("tool,call", [
    ("calculator", '{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}'),
    ("python", '{"name": "python", "arguments": {"code": "print(1234 * 5678)"}}'),
])
def test_the_worked_example_is_a_real_call_and_its_real_output(tokenizer, tool, call):
    from rl.tools import get_tools, parse_tool_calls, run_tool_call

    env = ToolEnv(tokenizer, reward_fn=None, tools=[tool], system_prompt=False, example=True)
    text = tokenizer.decode(env.reset(Sample("What is 2 + 2?", "4")))
    assert text == ("<|im_start|>user\nWhat is 1234 * 5678?<|im_end|>\n"
                    f"<|im_start|>assistant\n<tool_call>{call}</tool_call><|im_end|>\n"
                    f"<|im_start|>tool\n{get_tools([tool])[tool].example[1]}<|im_end|>\n"
                    "<|im_start|>assistant\n1234 * 5678 = 7006652<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    # The example shows what the tool really answers to that call.
    (parsed,) = parse_tool_calls(f"<tool_call>{call}</tool_call>")
    assert run_tool_call(parsed, get_tools([tool])) == (get_tools([tool])[tool].example[1], True)


def test_the_ablations_tools_off_env_answers_calls_with_an_error(tokenizer):
    """scripts/agentic_ablation.py's tools-off arm: the same prompt as ToolEnv, every call
    parsed, counted and answered with an error; the final answer scored as with the tool."""
    from scripts.agentic_ablation import ToolsOff

    on = ToolEnv(tokenizer, reward_fn=lambda text, s: float(text == s.answer))
    off = ToolsOff(tokenizer, reward_fn=lambda text, s: float(text == s.answer))
    sample = Sample("What is 2 * 3?", "6")
    assert off.reset(sample) == on.reset(sample) and off.turn_stop() == on.turn_stop()
    obs, reward, done = off.step(_ids(tokenizer, CALL + CALL))
    assert tokenizer.decode(obs).count("error: the calculator is not available in this run") == 2
    assert (reward, done, off.tool_calls, off.tool_errors) == (0.0, False, 2, 2)
    assert off.step(_ids(tokenizer, "6")) == ([], 1.0, True)
