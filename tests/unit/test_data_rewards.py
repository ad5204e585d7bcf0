"""rl/data.py and rl/rewards.py: prompt sources (JSONL with bad rows, reasoning-gym offline, the
built-in task, resumable iteration, prompt formatting) and reward functions (number extraction,
exact match, reasoning-gym scoring, and batch scoring that never crashes)."""

from __future__ import annotations

import json
import math

import pytest

from rl.data import (
    PromptSource,
    Sample,
    build_samples,
    builtin_samples,
    format_prompt,
    load_jsonl,
    reasoning_gym_samples,
)
from rl.errors import UserError
from rl.rewards import exact_match, extract_number, get_reward_fn, number, score_batch

# --- number extraction and rewards ------------------------------------------------------------


@pytest.mark.parametrize("text,expect", [
    ("42", 42), ("The answer is 7.", 7), ("-3.5 degrees", -3.5), ("x = \u22127", -7),
    ("1,234 apples", 1234), ("1,234,567.89", 1234567.89), ("1,23", 1), ("1, 2, 3", 1),
    ("12345", 12345), ("1234,567", 1234), (".5", 0.5), ("3.", 3), ("a1b2", 1), ("+5", 5),
    ("2024-01-01", 2024), ("1e5", 1), ("007", 7), ("  0  ", 0), ("", None), ("no digits", None),
    ("minus - 4", 4),
])
def test_extract_number(text, expect):
    got = extract_number(text)
    assert got == expect if expect is None else math.isclose(got, expect)


def s(answer, prompt="p", **metadata):
    return Sample(prompt=prompt, answer=answer, metadata=metadata)


def test_number_reward():
    assert number("6", s("6")) == 1.0
    assert number(" 6 apples", s("6")) == 1.0
    assert number("6.0", s("6")) == 1.0
    assert number("1000", s("1,000")) == 1.0
    assert number("-61", s("-61")) == 1.0
    assert number("no idea", s("6")) == 0.0
    assert math.isclose(number("5", s("6")), 0.1 + 0.4 * (1 - 1 / 6))
    assert math.isclose(number("100", s("6")), 0.1)  # far off: still more than no number
    assert math.isclose(number("0.5", s("0")), 0.1 + 0.4 * 0.5)  # |a| < 1 uses scale 1
    assert number("66", s("6")) < number("7", s("6")) < 1.0
    with pytest.raises(ValueError, match="no number"):
        number("6", s(None))


def test_exact_match():
    assert exact_match("  foo \n", s("foo")) == 1.0
    assert exact_match("Foo", s("foo")) == 0.0
    with pytest.raises(ValueError):
        exact_match("x", s(None))


# --- batch scoring ----------------------------------------------------------------------------


