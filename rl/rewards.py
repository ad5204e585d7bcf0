"""Reward functions for kimi-rl. A reward function is `fn(completion: str, sample: Sample) ->
float`; the built-ins are `exact_match`, `number` (first number in the completion, with dense
partial credit), and `reasoning_gym` (the dataset's own `score_answer`); `get_reward_fn` picks
one by name or wraps a user callable. `score_batch` is the only way the driver calls them: a
reward that raises or returns something that is not a finite number scores 0.0 and comes back
as a `RewardIssue` to log, so one bad sample or a buggy user function never kills a run."""

from __future__ import annotations

import functools
import json
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rl.data import Sample, check_reasoning_gym_task, create_reasoning_gym_dataset
from rl.errors import UserError

RewardFn = Callable[[str, Sample], float]

REWARD_TYPES = ("exact_match", "number", "reasoning_gym", "function")


# --- exact match ------------------------------------------------------------------------------


def exact_match(completion: str, sample: Sample) -> float:
    """1.0 if the completion equals the answer after stripping surrounding whitespace, else 0."""
    if sample.answer is None:
        raise ValueError("the sample has no answer to match")
    return 1.0 if completion.strip() == sample.answer.strip() else 0.0


# --- number -----------------------------------------------------------------------------------

# An optional minus (ASCII or U+2212), then digits with proper thousands groups ("1,234",
# tried first so that "1,234" is one number) or plain digits, then an optional fraction; or a
# bare fraction (".5"). "1, 2" is the number 1 (", " is not a thousands separator). Exponents
# ("1e5") are not recognized: the first number of "1e5" is 1.
_NUMBER = re.compile(r"[-\u2212]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")


