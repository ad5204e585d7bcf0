"""rl/config.py: the shipped configs load, every kind of bad input gives a one-line error that
names the file, the line and the dotted key, overrides apply, and dump -> load round-trips."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from rl.config import (
    Config,
    ConfigError,
    config_to_dict,
    dump_config,
    load_config,
    resolve_callable,
)
from rl.errors import UserError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A stand-in model directory: config.py only checks that config.json is there."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return path


@pytest.fixture
def write(tmp_path: Path, model_dir: Path):
    """write(body) -> path of a config whose first three lines are run_dir, total_steps and
    model.path, followed by `body` from line 4 on."""

    def make(body: str = "", header: bool = True) -> Path:
        head = f"run_dir: {tmp_path / 'run'}\ntotal_steps: 3\nmodel: {{path: {model_dir}}}\n"
        path = tmp_path / "cfg.yaml"
        path.write_text((head if header else "") + textwrap.dedent(body))
        return path

    return make


def error(path: Path, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", ["quickstart.yaml", "smollm2_arith.yaml"])
def test_shipped_configs_load(name: str, model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / name, [f"model.path={model_dir}"])
    assert cfg.model.path == str(model_dir)
    assert cfg.algorithm.name == "grpo"
    assert cfg.lora.enabled and cfg.lora.rank == 16
    assert cfg.logging.wandb == "offline"
    assert Path(cfg.run_dir).is_absolute()


def test_quickstart_values(model_dir: Path) -> None:
    cfg = load_config(CONFIGS / "quickstart.yaml", [f"model.path={model_dir}"])
    assert (cfg.total_steps, cfg.rollout.samples_per_prompt, cfg.rollout.max_tokens) == (20, 8, 8)
    assert (cfg.data.source, cfg.data.prompts_per_step, cfg.reward.type) == ("builtin", 8, "number")
    assert cfg.trainer.lr == 1e-2
    assert cfg.run_dir.endswith("runs/quickstart")


def test_smollm2_values(model_dir: Path) -> None:
    cfg = load_config(CONFIGS / "smollm2_arith.yaml", [f"model.path={model_dir}"])
    assert (cfg.model.dtype, cfg.total_steps, cfg.rollout.max_tokens) == ("bf16", 30, 48)
    assert (cfg.data.source, cfg.data.task, cfg.reward.type) == (
        "reasoning_gym", "basic_arithmetic", "number")
    assert cfg.data.chat_template and cfg.trainer.lr == 1e-4
    assert cfg.data.task_kwargs["max_digits"] == 2


def test_defaults(write) -> None:
    cfg = load_config(write())
    assert (cfg.seed, cfg.parity.enabled, cfg.parity.on_mismatch, cfg.total_steps) == (0, True, "fail", 3)
    assert cfg.trainer.betas == (0.9, 0.999)
    assert cfg.lora.target_modules[-1] == "down_proj" and len(cfg.lora.target_modules) == 7
    assert cfg.sync.hooks == ["checksum", "timing"]
    assert cfg.ray.temp_dir is None and cfg.data.task_kwargs == {}


# Each case: the body from line 4 on, the line the error must name, the key, and a phrase.
ERRORS = [
    ("rollout:\n  max_tokns: 8\n", 5, "rollout.max_tokns",
     "unknown key (did you mean max_tokens?)"),
    ("algorithm:\n  kl_coef: abc\n", 5, "algorithm.kl_coef", "expected a float, got 'abc'"),
    ("trainer:\n  micro_batch_size: 2.5\n", 5, "trainer.micro_batch_size", "expected an int"),
    ("seed: true\n", 4, "seed", "expected an int, got True"),
    ("logging:\n  project: 7\n", 5, "logging.project", "expected a string, got 7"),
    ("parity: false\n", 4, "parity", "expected a mapping, got a bool (write parity.enabled: false)"),
    ("parity:\n  enabled: 1\n", 5, "parity.enabled", "expected a bool"),
    ("parity:\n  on_mismatch: ignore\n", 5, "parity.on_mismatch", "expected one of fail, warn"),
    ("rollout:\n  temperature: 0\n", 5, "rollout.temperature", "must be > 0"),
    ("rollout:\n  temperature: 1.0e-6\n", 5, "rollout.temperature",
     "must be >= 1e-05 (below it vLLM samples greedily)"),
    ("rollout:\n  top_p: 0\n", 5, "rollout.top_p", "must be > 0"),
    ("rollout:\n  top_p: 1.5\n", 5, "rollout.top_p", "must be <= 1"),
    ("rollout:\n  top_k: -1\n", 5, "rollout.top_k", "must be >= 0"),
    ("lora:\n  rank: 0\n", 5, "lora.rank", "must be >= 1, got 0"),
    ("trainer:\n  betas: [0.9, 1.5]\n", 5, "trainer.betas[1]", "must be < 1"),
    ("trainer:\n  betas: [0.9]\n", 5, "trainer.betas", "expected a list of 2 values"),
    ("trainer:\n  lr: .nan\n", 5, "trainer.lr", "expected a finite float"),
    ("algorithm:\n  name: dpo\n", 5, "algorithm.name", "ppo, grpo, rloo"),
    ("lora:\n  target_modules:\n    - q_proj\n    - qkv\n", 7, "lora.target_modules[1]",
     "expected one of q_proj"),
    ("lora:\n  target_modules: q_proj\n", 5, "lora.target_modules", "expected a list"),
    ("data:\n  task_kwargs: [1]\n", 5, "data.task_kwargs", "expected a mapping"),
    ("trainer: 3\n", 4, "trainer", "expected a mapping, got an int"),
    ("seed: 1\nseed: 2\n", 5, "seed", "duplicate key"),
    ("lora:\n  dropout: 0.1\n", 5, "lora.dropout", "unknown key"),
    ("logging:\n  log_every: 2\n", 5, "logging.log_every", "unknown key"),
    ("lora:\n  target_modules: []\n", 5, "lora.target_modules", "is empty"),
    ("algorithm:\n  is_correction: tis\n", 5, "algorithm.is_correction", "parity.enabled: false"),
    ("algorithm:\n  name: ppo\n  vf_coef: 0\n", 6, "algorithm.vf_coef", "needs a critic"),
    ("rollout:\n  samples_per_prompt: 1\n", 5, "rollout.samples_per_prompt",
     "must be >= 2 for algorithm.name grpo"),
    ("data:\n  source: jsonl\n", 5, "data.path", "required when data.source is jsonl"),
    ("data:\n  source: jsonl\n  path: nope.jsonl\n", 6, "data.path", "no such file"),
    ("data:\n  source: reasoning_gym\n", 5, "data.task", "required when data.source"),
    ("reward:\n  type: reasoning_gym\n", 5, "reward.type", "needs data.source: reasoning_gym"),
    ("reward:\n  type: function\n", 5, "reward.function", "required when reward.type"),
    ("reward:\n  type: function\n  function: not a name\n", 6, "reward.function",
     "expected module:attr"),
    ("sync:\n  hooks: [checksum, bogus]\n", 5, "sync.hooks[1]", "parity_probe or module:attr"),
    ("checkpoint:\n  resume_from: missing/ckpt\n", 5, "checkpoint.resume_from", "no such"),
    ("trainer:\n  lr: !!python/object/apply:os.system [echo hi]\n", 5, "",
     "could not determine a constructor"),
    ("rollout:\n  max_tokens: [1,\n", 6, "", "invalid YAML"),
]


@pytest.mark.parametrize(("body", "line", "key", "phrase"), ERRORS)
def test_errors_name_file_line_and_key(write, body: str, line: int, key: str, phrase: str) -> None:
    path = write(body)
    message = error(path)
    assert message.startswith(f"{path}:{line}: "), message
    if key:
        assert f": {key}: " in message, message
    assert phrase in message, message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for a machine without CUDA")
def test_gpus_per_actor_needs_a_gpu_here(write) -> None:
    message = error(write("ray:\n  gpus_per_actor: 0.5\n"))
    assert ": ray.gpus_per_actor: " in message and "no CUDA device" in message, message
    cfg = load_config(write("ray:\n  gpus_per_actor: 0.5\n  address: 127.0.0.1:6379\n"))
    assert cfg.ray.gpus_per_actor == 0.5  # an existing cluster counts its own GPUs


def test_is_correction_error_names_both_keys(write) -> None:
    message = error(write("algorithm:\n  is_correction: mis\n"))
    assert "algorithm.is_correction" in message and "parity" in message
    cfg = load_config(write("parity:\n  enabled: false\nalgorithm:\n  is_correction: mis\n"))
    assert cfg.algorithm.is_correction == "mis"


def test_missing_required_keys(write, model_dir: Path, tmp_path: Path) -> None:
    path = write("run_dir: r\nmodel: {dtype: bf16}\n", header=False)
    assert error(path) == f"{path}: total_steps: required key missing"
    path = write("run_dir: r\ntotal_steps: 1\n", header=False)
    assert error(path) == f"{path}: model.path: required key missing"
    path = write(f"total_steps: 1\nmodel: {{path: {model_dir}}}\n", header=False)
    assert error(path) == f"{path}: run_dir: required key missing"


def test_model_errors(write, model_dir: Path, tmp_path: Path) -> None:
    head = "run_dir: r\ntotal_steps: 1\nmodel:\n"
    path = write(f"{head}  path: {model_dir}\n  dtype: fp16\n", header=False)
    assert error(path) == f"{path}:5: model.dtype: expected one of fp32, bf16; got 'fp16'"
    path = write(f"{head}  path: /definitely/not/here\n", header=False)
    assert error(path).startswith(f"{path}:4: model.path: no such model directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    path = write(f"{head}  path: {empty}\n", header=False)
    assert error(path).startswith(f"{path}:4: model.path: ")
    assert "has no config.json" in error(path)


def test_top_level_must_be_a_mapping(write) -> None:
    path = write("- a\n- b\n", header=False)
    assert error(path) == f"{path}:1: expected a mapping of config keys, got a list"
    path = write("", header=False)
    assert "empty config" in error(path)
    assert "no such config file" in error(path.with_name("absent.yaml"))


def test_non_string_keys(write) -> None:
    assert ": rollout.1: keys must be strings" in error(write("rollout:\n  1: 2\n"))


def test_ints_accepted_for_floats_and_exponent_without_dot(write) -> None:
    # PyYAML (YAML 1.1) reads `5e-3` as a string; float fields accept it anyway.
    cfg = load_config(write("trainer:\n  lr: 5e-3\n  grad_clip: 2\nalgorithm:\n  kl_coef: 1E-2\n"))
    assert cfg.trainer.lr == 0.005 and cfg.algorithm.kl_coef == 0.01
    assert isinstance(cfg.trainer.grad_clip, float) and cfg.trainer.grad_clip == 2.0


def test_empty_section_means_defaults(write) -> None:
    assert load_config(write("trainer:\nlora:\n")).trainer.lr == 1e-4


def test_overrides(write, model_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    cfg = load_config(write(), [
        "algorithm.kl_coef=0.01",
        "lora.target_modules=[q_proj,v_proj]",
        f"model.path={other}",
        "ray.address=",  # an empty value is null
        "data.task_kwargs={min_terms: 2}",
        "sync.hooks=[timing, os.path:join]",
        "seed=7",
    ])
    assert cfg.algorithm.kl_coef == 0.01
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.model.path == str(other) and cfg.ray.address is None
    assert cfg.data.task_kwargs == {"min_terms": 2}
    assert cfg.sync.hooks == ["timing", "os.path:join"] and cfg.seed == 7


def test_override_can_supply_a_missing_required_key(write, model_dir: Path) -> None:
    path = write("run_dir: r\ntotal_steps: 1\n", header=False)
    assert load_config(path, [f"model.path={model_dir}"]).model.path == str(model_dir)


@pytest.mark.parametrize(("override", "phrase"), [
    ("algorithm.kl_coef=abc", "algorithm.kl_coef: expected a float, got 'abc'"),
    ("rollout.max_tokns=8", "rollout.max_tokns: unknown key (did you mean max_tokens?)"),
    ("nosuch.key=1", "nosuch: unknown key"),
    ("total_steps=-1", "total_steps: must be >= 1, got -1"),
    ("lora.rank=true", "lora.rank: expected an int, got True"),
    ("lora.target_modules=[q_proj", "lora.target_modules: invalid YAML value"),
    ("seed.x=1", "seed: expected an int, got {'x': 1}"),
    ("total_steps.x=1", "total_steps: is an int, not a section"),
    ("trainer.betas=[0.9, 2]", "trainer.betas[1]: must be < 1"),
])
def test_override_errors_name_the_override(write, override: str, phrase: str) -> None:
    message = error(write("rollout:\n  max_tokens: 4\n"), [override])
    assert message.startswith(f"override {override!r}: "), message
    assert phrase in message, message


@pytest.mark.parametrize("override", ["lora.rank", "=3", "a..b=1", " =1"])
def test_malformed_overrides(write, override: str) -> None:
    assert "expected key=value" in error(write(), [override])


def test_override_replaces_the_file_line_in_errors(write) -> None:
    # The file sets a valid value on line 5; the override replaces it with a bad one.
    message = error(write("lora:\n  rank: 4\n"), ["lora.rank=0"])
    assert message.startswith("override 'lora.rank=0': lora.rank: must be >= 1")


def test_relative_paths_resolve_against_cwd(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text("{}\n")
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "x.yaml"
    path.write_text("run_dir: runs/x\ntotal_steps: 1\nmodel: {path: models/m}\n"
                    "ray: {temp_dir: tmp/ray}\ndata: {source: jsonl, path: data.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config("configs/x.yaml")
    assert cfg.run_dir == str(tmp_path / "runs" / "x")
    assert cfg.model.path == str(tmp_path / "models" / "m")
    assert cfg.ray.temp_dir == str(tmp_path / "tmp" / "ray")
    assert cfg.data.path == str(tmp_path / "data.jsonl")
    # The message names the file as the user spelled it.
    assert error(Path("configs/x.yaml"), ["model.path=gone"]).startswith(
        "override 'model.path=gone': model.path: no such model directory")


def test_round_trip(write, tmp_path: Path) -> None:
    cfg = load_config(write(), [
        "parity.enabled=false", "parity.on_mismatch=warn", "algorithm.name=ppo", "algorithm.is_correction=tis",
        "algorithm.critic_lr=3e-5", "trainer.betas=[0.8, 0.95]", "data.task_kwargs={a: [1, 2]}",
        "ray.num_cpus=2", "lora.target_modules=[o_proj]", "logging.project=päth",
    ])
    text = dump_config(cfg)
    assert yaml.safe_load(text) == config_to_dict(cfg)
    again = tmp_path / "dumped.yaml"
    again.write_text(text)
    assert load_config(again) == cfg
    assert isinstance(load_config(again).trainer.betas, tuple)


def test_round_trip_of_shipped_config(model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / "smollm2_arith.yaml", [f"model.path={model_dir}"])
    again = tmp_path / "dumped.yaml"
    again.write_text(dump_config(cfg))
    assert isinstance(cfg, Config) and load_config(again) == cfg


def test_resolve_callable(tmp_path: Path, monkeypatch) -> None:
    import os.path

    assert resolve_callable("os.path:join") is os.path.join
    with pytest.raises(ConfigError, match=r"^reward\.function: cannot import 'no_such_mod_xyz'"):
        resolve_callable("no_such_mod_xyz:f")
    with pytest.raises(ConfigError, match=r"^reward\.function: .*has no attribute 'nope'"):
        resolve_callable("os.path:nope")
    with pytest.raises(ConfigError, match=r"^sync\.hooks\[0\]: 'os:sep' is not callable"):
        resolve_callable("os:sep", key="sync.hooks[0]")
    with pytest.raises(ConfigError, match=r"expected module:attr"):
        resolve_callable("os.path.join")
    (tmp_path / "broken_reward_mod.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"RuntimeError: boom"):
        resolve_callable("broken_reward_mod:score")


def test_python_tags_never_run(write, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = write(f"seed: !!python/object/apply:os.system ['touch {marker}']\n")
    assert "could not determine a constructor" in error(path)
    assert not marker.exists()
    path = write("seed: !!python/object:rl.config.Config {}\n")
    assert error(path).startswith(f"{path}:4: invalid YAML")


def test_config_error_is_a_user_error() -> None:
    assert issubclass(ConfigError, UserError)


# --- env: and the multi-turn budgets ---------------------------------------------------------


# Errors of keys that depend on other keys: the message names the key and its line.
_ENV_ERRORS = [
    ("rollout:\n  max_turns: 3\n", 5, "rollout.max_turns: is 3, but no env.name is set"),
    ("env:\n  name: tool\n", 5, "env.name: expected one of tools, probe or module:attr, got 'tool'"),
    ("env:\n  name: tools\n  kwargs: {tools: [calc]}\n", 6, "env.kwargs: unknown tool 'calc'"),
    ("env:\n  name: tools\n  kwargs: {tool: [calculator]}\n", 6, "env.kwargs: unknown key 'tool'"),
    ("env:\n  name: no_such_module_xyz:Env\n", 5, "env.name: cannot import 'no_such_module_xyz'"),
    ("env:\n  kwargs: {a: 1}\n", 5, "env.kwargs: set, but no env.name is set"),
    ("env:\n  name: tools\nrollout:\n  max_tokens: 64\n  max_trajectory_tokens: 32\n", 8,
     "rollout.max_trajectory_tokens: is 32, below rollout.max_tokens 64"),
]
_DATA_PARALLEL_ERRORS = [
    ("trainer:\n  data_parallel_size: 2\n", 5,
     "trainer.data_parallel_size: is 2: it needs trainer.deterministic_layout: true"),
    ("trainer:\n  data_parallel_size: 0\n", 5, "trainer.data_parallel_size: must be >= 1"),
    ("trainer:\n  backend: deepspeed\n  deterministic_layout: true\n", 6,
     "trainer.deterministic_layout: needs trainer.backend megatron: deepspeed's ZeRO"),
    ("trainer:\n  backend: deepspeed\n  data_parallel_size: 2\n", 6,
     "trainer.data_parallel_size: is 2: the deepspeed backend's ranks are trainer.deepspeed.ranks"),
    ("data:\n  prompts_per_step: 2\nrollout:\n  samples_per_prompt: 2\n"
     "trainer:\n  data_parallel_size: 8\n  deterministic_layout: true\n", 9,
     "trainer.data_parallel_size: is 8, but a minibatch has 4 sequences"),
    ("trainer:\n  backend: deepspeed\n  packed_sequences: true\n", 6,
     "trainer.packed_sequences: needs trainer.backend megatron, parity.enabled true and a dense model"),
    ("parity:\n  enabled: false\ntrainer:\n  packed_sequences: true\n", 7,
     "trainer.packed_sequences: needs trainer.backend megatron"),
]


@pytest.mark.parametrize(("body", "line", "phrase"), _ENV_ERRORS + _DATA_PARALLEL_ERRORS)
def test_dependent_key_errors_name_the_key_and_line(write, body: str, line: int, phrase: str) -> None:
    path = write(body)
    message = error(path)
    assert message.startswith(f"{path}:{line}: "), message
    assert phrase in message, message


def test_data_parallel_config_loads(write) -> None:
    cfg = load_config(write("trainer:\n  data_parallel_size: 2\n  deterministic_layout: true\n"))
    assert (cfg.trainer.data_parallel_size, cfg.trainer.deterministic_layout) == (2, True)


def test_ordered_tensor_parallel_needs_whole_vocabulary_slices(write, model_dir: Path) -> None:
    """trainer.deterministic_layout at trainer TP 2: the LM head's gradient is summed in
    row_splits (gcd of heads, KV heads, intermediate = 2 here) slices of the vocabulary."""
    shape = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128}
    body = "lora:\n  enabled: true\ntrainer:\n  tensor_parallel_size: 2\n  deterministic_layout: true\n"
    for vocab, refused in ((512, False), (511, True)):
        config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, **shape}
        (model_dir / "config.json").write_text(json.dumps(config))
        path = write(body)
        if refused:
            assert error(path) == (f"{path}:8: trainer.deterministic_layout: at trainer.tensor_parallel_size 2 "
                                   "needs the vocabulary (511) divisible by the model's row_splits (2); use "
                                   "trainer.tensor_parallel_size 1")
        else:
            assert load_config(path).trainer.tensor_parallel_size == 2


def test_env_config_loads(write) -> None:
    cfg = load_config(write("env:\n  name: tools\n  kwargs: {tools: [calculator, python]}\n"
                            "rollout:\n  max_turns: 4\n  max_trajectory_tokens: 256\n"))
    assert (cfg.env.name, cfg.env.kwargs, cfg.rollout.max_turns) == ("tools", {"tools": ["calculator", "python"]}, 4)
    assert load_config(write()).env.name is None and load_config(write()).rollout.max_turns == 1


def test_sample_keys_under_one_worker_are_the_engines_own():
    """rl.loop.sample_keys at one worker: the keys RolloutEngine.generate makes itself after
    the worker's reseed, so one-worker runs sample what they sampled before keys were global."""
    from parity.sampling import request_key
    from rl.loop import rollout_seed, sample_keys

    for step, turn in ((1, 0), (7, 2)):
        seed = rollout_seed(3, step, 0, turn)
        assert sample_keys(3, step, 5, turn) == [request_key(seed, 0, i, 0) for i in range(5)]
    assert len(set(sample_keys(3, 1, 64))) == 64


