"""Environments for agentic (multi-turn) rollouts, over token ids.

An environment is one trajectory's counterpart: `reset(sample)` gives the prompt ids,
`step(generated_ids)` takes the ids the model generated in one turn and gives back
(observation ids, reward, done); `turn_stop()` may end the model's turns early (the `tools`
environment: at `</tool_call>`). The trajectory is kept as token ids from the first prompt to
the last token: what the model generated is appended exactly as vLLM returned it, and only the
observation (the tool result inside the chat template's turn markers) is encoded. Nothing is
ever decoded and re-encoded to build the next turn's input, so the trainer scores exactly the
tokens the rollout sampled.

`env.name` in the config picks the class: a built-in name (`tools`: the tool-calling
environment of rl.tools; `probe`: a tool message after every turn, for parity checks) or
`module:attr`, imported as reward functions are
(rl.config.resolve_env). The class is called once per trajectory as
`cls(tokenizer=..., reward_fn=..., **env.kwargs)`. `run_trajectories` drives a batch of
environments turn by turn through a `generate(prompts, turn)` callable (the rollout workers),
within `rollout.max_turns`, the per-turn budget `rollout.max_tokens` and the per-trajectory
budget `rollout.max_trajectory_tokens`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rl.data import Sample
from rl.tools import (
    CLOSE,
    ToolCall,
    example_messages,
    get_tools,
    parse_tool_calls,
    run_tool_call,
    tool_prompt,
)
from rollout.engine import Stop

ENV_MARKER = "\x00kimi-rl-model-turn\x00"  # stands for the model's turn in a rendered template


class Env(ABC):
    """One trajectory's environment; a fresh instance per trajectory. `tool_calls` and
    `tool_errors` count what it ran (the env/* metrics)."""

    def __init__(self, tokenizer: Any, reward_fn: Callable[[str, Sample], Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.tool_calls = 0
        self.tool_errors = 0

    @abstractmethod
    def reset(self, sample: Sample) -> list[int]:
        """The prompt ids of the first turn."""

    @abstractmethod
    def step(self, generated_ids: list[int]) -> tuple[list[int], float, bool]:
        """(observation ids to append, reward of this turn, done) after the model's turn."""

    def turn_stop(self) -> Stop | None:
        """Where the model's turn ends besides its end-of-sequence token and the turn budget
        (rollout.engine.Stop), or None. The ids up to and including the stop are the turn."""
        return None


def tool_call_stop(tokenizer: Any) -> Stop:
    """A turn ends at the close of its tool call: the token id of `</tool_call>` when the
    tokenizer has it as one token (vLLM matches ids on the engine side), else the stop string
    (matched on vLLM's detokenized text; the token completing it ends the turn)."""
    ids = tokenizer.encode(CLOSE, add_special_tokens=False)
    if len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == CLOSE:
        return Stop(token_ids=(ids[0],))
    return Stop(strings=(CLOSE,))


def tool_turn_ids(tokenizer: Any, generated_ids: list[int], content: str, role: str = "tool") -> list[int]:
    """The ids that follow a model turn when `content` comes back as a `role` message: the rest
    of the template's end-of-turn markers (those the model did not generate itself), the tool
    message in the template's form, and the next assistant header.

    Found by rendering a conversation with a marker for the model's turn, with and without the
    tool message: only this observation text is encoded, never the model's tokens. A tokenizer
    without a chat template gets a plain `<tool_response>` block."""
    if not getattr(tokenizer, "chat_template", None):
        text = f"\n<tool_response>\n{content}\n</tool_response>\n"
        return list(tokenizer.encode(text, add_special_tokens=False))
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": ENV_MARKER}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + [{"role": role, "content": content}], tokenize=False,
                                          add_generation_prompt=True)
    if not after.startswith(before) or ENV_MARKER not in before:
        raise ValueError("the chat template renders earlier turns differently once a tool message "
                         "follows: the tool turn cannot be appended as ids")
    closer = before[before.index(ENV_MARKER) + len(ENV_MARKER):]  # e.g. "<|im_end|>\n"
    if generated_ids:
        last = tokenizer.convert_ids_to_tokens(generated_ids[-1])
        if last in tokenizer.all_special_tokens and closer.startswith(last):
            closer = closer[len(last):]  # the model ended its turn with the marker itself
    return list(tokenizer.encode(closer + after[len(before):], add_special_tokens=False))


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids of `messages` with the assistant header (plain text without a template)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text, add_special_tokens=False))


class ToolEnv(Env):
    """The built-in environment `tools`: the model may call tools (rl.tools, Hermes format);
    each turn with calls gets their results back as one tool message; the first turn without a
    call is the final answer, scored by the run's reward function (reward 0 before it). A turn
    ends at the close of its call (turn_stop).

    kwargs: tools (names, default ["calculator"]); system_prompt (default true: a system
    message lists the tools and the call format); example (default false: a worked exchange
    with the first tool before the question, rl.tools.example_messages)."""

    def __init__(self, tokenizer: Any, reward_fn: Callable[[str, Sample], Any] | None = None,
                 tools: list[str] | tuple[str, ...] = ("calculator",), system_prompt: bool = True,
                 example: bool = False) -> None:
        super().__init__(tokenizer, reward_fn)
        self.tools = get_tools(list(tools))
        self.system_prompt = system_prompt
        self.example = example
        self.sample: Sample | None = None

    @staticmethod
    def check_kwargs(kwargs: dict[str, Any]) -> None:
        """ValueError naming a bad kwarg (the config check calls this before any work)."""
        unknown = sorted(set(kwargs) - {"tools", "system_prompt", "example"})
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} for env tools (tools, system_prompt, example)")
        tools = kwargs.get("tools", ["calculator"])
        if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
            raise ValueError(f"tools must be a list of tool names, got {tools!r}")
        get_tools(tools)
        for key in ("system_prompt", "example"):
            if not isinstance(kwargs.get(key, True), bool):
                raise ValueError(f"{key} must be true or false, got {kwargs[key]!r}")
        if kwargs.get("example") and not tools:
            raise ValueError("example needs at least one tool")

    def turn_stop(self) -> Stop:
        # The model's turn ends with its call: what it would write after the call is not
        # what the tool answered, so it is not sampled (nor trained on).
        return tool_call_stop(self.tokenizer)

    def reset(self, sample: Sample) -> list[int]:
        self.sample = sample
        messages = [{"role": "system", "content": tool_prompt(self.tools)}] if self.system_prompt else []
        if self.example and self.tools:
            messages += example_messages(next(iter(self.tools.values())))
        return chat_prompt_ids(self.tokenizer, messages + [{"role": "user", "content": sample.prompt}])

    def step(self, generated_ids: list[int]) -> tuple[list[int], float, bool]:
        text = self.tokenizer.decode(generated_ids, skip_special_tokens=True)
        calls = parse_tool_calls(text)
        if not calls:
            if self.reward_fn is None or self.sample is None:
                raise ValueError("ToolEnv needs a reward function and reset() before step()")
            return [], self.reward_fn(text, self.sample), True
        results = []
        for call in calls:
            output, ok = run_tool_call(call, self.tools)
            self.tool_calls += 1
            self.tool_errors += not ok
            results.append(output)
        return tool_turn_ids(self.tokenizer, generated_ids, "\n".join(results)), 0.0, False


class ProbeEnv(Env):
    """The built-in environment `probe`: every model turn gets a tool message back (the
    calculator's answer to a question about the turn's length) and the trajectory goes on until
    its budgets end it; reward 0. It makes multi-turn trajectories from any model, tool calls
    or not: what `kimi-rl parity check --env probe` and the parity tests run."""

    def __init__(self, tokenizer: Any, reward_fn: Callable[[str, Sample], Any] | None = None) -> None:
        super().__init__(tokenizer, reward_fn)

    @staticmethod
    def check_kwargs(kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise ValueError(f"env probe takes no kwargs, got {', '.join(sorted(kwargs))}")

    def reset(self, sample: Sample) -> list[int]:
        return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": sample.prompt}])

    def step(self, generated_ids: list[int]) -> tuple[list[int], float, bool]:
        self.tool_calls += 1
        result = run_tool_call(ToolCall("calculator", {"expression": f"{len(generated_ids)} ** 3"}),
                               get_tools(["calculator"]))[0]
        return tool_turn_ids(self.tokenizer, generated_ids, result), 0.0, False


BUILTIN_ENVS: dict[str, type[Env]] = {"tools": ToolEnv, "probe": ProbeEnv}


# --- running trajectories -------------------------------------------------------------------


@dataclass
class Budget:
    max_turns: int
    max_tokens: int  # per turn (what one generate call may sample)
    max_trajectory_tokens: int  # everything after the prompt: model turns and observations
    max_model_len: int  # the engine's context: a next turn must fit in it whole


@dataclass
class Trajectory:
    """One sample's trajectory as token ids. token_ids is everything after the prompt; mask
    is 1 on the model's tokens and 0 on observation / template tokens; logprobs holds the
    rollout log-prob of each model token (0.0 on observations)."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # per segment, float32
    turns: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (generated, observation)
    reward: float = 0.0
    done: bool = False
    error: str | None = None  # the environment raised: reported, reward 0

    def ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def completion(self) -> dict[str, Any]:
        """The loop's completion dict: prompt_ids, token_ids, rollout_logprobs, mask."""
        lp = torch.cat(self.logprobs) if self.logprobs else torch.zeros(0)
        return {"prompt_ids": self.prompt_ids, "token_ids": self.token_ids, "rollout_logprobs": lp,
                "mask": torch.tensor(self.mask, dtype=torch.float32)}


def _append(traj: Trajectory, ids: list[int], logprobs: torch.Tensor | None) -> None:
    traj.token_ids += ids
    traj.mask += [0 if logprobs is None else 1] * len(ids)
    traj.logprobs.append(torch.zeros(len(ids)) if logprobs is None else logprobs.to(torch.float32))


def _advance(traj: Trajectory, env: Env, out: dict[str, Any], last_turn: bool, budget: Budget) -> None:
    """One turn: the model's ids appended as generated (cut at the trajectory budget), the
    environment stepped, its observation appended unless the trajectory ends here."""
    room = budget.max_trajectory_tokens - len(traj.token_ids)
    generated, logprobs = list(out["token_ids"])[:room], out["rollout_logprobs"][:room]
    _append(traj, generated, logprobs)
    try:
        observation, reward, done = env.step(generated)
        traj.reward += float(reward)
    except Exception as e:  # a user environment may raise anything: reported, the trajectory ends
        traj.error = f"{type(e).__name__}: {e}"
        traj.done = True
        traj.turns.append((generated, []))
        return
    fits = (len(traj.token_ids) + len(observation) < budget.max_trajectory_tokens
            and len(traj.ids()) + len(observation) + budget.max_tokens <= budget.max_model_len)
    traj.done = done or last_turn or len(generated) == room or not fits
    if not traj.done:
        _append(traj, list(observation), None)
    traj.turns.append((generated, [] if traj.done else list(observation)))


def run_trajectories(envs: list[Env], samples: list[Sample], budget: Budget,
                     generate: Callable[[list[list[int]], int, Stop | None], list[dict[str, Any]]]) -> list[Trajectory]:
    """Each environment's trajectory, turn by turn: every unfinished trajectory's ids go to
    `generate(prompts, turn, stop)` together (one call per turn; `stop`: the first
    environment's turn_stop, the run's environments being of one class), which returns per
    prompt a dict with token_ids and rollout_logprobs."""
    trajectories = []
    for env, sample in zip(envs, samples, strict=True):
        try:
            trajectories.append(Trajectory(list(env.reset(sample))))
        except Exception as e:  # reported like a failing reward function
            raise ValueError(f"env reset failed for sample {sample.prompt[:80]!r}: "
                             f"{type(e).__name__}: {e}") from e
    stop = envs[0].turn_stop() if envs else None
    for turn in range(budget.max_turns):
        active = [i for i, t in enumerate(trajectories) if not t.done]
        if not active:
            break
        outs = generate([trajectories[i].ids() for i in active], turn, stop)
        for i, out in zip(active, outs, strict=True):
            _advance(trajectories[i], envs[i], out, turn == budget.max_turns - 1, budget)
    return trajectories


def env_metrics(envs: list[Env], trajectories: list[Trajectory]) -> dict[str, float]:
    """env/turns_mean (model turns per trajectory), env/tool_calls, env/tool_errors (sums over
    the step's trajectories) and env/errors (environments that raised)."""
    return {
        "env/turns_mean": sum(len(t.turns) for t in trajectories) / max(len(trajectories), 1),
        "env/tool_calls": float(sum(e.tool_calls for e in envs)),
        "env/tool_errors": float(sum(e.tool_errors for e in envs)),
        "env/errors": float(sum(t.error is not None for t in trajectories)),
    }
