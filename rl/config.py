"""The typed configuration of `kimi-rl train config.yaml [key=value ...]`: one dataclass per
section, with defaults, and `load_config`, which reads the YAML with `yaml.SafeLoader` only,
applies the dotted `key=value` overrides, and checks every value against the field annotations
(via `typing.get_type_hints`) and the bounds in the field metadata, plus a few cross-field rules
written out in `_check`. Every error is one line that names where the value came from (`file:line`
or `override 'key=value'`) and its dotted key. Relative paths (`run_dir`, `model.path`,
`data.path`, `ray.temp_dir`, `checkpoint.resume_from`) are resolved against the current working
directory, not the config file's folder, because users run `kimi-rl train configs/x.yaml` from
the repository root and write paths like `models/tiny-llama` relative to it. `dump_config`
writes YAML that `load_config` reads back into an equal `Config`."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import math
import operator
import os
import re
import types
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from parity.model_spec import ARCHITECTURES, KIMI_FORMATS
from parity.settings import setting
from rl.errors import UserError
from rollout.config import RolloutConfig
from trainer.config import (
    KIMI_ONLY_LORA_MODULES,
    LORA_MODULES,
    AlgorithmConfig,
    CheckpointConfig,
    LoraConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "EnvConfig", "LoggingConfig",
    "LoraConfig", "ModelConfig", "ParityConfig", "PlacementConfig", "RayConfig", "RewardConfig", "RolloutConfig", "SyncConfig",
    "TrainerConfig", "dump_config", "load_config", "resolve_callable", "resolve_env", "trainer_ranks",
]

BUILTIN_HOOKS = ("checksum", "timing", "parity_probe")
# "package.module:attr.sub": user code is imported only from a name spelled out like this.
_CALLABLE_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
# A custom resource of ray.placement: a plain name, none of Ray's own (nor node:<ip>).
_RESOURCE_NAME = re.compile(r"[A-Za-z_][\w.-]*")
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "TPU", "memory", "object_store_memory")
# PyYAML follows YAML 1.1, where `1e-4` (no dot) is a string, not a float; float fields accept it.
_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigError(UserError):
    """A bad config file or override; the message is one line naming the source and the key."""


@dataclass
class ModelConfig:
    path: str = setting(path=True)  # a Hugging Face checkpoint directory (has config.json)
    dtype: Literal["fp32", "bf16"] = "fp32"  # the same dtype on the rollout and trainer side


@dataclass
class PlacementConfig:
    # The Ray custom resource (`ray start --resources '{"host_b": 1}'`) of the node(s) that run
    # the rollout workers / the trainer's ranks, or for the trainer a list of one per rank (rank
    # order: ranks on several nodes); None lets Ray choose. Needs ray.address: the run's own
    # local cluster is one node with no custom resources.
    rollout: str | None = None
    trainer: str | list[str] | None = None


@dataclass
class RayConfig:
    address: str | None = None  # None starts a local cluster for this run
    num_cpus: int | None = setting(None, ge=1)  # None lets Ray count the cores
    dashboard: bool = False
    # None means <run_dir>/ray: Ray's temp and auth files must stay out of the user's home.
    temp_dir: str | None = setting(None, path=True)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    # The share of a GPU each rollout worker and each trainer rank asks Ray for: 0 runs them on
    # the CPU; 0.5 puts a worker and a rank on one card (rollout.gpu_memory_utilization keeps
    # vLLM to its part of the card's memory).
    gpus_per_actor: float = setting(0.0, ge=0, le=1)


@dataclass
class DataConfig:
    source: Literal["builtin", "jsonl", "reasoning_gym"] = "builtin"
    path: str | None = setting(None, path=True)  # the .jsonl file, for source jsonl
    task: str | None = None  # reasoning-gym dataset name, e.g. basic_arithmetic
    task_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the reasoning-gym dataset
    size: int = setting(256, ge=1)
    prompts_per_step: int = setting(8, ge=1)
    shuffle: bool = True
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template


@dataclass
class RewardConfig:
    type: Literal["exact_match", "number", "reasoning_gym", "function"] = "number"
    function: str | None = None  # "module:attr", for type function; see resolve_callable


@dataclass
class EnvConfig:
    # Multi-turn rollouts (rl.env): a built-in environment name (tools) or "module:attr" of an
    # rl.env.Env subclass; None keeps one prompt, one completion. The class is called per
    # trajectory as cls(tokenizer=..., reward_fn=..., **kwargs).
    name: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class SyncConfig:
    # Run around each trainer -> rollout weight sync: built-in names or "module:attr".
    hooks: list[str] = field(default_factory=lambda: ["checksum", "timing"])
    bucket_mb: int = setting(64, ge=1)
    parity_probe_prompts: int = setting(4, ge=1)


@dataclass
class LoggingConfig:
    wandb: Literal["offline", "online", "disabled"] = "offline"
    project: str = "kimi-rl"
    console: bool = True
    plot: bool = True


@dataclass
class ParityConfig:
    # Rollout and trainer compute bit-identical log-probs; false runs stock vLLM (adapter
    # merged into its weights) and allows algorithm.is_correction instead.
    enabled: bool = True
    # What a step does when the trainer's re-score of the sampled tokens differs from the
    # rollout's log-probs (checked before the update): fail = the update is not applied, the
    # sequences go to <run_dir>/mismatch/step_N.json and the run stops; warn = report, go on.
    on_mismatch: Literal["fail", "warn"] = "fail"


@dataclass
class Config:
    run_dir: str = setting(path=True)  # everything a run writes goes under it
    total_steps: int = setting(ge=1)
    model: ModelConfig  # required: model.path has no default
    seed: int = setting(0, ge=0)
    parity: ParityConfig = field(default_factory=ParityConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


class _Sources:
    """Where each dotted key came from ("file:line" or "override 'k=v'"), for error messages."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.by_key: dict[str, str] = {}

    def of(self, key: str) -> str:
        # A key with no entry of its own (a list item, a merged key) takes its parent's source.
        while key:
            if key in self.by_key:
                return self.by_key[key]
            key = key[: max(key.rfind("."), key.rfind("["), 0)]
        return self.file

    def error(self, key: str, message: str, where: str | None = None) -> ConfigError:
        return ConfigError(f"{where or self.of(key)}: {key}: {message}")


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read `path` (YAML), apply `key=value` overrides, validate; raises ConfigError."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{file}: no such config file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: cannot read config ({e})") from None
    sources = _Sources(file)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _record_lines(node, "", sources)  # before construction, which flattens `<<` merges
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{file}{line}: invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: invalid YAML: {e}") from None
    finally:
        loader.dispose()
    if data is None:
        raise ConfigError(f"{file}: empty config (expected a mapping of config keys)")
    if not isinstance(data, dict):
        raise ConfigError(f"{file}:1: expected a mapping of config keys, got {_kind(data)}")
    for override in overrides:
        _apply_override(data, override, sources)
    cfg = _build(Config, data, "", sources)
    _check(cfg, sources)
    return cfg


