"""Prompt sources for kimi-rl. A `Sample` is one prompt with its reference answer and whatever a
scorer needs (`metadata`, e.g. the reasoning-gym entry). Samples come from a JSONL file
(`load_jsonl`: bad rows are reported with file:line and skipped), from reasoning-gym
(`reasoning_gym_samples`, fully offline), or from the built-in counting task (`builtin_samples`),
which a tiny random-init model learns within ~20 RL steps. `PromptSource` hands out
`prompts_per_step` samples per step in a seeded, per-epoch shuffled order, and its
`state_dict` (epoch, position) lets a resumed run see exactly the prompts an uninterrupted run
would have seen. `format_prompt` turns a sample into prompt token ids."""

from __future__ import annotations

import difflib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl.errors import UserError


@dataclass
class Sample:
    prompt: str
    answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataIssue:
    """One skipped input row; str() gives the editor-clickable `path:line: message`."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


# --- iteration --------------------------------------------------------------------------------


class PromptSource:
    """Deterministic, resumable batches of prompts.

    Each epoch visits every sample once, in an order shuffled with `seed + epoch` (or in file
    order when shuffle=False); a batch that runs past the end of an epoch continues into the
    next one. The whole cursor is (epoch, position), so `state_dict` / `load_state_dict` resume
    exactly: the order of an epoch is a pure function of (seed, epoch, number of samples)."""

    def __init__(self, samples: list[Sample], prompts_per_step: int, seed: int, shuffle: bool):
        if not samples:
            raise UserError("the prompt source is empty: no samples to train on")
        if prompts_per_step < 1:
            raise UserError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        self.samples = samples
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        if self.shuffle:
            # A fresh Random per epoch: the order never depends on how many batches came before.
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[Sample]:
        batch = []
        while len(batch) < self.prompts_per_step:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            batch.append(self.samples[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        # num_samples / seed / shuffle are stored only to refuse a resume on different data.
        return {
            "epoch": self.epoch, "position": self.position,
            "num_samples": len(self.samples), "seed": self.seed, "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("num_samples", "seed", "shuffle"):
            if key in state and state[key] != mine[key]:
                raise UserError(
                    f"cannot resume the prompt source: the checkpoint has {key}={state[key]!r}, "
                    f"this run has {key}={mine[key]!r} (the prompt order would differ)"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.samples):
            raise UserError(f"cannot resume the prompt source: bad cursor epoch={epoch}, "
                            f"position={position} for {len(self.samples)} samples")
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)


# --- JSONL ------------------------------------------------------------------------------------


def _parse_row(text: str) -> Sample:
    """One JSONL row -> Sample; raises ValueError with the message for the DataIssue."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    if "prompt" not in row:
        raise ValueError("missing 'prompt'")
    prompt = row.pop("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"'prompt' must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError("'prompt' is empty")
    answer = row.pop("answer", None)
    # bool is an int subclass, but `"answer": true` is almost certainly a mistake.
    if isinstance(answer, bool) or not isinstance(answer, str | int | float | None):
        raise ValueError(f"'answer' must be a string or a number, got {type(answer).__name__}")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise ValueError(f"'answer' must be finite, got {answer}")
    return Sample(prompt=prompt, answer=None if answer is None else str(answer), metadata=row)


def load_jsonl(path: str | Path) -> tuple[list[Sample], list[DataIssue]]:
    """Read `{"prompt": str, "answer": str | number (optional), ...}` rows; other keys go to
    metadata. Bad rows are skipped and returned as DataIssues (file:line); blank lines are
    ignored. Raises UserError if the file cannot be read or no good row remains."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read prompts file {path}: {e.strerror or e}") from None
    samples: list[Sample] = []
    issues: list[DataIssue] = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        try:
            # Decode per line, so one bad byte costs one row, not the file.
            text = line.decode("utf-8")
            if lineno == 1:
                text = text.removeprefix("\ufeff")  # editors on Windows write a BOM
            if not text.strip():
                continue
            samples.append(_parse_row(text))
        except UnicodeDecodeError as e:
            issues.append(DataIssue(str(path), lineno, f"not valid UTF-8 ({e.reason})"))
        except ValueError as e:
            issues.append(DataIssue(str(path), lineno, str(e)))
    if not samples:
        detail = f"; first problem: {issues[0]}" if issues else " (the file is empty)"
        raise UserError(f"no usable prompts in {path}: {len(issues)} bad rows{detail}")
    return samples, issues


# --- reasoning-gym ----------------------------------------------------------------------------


def reasoning_gym_tasks() -> list[str]:
    """Names of the installed reasoning-gym datasets (its registry, filled at import)."""
    import reasoning_gym.factory  # slow import (~2 s): only when reasoning-gym is used

    return sorted(reasoning_gym.factory.DATASETS)


def check_reasoning_gym_task(task: str) -> None:
    """UserError naming close matches (or a few valid names) if `task` is not registered."""
    tasks = reasoning_gym_tasks()
    if task in tasks:
        return
    close = difflib.get_close_matches(task, tasks, n=5)
    hint = f"did you mean: {', '.join(close)}?" if close else f"e.g. {', '.join(tasks[:8])}"
    raise UserError(f"unknown reasoning-gym task {task!r} ({len(tasks)} tasks installed; {hint})")


def create_reasoning_gym_dataset(task: str, **kwargs: Any) -> Any:
    """`reasoning_gym.create_dataset(task, **kwargs)`, with config errors as UserError.

    kwargs are plain data (from YAML / JSON); composite's `datasets` entries may be dicts
    {name, weight, config}, which are turned into the DatasetSpec objects that it requires."""
    import reasoning_gym

    check_reasoning_gym_task(task)
    try:
        if task == "composite" and isinstance(kwargs.get("datasets"), list):
            from reasoning_gym.composite import DatasetSpec

            kwargs = dict(kwargs, datasets=[
                DatasetSpec(**d) if isinstance(d, dict) else d for d in kwargs["datasets"]
            ])
        return reasoning_gym.create_dataset(task, **kwargs)
    except (TypeError, ValueError, AssertionError, AttributeError, KeyError) as e:
        # Config dataclasses raise TypeError on unknown fields, validate() asserts on bad values.
        why = str(e) or type(e).__name__
        raise UserError(f"bad options for reasoning-gym task {task!r}: {why}") from None


def reasoning_gym_samples(task: str, size: int, seed: int, **kwargs: Any) -> list[Sample]:
    """`size` entries of reasoning-gym's `task` generated with `seed` (offline, procedural).

    metadata = {"entry": entry, "task": task, "task_kwargs": kwargs}: the reasoning-gym reward
    rebuilds the dataset from task + task_kwargs, because some scorers read the dataset config
    (e.g. decimal_arithmetic, time_intervals), which a default-config scorer would get wrong."""
    if size < 1:
        raise UserError(f"the reasoning-gym size must be >= 1, got {size}")
    dataset = create_reasoning_gym_dataset(task, size=size, seed=seed, **kwargs)
    return [
        Sample(prompt=e["question"], answer=e["answer"],
               metadata={"entry": e, "task": task, "task_kwargs": dict(kwargs)})
        for e in dataset
    ]


# --- the built-in task ------------------------------------------------------------------------


def builtin_samples(size: int, seed: int) -> list[Sample]:
    """The built-in counting task: "Count: 3 4 5 ->" with answer "6".

    The prompt counts three consecutive numbers from a start in 0..6, so the answer is a single
    digit 3..9. It is meant for smoke runs with a tiny random-init model: scored by the `number`
    reward, whose partial credit (0.1 for any number, up to 0.5 for a close one, 1.0 exact)
    turns "emit a digit at all" and then "emit a digit near the answer" into dense signals, so
    the mean reward visibly climbs from ~0 within ~20 steps of <= 8 generated tokens. The
    tokenizer splits digits individually, so every answer is one token. Deterministic in
    (size, seed).

    Measured (tiny llama preset, GRPO G=4, 8 prompts/step, 8 tokens, T=1, LoRA r=16 on all
    targets, lr 1e-2): the mean reward goes from ~0.01 to ~0.3-0.45 in 20 steps. The tiny
    preset's init scale matters: see rl.models.PRESETS."""
    rng = random.Random(seed)
    samples = []
    for i in range(size):
        start = rng.randint(0, 6)
        prompt = "Count: " + " ".join(str(start + k) for k in range(3)) + " ->"
        samples.append(Sample(prompt=prompt, answer=str(start + 3),
                              metadata={"task": "builtin_count", "index": i}))
    return samples


def build_samples(
    source: str,
    path: str | Path | None = None,
    task: str | None = None,
    size: int = 256,
    seed: int = 0,
    task_kwargs: dict[str, Any] | None = None,
) -> tuple[list[Sample], list[DataIssue]]:
    """Dispatch on source: "builtin" (size, seed), "jsonl" (path), "reasoning_gym" (task, size,
    seed, task_kwargs). Returns the samples and the skipped-row issues (JSONL only)."""
    if source == "builtin":
        return builtin_samples(size, seed), []
    if source == "jsonl":
        if not path:
            raise UserError("the jsonl prompt source needs a path")
        return load_jsonl(path)
    if source == "reasoning_gym":
        if not task:
            raise UserError("the reasoning_gym prompt source needs a task name")
        return reasoning_gym_samples(task, size, seed, **(task_kwargs or {})), []
    raise UserError(f"unknown prompt source {source!r}; expected builtin, jsonl or reasoning_gym")


def format_prompt(sample: Sample, tokenizer: Any, chat_template: bool) -> list[int]:
    """Prompt token ids: the chat template with the generation prompt (one user message), or
    the plain prompt text encoded without special tokens."""
    text = sample.prompt
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("chat_template is on, but the tokenizer has no chat template")
        # Render to text, then encode: the rendered template already holds its special tokens,
        # and this sidesteps apply_chat_template's return type changing across versions.
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.prompt}], tokenize=False,
            add_generation_prompt=True,
        )
    return list(tokenizer.encode(text, add_special_tokens=False))