def test_score_batch_reports_bad_rewards_and_never_raises():
    def flaky(completion: str, sample: Sample):
        return {"raise": lambda: 1 / 0, "nan": lambda: float("nan"), "inf": lambda: math.inf,
                "none": lambda: None, "str": lambda: "0.5", "bool": lambda: True,
                "ok": lambda: 0.25}[completion]()

    completions = ["ok", "raise", "nan", "inf", "none", "str", "bool"]
    samples = [s("1", prompt=f"prompt number {i} " + "x" * 100) for i in range(7)]
    rewards, issues = score_batch(flaky, completions, samples)
    assert rewards == [0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert [i.index for i in issues] == [1, 2, 3, 4, 5]
    assert issues[0].error.startswith("ZeroDivisionError: ")
    assert "nan" in issues[1].error and "inf" in issues[2].error
    assert "NoneType" in issues[3].error and "str" in issues[4].error
    assert issues[0].prompt.startswith("prompt number 1") and len(issues[0].prompt) <= 80
    assert "sample 1" in str(issues[0]) and "ZeroDivisionError" in str(issues[0])
    with pytest.raises(ValueError):
        score_batch(flaky, ["ok"], [])


def test_score_batch_reports_samples_without_a_number_answer():
    rewards, issues = score_batch(number, ["3", "3"], [s("3"), s(None)])
    assert rewards == [1.0, 0.0] and len(issues) == 1 and "ValueError" in issues[0].error


def test_get_reward_fn():
    assert get_reward_fn("number") is number
    assert get_reward_fn("exact_match") is exact_match

    def mine(c, sample):
        return 0.5

    assert get_reward_fn("function", function=mine) is mine
    with pytest.raises(UserError, match="callable"):
        get_reward_fn("function")
    with pytest.raises(UserError, match="exact_match"):
        get_reward_fn("bleu")


# --- reasoning-gym (offline) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def arithmetic():
    return reasoning_gym_samples("basic_arithmetic", size=4, seed=0)


def test_reasoning_gym_samples(arithmetic):
    assert len(arithmetic) == 4
    again = reasoning_gym_samples("basic_arithmetic", size=4, seed=0)
    assert [x.prompt for x in again] == [x.prompt for x in arithmetic]  # seeded
    first = arithmetic[0]
    assert first.prompt == first.metadata["entry"]["question"]
    assert first.answer == first.metadata["entry"]["answer"]
    assert first.metadata["task"] == "basic_arithmetic" and first.metadata["task_kwargs"] == {}


def test_reasoning_gym_reward(arithmetic):
    fn = get_reward_fn("reasoning_gym", task="basic_arithmetic")
    x = arithmetic[0]
    wrong = str(int(x.answer) + 1)
    rewards, issues = score_batch(
        fn, [x.answer, f" {x.answer}\n", f"think... <answer>{x.answer}</answer>", wrong],
        [x] * 4,
    )
    assert rewards[:3] == [1.0, 1.0, 1.0] and rewards[3] < 1.0 and not issues
    # A sample from another source has no entry: reported, scored 0.
    rewards, issues = score_batch(fn, ["1"], [s("1")])
    assert rewards == [0.0] and "entry" in issues[0].error


def test_reasoning_gym_unknown_task_and_bad_options():
    with pytest.raises(UserError, match="basic_arithmetic"):  # a close match is suggested
        reasoning_gym_samples("basic_arithmetc", size=2, seed=0)
    with pytest.raises(UserError, match="tasks installed"):
        get_reward_fn("reasoning_gym", task="no_such_task_xyz")
    with pytest.raises(UserError, match="bad options"):
        reasoning_gym_samples("basic_arithmetic", size=2, seed=0, no_such_option=1)
    with pytest.raises(UserError, match="bad options"):
        reasoning_gym_samples("composite", size=2, seed=0, datasets=[{"nme": "x"}])


def test_reasoning_gym_composite_from_plain_dicts():
    specs = [{"name": "basic_arithmetic", "weight": 1, "config": {}},
             {"name": "leg_counting", "weight": 1, "config": {}}]
    samples = reasoning_gym_samples("composite", size=4, seed=0, datasets=specs)
    rewards, issues = score_batch(get_reward_fn("reasoning_gym"), [x.answer for x in samples],
                                  samples)
    assert rewards == [1.0] * 4 and not issues


# --- JSONL ------------------------------------------------------------------------------------


def test_load_jsonl_skips_and_reports_bad_rows(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"prompt": "good one", "answer": "1", "source": "a"}),  # 1
        "",                                                                # 2 blank: ignored
        "{not json",                                                       # 3
        json.dumps(["prompt", "x"]),                                       # 4
        json.dumps({"answer": "2"}),                                       # 5
        json.dumps({"prompt": "   "}),                                     # 6
        json.dumps({"prompt": 7}),                                         # 7
        json.dumps({"prompt": "bad answer", "answer": [1]}),               # 8
        json.dumps({"prompt": "numeric answer", "answer": 12}),            # 9
        json.dumps({"prompt": "no answer"}),                               # 10
        json.dumps({"prompt": "bool answer", "answer": True}),             # 11
    ]
    data = "\n".join(lines).encode() + b"\n\xff\xfe{}\n   \n"              # 12 bad UTF-8
    path.write_bytes(data)
    samples, issues = load_jsonl(path)
    assert [x.prompt for x in samples] == ["good one", "numeric answer", "no answer"]
    assert [x.answer for x in samples] == ["1", "12", None]
    assert samples[0].metadata == {"source": "a"}
    assert [i.line for i in issues] == [3, 4, 5, 6, 7, 8, 11, 12]
    messages = [i.message for i in issues]
    assert "invalid JSON" in messages[0] and "JSON object" in messages[1]
    assert "missing 'prompt'" in messages[2] and "empty" in messages[3]
    assert "'prompt' must be a string" in messages[4] and "'answer'" in messages[5]
    assert "UTF-8" in messages[7]
    assert str(issues[0]) == f"{path}:3: {issues[0].message}"