def _record_lines(node: yaml.Node, prefix: str, sources: _Sources) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue  # merged keys report their mapping's line; `_build` rejects odd keys
            key = f"{prefix}{key_node.value}"
            where = f"{sources.file}:{key_node.start_mark.line + 1}"
            if key_node.value in seen:
                raise sources.error(key, "duplicate key", where)
            seen.add(key_node.value)
            sources.by_key[key] = where
            _record_lines(value_node, f"{key}.", sources)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            key = f"{prefix.removesuffix('.')}[{i}]"
            sources.by_key[key] = f"{sources.file}:{item.start_mark.line + 1}"
            _record_lines(item, f"{key}.", sources)


def _apply_override(data: dict[str, Any], override: str, sources: _Sources) -> None:
    where = f"override {override!r}"
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"\w+(\.\w+)*", key):
        raise ConfigError(f"{where}: expected key=value with a dotted key, e.g. lora.rank=16")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or e
        raise ConfigError(f"{where}: {key}: invalid YAML value ({problem})") from None
    *parents, last = key.split(".")
    node = data
    for i, part in enumerate(parents):
        parent = ".".join(parents[: i + 1])
        if node.get(part) is None:
            node[part] = {}  # a section left empty (`trainer:`) or absent
            sources.by_key.setdefault(parent, where)
        node = node[part]
        if not isinstance(node, dict):
            raise sources.error(parent, f"is {_kind(node)}, not a section", where)
    node[last] = value
    for old in [k for k in sources.by_key if k == key or k.startswith((f"{key}.", f"{key}["))]:
        del sources.by_key[old]
    sources.by_key[key] = where