@pytest.mark.parametrize(("body", "line", "phrase"), [
    ("ray:\n  placement: {rollout: host_b}\n", 5, "ray.placement.rollout: needs ray.address"),
    ("ray:\n  address: 10.0.0.1:6379\n  placement: {trainer: CPU}\n", 6,
     "ray.placement.trainer: expected the name of a custom Ray resource"),
    ("ray:\n  address: 10.0.0.1:6379\n  placement: {rollout: 'node:10.0.0.2'}\n", 6,
     "ray.placement.rollout: expected the name of a custom Ray resource"),
    ("ray:\n  address: 10.0.0.1:6379\n  placement: {trainer: [host_a, host_b]}\n", 6,
     "ray.placement.trainer: lists 2 resources, one per trainer rank, but the trainer has 1 ranks"),
    ("trainer:\n  data_parallel_size: 2\n  deterministic_layout: true\nray:\n  address: 10.0.0.1:6379\n"
     "  placement: {trainer: [host_a, GPU]}\n", 9,
     "ray.placement.trainer: expected the name of a custom Ray resource (as in ray start --resources "
     "'{\"host_b\": 1}'), got 'GPU'"),
])
def test_placement_errors(write, body: str, line: int, phrase: str) -> None:
    path = write(body)
    message = error(path)
    assert message.startswith(f"{path}:{line}: ") and phrase in message, message