def test_load_jsonl_fatal_only_without_good_rows(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"answer": 1}\n[1]\n')
    with pytest.raises(UserError, match=r"bad\.jsonl.*2 bad rows.*bad\.jsonl:1"):
        load_jsonl(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(UserError, match="empty"):
        load_jsonl(empty)
    with pytest.raises(UserError, match="cannot read"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_build_samples_dispatch(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\nnope\n')
    samples, issues = build_samples("jsonl", path=path)
    assert len(samples) == 1 and len(issues) == 1
    samples, issues = build_samples("builtin", size=5, seed=1)
    assert len(samples) == 5 and issues == []
    with pytest.raises(UserError, match="unknown prompt source"):
        build_samples("csv")
    with pytest.raises(UserError, match="path"):
        build_samples("jsonl")


# --- the built-in task ------------------------------------------------------------------------


def test_builtin_task_deterministic_and_well_formed():
    a, b = builtin_samples(50, seed=3), builtin_samples(50, seed=3)
    assert a == b
    assert [x.prompt for x in builtin_samples(50, seed=4)] != [x.prompt for x in a]
    for x in a:
        nums = [int(t) for t in x.prompt.removeprefix("Count: ").removesuffix(" ->").split()]
        assert nums == [nums[0], nums[0] + 1, nums[0] + 2]
        assert x.answer == str(nums[0] + 3) and len(x.answer) == 1
        assert number(x.answer, x) == 1.0


# --- resumable iteration ----------------------------------------------------------------------


def test_prompt_source_resume_gives_identical_batches():
    samples = builtin_samples(10, seed=0)
    for i, x in enumerate(samples):
        x.metadata["id"] = i
    ids = lambda batch: [x.metadata["id"] for x in batch]  # noqa: E731

    straight = PromptSource(samples, prompts_per_step=4, seed=7, shuffle=True)
    expected = [ids(straight.next_batch()) for _ in range(8)]  # 32 prompts: 3+ epochs

    first = PromptSource(samples, prompts_per_step=4, seed=7, shuffle=True)
    got = [ids(first.next_batch()) for _ in range(3)]  # stop mid-epoch
    state = json.loads(json.dumps(first.state_dict()))  # as it would be checkpointed
    resumed = PromptSource(samples, prompts_per_step=4, seed=7, shuffle=True)
    resumed.load_state_dict(state)
    got += [ids(resumed.next_batch()) for _ in range(5)]
    assert got == expected

    flat = [i for batch in expected for i in batch]
    epochs = [flat[k:k + 10] for k in (0, 10, 20)]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # each epoch: a permutation
    assert epochs[0] != epochs[1]  # reshuffled with seed + epoch
    assert state["epoch"] == 1 and state["position"] == 2


def test_prompt_source_no_shuffle_and_checks():
    samples = builtin_samples(3, seed=0)
    src = PromptSource(samples, prompts_per_step=2, seed=0, shuffle=False)
    assert src.next_batch() == samples[:2] and src.next_batch() == [samples[2], samples[0]]
    other = PromptSource(builtin_samples(4, seed=0), 2, seed=0, shuffle=False)
    with pytest.raises(UserError, match="num_samples"):
        other.load_state_dict(src.state_dict())
    with pytest.raises(UserError, match="empty"):
        PromptSource([], 2, 0, True)
    with pytest.raises(UserError, match="prompts_per_step"):
        PromptSource(samples, 0, 0, True)


# --- prompt formatting ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from rl.models import build_tokenizer

    return build_tokenizer(512, 2048)


def test_format_prompt(tokenizer):
    x = Sample(prompt="Count: 1 2 3 ->", answer="4", metadata={})
    plain = format_prompt(x, tokenizer, chat_template=False)
    assert tokenizer.decode(plain) == x.prompt and tokenizer.eos_token_id not in plain
    chat = format_prompt(x, tokenizer, chat_template=True)
    assert tokenizer.decode(chat) == "<|im_start|>user\nCount: 1 2 3 -><|im_end|>\n" \
                                     "<|im_start|>assistant\n"
    assert chat.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2
    tokenizer_without = type("T", (), {"chat_template": None})()
    with pytest.raises(UserError, match="chat template"):
        format_prompt(x, tokenizer_without, chat_template=True)