def _build(cls: type, data: Any, prefix: str, sources: _Sources) -> Any:
    """A `cls` instance from a mapping, checking keys, types and bounds field by field."""
    section = prefix.removesuffix(".")
    if data is None:
        data = {}  # `trainer:` with nothing under it means all defaults
    if not isinstance(data, dict):
        # `parity` was a bool before it became a section: say what to write instead.
        hint = f" (write parity.enabled: {str(data).lower()})" if cls is ParityConfig and isinstance(data, bool) else ""
        raise sources.error(section, f"expected a mapping, got {_kind(data)}{hint}")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if not isinstance(key, str):
            raise sources.error(f"{prefix}{key}", f"keys must be strings, got {_kind(key)}")
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise sources.error(f"{prefix}{key}", f"unknown key{hint}")
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            values[f.name] = _build(tp, data.get(f.name), f"{key}.", sources)
            continue
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"{sources.file}: {key}: required key missing")
            continue  # the dataclass default
        value = _convert(tp, data[f.name], key, sources)
        if isinstance(value, tuple):
            for i, item in enumerate(value):
                _check_bounds(item, f.metadata, f"{key}[{i}]", sources)
        else:
            _check_bounds(value, f.metadata, key, sources)
        if f.metadata.get("path") and value is not None:
            value = os.path.abspath(os.path.expanduser(value))
        values[f.name] = value
    return cls(**values)