def test_placement_defaults_and_keys(write) -> None:
    cfg = load_config(write(), ["ray.address=10.0.0.1:6379", "ray.placement.rollout=host_b"])
    assert (cfg.ray.placement.rollout, cfg.ray.placement.trainer) == ("host_b", None)
    assert load_config(write()).ray.placement.rollout is None
    # One resource per trainer rank, in rank order: ranks on several nodes.
    cfg = load_config(write(), ["ray.address=10.0.0.1:6379", "trainer.data_parallel_size=2",
                                "trainer.deterministic_layout=true", "ray.placement.trainer=[host_a, host_b]"])
    assert cfg.ray.placement.trainer == ["host_a", "host_b"]


def test_fp8_cache_on_a_dense_model_is_refused_naming_the_key(write) -> None:
    path = write("rollout:\n  kv_cache_dtype: fp8\n")
    message = error(path)
    assert message.startswith(f"{path}:5: rollout.kv_cache_dtype: "), message
    assert "only the Kimi architectures' MLA caches keep FP8 entries" in message, message


@pytest.mark.parametrize("architecture", ["KimiMiniForCausalLM", "KimiLinearForCausalLM"])
def test_kimi_architectures_checks(tmp_path, architecture) -> None:
    model = tmp_path / "kimi"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    head = f"run_dir: {tmp_path / 'run'}\ntotal_steps: 3\nmodel: {{path: {model}}}\n"
    cfg_path = tmp_path / "kimi.yaml"
    cfg_path.write_text(head + "rollout:\n  kv_cache_dtype: fp8\n")
    assert load_config(cfg_path).rollout.kv_cache_dtype == "fp8"
    for body, line, phrase in [
        ("parity:\n  enabled: false\n", 5, f"parity.enabled: must be true for {architecture}"),
        ("rollout:\n  enforce_eager: false\n", 5, f"rollout.enforce_eager: is false with lora on {architecture}"),
        ("trainer:\n  backend: deepspeed\n", 5, "trainer.backend: deepspeed trains the HF parity models"),
    ]:
        cfg_path.write_text(head + body)
        message = error(cfg_path)
        assert message.startswith(f"{cfg_path}:{line}: {phrase}"), message


def test_a_resume_records_the_run_dir_it_runs_in(model_dir: Path, tmp_path: Path) -> None:
    """`train x.yaml --resume DIR` keeps x.yaml's run_dir in the config but runs in DIR: the
    config.yaml written there names DIR."""
    from rich.console import Console

    from rl.loop import prepare_run_dir
    from tests.unit.test_checkpoint import Tensors
    from trainer.checkpoint import save_checkpoint

    run = tmp_path / "elsewhere"
    save_checkpoint(run, 3, Tensors(seed=3), extra={})
    cfg = load_config(CONFIGS / "quickstart.yaml", [f"model.path={model_dir}", f"checkpoint.resume_from={run}"])
    assert Path(cfg.run_dir) != run
    run_dir, resumed = prepare_run_dir(cfg, Console(quiet=True))
    assert (run_dir, resumed["step"]) == (run, 3)
    assert load_config(run / "config.yaml", [f"model.path={model_dir}"]).run_dir == str(run)