def extract_number(text: str) -> float | None:
    """The first number in text as a float (ints, decimals, negatives, "1,234"), or None."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    return float(m.group(0).replace(",", "").replace("\u2212", "-"))


def number(completion: str, sample: Sample) -> float:
    """Numeric match of the first number in the completion x against the answer's number a:

      1.0                                          if x == a
      0.1 + 0.4 * max(0, 1 - |x - a| / max(|a|, 1)) if x is present but wrong   (in [0.1, 0.5))
      0.0                                          if the completion has no number

    The partial credit is there for learning from scratch: "produce any number" and then
    "produce a closer number" are rewarded before the exact answer ever shows up, which is what
    lifts a tiny random-init model's mean reward on the built-in counting task from ~0.05 to
    ~0.3 within 20 steps (see `rl.data.builtin_samples`). The distance
    is relative (scaled by |a|) so that a near miss on 1000 counts like a near miss on 10."""
    a = extract_number(sample.answer or "")
    if a is None:
        raise ValueError(f"the sample's answer {sample.answer!r} holds no number")
    x = extract_number(completion)
    if x is None:
        return 0.0
    if x == a:
        return 1.0
    return 0.1 + 0.4 * max(0.0, 1.0 - abs(x - a) / max(abs(a), 1.0))


# --- reasoning-gym ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _reasoning_gym_scorer(task: str, task_kwargs_json: str) -> Callable[..., float]:
    """`score_answer` of the dataset built with the sample's own config, once per config.

    Not `reasoning_gym.get_score_answer_fn(task)`: that builds the dataset with the *default*
    config, and some scorers read the config (decimal_arithmetic, time_intervals, puzzle24,
    polynomial_equations, ...), while `composite` cannot be built without options at all.
    Building a dataset is cheap: entries are generated on demand in __getitem__."""
    return create_reasoning_gym_dataset(task, **json.loads(task_kwargs_json)).score_answer


def reasoning_gym_reward(completion: str, sample: Sample, task: str | None = None) -> float:
    """Score with reasoning-gym's `score_answer(answer, entry)`, entry = metadata["entry"].

    The answer is the text inside the last <answer>...</answer> tag if there is one (the
    reasoning-gym prompt convention), else the whole completion stripped: the default scorer
    compares strings exactly, so "  -4\\n" would otherwise earn only partial credit for "-4"."""
    from reasoning_gym.utils import extract_answer

    entry = sample.metadata.get("entry")
    task = sample.metadata.get("task") or task
    if entry is None or task is None:
        raise ValueError("the sample has no reasoning-gym entry/task in its metadata")
    kwargs = sample.metadata.get("task_kwargs") or {}
    scorer = _reasoning_gym_scorer(task, json.dumps(kwargs, sort_keys=True, default=str))
    tagged = extract_answer(completion) if "<answer>" in completion else None
    answer = tagged if tagged is not None else completion.strip()
    return float(scorer(answer=answer, entry=entry))


# --- selection and batch scoring --------------------------------------------------------------


def get_reward_fn(
    type: str, function: Callable[[str, Sample], Any] | None = None, task: str | None = None
) -> RewardFn:
    """The reward function named by `type` (one of REWARD_TYPES).

    function: the user callable for type "function" (resolved from its import path elsewhere).
    task: for "reasoning_gym", checked now (a typo fails before the first rollout) and used for
    samples whose metadata does not name their task."""
    if type == "exact_match":
        return exact_match
    if type == "number":
        return number
    if type == "reasoning_gym":
        if task is not None:
            check_reasoning_gym_task(task)
        return functools.partial(reasoning_gym_reward, task=task)
    if type == "function":
        if function is None or not callable(function):
            raise UserError("reward type 'function' needs a callable (function: module:name)")
        return function
    raise UserError(f"unknown reward type {type!r}; expected one of {', '.join(REWARD_TYPES)}")


@dataclass
class RewardIssue:
    """A sample whose reward could not be computed (it was scored 0.0)."""

    index: int  # position in the batch
    prompt: str  # the first 80 characters of the prompt
    error: str  # "ExceptionType: message", or what the function returned instead of a number
    # The function returned NaN or inf: the loop skips the step (a number that broke, unlike an
    # exception, says the whole batch's rewards may be wrong).
    non_finite: bool = False

    def __str__(self) -> str:
        return f"reward for sample {self.index} ({self.prompt!r}) set to 0: {self.error}"


def score_batch(
    fn: RewardFn, completions: list[str], samples: list[Sample]
) -> tuple[list[float], list[RewardIssue]]:
    """fn over (completion, sample) pairs. Never raises for a bad reward: an exception, or a
    result that is not a finite real number (None, str, NaN, inf), scores 0.0 and is reported."""
    if len(completions) != len(samples):
        raise ValueError(f"{len(completions)} completions for {len(samples)} samples")
    rewards: list[float] = []
    issues: list[RewardIssue] = []
    for i, (completion, sample) in enumerate(zip(completions, samples, strict=True)):
        error = None
        try:
            value = fn(completion, sample)
        except Exception as e:  # a user function can raise anything; KeyboardInterrupt passes
            error = f"{type(e).__name__}: {e}"
        else:
            value, error = as_reward(value)
        if error is None:
            rewards.append(value)
        else:
            rewards.append(0.0)
            issues.append(RewardIssue(i, excerpt(sample.prompt), error, error.startswith(NON_FINITE)))
    return rewards, issues


NON_FINITE = "returned non-finite"


def as_reward(value: Any) -> tuple[float, str | None]:
    """(float, None) for a finite real number, else (0.0, what was wrong).

    Accepted: int, float, bool (a `completion == answer` reward is natural), numpy scalars and
    anything else with __float__ such as a one-element torch tensor; strings are refused even
    when they parse, because "0.5" from a reward function is a bug worth seeing."""
    if isinstance(value, str | bytes) or not (
        isinstance(value, numbers.Real) or hasattr(value, "__float__")
    ):
        return 0.0, f"returned {type(value).__name__} {value!r:.60}, not a number"
    try:
        x = float(value)
    except (TypeError, ValueError, RuntimeError) as e:  # e.g. a tensor with many elements
        return 0.0, f"returned {type(value).__name__} that is not a scalar ({e})"
    if not math.isfinite(x):
        return 0.0, f"{NON_FINITE} {x}"
    return x, None


def excerpt(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