def _convert(tp: Any, value: Any, key: str, sources: _Sources) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        for tp in kinds[:-1]:  # `str | list[str]`: the first kind the value is
            try:
                return _convert(tp, value, key, sources)
            except ConfigError:
                pass
        return _convert(kinds[-1], value, key, sources)
    if origin is Literal:
        if not isinstance(value, str) or value not in args:
            raise sources.error(key, f"expected one of {', '.join(args)}; got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise sources.error(key, f"expected a list of {len(args)} values, got {value!r}")
        items = enumerate(zip(args, value, strict=True))
        return tuple(_convert(a, v, f"{key}[{i}]", sources) for i, (a, v) in items)
    if origin is list:
        if not isinstance(value, list):
            raise sources.error(key, f"expected a list, got {_kind(value)} {value!r}")
        return [_convert(args[0], v, f"{key}[{i}]", sources) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise sources.error(key, f"expected a mapping with string keys, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise sources.error(key, f"expected a finite float, got {value!r}")
            return float(value)  # ints are fine where a float is expected
        raise sources.error(key, f"expected a float, got {value!r}")
    # bool is a subclass of int in Python, so `steps: true` must not pass as an int.
    if tp in (int, str, bool) and type(value) is tp:
        return value
    names = {int: "an int", str: "a string", bool: "a bool (true or false)"}
    raise sources.error(key, f"expected {names[tp]}, got {value!r}")


_BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="),
           "lt": (operator.lt, "<")}


def _check_bounds(value: Any, metadata: Any, key: str, sources: _Sources) -> None:
    for name, (op, sign) in _BOUNDS.items():
        bound = metadata.get(name)
        if bound is not None and value is not None and not op(value, bound):
            raise sources.error(key, f"must be {sign} {bound}, got {value!r}")


def _check(cfg: Config, sources: _Sources) -> None:
    """Rules that involve more than one field, or the file system."""
    err = sources.error
    model_dir = Path(cfg.model.path)
    if not model_dir.is_dir():
        raise err("model.path", f"no such model directory: {model_dir}")
    if not (model_dir / "config.json").is_file():
        raise err("model.path", f"{model_dir} has no config.json (not a Hugging Face model)")
    for i, module in enumerate(cfg.lora.target_modules):
        if module == "gate":  # the MoE router: its experts' projections are the targets
            raise err(f"lora.target_modules[{i}]", "'gate' is the MoE router (mlp.gate), which takes no "
                      "LoRA adapter; gate_proj, up_proj and down_proj adapt every expert")
        if module not in LORA_MODULES:
            raise err(f"lora.target_modules[{i}]", f"expected one of {', '.join(LORA_MODULES)}; "
                      f"got {module!r}")
    _check_tensor_parallel(cfg, sources, model_dir)
    _check_data_parallel(cfg, sources)
    try:
        cfg.rollout.sampling()
    except ValueError as e:  # a temperature vLLM would treat as greedy
        raise err("rollout.temperature", str(e).removeprefix("temperature ")) from None
    if cfg.lora.enabled and not cfg.lora.target_modules:
        raise err("lora.target_modules", f"is empty; pick from {', '.join(LORA_MODULES)}")
    _check_model_fit(cfg, sources, model_dir)
    _check_algorithm(cfg, sources)
    _check_data_reward_hooks(cfg, sources)
    _check_env(cfg, sources)
    _check_placement(cfg, sources)
    _check_gpus(cfg, sources)


def _check_gpus(cfg: Config, sources: _Sources) -> None:
    """ray.gpus_per_actor on the run's own local cluster needs a CUDA device here (an
    existing cluster's GPUs are Ray's to count)."""
    if cfg.ray.gpus_per_actor > 0 and cfg.ray.address is None:
        import torch

        if not torch.cuda.is_available():
            raise sources.error("ray.gpus_per_actor", f"is {cfg.ray.gpus_per_actor}, but this machine has "
                                "no CUDA device (0 runs on the CPU)")


def trainer_ranks(cfg: Config) -> int:
    """The trainer's Ray actors: its tensor- x data-parallel ranks (megatron; a DeepSpeed
    worker starts its own ranks)."""
    return cfg.trainer.tensor_parallel_size * cfg.trainer.data_parallel_size


def _check_placement(cfg: Config, sources: _Sources) -> None:
    """ray.placement names custom resources of an existing cluster; whether the cluster has
    them is checked when the run connects (rl.cluster.placement_group)."""
    for role in ("rollout", "trainer"):
        resources = getattr(cfg.ray.placement, role)
        if resources is None:
            continue
        key = f"ray.placement.{role}"
        if cfg.ray.address is None:
            raise sources.error(key, "needs ray.address: the run's own local cluster is one node with "
                                "no custom resources")
        if isinstance(resources, list) and len(resources) != trainer_ranks(cfg):
            raise sources.error(key, f"lists {len(resources)} resources, one per trainer rank, but the "
                                f"trainer has {trainer_ranks(cfg)} ranks")
        for resource in resources if isinstance(resources, list) else [resources]:
            if not _RESOURCE_NAME.fullmatch(resource) or resource in _RAY_BUILTIN_RESOURCES:
                raise sources.error(key, f"expected the name of a custom Ray resource (as in ray start "
                                    f"--resources '{{\"host_b\": 1}}'), got {resource!r}")


def _check_env(cfg: Config, sources: _Sources) -> None:
    """env: the environment it names (imported now) and the multi-turn budgets."""
    err = sources.error
    if cfg.env.name is None:
        if cfg.rollout.max_turns > 1:
            raise err("rollout.max_turns", f"is {cfg.rollout.max_turns}, but no env.name is set: "
                      "multi-turn rollouts need an environment (e.g. env.name: tools)")
        if cfg.env.kwargs:
            raise err("env.kwargs", "set, but no env.name is set")
        return
    from rl.env import BUILTIN_ENVS

    if cfg.env.name in BUILTIN_ENVS:
        try:
            BUILTIN_ENVS[cfg.env.name].check_kwargs(cfg.env.kwargs)
        except ValueError as e:
            raise err("env.kwargs", str(e)) from None
    elif not _CALLABLE_SPEC.fullmatch(cfg.env.name):
        raise err("env.name", f"expected one of {', '.join(BUILTIN_ENVS)} or module:attr, got {cfg.env.name!r}")
    else:
        _importable(cfg.env.name, "env.name", sources)
    if cfg.rollout.max_trajectory_tokens < cfg.rollout.max_tokens:
        raise err("rollout.max_trajectory_tokens", f"is {cfg.rollout.max_trajectory_tokens}, below "
                  f"rollout.max_tokens {cfg.rollout.max_tokens} (one turn's budget)")


def _check_data_parallel(cfg: Config, sources: _Sources) -> None:
    """trainer.data_parallel_size / deterministic_layout: megatron's, and a row per rank."""
    err, tr = sources.error, cfg.trainer
    if tr.deterministic_layout and tr.backend != "megatron":
        raise err("trainer.deterministic_layout", f"needs trainer.backend megatron: {tr.backend}'s "
                  "ZeRO reduces gradients in its own buckets, in an order we do not fix")
    if tr.data_parallel_size == 1:
        return
    key = "trainer.data_parallel_size"
    if tr.backend != "megatron":
        raise err(key, f"is {tr.data_parallel_size}: the deepspeed backend's ranks are "
                  "trainer.deepspeed.ranks")
    if not tr.deterministic_layout:
        raise err(key, f"is {tr.data_parallel_size}: it needs trainer.deterministic_layout: true "
                  "(the ordered gradient reduction is the only one built)")
    rows = cfg.data.prompts_per_step * cfg.rollout.samples_per_prompt // cfg.algorithm.minibatches
    if tr.data_parallel_size > rows:
        raise err(key, f"is {tr.data_parallel_size}, but a minibatch has {rows} sequences: "
                  "every rank needs at least one")


def _check_tensor_parallel(cfg: Config, sources: _Sources, model_dir: Path) -> None:
    """trainer / rollout tensor_parallel_size: what TP needs, and that the model splits."""
    err = sources.error
    # Any rollout TP against any trainer TP: the row-parallel K-order is fixed by the model
    # (parity.tp.row_splits), so the two sides agree bit for bit at different TP sizes.
    trainer_tp = cfg.trainer.tensor_parallel_size
    if trainer_tp > 1:
        key = "trainer.tensor_parallel_size"
        if cfg.trainer.backend != "megatron":
            raise err(key, f"is {trainer_tp}: tensor parallelism is the megatron backend's "
                      f"(trainer.backend is {cfg.trainer.backend})")
        if not cfg.lora.enabled:
            raise err(key, f"is {trainer_tp}: a TP trainer trains replicated LoRA adapters; "
                      "set lora.enabled true (a full fine-tune at TP > 1 is not supported)")
        if not cfg.parity.enabled:
            raise err(key, f"is {trainer_tp}: with parity off the rollout gets the adapter merged "
                      "into full weights, which a TP trainer holds in shards; use parity.enabled true")
    for key, size in (("rollout.tensor_parallel_size", cfg.rollout.tensor_parallel_size),
                      ("trainer.tensor_parallel_size", trainer_tp)):
        if size == 1:
            continue
        from parity.model_spec import ModelSpec, load_spec
        from parity.tp import check_tp

        spec = load_spec(model_dir)
        if not isinstance(spec, ModelSpec):
            raise err(key, f"is {size}: tensor parallelism is for dense Llama / Qwen3 models; "
                      f"{model_dir} is not one")
        try:
            check_tp(spec, size)
        except ValueError as e:
            raise err(key, str(e)) from None
    if trainer_tp > 1 and cfg.trainer.deterministic_layout:
        _check_ordered_vocab(sources, model_dir, trainer_tp)


def _check_ordered_vocab(sources: _Sources, model_dir: Path, trainer_tp: int) -> None:
    from parity.model_spec import load_spec
    from parity.tp import check_ordered_vocab

    try:
        check_ordered_vocab(load_spec(model_dir), trainer_tp)
    except ValueError as e:
        raise sources.error("trainer.deterministic_layout", str(e)) from None


def _check_model_fit(cfg: Config, sources: _Sources, model_dir: Path) -> None:
    """The rules that depend on the model's architecture (kimi-mini or a dense model)."""
    err = sources.error
    try:
        architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or [""]
    except (OSError, ValueError, AttributeError):
        architectures = [""]  # validate_model_dir reports a broken config.json with its line
    kimi = architectures[0] in KIMI_FORMATS
    if cfg.trainer.packed_sequences and (kimi or not cfg.parity.enabled or cfg.trainer.backend != "megatron"):
        raise err("trainer.packed_sequences", "needs trainer.backend megatron, parity.enabled true and a dense "
                  f"model (the parity attention takes the packed layout); got {cfg.trainer.backend}, "
                  f"parity.enabled {str(cfg.parity.enabled).lower()}, {architectures[0]}")
    if kimi:
        if not cfg.parity.enabled:
            raise err("parity.enabled", f"must be true for {architectures[0]}: its KDA / MLA / MoE layers exist "
                      "here only as parity implementations (there is no stock vLLM-CPU / Megatron version)")
    elif not cfg.parity.enabled:
        from parity.model_spec import load_spec
        from rollout.engine import check_stock_engine

        try:
            spec = load_spec(model_dir)
        except (OSError, ValueError, KeyError, TypeError):
            spec = None  # not a model this toolkit builds: validate_model_dir says why
        try:
            if spec is not None:
                check_stock_engine(spec)
        except ValueError as e:
            raise err("parity.enabled", f"is false, but stock vLLM cannot run {model_dir}: {e}") from None
    if not kimi and cfg.lora.enabled:
        for module in cfg.lora.target_modules:
            if module in KIMI_ONLY_LORA_MODULES:
                raise err("lora.target_modules", f"{module!r} exists in the Kimi architectures' layers only, "
                          f"not in {architectures[0]}")
    if kimi and cfg.lora.enabled and not cfg.rollout.enforce_eager:
        raise err("rollout.enforce_eager", f"is false with lora on {architectures[0]}: its parity model cannot "
                  "reserve the adapter before vLLM compiles and captures (Llama and Qwen3 can)")
    if cfg.rollout.kv_cache_dtype != "auto":
        from parity.model_spec import check_kv_cache_dtype

        try:
            check_kv_cache_dtype(cfg.rollout.kv_cache_dtype, architectures[0] if cfg.parity.enabled else None)
        except ValueError as e:
            raise err("rollout.kv_cache_dtype", str(e).removeprefix("kv_cache_dtype fp8: ")) from None
    if cfg.trainer.backend == "deepspeed":
        _check_deepspeed(cfg, sources, architectures[0])


def _check_algorithm(cfg: Config, sources: _Sources) -> None:
    err = sources.error
    if cfg.algorithm.is_correction != "none" and cfg.parity.enabled:
        raise err("algorithm.is_correction", f"{cfg.algorithm.is_correction!r} needs "
                  "parity.enabled: false (with parity the two sides' log-probs match: nothing to correct)")
    if cfg.algorithm.name == "ppo" and cfg.algorithm.vf_coef == 0:
        raise err("algorithm.vf_coef", "must be > 0 for ppo: PPO needs a critic, and with "
                  "vf_coef 0 the value loss that trains it vanishes")
    if cfg.algorithm.name in ("grpo", "rloo") and cfg.rollout.samples_per_prompt < 2:
        raise err("rollout.samples_per_prompt", f"must be >= 2 for algorithm.name "
                  f"{cfg.algorithm.name}: its baseline is the other samples of the same prompt")


def _check_data_reward_hooks(cfg: Config, sources: _Sources) -> None:
    """data, reward and sync hooks: the files and the user code they name, and resume_from."""
    err = sources.error
    if cfg.data.source == "jsonl":
        if cfg.data.path is None:
            raise err("data.path", "required when data.source is jsonl", sources.of("data.source"))
        if not Path(cfg.data.path).is_file():
            raise err("data.path", f"no such file: {cfg.data.path}")
    if cfg.data.source == "reasoning_gym" and not cfg.data.task:
        raise err("data.task", "required when data.source is reasoning_gym (e.g. "
                  "basic_arithmetic)", sources.of("data.source"))
    if cfg.reward.type == "reasoning_gym" and cfg.data.source != "reasoning_gym":
        raise err("reward.type", "reasoning_gym scores answers with the reasoning-gym task, so "
                  "it needs data.source: reasoning_gym")
    if cfg.reward.type == "function" and cfg.reward.function is None:
        raise err("reward.function", "required when reward.type is function (module:attr)",
                  sources.of("reward.type"))
    if cfg.reward.function is not None:
        if not _CALLABLE_SPEC.fullmatch(cfg.reward.function):
            raise err("reward.function", f"expected module:attr, got {cfg.reward.function!r}")
        _importable(cfg.reward.function, "reward.function", sources)
    for i, hook in enumerate(cfg.sync.hooks):
        if hook not in BUILTIN_HOOKS:
            if not _CALLABLE_SPEC.fullmatch(hook):
                raise err(f"sync.hooks[{i}]", f"expected one of {', '.join(BUILTIN_HOOKS)} or "
                          f"module:attr, got {hook!r}")
            _importable(hook, f"sync.hooks[{i}]", sources)
    if cfg.checkpoint.resume_from is not None and not Path(cfg.checkpoint.resume_from).exists():
        raise err("checkpoint.resume_from", f"no such checkpoint: {cfg.checkpoint.resume_from}")


def _check_deepspeed(cfg: Config, sources: _Sources, architecture: str) -> None:
    """trainer.backend deepspeed: the HF parity model (dense Llama / Qwen3) under ZeRO; the
    user's DeepSpeed JSON is read and checked now, before any work starts."""
    from trainer.backend import get_backend

    err, ds = sources.error, cfg.trainer.deepspeed
    if architecture in KIMI_FORMATS or architecture == ARCHITECTURES["qwen3-moe"]:
        raise err("trainer.backend", "deepspeed trains the HF parity models (Llama, Qwen3); "
                  f"{architecture} has none here: use trainer.backend megatron")
    if not cfg.parity.enabled:
        raise err("trainer.backend", "deepspeed trains the HF parity model only: it needs "
                  "parity.enabled: true")
    rows = cfg.data.prompts_per_step * cfg.rollout.samples_per_prompt // cfg.algorithm.minibatches
    if ds.ranks > rows:
        raise err("trainer.deepspeed.ranks", f"is {ds.ranks}, but a minibatch has {rows} "
                  "sequences: every rank needs at least one")
    try:
        get_backend("deepspeed").check_config(cfg.trainer, cfg.model.dtype)
    except ValueError as e:
        raise err("trainer.deepspeed.config", str(e)) from None


def _importable(spec: str, key: str, sources: _Sources) -> None:
    """User code named in the config is imported while the config is checked, so a typo or a
    broken module fails before any work starts, with the file and line of the key."""
    try:
        resolve_callable(spec, key)
    except ConfigError as e:
        raise ConfigError(f"{sources.of(key)}: {e}") from None


def resolve_callable(spec: str, key: str = "reward.function") -> Any:
    """Import the object named by `spec` ("module:attr"); `key` names the config key in errors.
    This is the only place user code gets imported, and only by the name the config spells out."""
    if not _CALLABLE_SPEC.fullmatch(spec):
        raise ConfigError(f"{key}: expected module:attr, got {spec!r}")
    module_name, attr = spec.split(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # the user's module may raise anything while it is imported
        reason = f"{type(e).__name__}: {e}"
        raise ConfigError(f"{key}: cannot import {module_name!r} ({reason})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: {spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}: {spec!r} is not callable")
    return obj


def resolve_env(name: str) -> Any:
    """The environment class of `env.name`: a built-in name (rl.env.BUILTIN_ENVS), or
    module:attr, imported as reward functions are."""
    from rl.env import BUILTIN_ENVS

    return BUILTIN_ENVS[name] if name in BUILTIN_ENVS else resolve_callable(name, "env.name")


def config_to_dict(cfg: Any) -> Any:
    """Plain dicts, lists and scalars (tuples become lists), in field order."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list | tuple):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_config(cfg: Config) -> str:
    """The config as YAML (for --print-config and <run_dir>/config.yaml); loads back equal."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True)


def _kind(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "a string", bool: "a bool", int: "an int",
             float: "a float", type(None): "null"}
    return names.get(type(value), type(value).__name__)
